"""A site's intensity fingerprint for FLARE's federated statistics (``nvflare.recipe.fedstats.FedStatsRecipe``).

nnU-Net normalises a CT channel with its dataset fingerprint: the intensities of foreground voxels, clipped to their
0.5 and 99.5 percentiles, then z-scored with their mean and standard deviation (``CTNormalization``). In a federation
no site sees the others' voxels, so each site sends only the declared summary numbers of its own foreground samples
(count, sum, mean, standard deviation and a t-digest for the two quantiles) through FLARE's statistics workflow and its
privacy filter (minimum count), and the server combines them into the global numbers, as nnU-Net federations on FLARE
and Flower share fingerprints. ``feduq fingerprint`` runs it and writes the window into the task file.

:class:`IntensityFingerprint` is FLARE's ``Statistics`` spec over :func:`feduq.sites.nnunet_raw.foreground_intensities`:
one dataset ``"train"``, one feature per ``CT`` channel without a window (named after the channel). It answers only
the statistics the job asks for (no histogram, minimum or maximum).

A site that cannot read its data answers the task with an error reply carrying its reason
(:class:`FingerprintExecutor`, where FLARE's ``StatisticsExecutor`` ends the site's job without a reply), and the
server (:class:`FingerprintController`, FLARE's ``StatisticsController`` with FedUQ's site watch of
:mod:`feduq.flare.liveness`) stops the job at the first failed or silent site, naming it and why in the
``FEDUQ_JOB_FAILED`` line :mod:`feduq.recipes.outcome` reads: the window needs every site's numbers, and FLARE's
controller waited for ever for a site whose job had ended.

What it sends is FLARE's statistics result, not a DXO, so FedUQ's privacy ledger (which declares DXOs) does not
describe it: a site whose own privacy policy enforces the ledger on every job (``feduq prepare-site``) refuses
this job's results. Declaring FLARE's statistics results in the ledger is not built yet.
"""

from __future__ import annotations

import threading
from typing import Dict, List

import numpy as np
from nvflare.apis.dxo import DXO
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.statistics_spec import DataType, Feature, Statistics
from nvflare.app_common.app_constant import StatisticsConstants
from nvflare.app_common.executors.statistics.statistics_executor import StatisticsExecutor
from nvflare.app_common.workflows.statistics_controller import StatisticsController

from ..data import DataError, get_task, job_task, resolve_data_root
from ..sites.nnunet_raw import foreground_intensities
from ..sites.centers import site_center
from .liveness import SILENT_S, watch_sites
from .quorum import error_reply, job_failed_line, site_error
from .site_config import read_site_config

__all__ = ["DATASET", "IntensityFingerprint", "FingerprintExecutor", "FingerprintController", "fingerprint_channels"]

DATASET = "train"


def fingerprint_channels(task) -> dict[str, int]:
    """Feature name (``"<index>_<channel name>"``: two CT phases may share a name) -> channel index of the task's
    ``CT`` channels still without a window."""
    d = get_task(task)
    return {f"{i}_{d.channel_names[i]}": i for i in d.missing_windows}


