"""Server workflows for rounds that need more than one exchange, and the final test evaluation.

* :class:`FedEviController` -- FedEvi's round (Chen et al., MICCAI 2024, §2.3, Eq. 6-8) as it must
  run in a real federation: clients train and return θ_k, N_k and A_k; the server sends the
  surrogate θ̂ = Σ_k β_k^{r-1} θ_k out as a second task; clients return G_k; the server updates β
  and aggregates θ^r = Σ_k β_k^r θ_k.
* :class:`FinalTestEvaluation` -- after training, every site scores the best global model on its
  own test split and the server writes the per-client table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from nvflare.apis.fl_constant import ReturnCode
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg
from nvflare.app_common.workflows.model_controller import ModelController
from nvflare.app_common.workflows.scatter_and_gather import ScatterAndGather

from ..constants import FedUQMetaKey, FedUQTask
from ..methods.fedevi import FedEviConfig, client_scores, initial_weights, update_weights
from ..reporting import write_results
from .aggregators import WeightedAggregator
from .jobcheck import JobConfigError, validate_running_app
from .quorum import WAIT_FOREVER, job_failed_line, quorum_message, required_answers, site_error

LAST_ROUND = FedUQMetaKey.LAST_COMPLETED_ROUND


def fail_job(component, fl_ctx, reason: str, sites: dict[str, str] | None = None) -> None:
    """Log ``FEDUQ_JOB_FAILED {json}`` and panic: FLARE aborts the job (see :mod:`feduq.flare.quorum`)."""
    component.log_error(fl_ctx, job_failed_line(reason, sites or {}))
    component.system_panic(reason, fl_ctx)


class ResumableScatterAndGather(ScatterAndGather):
    """FLARE's ScatterAndGather with FedUQ's start-up check, quorum and resume.

    * **Start-up**: the job's configuration is validated (:func:`feduq.flare.jobcheck.validate_running_app`);
      an invalid job stops before round 0 with the same message ``configure_job.py`` gives.
    * **Quorum** (:mod:`feduq.flare.quorum`): ``min_clients`` is the number of valid updates a round
      needs (the job's tools set it to the number of sites unless ``--min-clients`` says otherwise).
      A site's error reply is recorded with the reason the site sent; as soon as fewer than
      ``min_clients`` sites can still answer, or fewer updates than that were accepted (NaN,
      shape mismatch, timeout), the job stops with ``FEDUQ_JOB_FAILED`` naming every failed site
      and why. No round is aggregated or saved with fewer updates.
    * **Resume**: FedUQ's shareable generator stamps ``feduq_last_completed_round`` into the global
      model's meta, which the persistor saves with every checkpoint. When a job is started from such
      a checkpoint (``tools/resume_job.py``, e.g. after the server was killed), training continues at
      the next round and ends at the same ``num_rounds`` as the original job. (NVFlare 2.9 no longer
      snapshots component state itself.)
    """

    def start_controller(self, fl_ctx) -> None:
        try:
            validate_running_app(fl_ctx)
        except JobConfigError as e:
            fail_job(self, fl_ctx, f"invalid job configuration: {e}")
            return
        super().start_controller(fl_ctx)
        if isinstance(self.aggregator, WeightedAggregator):
            self.aggregator.set_quorum(self._min_clients)
        meta = (self._global_weights or {}).get(ModelLearnableKey.META) or {}
        last = meta.get(LAST_ROUND)
        if last is not None:
            self._current_round = int(last) + 1
            self.log_info(fl_ctx, f"resuming from checkpoint: last completed round {last}, next round {last + 1}")

    def _accept_train_result(self, client_name: str, result, fl_ctx, is_unknown_task: bool = False) -> bool:
        """Record a site's error with its reason; stop the job when the quorum can no longer be met."""
        rc = result.get_return_code(ReturnCode.OK)
        if is_unknown_task or rc == ReturnCode.OK:
            return super()._accept_train_result(client_name, result, fl_ctx, is_unknown_task)
        reason = site_error(result)
        self._current_failed_clients.add(client_name)
        if not hasattr(self, "_failure_reasons"):
            self._failure_reasons: dict = {}
        self._failure_reasons.setdefault(self._current_round, {})[client_name] = reason
        if isinstance(self.aggregator, WeightedAggregator):
            self.aggregator.note_failure(client_name, reason)
        num_sites = self._current_num_targets
        required = required_answers(self._min_clients, num_sites)
        if num_sites - len(self._current_failed_clients) < required:
            failed = dict(self._failure_reasons[self._current_round])
            msg = quorum_message("train", self._current_round, required, [], failed, [], num_sites=num_sites)
            fail_job(self, fl_ctx, msg, failed)
        else:
            self.log_warning(fl_ctx, f"round {self._current_round}: site {client_name!r} failed ({reason}); continuing "
                                     f"without it ({num_sites - len(self._current_failed_clients)} of {num_sites} "
                                     f"can still answer, {required} required)")
        return False


class FedEviController(BaseFedAvg):
    """FedEvi's two-exchange round on FLARE's ModelController API.

    Per round r (0-based here; FedEvi's 1-based r is r + 1):

    1. ``train`` -> each site returns θ_k, N_k, A_k (mean U_ale on its validation split) and R_k.
    2. The aggregator validates every update (finite, matching names and shapes).
    3. ``validate_surrogate`` with θ̂ = Σ β_k^{r-1} θ_k (β renormalised over the accepted sites)
       -> each site returns G_k (mean U_epi of θ̂ on its validation split).
    4. β^r = update(β^{r-1}, δ·G/A) (Eq. 8; switches in :class:`feduq.methods.fedevi.FedEviConfig`).
    5. θ^r = Σ β_k^r θ_k; β is logged (``FEDEVI_BETA {json}``) and stored in the model's meta, so
       it is checkpointed with the global model and restored on resume.

    A site that fails or times out in step 1 or 3 is left out of that round; its β is carried
    forward unchanged and the others are renormalised. When fewer than the quorum can answer
    validly (:mod:`feduq.flare.quorum`), the job stops with ``FEDUQ_JOB_FAILED`` naming every failed
    site and its reason; a round is never aggregated with fewer. The job configuration is validated
    at start-up (:func:`feduq.flare.jobcheck.validate_running_app`).

    Args:
        num_rounds: federated rounds R.
        aggregator_id: id of a :class:`feduq.flare.aggregators.WeightedAggregator` component.
        persistor_id: id of the model persistor.
        min_clients: valid answers each task needs; None requires every site (a failing site then
            stops the job). With a value, the workflow waits for every live site until the
            task's timeout and continues with whoever answered, as long as at least
            ``min_clients`` did.
        train_timeout, surrogate_timeout: seconds to wait for each task (0 = no limit).
        delta, reliability, clip_min, renormalize_after_clip, initial_weights: FedEvi switches,
            see :class:`feduq.methods.fedevi.FedEviConfig` for meanings and defaults.
    """

    def __init__(
        self,
        *,
        num_rounds: int = 200,
        aggregator_id: str = "aggregator",
        persistor_id: str = "persistor",
        min_clients: int | None = None,
        train_timeout: int = 0,
        surrogate_timeout: int = 0,
        delta: float = 1.0,
        reliability: str = "code",
        clip_min: float = 1e-3,
        renormalize_after_clip: bool = False,
        initial_weights: str = "samples",
        **kwargs,
    ):
        # FLARE never panics on a site's error by itself: this workflow applies the quorum, with reasons
        kwargs.setdefault("ignore_result_error", True)
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, **kwargs)
        if min_clients is not None and int(min_clients) < 1:
            raise ValueError(f"FedEviController: min_clients must be >= 1 or None, got {min_clients!r}")
        self._failures: dict[str, str] = {}
        self.aggregator_id = aggregator_id
        self.min_clients = min_clients
        self.train_timeout = train_timeout
        self.surrogate_timeout = surrogate_timeout
        self.config = FedEviConfig(
            delta=delta,
            reliability=reliability,
            clip_min=clip_min,
            renormalize_after_clip=renormalize_after_clip,
            initial=initial_weights,
        )
        self.config.validate()

    def run(self) -> None:
        try:
            validate_running_app(self.fl_ctx)
        except JobConfigError as e:
            fail_job(self, self.fl_ctx, f"invalid job configuration: {e}")
            return
        aggregator = self.get_component(self.aggregator_id)
        if not isinstance(aggregator, WeightedAggregator):
            self.panic(f"component {self.aggregator_id!r} must be a WeightedAggregator, got {type(aggregator)}")
            return
        aggregator.fl_ctx = self.fl_ctx
        aggregator.set_quorum(self.min_clients)
        required = required_answers(self.min_clients, self._num_sites())
        model = self.load_model()
        if model is None:
            return
        model.meta = dict(model.meta or {})
        beta: dict[str, float] = {k: float(v) for k, v in (model.meta.get(FedUQMetaKey.FEDEVI_BETA) or {}).items()}
        first_round = int(model.meta.get(LAST_ROUND, self.start_round - 1)) + 1
        if first_round > self.start_round:
            self.info(f"resuming FedEvi at round {first_round} with beta {beta}")
        model.start_round, model.total_rounds = self.start_round, self.num_rounds

        for self.current_round in range(first_round, self.num_rounds):
            r = self.current_round
            self.info(f"FedEvi round {r} started")
            model.current_round = r
            self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, r, private=True, sticky=False)
            self.event(AppEventType.ROUND_STARTED)
            clients = self.sample_clients()

            results = self._exchange(FedUQTask.TRAIN, model, clients, self.train_timeout)
            if self._aborted():
                return
            aggregator.reset_stats()
            for res in results:
                res.current_round = r
            accepted_results = [res for res in results if aggregator.accept_model(res)]
            sites = aggregator.accepted_sites()
            if not self._quorum_met("train", required, clients, sites, rejected=aggregator.rejected_sites()):
                return
            self._log_missing("train", clients, sites)
            meta = {res.meta["client_name"]: res.meta for res in accepted_results}
            if not beta:
                beta0 = initial_weights([meta[s][FedUQMetaKey.NUM_SAMPLES] for s in sites], mode=self.config.initial)
                beta = dict(zip(sites, map(float, beta0)))
                self.info("FEDEVI_BETA " + json.dumps({"round": "initial", "beta": beta}))
            for s in sites:  # a site joining late starts from the mean weight
                beta.setdefault(s, float(np.mean(list(beta.values()))))
            beta_prev = {s: beta[s] for s in sites}  # renormalised over `sites` by the averaging

            surrogate = FLModel(
                params=aggregator.average(beta_prev), params_type=ParamsType.FULL, current_round=r, meta={}
            )
            sur_results = self._exchange(FedUQTask.VALIDATE_SURROGATE, surrogate, sites, self.surrogate_timeout)
            if self._aborted():
                return
            epistemic, invalid = {}, {}
            for res in sur_results:
                g = (res.meta or {}).get(FedUQMetaKey.MEAN_EPISTEMIC)
                if isinstance(g, (int, float)) and math.isfinite(g) and g >= 0:
                    epistemic[res.meta["client_name"]] = float(g)
                else:
                    invalid[res.meta.get("client_name")] = f"sent an invalid G_k {g!r}"
                    self.warning(f"round {r}: site {res.meta.get('client_name')!r} sent an invalid G_k {g!r}")
            scored = [s for s in sites if s in epistemic]
            if not self._quorum_met("validate_surrogate", required, clients, scored, rejected=invalid):
                return
            self._log_missing("validate_surrogate", sites, scored)
            if scored:
                updated = update_weights(
                    [beta_prev[s] for s in scored],
                    client_scores(
                        [epistemic[s] for s in scored],
                        mean_aleatoric=[meta[s][FedUQMetaKey.MEAN_ALEATORIC] for s in scored],
                        mean_inv_aleatoric=[meta[s].get(FedUQMetaKey.MEAN_INV_ALEATORIC, np.nan) for s in scored],
                        delta=self.config.delta,
                        reliability=self.config.reliability,
                    ),
                    clip_min=self.config.clip_min,
                    renormalize_after_clip=self.config.renormalize_after_clip,
                )
                # Full participation: exactly Eq. 8 / the official update. Partial: the sites that
                # were scored share the mass they held before; everyone else keeps their beta.
                mass = 1.0 if set(scored) == set(beta) else sum(beta_prev[s] for s in scored)
                beta.update({s: float(w) * mass for s, w in zip(scored, updated)})
            beta_round = {s: beta[s] for s in sites}
            self.info(
                "FEDEVI_BETA "
                + json.dumps(
                    {
                        "round": r,
                        "beta": {s: round(w, 6) for s, w in beta.items()},
                        "G": {s: round(v, 6) for s, v in epistemic.items()},
                        "A": {s: round(meta[s][FedUQMetaKey.MEAN_ALEATORIC], 6) for s in sites},
                    }
                )
            )

            aggr = self.aggregate(accepted_results, aggregate_fn=lambda _res: aggregator.aggregate_model(beta_round))
            if aggr.params:
                model = self.update_model(model, aggr)
            model.meta = dict(model.meta or {})
            model.meta[FedUQMetaKey.FEDEVI_BETA] = dict(beta)
            model.meta[LAST_ROUND] = r
            self.save_model(model)
            self._maybe_cleanup_memory()
        self.info("FedEvi finished")

    def _num_sites(self) -> int:
        """K, the number of sites in the job."""
        return len(self.engine.get_clients())

    def _aborted(self) -> bool:
        return self.abort_signal is not None and self.abort_signal.triggered

    def _accept_train_result(self, client_name: str, result, fl_ctx, is_unknown_task: bool = False) -> bool:
        """FLARE's result check (errors ignored here), plus the reason of a site's error reply."""
        if not is_unknown_task and result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            self._failures[client_name] = site_error(result)
            self.warning(f"round {self.current_round}: site {client_name!r} failed: {self._failures[client_name]}")
        return super()._accept_train_result(client_name, result, fl_ctx, is_unknown_task)

    def _quorum_met(self, task: str, required: int, expected: list[str], valid: list[str], rejected: dict) -> bool:
        """True when ``valid`` meets the quorum; otherwise fail the job naming every other site and why."""
        if len(valid) >= max(required, 1):
            return True
        failed = {**{s: w for s, w in self._failures.items() if s not in valid}, **rejected}
        missing = [s for s in expected if s not in valid and s not in failed]
        reason = quorum_message(task, self.current_round, max(required, 1), valid, failed, missing)
        fail_job(self, self.fl_ctx, reason, {**failed, **{s: "no answer" for s in missing}})
        return False

    def _exchange(self, task_name: str, data: FLModel, targets: list[str], timeout: int) -> list[FLModel]:
        """Send a task and wait for every live site; with ``min_clients`` set, give up on the
        others only when ``timeout`` expires (never cut a slow but healthy site off early)."""
        self._failures = {}
        if self.min_clients is None:
            return self.send_model_and_wait(task_name=task_name, data=data, targets=targets, timeout=timeout)
        return self.broadcast_model(
            task_name=task_name,
            data=data,
            targets=targets,
            min_responses=min(self.min_clients, len(targets)),
            wait_time_after_min_received=timeout if timeout > 0 else WAIT_FOREVER,  # every live site answers
            timeout=timeout,
        )

    def _log_missing(self, task: str, expected: list[str], answered: list[str]) -> None:
        missing = sorted(set(expected) - set(answered))
        if missing:
            self.warning(f"round {self.current_round} task {task!r}: no valid answer from {missing}; continuing")


