"""Server workflows every method shares, and the final test evaluation.

* :func:`fail_job` and :data:`LAST_ROUND` -- stopping a job with ``FEDUQ_JOB_FAILED``, and the
  round a checkpoint completed (used by every FedUQ workflow).
* :class:`QuorumExchange` -- FedUQ's ModelController workflows' start-up check, one task exchange under the
  quorum rule, and acceptance of answers (the round itself: :class:`feduq.flare.controller.FedUQController`).
* :class:`FinalTestEvaluation` -- after training, every site validates the last global model (so it can be
  selected like every earlier one), then scores the best global model on its own test split and the server
  writes the per-client table.

A method's extra exchanges (FedEvi's surrogate validation) are its server part's
(:class:`feduq.methods.fedevi.FedEviServer`), run by :class:`feduq.flare.controller.FedUQController`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from nvflare.apis.fl_constant import ReturnCode
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import ModelLearnableKey
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.workflows.model_controller import ModelController

from ..common.wire import FedUQMetaKey, FedUQTask
from ..core.networks import network_note
from ..scores.tables import write_results
from ..jobs.jobcheck import JobConfigError, validate_running_app
from .liveness import watch_sites
from .selection import BestModelSelector
from .quorum import WAIT_FOREVER, job_failed_line, quorum_message, required_answers, site_error

LAST_ROUND = FedUQMetaKey.LAST_COMPLETED_ROUND


def fail_job(component, fl_ctx, reason: str, sites: dict[str, str] | None = None) -> None:
    """Log ``FEDUQ_JOB_FAILED {json}`` and panic: FLARE aborts the job (see :mod:`feduq.flare.quorum`)."""
    component.log_error(fl_ctx, job_failed_line(reason, sites or {}))
    component.system_panic(reason, fl_ctx)


class SiteErrorRecorder:
    """Mixin for FedUQ's ModelController workflows: keep each site's error reason of the current task.

    FLARE is told to ignore result errors (``ignore_result_error=True``); this records the reason the
    site sent (:func:`feduq.flare.quorum.site_error`) in ``self._failures`` (site -> reason; the
    workflow resets it before each task) so the workflow's quorum check can name it.
    """

    _failures: dict[str, str]
    _watch = None

    def start_controller(self, fl_ctx) -> None:
        """FLARE's start, then the watch over the sites' signs of life (:mod:`feduq.flare.liveness`)."""
        super().start_controller(fl_ctx)
        self._failures = getattr(self, "_failures", {})
        watched = watch_sites(self.communicator, fl_ctx, self._sites_gone)
        if watched is not None:
            self._watch, simulator_root = watched
            self.info(f"FedUQ site watch: a site silent for {self._watch.silent_s:.0f} s while a task waits for it is "
                      f"named as gone, unless it is a process of the simulation in {simulator_root} that still runs")

    def stop_controller(self, fl_ctx) -> None:
        if self._watch is not None:
            self._watch.stop()
        super().stop_controller(fl_ctx)

    def _watched(self, send, targets):
        if self._watch is not None:
            self._watch.expect([t if isinstance(t, str) else t.name for t in targets] if targets is not None
                               else [c.name for c in self.engine.get_clients()])
        try:
            return send()
        finally:
            if self._watch is not None:
                self._watch.done()

    def send_model_and_wait(self, *args, targets=None, **kwargs):
        """FLARE's send-and-wait, the watch told which sites the task waits for."""
        return self._watched(lambda: super(SiteErrorRecorder, self).send_model_and_wait(*args, targets=targets,
                                                                                         **kwargs), targets)

    def broadcast_model(self, *args, targets=None, **kwargs):
        """FLARE's broadcast, the watch told which sites the task waits for."""
        return self._watched(lambda: super(SiteErrorRecorder, self).broadcast_model(*args, targets=targets, **kwargs),
                             targets)

    def _sites_gone(self, gone: dict[str, str], cancel: bool) -> None:
        """The watch's report: name each gone site (its reason is the quorum's); when the task waits only for gone
        sites, cancel it so the answers received are used now."""
        for site, reason in gone.items():
            self._failures[site] = reason
            self.warning(f"FEDUQ_SITE_GONE site {site!r}: {reason}")
        if cancel:
            self.cancel_all_tasks(fl_ctx=self.fl_ctx)

    def _accept_train_result(self, client_name: str, result, fl_ctx, is_unknown_task: bool = False) -> bool:
        if self._watch is not None:
            self._watch.heard(client_name)
            self._watch.answered(client_name)
        if not is_unknown_task and result.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            self._failures[client_name] = site_error(result)
            self.warning(f"site {client_name!r} failed its task: {self._failures[client_name]}")
        return super()._accept_train_result(client_name, result, fl_ctx, is_unknown_task)