class IntensityFingerprint(Statistics):
    """A site's foreground intensity samples of its CT channels, as FLARE's federated statistics read them.

    Args:
        task: the task's declaration (the JSON object of its task file; the job carries it).
        voxels_per_case: foreground voxels sampled per case (nnU-Net's fingerprint takes 10,000).
        seed: the sampling seed.
    """

    def __init__(self, task: dict, voxels_per_case: int = 10000, seed: int = 0):
        super().__init__()
        self.task, self.voxels_per_case, self.seed = task, int(voxels_per_case), int(seed)
        self.samples: Dict[str, np.ndarray] = {}

    def initialize(self, fl_ctx: FLContext):
        """Read this site's samples (its data root and center from ``local/feduq_site.json`` or
        ``$FEDUQ_DATA_ROOT``). Raises DataError naming the site and file."""
        spec = job_task(self.task)
        site = fl_ctx.get_identity_name()
        cfg = read_site_config(fl_ctx)
        center = site_center(spec.name, cfg.get("center", site))
        root = resolve_data_root(cfg.get("data_root"), site=site)
        values = foreground_intensities(spec.name, root, center, site, self.voxels_per_case, self.seed)
        self.samples = {name: values[c] for name, c in fingerprint_channels(spec.name).items()}

    def features(self) -> Dict[str, List[Feature]]:
        return {DATASET: [Feature(name, DataType.FLOAT) for name in self.samples]}

    def count(self, dataset_name: str, feature_name: str) -> int:
        return int(self.samples[feature_name].size)

    def sum(self, dataset_name: str, feature_name: str) -> float:
        return float(self.samples[feature_name].sum())

    def mean(self, dataset_name: str, feature_name: str) -> float:
        return float(self.samples[feature_name].mean())

    def stddev(self, dataset_name: str, feature_name: str) -> float:
        return float(self.samples[feature_name].std(ddof=1))

    def variance_with_mean(self, dataset_name: str, feature_name: str, global_mean: float,
                           global_count: float) -> float:
        x = self.samples[feature_name]
        return float(((x - global_mean) ** 2).sum() / (global_count - 1))

    def failure_count(self, dataset_name: str, feature_name: str) -> int:
        return 0

    def quantiles(self, dataset_name: str, feature_name: str, percents: List) -> Dict:
        from fastdigest import TDigest

        digest = TDigest.from_values(self.samples[feature_name])  # fastdigest 0.12 (FLARE's server merges its dict)
        return {StatisticsConstants.STATS_QUANTILE: {p: float(digest.quantile(p)) for p in percents},
                StatisticsConstants.STATS_DIGEST_COORD: digest.to_dict()}


def _site_named(site: str, message: str) -> str:
    return message if message.startswith(f"site {site!r}") else f"site {site!r}: {message}"


class FingerprintExecutor(StatisticsExecutor):
    """FLARE's ``StatisticsExecutor`` whose site answers a task it cannot run with an error reply naming itself and
    why (the header of :func:`feduq.flare.quorum.error_reply`). FLARE's executor, when its generator fails to start
    (a missing data root, a volume with NaN voxels), panics at the first task: the site's job ends before its reply
    is sent, and the server's statistics controller waits for it for ever."""

    _setup_error: str | None = None

    def initialize(self, fl_ctx: FLContext):
        self.client_name = fl_ctx.get_identity_name()
        self._setup_error = None
        try:
            self.task_handler = self.get_task_handler(fl_ctx)  # the generator reads the site's samples here
        except Exception as e:
            self._setup_error = _site_named(self.client_name, str(e) if isinstance(e, DataError)
                                            else f"{type(e).__name__}: {e}")
            log = self.log_error if isinstance(e, DataError) else self.log_exception  # a bug keeps its traceback
            log(fl_ctx, f"FedUQ setup failed: {self._setup_error}")

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = fl_ctx.get_identity_name()
        if self._setup_error is not None or self.task_handler is None:
            why = (self._setup_error or "the statistics generator did not start").removeprefix(f"site {site!r}: ")
            reason = f"site {site!r}: setup failed: {why}"
            self.log_error(fl_ctx, f"cannot run task {task_name!r}: {reason}")
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, reason)
        if abort_signal.triggered:
            return make_reply(ReturnCode.TASK_ABORTED)
        try:
            result = self.task_handler.execute_task(task_name, shareable, fl_ctx, abort_signal)
        except Exception as e:
            reason = f"site {site!r}: task {task_name!r} failed: {type(e).__name__}: {e}"
            self.log_exception(fl_ctx, reason)
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, reason)
        if result is None:
            reason = f"site {site!r}: task {task_name!r} gave no result"
            self.log_error(fl_ctx, reason)
            return error_reply(ReturnCode.EXECUTION_RESULT_ERROR, reason)
        return DXO(data_kind=self.get_data_kind(), data=result).to_shareable()