class FinalTestEvaluation(ModelController):
    """Send the best global model to every site's ``test`` task and write the per-client table.

    Args:
        persistor_id: id of the model persistor that saved the global models.
        model_file: inventory name of the model to evaluate (the best by validation Dice).
        fallback_model_file: used when ``model_file`` does not exist (e.g. a 1-round run).
        method: method name written into the result files.
        results_dir: folder under the job's run directory for the table files.
        timeout: seconds to wait for the sites (0 = no limit).
        min_clients: sites that must answer the test task (a site with an empty test split answers
            with no scores and counts); None = every site. Fewer: the job fails with
            ``FEDUQ_JOB_FAILED`` naming the sites and their errors, and no table is written.
    """

    def __init__(
        self,
        persistor_id: str = "persistor",
        model_file: str = "best_FL_global_model.pt",
        fallback_model_file: str = "FL_global_model.pt",
        method: str = "",
        results_dir: str = "results",
        timeout: int = 0,
        min_clients: int | None = None,
    ):
        # FLARE never panics on a site's error by itself: the quorum below decides, with reasons
        super().__init__(persistor_id=persistor_id, ignore_result_error=True)
        required_answers(min_clients, 1)  # validates
        self.model_file = model_file
        self.fallback_model_file = fallback_model_file
        self.method = method
        self.results_dir = results_dir
        self.timeout = timeout
        self.min_clients = min_clients
        self._failures: dict[str, str] = {}

    def _accept_train_result(self, client_name: str, result, fl_ctx, is_unknown_task: bool = False) -> bool:
        if not is_unknown_task and result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            self._failures[client_name] = site_error(result)
            self.warning(f"site {client_name!r} failed the test task: {self._failures[client_name]}")
        return super()._accept_train_result(client_name, result, fl_ctx, is_unknown_task)

    def run(self) -> None:
        if self.abort_signal.triggered:
            return
        name, learnable = self.model_file, None
        if self.persistor is not None:
            learnable = self.persistor.get_model(self.model_file, self.fl_ctx)
            if learnable is None:
                name = self.fallback_model_file
                self.warning(f"{self.model_file} not found; evaluating {name}")
                learnable = self.persistor.get_model(name, self.fl_ctx)
        if learnable is None:
            self.panic("no global model to evaluate")
            return
        data = FLModel(params=learnable[ModelLearnableKey.WEIGHTS], params_type=ParamsType.FULL, meta={"evaluated_model": name})
        results = self.send_model_and_wait(task_name=FedUQTask.TEST, data=data, timeout=self.timeout)
        if self.abort_signal.triggered:
            return
        clients = [c.name for c in self.engine.get_clients()]
        answered = [res.meta["client_name"] for res in results]
        required = max(required_answers(self.min_clients, len(clients)), 1)
        if len(answered) < required:
            failed = {s: w for s, w in self._failures.items() if s not in answered}
            missing = [s for s in clients if s not in answered and s not in failed]
            reason = quorum_message(FedUQTask.TEST, None, required, answered, failed, missing)
            fail_job(self, self.fl_ctx, reason, {**failed, **{s: "no answer" for s in missing}})
            return
        by_site = {res.meta["client_name"]: res.metrics for res in results if res.metrics}
        site_metrics = {s: by_site[s] for s in clients + sorted(set(by_site) - set(clients)) if s in by_site}
        missing = sorted(set(clients) - set(site_metrics))
        if missing:
            self.warning(f"no test result from {missing}; they are left out of the table")
        if not site_metrics:
            self.panic("no site returned test metrics")
            return
        out_dir = Path(self.get_run_dir()) / self.results_dir
        paths = write_results(site_metrics, out_dir, method=self.method, note=f"Model evaluated: `{name}`.")
        table = paths["markdown"].read_text()
        self.info(f"FedUQ per-client test results ({name}):\n{table}")
        self.info(f"FedUQ results written to {paths['markdown']} and {paths['csv']}")
        print(f"\n{table}\nFedUQ results written to {paths['markdown']}\n", flush=True)
