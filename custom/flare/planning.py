"""The federation's nnU-Net plan made in FLARE: each site fingerprints its own training cases, the server plans once.

Two of FLARE's own ``BroadcastAndProcess`` workflows run one after the other with one FedUQ
``ResponseProcessor`` (:class:`FederatedPlanner`), so the round-free exchange is FLARE's and FedUQ adds only what
is its own (:mod:`feduq.nnunet.federated_plans`):

1. ``feduq_count_cases``: every site answers its number of training cases (:class:`PlanFingerprintExecutor`); the
   server sums them, since nnU-Net samples ``10e7 // pooled cases`` foreground voxels per case;
2. ``feduq_plan_fingerprint`` (carrying that number): every site answers its summary
   (:func:`feduq.nnunet.federated_plans.site_fingerprint` on the wire, :func:`~feduq.nnunet.federated_plans.to_wire`);
   the server merges the summaries in site order, runs nnU-Net's planner on the merged fingerprint and writes the
   plan (and its slim form) into the job's run folder (``<run>/plans/``), with the merged fingerprint beside them.

What a site sends is declared in FedUQ's privacy ledger (job ``nnunet_fingerprint``) and checked by the ledger
filter on each site. A site that fails answers with an error reply naming itself and why; a site that fails or does
not answer within the task's timeout stops the job with ``FEDUQ_JOB_FAILED`` naming it (:mod:`feduq.recipes.outcome`
reads it): the plan needs every site's numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

from nvflare.apis.client import Client
from nvflare.apis.dxo import DXO, DataKind, from_shareable
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.response_processor import ResponseProcessor

from ..data import DataError, job_task, resolve_data_root
from ..sites.nnunet_raw import training_case_files
from ..sites.centers import site_center
from ..nnunet import federated_plans as fpl
from .quorum import error_reply, job_failed_line, site_error
from .site_config import read_site_config

COUNT_TASK, FINGERPRINT_TASK = "feduq_count_cases", "feduq_plan_fingerprint"
PLANS_FOLDER = "plans"  #: in the server's run folder: plans.json, plans_slim.json, dataset_fingerprint.json
SITE_KEY = "feduq_site"


class PlanFingerprintExecutor(Executor):
    """A site's side of the plan job: its training cases counted, then fingerprinted (the module docstring).

    Args:
        task: the task's declaration (a JSON object carried in the job).
    """

    def __init__(self, task: dict):
        super().__init__()
        self.task = task

    def _cases(self, fl_ctx: FLContext) -> list:
        site = fl_ctx.get_identity_name()
        spec = job_task(self.task)
        cfg = read_site_config(fl_ctx)
        root = resolve_data_root(cfg.get("data_root"), site=site)
        return training_case_files(spec.name, root, site_center(spec.name, cfg.get("center", site)), site)

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        site = fl_ctx.get_identity_name()
        if abort_signal.triggered:
            return make_reply(ReturnCode.TASK_ABORTED)
        try:
            cases = self._cases(fl_ctx)
            if task_name == COUNT_TASK:
                data = {"n_cases": len(cases)}
            elif task_name == FINGERPRINT_TASK:
                samples = int(from_shareable(shareable).data["num_samples"])
                reader = fpl.reader_class(job_task(self.task).raw, cases[0][0][0])
                data = fpl.to_wire(fpl.site_fingerprint(cases, reader, samples, site))
            else:
                return make_reply(ReturnCode.TASK_UNKNOWN)
        except (DataError, fpl.FingerprintError, ValueError, OSError) as e:
            reason = str(e) if str(e).startswith(f"site {site!r}") else f"site {site!r}: {e}"
            self.log_error(fl_ctx, f"cannot run task {task_name!r}: {reason}")
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, reason)
        self.log_info(fl_ctx, f"site {site!r}: {task_name} answered for {len(cases)} training case(s)")
        return DXO(data_kind=DataKind.METRICS, data=data, meta={SITE_KEY: site}).to_shareable()


class FederatedPlanner(ResponseProcessor):
    """The server's side of the plan job (module docstring), FLARE's ``BroadcastAndProcess`` processor of both tasks.

    Args:
        task: the task's declaration (the planner's ``dataset.json`` keys).
        configuration: nnU-Net's configuration kept (``3d_fullres``).
        foreground_voxels: nnU-Net's foreground samples over the dataset (its 10e7; fewer for tests).
    """

    def __init__(self, task: dict, configuration: str = "3d_fullres",
                 foreground_voxels: float = fpl.NNUNET_FOREGROUND_VOXELS):
        super().__init__()
        self.task, self.configuration, self.foreground_voxels = task, configuration, float(foreground_voxels)
        self.counts: dict[str, int] = {}
        self.summaries: dict[str, dict] = {}
        self.failed: dict[str, str] = {}
        self.phase = None

    def _fail(self, fl_ctx: FLContext, sites: dict[str, str], what: str) -> bool:
        self.failed.update(sites)
        reason = f"the federation's nnU-Net plan needs every site's {what}; " + "; ".join(
            why if why.startswith(f"site {s!r}") else f"site {s!r}: {why}" for s, why in sorted(sites.items()))
        self.log_error(fl_ctx, job_failed_line(reason, sites))
        return False

    def create_task_data(self, task_name: str, fl_ctx: FLContext) -> Shareable:
        self.phase = task_name
        if task_name == COUNT_TASK:
            self.counts = {}
            return Shareable()
        self.summaries = {}
        samples = fpl.samples_per_case(sum(self.counts.values()) or 1, self.foreground_voxels)
        self.log_info(fl_ctx, f"{sum(self.counts.values())} training cases over {len(self.counts)} sites: "
                              f"{samples} foreground voxels sampled per case")
        return DXO(data_kind=DataKind.METRICS, data={"num_samples": samples}).to_shareable()

    def process_client_response(self, client: Client, task_name: str, response: Shareable, fl_ctx: FLContext) -> bool:
        site = client.name
        if response.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return self._fail(fl_ctx, {site: site_error(response)}, "numbers")
        try:
            data = from_shareable(response).data
            if task_name == COUNT_TASK:
                self.counts[site] = int(data["n_cases"])
            else:
                self.summaries[site] = fpl.from_wire(data, site)
        except (KeyError, TypeError, ValueError) as e:
            return self._fail(fl_ctx, {site: f"its answer is not a fingerprint: {e}"}, "numbers")
        return True

    def final_process(self, fl_ctx: FLContext) -> bool:
        sites = sorted(c.name for c in fl_ctx.get_engine().get_clients())
        got = self.counts if self.phase == COUNT_TASK else self.summaries
        missing = {s: "it did not answer within the task's timeout" for s in sites if s not in got and
                   s not in self.failed}
        if missing or self.failed:
            return self._fail(fl_ctx, missing, "numbers") if missing else False
        if self.phase == COUNT_TASK:
            return True
        try:
            fingerprint = fpl.merge_fingerprints({s: self.summaries[s] for s in sites})
            spec = job_task(self.task)
            reader = self.task.get("overwrite_image_reader_writer") or fpl.reader_name(spec.file_ending)
            plans = fpl.plan_from_fingerprint(self.task, fingerprint, reader, self.configuration)
        except (fpl.FingerprintError, DataError) as e:
            self.log_error(fl_ctx, job_failed_line(f"nnU-Net's plan of the federated fingerprint failed: {e}", {}))
            return False
        out = Path(fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id())) / PLANS_FOLDER
        out.mkdir(parents=True, exist_ok=True)
        (out / "dataset_fingerprint.json").write_text(json.dumps(fingerprint))
        (out / "plans.json").write_text(json.dumps(plans, indent=1))
        (out / "plans_slim.json").write_text(json.dumps(fpl.slim_plan_3d(plans, self.configuration), indent=1))
        cfg = plans["configurations"][self.configuration]
        self.log_info(fl_ctx, f"FEDUQ_PLANS written to {out}: {self.configuration} patch {cfg['patch_size']}, spacing "
                              f"{cfg['spacing']} mm, batch {cfg['batch_size']}, {len(fingerprint['spacings'])} cases")
        return True
