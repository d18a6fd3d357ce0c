"""The federation's nnU-Net plan job (:mod:`feduq.flare.planning`): its files, and a run in FLARE's simulator.

Two of FLARE's ``BroadcastAndProcess`` workflows with FedUQ's :class:`feduq.flare.planning.FederatedPlanner` on the
server and :class:`~feduq.flare.planning.PlanFingerprintExecutor` on the sites, with the privacy ledger's filters
(job ``nnunet_fingerprint``) on both tasks. ``feduq plan`` runs it in the simulator, or exports it for
a POC or provisioned project; the plan lands in the server's run folder (``plans/plans.json``, ``plans_slim.json``).
"""

from __future__ import annotations

import os
from pathlib import Path

from ..data import DataError, get_task
from .jobspec import CLIENT, CUSTOM, CUSTOM_README, META, SERVER, dump_json, ledger_filters

JOB_NAME = "feduq_nnunet_plan"
_PLANNING = "feduq.flare.planning"
#: seconds a site may take to count or fingerprint its training cases
TASK_TIMEOUT = 3600


def plan_job(task, configuration: str = "3d_fullres", foreground_voxels: float | None = None,
             timeout: int = TASK_TIMEOUT) -> dict[str, str]:
    """The job's files for the task's training sites (its sites but the held-out ones).

    Raises:
        DataError: the task is not a declared volume task.
    """
    from ..flare.planning import COUNT_TASK, FINGERPRINT_TASK
    from ..registry.ledger import FINGERPRINT_JOB

    spec = get_task(task)
    if spec.kind != "3d":
        raise DataError(f"task {spec.name!r} holds 2D images ({spec.file_ending}): nnU-Net's "
                        f"{configuration} plan is for volumes")
    sites = [s for s in spec.centers if s not in spec.held_out]
    planner = {"task": spec.raw, "configuration": configuration}
    if foreground_voxels is not None:
        import math

        if isinstance(foreground_voxels, bool) or not isinstance(foreground_voxels, (int, float)) or not (
                math.isfinite(foreground_voxels) and foreground_voxels >= 1):
            raise DataError(f"--foreground-voxels {foreground_voxels!r}: expected a number of voxels >= 1 sampled over "
                            "the federation (nnU-Net's default 10e7)")
        planner["foreground_voxels"] = float(foreground_voxels)
    workflow = {"min_responses_required": 0, "wait_time_after_min_received": 0, "timeout": int(timeout)}
    server = {"format_version": 2,
              "workflows": [{"id": f"wf_{t}", "path": "nvflare.app_common.workflows.broadcast_and_process."
                             "BroadcastAndProcess", "args": {"processor": "planner", "task_name": t, **workflow}}
                            for t in (COUNT_TASK, FINGERPRINT_TASK)],
              "components": [{"id": "planner", "path": f"{_PLANNING}.FederatedPlanner", "args": planner}],
              "task_data_filters": [], "task_result_filters": []}
    client = {"format_version": 2,
              "executors": [{"tasks": [COUNT_TASK, FINGERPRINT_TASK],
                             "executor": {"path": f"{_PLANNING}.PlanFingerprintExecutor",
                                          "args": {"task": spec.raw}}}],
              "components": [], **ledger_filters(FINGERPRINT_JOB, [COUNT_TASK, FINGERPRINT_TASK])}
    meta = {"name": JOB_NAME, "resource_spec": {}, "min_clients": len(sites), "deploy_map": {"app": ["server", *sites]}}
    return {META: dump_json(meta), SERVER: dump_json(server), CLIENT: dump_json(client), CUSTOM: CUSTOM_README}


def check_plan_sites(task, data_root: str | os.PathLike | None) -> None:
    """Before FLARE's simulator starts (its sites' data are here): every training site's training cases as its
    fingerprint will read them (:func:`feduq.sites.nnunet_raw.training_case_files`, headers only), so a volume without
    a spacing, which nnU-Net's reader would read as 1 mm and plan with, is one line naming the file, not a site's
    error in the job's logs a minute later. Nothing is checked without a data root (the run then says so).

    Raises:
        DataError: the data root lacks a site's folder; a site's ``dataset.json``, split or files as
            :func:`~feduq.sites.nnunet_raw.training_case_files` refuses them (naming the site and the file).
    """
    from ..sites.nnunet_raw import training_case_files
    from ..sites.centers import site_center
    from .fingerprint import fingerprint_data_root

    root = data_root or os.environ.get("FEDUQ_DATA_ROOT")
    if not root:
        return
    spec = get_task(task)
    root = fingerprint_data_root(spec.name, root)
    for site in (s for s in spec.centers if s not in spec.held_out):
        training_case_files(spec.name, root, site_center(spec.name, site), site)


def run_plan(task, data_root: str | os.PathLike, workspace: str | os.PathLike, **job_args) -> Path:
    """Run the plan job in FLARE's simulator (one process per site); returns the folder holding ``plans.json``,
    ``plans_slim.json`` and ``dataset_fingerprint.json``.

    Raises:
        DataError: as :func:`plan_job`; the data root is not a folder or lacks a site's folder (before FLARE starts);
            the job failed (one line: each failed site and its first error, and where the logs are).
    """
    from .fingerprint import run_summary_job

    return run_summary_job(task, plan_job(task, **job_args), data_root, workspace, "plans/plans.json", "plan job",
                           "plan").parent