class QuorumExchange(SiteErrorRecorder):
    """Mixin for FedUQ's ModelController workflows: one task exchange under the quorum rule.

    Needs ``self.min_clients`` (None = every target must answer) and ``self.current_round``.
    """

    min_clients: int | None
    #: the task timeouts (seconds) this workflow takes; ``train_timeout`` of the job tools sets each of them
    #: (:func:`feduq.recipes.settings.configure`)
    timeout_args: tuple[str, ...] = ("train_timeout",)

    def _aborted(self) -> bool:
        return self.abort_signal is not None and self.abort_signal.triggered

    def _start_run(self) -> tuple[FLModel, int] | None:
        """Validate the deployed job, load the global model and return ``(model, first round to run)``
        (resume: the round after the checkpointed one); None when the job was stopped instead."""
        try:
            validate_running_app(self.fl_ctx, clients=[c.name for c in self.engine.get_clients()])
        except JobConfigError as e:
            fail_job(self, self.fl_ctx, f"invalid job configuration: {e}")
            return None
        model = self.load_model()
        if model is None:
            return None
        model.meta = dict(model.meta or {})
        return model, int(model.meta.get(LAST_ROUND, self.start_round - 1)) + 1

    def _required(self, num_sites: int) -> int:
        """Valid answers a task to ``num_sites`` sites needs: ``min_clients`` of them (all when None), at least the
        method's ``min_sites`` (a collaboration graph needs 2) and at least 1."""
        min_sites = getattr(getattr(self, "server", None), "min_sites", 1)
        return max(required_answers(self.min_clients, num_sites), min_sites, 1)

    def _quorum_met(self, task: str, required: int, expected: list[str], valid: list[str], rejected: dict) -> bool:
        """True when ``valid`` meets the quorum; otherwise fail the job naming every other site and why."""
        if len(valid) >= max(required, 1):
            return True
        failed = {**{s: w for s, w in self._failures.items() if s not in valid}, **rejected}
        missing = [s for s in expected if s not in valid and s not in failed]
        reason = quorum_message(task, self.current_round, max(required, 1), valid, failed, missing)
        fail_job(self, self.fl_ctx, reason, {**failed, **{s: "no answer" for s in missing}})
        return False

    def _accept_train_result(self, client_name: str, result, fl_ctx, is_unknown_task: bool = False) -> bool:
        """Record a site's error (:class:`SiteErrorRecorder`); as soon as the quorum can no longer be met, stop the
        job with every failed site and why, without waiting for the others."""
        accepted = super()._accept_train_result(client_name, result, fl_ctx, is_unknown_task)
        task, n, required = getattr(self, "_task_quorum", (None, 0, 0))
        if task and client_name in self._failures and n - len(self._failures) < required and not self._quorum_lost:
            self._quorum_lost = True
            failed = dict(self._failures)
            fail_job(self, fl_ctx, quorum_message(task, self.current_round, required, [], failed, [], num_sites=n), failed)
        return accepted

    def _exchange(self, task_name: str, data: FLModel, targets: list[str], timeout: int,
                  quorum: bool = True) -> list[FLModel]:
        """Send a task and wait for every live site; with ``min_clients`` set, give up on the
        others only when ``timeout`` expires (never cut a slow but healthy site off early). With ``quorum``, the job
        stops as soon as too many sites failed for the quorum; without, the caller decides what the answers are worth."""
        self._failures, self._quorum_lost = {}, False
        self._task_quorum = (task_name, len(targets), self._required(len(targets))) if quorum else (None, 0, 0)
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


