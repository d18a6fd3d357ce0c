#!/usr/bin/env python3
"""Run a FedUQ job in the NVFlare simulator and say whether it worked (the one way FedUQ tools run the simulator).

    python tools/simulate.py jobs/fedevi -w workspaces/fedevi --data-root ../shared/data
    FEDUQ_DATA_ROOT=../shared/data python tools/simulate.py jobs/fedevi -w workspaces/fedevi [--log FILE]

Before FLARE starts, the data root (``--data-root``, else ``$FEDUQ_DATA_ROOT``) is resolved to an absolute path
(each simulated site runs in its own workspace folder, where a relative path means nothing) and checked to hold the
job's centers (``<root>/<task folder>/<center>/``); a missing center stops here with its name. The workspace is
then made afresh (an existing one is removed), FedUQ is allow-listed and the absolute root is written into the
sites' ``local/feduq_site.json`` (``tools/prepare_site.py``), and ``nvflare simulator JOB -w WS -t <sites>`` runs.

``nvflare simulator`` exits 0 even when the job aborted, so the outcome is read from the workspace instead
(:func:`feduq.runs.simulator_outcome`): the exit code is 0 only when the per-client table was written and the
server logged no fatal error; otherwise the server's reason and each failing site's first error are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_site import allow_feduq, write_site_config  # noqa: E402

from feduq.data import DATA_ROOT_ENV, DataError, get_task  # noqa: E402
from feduq.flare.jobcheck import JobConfigError, read_job  # noqa: E402
from feduq.runs import RunOutcome, check_data_root, simulator_outcome  # noqa: E402

DEFAULT_TASK = "polyp"


def job_task_and_sites(job: str | Path) -> tuple[str, list[str]]:
    """The task (client config ``executors[0].executor.args.task``, default polyp) and the sites of a job folder.

    Raises:
        FileNotFoundError: the job folder has no ``meta.json``.
        JobConfigError: a config file is missing or not valid JSON (:func:`feduq.flare.jobcheck.read_job`).
    """
    client, _, meta = read_job(job)
    if meta is None:
        raise FileNotFoundError(f"{job} is not a job folder (no meta.json)")
    sites = [s for s in meta["deploy_map"].get("app", []) if s != "server"]
    executors = client.get("executors") or [{}]
    return executors[0].get("executor", {}).get("args", {}).get("task", DEFAULT_TASK), sites


def resolve_and_check(job: str | Path, data_root: str | Path | None) -> Path:
    """The absolute data root for ``job`` (argument, else ``$FEDUQ_DATA_ROOT``), checked to hold its centers.

    Raises:
        DataError: no data root given, the root is not a folder, or a center of the job's sites is missing.
    """
    if data_root in (None, ""):
        data_root = os.environ.get(DATA_ROOT_ENV)
    if not data_root:
        raise DataError(f"no data root: pass --data-root DIR or set {DATA_ROOT_ENV}")
    task, sites = job_task_and_sites(job)
    from feduq.sites import parse_site

    spec = get_task(task)
    known = set(spec.centers) | set(spec.partition_centers)
    centers = sorted({parse_site(s)[0] for s in sites} & known)  # virtual sites read their center's folder
    return check_data_root(data_root, task, centers)


def nvflare_cli() -> str:
    """The ``nvflare`` command of the environment running this script (else the one on PATH)."""
    beside = Path(sys.executable).with_name("nvflare")
    return str(beside) if beside.is_file() else (shutil.which("nvflare") or "nvflare")


def simulate(
    job: str | Path,
    ws: str | Path,
    data_root: str | Path | None,
    threads: int | None = None,
    log: str | Path | None = None,
    extra_env: dict[str, str] | None = None,
) -> RunOutcome:
    """Check the data, prepare a fresh workspace, run ``nvflare simulator`` and read the outcome.

    Args:
        job: the job folder.
        ws: the simulator workspace; an existing folder is removed first.
        data_root: the data root, absolute or relative to the current folder; None: ``$FEDUQ_DATA_ROOT``.
        threads: simulator threads (``-t``); default one per site.
        log: write the simulator's output to this file instead of streaming it through (it may lie in ``ws``).
        extra_env: more environment variables for the simulator.

    Returns:
        The run's :class:`~feduq.runs.RunOutcome` (a non-zero simulator exit code also makes it fail).

    Raises:
        DataError: as :func:`resolve_and_check`, before anything is started or removed.
        FileNotFoundError: ``job`` is not a job folder.
    """
    job, ws = Path(job).resolve(), Path(ws).resolve()
    root = resolve_and_check(job, data_root)
    _, sites = job_task_and_sites(job)
    if ws.exists():
        shutil.rmtree(ws)
    allow_feduq(ws)
    write_site_config(ws, data_root=str(root))
    env = {**os.environ, DATA_ROOT_ENV: str(root), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [nvflare_cli(), "simulator", str(job), "-w", str(ws), "-t", str(threads or max(1, len(sites)))]
    if log is None:
        sys.stdout.flush()
        rc = run_process_group(cmd, env)
    else:
        Path(log).parent.mkdir(parents=True, exist_ok=True)
        with open(log, "w") as f:
            rc = run_process_group(cmd, env, stdout=f, stderr=subprocess.STDOUT)
    outcome = simulator_outcome(ws)
    if rc != 0:
        outcome.ok = False
        note = f"nvflare simulator exited with code {rc}"
        outcome.server_error = f"{outcome.server_error} ({note})" if outcome.server_error else note
    return outcome


def run_process_group(cmd: list[str], env: dict, **popen_args) -> int:
    """Run ``cmd`` in its own process group and return its exit code. When this process is interrupted (Ctrl-C) or
    terminated (SIGTERM, e.g. a stopped sweep), the whole group goes with it: the simulator's server and site
    processes never outlive the tool that started them."""
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen_args)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        return proc.wait()
    except BaseException:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        raise
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", type=Path, help="job folder (e.g. jobs/fedevi)")
    p.add_argument("-w", "--workspace", type=Path, required=True, help="simulator workspace (removed first)")
    p.add_argument("--data-root", help=f"folder holding <task>/<center>/ (default ${DATA_ROOT_ENV})")
    p.add_argument("-t", "--threads", type=int, help="simulator threads (default: one per site)")
    p.add_argument("--log", type=Path, help="write the simulator's output to this file instead of the terminal")
    a = p.parse_args(argv)
    try:
        outcome = simulate(a.job, a.workspace, a.data_root, threads=a.threads, log=a.log)
    except (DataError, FileNotFoundError, JobConfigError) as e:
        print(f"simulate.py: {e}", file=sys.stderr)
        return 1
    print(outcome.summary())
    if outcome.ok:
        ws = a.workspace.resolve()
        print(f"Models: {ws}/server/simulate_job/app_server/ ; logs: {ws}/server/log.txt, {ws}/<site>/log.txt")
        return 0
    if a.log is not None:
        print(f"Simulator output: {a.log}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
