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

LAST_ROUND = FedUQMetaKey.LAST_COMPLETED_ROUND


class ResumableScatterAndGather(ScatterAndGather):
    """FLARE's ScatterAndGather that continues after the last round recorded in the loaded model.

    FedUQ's shareable generator stamps ``feduq_last_completed_round`` into the global model's meta,
    which the persistor saves with every checkpoint. When a job is started from such a checkpoint
    (``tools/resume_job.py``, e.g. after the server was killed), training continues at the next
    round and ends at the same ``num_rounds`` as the original job. Without that key it behaves
    exactly like ScatterAndGather. (NVFlare 2.9 no longer snapshots component state itself.)
    """

    def start_controller(self, fl_ctx) -> None:
        super().start_controller(fl_ctx)
        meta = (self._global_weights or {}).get(ModelLearnableKey.META) or {}
        last = meta.get(LAST_ROUND)
        if last is not None:
            self._current_round = int(last) + 1
            self.log_info(fl_ctx, f"resuming from checkpoint: last completed round {last}, next round {last + 1}")


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
    forward unchanged and the others are renormalised.

    Args:
        num_rounds: federated rounds R.
        aggregator_id: id of a :class:`feduq.flare.aggregators.WeightedAggregator` component.
        persistor_id: id of the model persistor.
        min_clients: fewest answers a task needs; None requires every site (a failing site then
            stops the job). With a value, the workflow waits for every live site until the
            task's timeout and continues with whoever answered.
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
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, **kwargs)
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
        aggregator = self.get_component(self.aggregator_id)
        if not isinstance(aggregator, WeightedAggregator):
            self.panic(f"component {self.aggregator_id!r} must be a WeightedAggregator, got {type(aggregator)}")
            return
        aggregator.fl_ctx = self.fl_ctx
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
            aggregator.reset_stats()
            for res in results:
                res.current_round = r
            accepted_results = [res for res in results if aggregator.accept_model(res)]
            sites = aggregator.accepted_sites()
            self._log_missing("train", clients, sites)
            if not sites:
                self.error(f"round {r}: no valid update; the global model stays unchanged")
                continue
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
            epistemic = {}
            for res in sur_results:
                g = (res.meta or {}).get(FedUQMetaKey.MEAN_EPISTEMIC)
                if isinstance(g, (int, float)) and math.isfinite(g) and g >= 0:
                    epistemic[res.meta["client_name"]] = float(g)
                else:
                    self.warning(f"round {r}: site {res.meta.get('client_name')!r} sent an invalid G_k {g!r}")
            scored = [s for s in sites if s in epistemic]
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

    def _exchange(self, task_name: str, data: FLModel, targets: list[str], timeout: int) -> list[FLModel]:
        """Send a task and wait for every live site; with ``min_clients`` set, give up on the
        others only when ``timeout`` expires (never cut a slow but healthy site off early)."""
        if self.min_clients is None:
            return self.send_model_and_wait(task_name=task_name, data=data, targets=targets, timeout=timeout)
        return self.broadcast_model(
            task_name=task_name,
            data=data,
            targets=targets,
            min_responses=min(self.min_clients, len(targets)),
            wait_time_after_min_received=timeout,
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
    """

    def __init__(
        self,
        persistor_id: str = "persistor",
        model_file: str = "best_FL_global_model.pt",
        fallback_model_file: str = "FL_global_model.pt",
        method: str = "",
        results_dir: str = "results",
        timeout: int = 0,
    ):
        # a site whose test task fails is reported missing instead of aborting the job
        super().__init__(persistor_id=persistor_id, ignore_result_error=True)
        self.model_file = model_file
        self.fallback_model_file = fallback_model_file
        self.method = method
        self.results_dir = results_dir
        self.timeout = timeout

    def run(self) -> None:
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
        by_site = {res.meta["client_name"]: res.metrics for res in results if res.metrics}
        clients = [c.name for c in self.engine.get_clients()]
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