class FinalTestEvaluation(SiteErrorRecorder, ModelController):
    """Validate the last global model, then send the best one to every site's ``test`` task (or to ``test_sites``), and
    write the table.

    Sites validate the model they receive at the start of each round, so without a last pass the model of the final
    round would never be validated and never selected (the official FedEvi code validates it). With
    ``validate_last``, the last global model (``fallback_model_file``) goes to every site's ``validate`` task first;
    the mean over the answering sites of the selector's key metric (unweighted, as FLARE's
    :class:`IntimeModelSelector` in FedUQ's jobs computes it) goes to :meth:`BestModelSelector.offer`, and when better
    the last model becomes the best (the persistor saves it as ``model_file``; the selector records round
    ``last + 1``). The server logs
    ``FEDUQ_FINAL_VALIDATION {json}``: ``round``, ``key_metric``, ``value``, ``best_before``, ``selected``. Skipped
    when the job has no model selector (``selector_id``), when ``model_file`` is the last model already, or when fewer sites answer
    than ``min_clients`` requires (a warning; the earlier selection stands).

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
        validate_last: validate the last global model and let it be selected (see above).
        selector_id: id of the job's :class:`feduq.flare.selection.BestModelSelector` (none: no last validation).
        test_sites: the sites that run the test task (None: every site); ``min_clients`` then counts among them
            (and, for the last model's validation, which every site runs, among all sites). Virtual sites of one
            center share its test list, so one of them scores it for all (``feduq configure --test-sites
            per-center``); the table has a row per tested site, so its Avg/Std weigh each center once. A site named
            that is not a client of the job stops it before its first round (the training workflow's start-up
            check) and again here, naming it; a tested site that fails is left out as any site is (its center then
            has no row).
    """

    #: the task timeouts (s) this workflow takes; the job tools' ``train_timeout`` sets them with the round's
    timeout_args: tuple[str, ...] = ("timeout",)

    def __init__(
        self,
        persistor_id: str = "persistor",
        model_file: str = "best_FL_global_model.pt",
        fallback_model_file: str = "FL_global_model.pt",
        method: str = "",
        results_dir: str = "results",
        timeout: int = 0,
        min_clients: int | None = None,
        validate_last: bool = True,
        selector_id: str = "model_selector",
        test_sites: list[str] | None = None,
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
        self.validate_last = bool(validate_last)
        self.selector_id = selector_id
        if test_sites is not None and (not isinstance(test_sites, (list, tuple)) or not test_sites
                                       or not all(isinstance(t, str) for t in test_sites)):
            raise ValueError(f"test_sites must be a non-empty list of site names or None, got {test_sites!r}")
        repeated = sorted({t for t in test_sites or [] if list(test_sites).count(t) > 1})
        if repeated:
            raise ValueError(f"test_sites {repeated} are listed more than once")
        self.test_sites = None if test_sites is None else list(test_sites)
        self._failures: dict[str, str] = {}

    def _selector(self) -> BestModelSelector | None:
        found = self.get_component(self.selector_id) if self.selector_id else None
        return found if isinstance(found, BestModelSelector) else None

    def _validate_last_model(self) -> None:
        """The last global model through every site's ``validate`` task; it becomes the best when it validates better."""
        selector = self._selector()
        if selector is None or self.persistor is None or self.model_file == self.fallback_model_file:
            return
        learnable = self.persistor.get_model(self.fallback_model_file, self.fl_ctx)
        meta = (learnable or {}).get(ModelLearnableKey.META) or {}
        if learnable is None or meta.get(LAST_ROUND) is None:
            return
        last = int(meta[LAST_ROUND]) + 1  # the round that would have validated it, as the selector numbers rounds
        data = FLModel(params=learnable[ModelLearnableKey.WEIGHTS], params_type=ParamsType.FULL, current_round=last,
                       meta={"evaluated_model": self.fallback_model_file})
        self._failures = {}
        results = self.send_model_and_wait(task_name=FedUQTask.VALIDATE, data=data, timeout=self.timeout)
        if self.abort_signal.triggered:
            return
        key = selector.key_metric
        values = [float(res.metrics[key]) for res in results
                  if isinstance((res.metrics or {}).get(key), (int, float)) and math.isfinite(res.metrics[key])]
        required = max(required_answers(self.min_clients, len(self.engine.get_clients())), 1)
        if len(values) < required:
            self.warning(f"the last global model: {len(values)} site(s) sent a finite {key} ({required} required; "
                         f"failed: {self._failures or 'none'}); the selection of earlier rounds stands")
            return
        value = sum(values) / len(values)
        best_before = selector.best_raw_val_metric
        self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, last, private=True, sticky=False)
        self.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, learnable, private=True, sticky=False)
        selected = selector.offer(value, self.fl_ctx)
        self.info("FEDUQ_FINAL_VALIDATION " + json.dumps({
            "round": last, "key_metric": key, "value": value, "selected": selected,
            "best_before": None if best_before is None else float(best_before)}))

    def run(self) -> None:
        if self.abort_signal.triggered:
            return
        if self.validate_last:
            self._validate_last_model()
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
        clients = [c.name for c in self.engine.get_clients()]
        if self.test_sites is not None:
            unknown = [t for t in self.test_sites if t not in clients]
            if unknown:
                listed = ", ".join(clients[:8]) + (f", ... ({len(clients)} sites)" if len(clients) > 8 else "")
                fail_job(self, self.fl_ctx, f"final test: test_sites {unknown[:8]} are not sites of this job "
                                            f"(sites: {listed})")
                return
            clients = list(self.test_sites)
        data = FLModel(params=learnable[ModelLearnableKey.WEIGHTS], params_type=ParamsType.FULL, meta={"evaluated_model": name})
        results = self.send_model_and_wait(task_name=FedUQTask.TEST, data=data, timeout=self.timeout,
                                           targets=None if self.test_sites is None else clients)
        if self.abort_signal.triggered:
            return
        for res in list(results):  # a result computed in another site's place (feduq.parts.server.check_sender)
            sender, site = res.meta.get(FedUQMetaKey.SITE), res.meta["client_name"]
            if sender is not None and sender != site:
                self._failures[site] = (f"its test result was computed by site {sender!r} (FLARE ran that site's task "
                                        f"in {site!r}'s place); left out")
                self.warning(f"site {site!r}: {self._failures[site]}")
                results.remove(res)
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
        network = getattr(self.persistor, "model", None)
        trained = f" Trained {network_note(network)}." if isinstance(network, torch.nn.Module) else ""
        paths = write_results(site_metrics, out_dir, method=self.method, note=f"Model evaluated: `{name}`.{trained}",
                              missing=missing)
        table = paths["markdown"].read_text()
        self.info(f"FedUQ per-client test results ({name}):\n{table}")
        self.info(f"FedUQ results written to {paths['markdown']} and {paths['csv']}")
        print(f"\n{table}\nFedUQ results written to {paths['markdown']}\n", flush=True)
