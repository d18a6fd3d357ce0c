"""Run FedUQ jobs in a local NVFlare POC federation whose sites are the task's centers.

    feduq poc start --task polyp --data-root /data/feduq     # provision + start
    feduq poc prepare --task polyp --data-root /data/feduq   # provision only (the kits, ready to start)
    feduq poc submit fedevi                                  # submit, wait, download, show table
    feduq poc status                                         # processes and their memory
    feduq poc stop                                           # stop and delete the POC workspace

``start`` provisions a POC project (``nvflare poc prepare -c <centers>``) with one client site per
center, writes each site's own ``local/feduq_site.json`` (its data root and center: the data path is
the site's setting, never the job's) and allow-lists FedUQ's classes on every site
(``feduq prepare-site``), then starts server and clients (``nvflare poc start``; no admin console,
as in NVFlare >= 2.8). ``submit`` uses the FLARE Python session API; the same can be done with
``nvflare job submit/wait/download`` or the admin console (see README, "POC"). ``submit`` exits 1 when the job
did not end ``FINISHED:COMPLETED`` or wrote no per-client table, printing the server's reason and each failing
site's first error (from the sites' job logs, ``<site kit>/<job_id>/log.txt``).

Environment: ``NVFLARE_POC_WORKSPACE`` (default ``workspaces/poc`` under the working folder) is where the POC lives. NVFlare
also registers the POC's admin startup kit in ``~/.nvflare``; set ``HOME`` to keep that elsewhere.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from feduq.cli import verb_parser
from feduq.recipes.jobspec import job_folder

from feduq.recipes.poc import (ADMIN, PROJECT, kit_dir, parent_logs, poc_workspace, site_job_logs,  # noqa: F401
                               prepare, site_memory, start, stop)


def submit(job: str | Path, timeout: int = 3600, download: str | Path | None = None) -> dict:
    """Submit ``job`` with the FLARE Python session API, wait, download, and print the table.

    Returns:
        ``{"job_id", "status", "seconds", "result_dir", "table", "peak_mib"}``; ``table`` is the
        per-client Markdown table, ``peak_mib`` the peak resident memory per participant.

    Raises:
        TimeoutError: the job did not finish within ``timeout`` seconds (it is aborted).
        RuntimeError: the job finished in a state other than COMPLETED, or wrote no per-client table, or its
            server logged a fatal error; the message is :meth:`feduq.recipes.outcome.RunOutcome.summary` (the server's reason
            and each failing site's first error, from the POC sites' job logs).
    """
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    from feduq.recipes.outcome import poc_outcome

    session = new_secure_session(ADMIN, str(kit_dir(ADMIN)))
    peak: dict[str, float] = {}
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            for k, v in site_memory().items():
                peak[k] = max(peak.get(k, 0.0), v)
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    try:
        t0 = time.time()
        job_id = session.submit_job(str(Path(job).resolve()))
        print(f"submitted {job} as {job_id}")
        sampler.start()
        session.monitor_job(job_id, timeout=timeout, poll_interval=2.0)
        seconds = time.time() - t0
        status = session.get_job_meta(job_id).get("status", "")
        if "FINISHED" not in status:
            session.abort_job(job_id)
            raise TimeoutError(f"job {job_id} not finished after {timeout} s (status {status}); aborted")
        dest = Path(download or Path("workspaces") / "poc_results").resolve()
        result_dir = Path(session.download_job_result(job_id, str(dest)))
    finally:
        stop.set()
        session.close()
    outcome = poc_outcome(result_dir, site_job_logs(job_id), status=status, job_id=job_id, parent_logs=parent_logs())
    if not outcome.ok:
        raise RuntimeError(f"job {job_id} failed ({status} after {seconds:.0f} s; logs in {result_dir}):\n"
                           + outcome.summary())
    markdown = outcome.table.with_suffix(".md")
    table = markdown.read_text() if markdown.is_file() else ""
    print(f"job {job_id}: {status} in {seconds:.1f} s; results in {result_dir}\n{table}")
    return {"job_id": job_id, "status": status, "seconds": seconds, "result_dir": result_dir, "table": table,
            "peak_mib": peak}


def main(argv=None) -> int:
    p = verb_parser("feduq poc", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, what in (("start", "provision and start a POC whose sites are the task's centers"),
                       ("prepare", "provision a POC's startup kits, ready for feduq poc start or nvflare poc start")):
        s = sub.add_parser(name, help=what)
        s.add_argument("--task", default="polyp")
        s.add_argument("--sites", nargs="+", help="a subset of the centers (default: all)")
        s.add_argument("--data-root", help="data root written into each site's local config")
    j = sub.add_parser("submit", help="submit a job folder, wait, download and print the table")
    j.add_argument("job", type=job_folder, help="a job folder (feduq run --export-to, feduq configure) or a registered method")
    j.add_argument("--timeout", type=int, default=3600)
    j.add_argument("--download", help="folder for the downloaded results (default workspaces/poc_results)")
    sub.add_parser("status", help="POC processes and their memory")
    k = sub.add_parser("stop", help="stop server and clients and delete the POC workspace")
    k.add_argument("--keep", action="store_true", help="keep the POC workspace (logs, startup kits)")
    a = p.parse_args(argv)
    if a.cmd in ("start", "prepare"):
        from feduq.data import DataError

        try:
            sites = (start if a.cmd == "start" else prepare)(a.task, a.sites, a.data_root)
        except DataError as e:
            print(f"feduq poc {a.cmd}: error: {e}", file=sys.stderr)
            return 2
        if a.cmd == "prepare":
            print(f"POC kits of {', '.join(sites)} in {poc_workspace()} (start them: feduq poc start, or "
                  f"nvflare poc start)")
    elif a.cmd == "submit":
        if not (Path(a.job) / "meta.json").is_file():  # checked before any session is opened
            print(f"feduq poc submit: error: {a.job} is not a job folder (no meta.json); e.g. a method's name, or a "
                  f"folder made by feduq configure", file=sys.stderr)
            return 2
        if not kit_dir(ADMIN).is_dir():
            print(f"feduq poc submit: error: no POC here (no admin startup kit at {kit_dir(ADMIN)}); start one with "
                  f"feduq poc start, or set NVFLARE_POC_WORKSPACE to the POC's workspace", file=sys.stderr)
            return 2
        try:
            res = submit(a.job, a.timeout, a.download)
        except (RuntimeError, TimeoutError) as e:
            print(e, file=sys.stderr)
            return 1
        print("peak memory per participant (MiB): " + json.dumps({k: round(v) for k, v in res["peak_mib"].items()}))
    elif a.cmd == "status":
        print(json.dumps({k: round(v) for k, v in site_memory().items()}, indent=2))
    else:
        try:
            stop(clean=not a.keep)
        except RuntimeError as e:
            print(f"feduq poc: error: {e}", file=sys.stderr)
            return 2
    return 0


