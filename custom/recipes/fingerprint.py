"""The intensity fingerprint job of a declared task: FLARE's own federated statistics workflow over FedUQ's
:class:`feduq.flare.fingerprint.IntensityFingerprint`, and the CT windows it gives.

The job is FLARE's statistics job (``StatisticsController`` on the server, ``StatisticsExecutor`` and the
``StatisticsPrivacyFilter`` with its minimum-count cleanser on the sites, the global numbers written by
``JsonStatsFileWriter``), as ``nvflare.recipe.fedstats.FedStatsRecipe`` makes it, with FedUQ's generator named by
its class path (the sites run their installed ``feduq``, as every FedUQ job), and FLARE's controller and executor
subclassed so that a site which fails or falls silent stops the job naming it and why, instead of holding it for ever
(:class:`feduq.flare.fingerprint.FingerprintController`, :class:`~feduq.flare.fingerprint.FingerprintExecutor`).
Each site sends only the numbers of :func:`statistic_configs` (no histogram). ``feduq fingerprint`` runs
it in FLARE's simulator, or exports it for a POC or provisioned project, and writes the windows into the task file
(:func:`window_declaration`).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any, Callable

from ..data import DataError, get_task
from .jobspec import CLIENT, CUSTOM, CUSTOM_README, META, SERVER, dump_json, write_job

__all__ = ["QUANTILES", "STATS_FILE", "JOB_NAME", "statistic_configs", "fingerprint_job", "fingerprint_data_root",
           "run_summary_job", "run_in_workspace",
           "run_fingerprint", "job_failure", "window_declaration"]

QUANTILES = (0.005, 0.995)  # nnU-Net's CT normalisation clips to these percentiles of the foreground intensities
STATS_FILE = "statistics/intensity_fingerprint.json"
JOB_NAME = "feduq_intensity_fingerprint"
_STATS = "nvflare.app_common"
_FEDUQ = "feduq.flare.fingerprint"


def statistic_configs() -> dict:
    """What each site sends, in FLARE's statistics names: count, sum, mean, standard deviation, the two quantiles (a
    t-digest); no histogram, whose bins would show more of the intensity distribution than the window needs."""
    return {"count": {}, "sum": {}, "mean": {}, "stddev": {}, "quantile": {"*": list(QUANTILES)}}


def fingerprint_job(task, min_count: int = 10, voxels_per_case: int = 10000, seed: int = 0) -> dict[str, str]:
    """The job's files (``meta.json``, the server and client configs, ``app/custom/README.md``) for the task's
    training sites (its sites but the held-out ones).

    Raises:
        DataError: the task is not declared or has no CT channel without a window.
    """
    from ..flare.fingerprint import fingerprint_channels

    spec = get_task(task)
    if not fingerprint_channels(spec.name):
        raise DataError(f"task {spec.name!r} has no CT channel without a window: nothing to fingerprint")
    sites = [s for s in spec.centers if s not in spec.held_out]
    server = {"format_version": 2, "workflows": [{"id": "controller", "path": f"{_FEDUQ}.FingerprintController",
                                                 "args": {"statistic_configs": statistic_configs(),
                                                          "writer_id": "stats_writer", "enable_pre_run_task": False}}],
              "components": [{"id": "stats_writer", "path": f"{_STATS}.statistics.json_stats_file_persistor."
                              "JsonStatsFileWriter", "args": {"output_path": STATS_FILE, "json_encoder_path":
                                                              f"{_STATS}.utils.json_utils.ObjectEncoder"}}],
              "task_data_filters": [], "task_result_filters": []}
    client = {"format_version": 2,
              "executors": [{"tasks": ["fed_stats_pre_run", "fed_stats"],
                             "executor": {"path": f"{_FEDUQ}.FingerprintExecutor",
                                          "args": {"generator_id": "stats_generator"}}}],
              "components": [{"id": "stats_generator", "path": f"{_FEDUQ}.IntensityFingerprint",
                              "args": {"task": spec.raw, "voxels_per_case": int(voxels_per_case),
                                       "seed": int(seed)}},
                             {"id": "min_count_cleanser", "path": f"{_STATS}.statistics.min_count_cleanser."
                              "MinCountCleanser", "args": {"min_count": int(min_count)}}],
              "task_data_filters": [],
              "task_result_filters": [{"tasks": ["fed_stats"], "filters": [{
                  "path": f"{_STATS}.filters.statistics_privacy_filter.StatisticsPrivacyFilter",
                  "args": {"result_cleanser_ids": ["min_count_cleanser"]}}]}]}
    meta = {"name": JOB_NAME, "resource_spec": {}, "min_clients": len(sites), "deploy_map": {"app": ["server", *sites]}}
    return {META: dump_json(meta), SERVER: dump_json(server), CLIENT: dump_json(client), CUSTOM: CUSTOM_README}


def fingerprint_data_root(task, data_root: str | os.PathLike) -> Path:
    """The absolute data root, checked to hold the folder of every site of the fingerprint job (before FLARE starts:
    one line naming the root, not one per site from their logs).

    Raises:
        DataError: the root is not a folder, or lacks a site's folder (names each missing one).
    """
    from .outcome import check_data_root

    root = Path(data_root).expanduser().resolve()
    if not root.is_dir():
        raise DataError(f"data root {root} does not exist or is not a folder")
    spec = get_task(task)
    return check_data_root(root, spec.name, [s for s in spec.centers if s not in spec.held_out])


def run_fingerprint(task, data_root: str | os.PathLike, workspace: str | os.PathLike, **job_args) -> dict:
    """Run the fingerprint job in FLARE's simulator (one process per site) and return the server's statistics
    (feature -> statistic -> ``"Global"`` or site -> dataset -> value).

    Raises:
        DataError: as :func:`fingerprint_job`; the data root is not a folder or lacks a site's folder (before FLARE
            starts); the job failed (one line: each failed site and its first error, from
            the server's ``FEDUQ_JOB_FAILED`` record or the logs, and where the logs are) or wrote no statistics.
    """
    found = run_summary_job(task, fingerprint_job(task, **job_args), data_root, workspace, Path(STATS_FILE).name,
                            "fingerprint job", "statistics")
    return json.loads(found.read_text())


def run_in_workspace(task, data_root, workspace, tool: str, run: Callable[[Path, Path], Any]):
    """A tool's run of a summary job: the data root (``data_root``, else ``$FEDUQ_DATA_ROOT``) checked to hold every
    training site's folder, the workspace (``workspace``, else a new temporary folder) marked as the tool's afterwards
    (a failed run's logs too: a rerun may replace it), ``run(root, workspace)``'s value returned.

    Raises:
        DataError: no data root, or one that lacks a site's folder; whatever ``run`` raises.
    """
    import tempfile

    from ..outputs import user_files, write_marker

    root = data_root or os.environ.get("FEDUQ_DATA_ROOT")
    if not root:
        raise DataError("no data root: pass --data-root DIR or set FEDUQ_DATA_ROOT")
    root = fingerprint_data_root(task, root)  # DataError naming it, before any folder is made
    ws = Path(workspace) if workspace else Path(tempfile.mkdtemp(prefix=f"feduq-{tool.split('.')[0]}-"))
    keep = user_files(ws)
    try:
        return run(root, ws)
    finally:
        if ws.is_dir():
            write_marker(ws, tool, exclude=keep)


def run_summary_job(task, files: dict[str, str], data_root, workspace, output: str, job: str, what: str) -> Path:
    """Run a job of summary numbers (the task's training sites answer, the server writes one file) in FLARE's
    simulator, one process per site in its own process group, and return the file the server wrote (the first
    match of the glob ``output`` under the workspace).

    Raises:
        DataError: the data root is not a folder or lacks a site's folder (before FLARE starts); the job failed (one
            line: ``"the <job> failed: "`` each failed site and its first error, from the server's
            ``FEDUQ_JOB_FAILED`` record or the logs, and where the logs are) or wrote no ``what``.
    """
    from .outcome import server_failure
    from .simulation import run_process_group, simulator_command

    sites = json.loads(files[META])["deploy_map"]["app"][1:]
    root = fingerprint_data_root(task, data_root)
    ws = Path(workspace).resolve()
    job_dir = write_job(files, ws / "job" / json.loads(files[META])["name"])
    env = {**os.environ, "FEDUQ_DATA_ROOT": str(root), "PYTHONUNBUFFERED": "1"}
    log = ws / "simulator.log"
    with open(log, "w") as out:  # its own process group: the simulator's processes never outlive this one
        rc = run_process_group(simulator_command(job_dir, ws / "simulate", len(sites)), env, stdout=out,
                               stderr=subprocess.STDOUT)
    found = sorted((ws / "simulate").rglob(output))
    server_log = ws / "simulate" / "server" / "log.txt"
    failed, _ = server_failure(server_log.read_text(errors="replace").splitlines() if server_log.is_file() else [])
    if failed is not None or rc != 0 or not found:
        why = job_failure(ws / "simulate", log) or (f"the simulator exited with code {rc}" if rc != 0
                                                    else f"it wrote no {what}")
        raise DataError(f"the {job} failed: {why} (logs under {ws / 'simulate'})")
    return found[0]


def job_failure(simulate: Path, simulator_log: Path | None = None) -> str | None:
    """Why the failed fingerprint job in the simulator workspace ``simulate`` failed, in one line, or None: the
    server's ``FEDUQ_JOB_FAILED`` reason (with each named site's first logged error it does not already say), else
    each site's first log error, else FLARE's own fatal error, else the simulator output's first error line."""
    from .outcome import server_failure, site_first_error

    def lines(path: Path) -> list[str]:
        return path.read_text(errors="replace").splitlines() if path.is_file() else []

    def one_line(text: str) -> str:
        return " ".join(text.split())

    server = lines(simulate / "server" / "log.txt")
    reason, failed = server_failure(server)
    site_logs = {d.name: lines(d / "log.txt") for d in sorted(simulate.iterdir()) if d.is_dir()
                 and d.name not in ("server", "startup", "local") and (d / "log.txt").is_file()} \
        if simulate.is_dir() else {}
    first = {s: e for s, e in ((s, site_first_error(v)) for s, v in site_logs.items()) if e}
    if reason is not None and failed:
        extra = [f"{s}'s first logged error: {first[s]}" for s in sorted(failed) if s in first
                 and first[s].removeprefix("FedUQ setup failed: ").removeprefix(f"site {s!r}: ") not in reason]
        return one_line("; ".join([reason, *extra]))
    if first:
        return one_line("; ".join(f"site {s!r}: {e.removeprefix(f'site {s!r}: ')}" for s, e in sorted(first.items())))
    if reason is not None:
        return one_line(reason)
    noted = [line for line in lines(simulator_log) if "rror" in line] if simulator_log is not None else []
    return one_line(noted[0])[:300] if noted else None


def window_declaration(task, stats: dict) -> dict:
    """The task's declaration (JSON) with each fingerprinted CT channel's ``{"scheme": "CT", "window": [p0.5,
    p99.5], "mean": m, "std": s}`` from the statistics' global numbers.

    Raises:
        ValueError: a channel or global statistic missing from ``stats`` (names both).
    """
    from ..flare.fingerprint import DATASET, fingerprint_channels

    spec = get_task(task)
    raw = json.loads(json.dumps(spec.raw))
    norm = raw.setdefault("feduq", {}).setdefault("normalization", {})
    for name, c in fingerprint_channels(spec.name).items():
        try:
            g = {k: stats[name][k]["Global"][DATASET] for k in ("mean", "stddev", "quantile")}
            q = {float(p): float(v) for p, v in g["quantile"].items()}
            low, high = q[QUANTILES[0]], q[QUANTILES[1]]
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"the statistics have no global {e} of channel {name!r}") from None
        norm[str(c)] = {"scheme": "CT", "window": [round(low, 4), round(high, 4)], "mean": round(float(g["mean"]), 4),
                        "std": round(float(g["stddev"]), 4)}
    return raw


def write_declaration(raw: dict, out: str | os.PathLike) -> Path:
    """Write a task file (indented JSON) and return its path."""
    out = Path(out)
    out.write_text(json.dumps(raw, indent=1) + "\n")
    return out