class FingerprintController(StatisticsController):
    """FLARE's ``StatisticsController`` that stops the job at the first site that fails or falls silent, naming it.

    FLARE's controller waits for every site's answer without a timeout, so a site whose job ended (FLARE's own
    executor panics on a generator that did not start; a process killed or out of memory) held it for ever. Here a
    site's error reply, or a site silent for ``silent_s`` seconds while a task waits for it
    (:class:`feduq.flare.liveness.SiteWatch`, as FedUQ's training workflows watch their sites), fails the job at once
    with ``FEDUQ_JOB_FAILED {"reason": ..., "sites": {site: why}}`` (:mod:`feduq.recipes.outcome` reads it): the
    window needs every site's numbers. Arguments: FLARE's, and ``silent_s``.
    """

    def __init__(self, *args, silent_s: float = SILENT_S, **kwargs):
        super().__init__(*args, **kwargs)
        self.silent_s = float(silent_s)
        self._watch = None  # a feduq.flare.liveness.SiteWatch while the controller runs
        self._failed = False
        self._fail_lock = threading.Lock()

    def start_controller(self, fl_ctx: FLContext):
        super().start_controller(fl_ctx)
        watched = watch_sites(self.communicator, fl_ctx, self._sites_gone, self.silent_s)
        if watched is not None:
            self._watch = watched[0]
            self.log_info(fl_ctx, f"FedUQ site watch: a site silent for {self.silent_s:.0f} s while a task waits "
                                  "for it fails the job, naming it")

    def stop_controller(self, fl_ctx: FLContext):
        if self._watch is not None:
            self._watch.stop()
        super().stop_controller(fl_ctx)

    def fail(self, sites: dict[str, str]) -> None:
        """Fail the job once, naming each site and why (``FEDUQ_JOB_FAILED``), and stop waiting for the others."""
        with self._fail_lock:
            if self._failed:
                return
            self._failed = True
        reason = "the intensity fingerprint needs every site's statistics; " + "; ".join(
            _site_named(s, why) for s, why in sorted(sites.items()))
        self.log_error(self.fl_ctx, job_failed_line(reason, sites))
        self.system_panic(reason, self.fl_ctx)
        self.cancel_all_tasks(fl_ctx=self.fl_ctx)

    def _sites_gone(self, gone: dict[str, str], cancel: bool) -> None:
        for site, reason in gone.items():
            self.log_warning(self.fl_ctx, f"FEDUQ_SITE_GONE site {site!r}: {reason}")
        if gone:
            self.fail(gone)

    def broadcast_and_wait(self, task, fl_ctx, targets=None, min_responses=1, wait_time_after_min_received=0,
                           abort_signal=None):
        if self._failed:
            return None
        if self._watch is not None:
            self._watch.expect([t if isinstance(t, str) else t.name for t in targets] if targets is not None
                               else [c.name for c in fl_ctx.get_engine().get_clients()])
        try:
            return super().broadcast_and_wait(task, fl_ctx, targets, min_responses, wait_time_after_min_received,
                                              abort_signal)
        finally:
            if self._watch is not None:
                self._watch.done()

    def statistics_task_flow(self, abort_signal, fl_ctx, statistic_task):
        if self._failed:
            return False
        return super().statistics_task_flow(abort_signal, fl_ctx, statistic_task)

    def _failed_reply(self, client_task) -> bool:
        site, result = client_task.client.name, client_task.result
        if self._watch is not None:
            self._watch.heard(site)
            self._watch.answered(site)
        if result.get_return_code(ReturnCode.OK) == ReturnCode.OK:
            return False
        if result.get_return_code() != ReturnCode.TASK_ABORTED or not self._failed:
            self.fail({site: site_error(result)})
        client_task.result = None
        return True

    def results_pre_run_cb(self, client_task, fl_ctx: FLContext):
        if not self._failed_reply(client_task):
            super().results_pre_run_cb(client_task, fl_ctx)

    def results_cb(self, client_task, fl_ctx: FLContext):
        if not self._failed_reply(client_task):
            super().results_cb(client_task, fl_ctx)

    def post_fn(self, task_name: str, fl_ctx: FLContext):
        """Name the sites that sent no statistics (FLARE's privacy filter withholds a feature with fewer samples
        than the job's ``min_count``), else FLARE's combination and writer."""
        if self._failed:
            return
        sites = [c.name for c in fl_ctx.get_engine().get_clients()]
        sent = {s for per_site in self.client_statistics.values() for s, by_ds in per_site.items()
                if any(by_ds.get(ds) for ds in by_ds)}
        missing = {s: "it sent no statistics (its privacy filter withholds a feature with fewer samples than the "
                      "job's min_count; see its log)" for s in sites if s not in sent}
        if missing:
            self.fail(missing)
            return
        super().post_fn(task_name, fl_ctx)
