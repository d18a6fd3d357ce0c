#!/usr/bin/env python3
"""Run a FedUQ job in the NVFlare simulator and say whether it worked (the one way FedUQ tools run the simulator).

    python tools/simulate.py jobs/fedevi -w workspaces/fedevi --data-root ../shared/data
    FEDUQ_DATA_ROOT=../shared/data python tools/simulate.py jobs/fedevi -w workspaces/fedevi [--log FILE]

Before FLARE starts, the data root (``--data-root``, else ``$FEDUQ_DATA_ROOT``) is resolved to an absolute path
(each simulated site runs in its own workspace folder, where a relative path means nothing) and checked to hold the
job's centers (``<root>/<task folder>/<center>/``); a missing center stops here with its name. The workspace is
then made afresh, FedUQ is allow-listed and the absolute root is written into the sites' ``local/feduq_site.json``
(``tools/prepare_site.py``), and ``nvflare simulator JOB -w WS -t <sites>`` runs.

The workspace is removed first only when that is safe (:func:`feduq.outputs.check_output_folder`): never when it is,
contains or lies inside the job or the data root, and when it is not empty only if a FedUQ tool made it (or with
``--force``); otherwise the tool stops with one line naming the folder and a file it did not write.

The terminal shows one line per round (round r/R, the sites' mean validation Dice of the global model, the aggregation
weights, elapsed time and ETA; :class:`feduq.progress.RoundProgress`) and the per-client table at the end; FLARE's
whole output goes to ``WS/simulator.log`` (``--log`` elsewhere, ``-v`` to the terminal as well).

``nvflare simulator``'s exit code alone does not say that the job finished, so the outcome is read from the workspace
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
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

from prepare_site import allow_feduq, write_site_config  # noqa: E402

from feduq.constants import SITE_CONFIG_FILE  # noqa: E402
from feduq.data import DATA_ROOT_ENV, DataError, get_task  # noqa: E402
from feduq.flare.jobcheck import JobConfigError, read_job  # noqa: E402
from feduq.outputs import check_output_folder  # noqa: E402
from feduq.progress import RoundProgress  # noqa: E402
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


def is_simulator_workspace(folder: Path) -> bool:
    """A workspace an earlier ``simulate.py`` made: the ``local/feduq_site.json`` and ``local/resources.json`` it
    writes before the simulator starts (the simulator itself deletes anything else it did not make)."""
    return (folder / "local" / SITE_CONFIG_FILE).is_file() and (folder / "local" / "resources.json").is_file()


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
    force: bool = False,
    verbose: bool = False,
    label: str = "",
    echo: Callable[[str], None] = print,
) -> RunOutcome:
    """Check the data, prepare a fresh workspace, run ``nvflare simulator`` and read the outcome.

    Args:
        job: the job folder.
        ws: the simulator workspace; an existing folder is removed first if a FedUQ tool made it (or ``force``).
        data_root: the data root, absolute or relative to the current folder; None: ``$FEDUQ_DATA_ROOT``.
        threads: simulator threads (``-t``); default one per site.
        log: the file for the simulator's whole output (default ``WS/simulator.log``; it is opened once the simulator
            has cleaned the workspace, and the lines before are kept).
        extra_env: more environment variables for the simulator.
        force: replace an existing non-empty workspace that no FedUQ tool made.
        verbose: also print the simulator's whole output (else only one line per round).
        label: prefix of the progress lines (e.g. ``"fedevi s0"`` in a sweep).
        echo: where the progress lines go (``print``; a sweep passes ``tqdm.write``).

    Returns:
        The run's :class:`~feduq.runs.RunOutcome` (a non-zero simulator exit code also makes it fail).

    Raises:
        DataError: as :func:`resolve_and_check`, or :class:`~feduq.outputs.OutputFolderError` for a workspace
            that must not be replaced; both before anything is started or removed.
        FileNotFoundError: ``job`` is not a job folder.
    """
    job, ws = Path(job).resolve(), Path(ws).resolve()
    root = resolve_and_check(job, data_root)
    _, sites = job_task_and_sites(job)
    ws = check_output_folder(ws, {"job": job, "data root": root}, "simulate.py", force=force,
                             recognise=is_simulator_workspace)  # (the simulator itself removes a marker file)
    if ws.exists():
        shutil.rmtree(ws)
    allow_feduq(ws)
    write_site_config(ws, data_root=str(root))
    env = {**os.environ, DATA_ROOT_ENV: str(root), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = [nvflare_cli(), "simulator", str(job), "-w", str(ws), "-t", str(threads or max(1, len(sites)))]
    log = Path(log) if log is not None else ws / "simulator.log"
    progress = RoundProgress(job_rounds(job), label=label)
    sink = _LateLog(log, ws / "server")

    def on_line(line: str) -> None:
        sink.write(line)
        if verbose:
            sys.stdout.write(line)
            sys.stdout.flush()
        message = progress.feed(line)
        if message:
            echo(message)

    sys.stdout.flush()
    try:
        rc = run_process_group(cmd, env, on_line=on_line)
    finally:
        sink.close()
    outcome = simulator_outcome(ws)
    if rc != 0:
        outcome.ok = False
        note = f"nvflare simulator exited with code {rc}"
        outcome.server_error = f"{outcome.server_error} ({note})" if outcome.server_error else note
    return outcome


class _LateLog:
    """A log file opened only once ``ready`` exists (the simulator deletes what is in its workspace when it starts,
    then makes ``server/``); the lines that came before are kept and written first."""

    def __init__(self, path: Path, ready: Path):
        self.path, self.ready, self.pending, self.file = path, ready, [], None
        self.inside = ready.parent.resolve() in path.resolve().parents  # a log outside the workspace opens at once

    def write(self, line: str) -> None:
        if self.file is None and (self.ready.exists() or not self.inside):
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "w")
            self.file.writelines(self.pending)
            self.pending = []
        if self.file is None:
            self.pending.append(line)
        else:
            self.file.write(line)

    def close(self) -> None:
        if self.file is None:  # the simulator never got as far as making its server folder
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.file = open(self.path, "w")
            self.file.writelines(self.pending)
        self.file.close()


def job_rounds(job: Path) -> int:
    """The job's rounds: ``num_rounds`` of its first server workflow (0 when it has none)."""
    _, server, _ = read_job(job)
    workflows = (server or {}).get("workflows") or [{}]
    return int(workflows[0].get("args", {}).get("num_rounds", 0) or 0)


def run_process_group(cmd: list[str], env: dict, on_line: Callable[[str], None] | None = None, **popen_args) -> int:
    """Run ``cmd`` in its own process group and return its exit code. When this process is interrupted (Ctrl-C) or
    terminated (SIGTERM, e.g. a stopped sweep), the whole group goes with it: the simulator's server and site
    processes never outlive the tool that started them. ``on_line`` receives every line of the command's
    stdout and stderr together."""
    if on_line is not None:
        popen_args.update(stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1, errors="replace")
    proc = subprocess.Popen(cmd, env=env, start_new_session=True, **popen_args)
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise KeyboardInterrupt(f"signal {signum}")

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        if on_line is not None:
            for line in proc.stdout:
                on_line(line)
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
    p.add_argument("-w", "--workspace", type=Path, required=True,
                   help="simulator workspace (made afresh; an existing one only if a FedUQ tool made it)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing workspace folder that holds files no FedUQ tool wrote")
    p.add_argument("--data-root", help=f"folder holding <task>/<center>/ (default ${DATA_ROOT_ENV})")
    p.add_argument("-t", "--threads", type=int, help="simulator threads (default: one per site)")
    p.add_argument("--log", type=Path, help="the file for the simulator's whole output (default WS/simulator.log)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the simulator's whole output (default: one line per round, the summary at the end)")
    a = p.parse_args(argv)
    try:
        outcome = simulate(a.job, a.workspace, a.data_root, threads=a.threads, log=a.log, force=a.force,
                           verbose=a.verbose)
    except (DataError, FileNotFoundError, JobConfigError) as e:
        print(f"simulate.py: {e}", file=sys.stderr)
        return 1
    if outcome.ok and outcome.table is not None and outcome.table.with_suffix(".md").is_file():
        print(outcome.table.with_suffix(".md").read_text().rstrip() + "\n")
    print(outcome.summary())
    if outcome.ok:
        ws = a.workspace.resolve()
        print(f"Models: {ws}/server/simulate_job/app_server/ ; logs: {ws}/server/log.txt, {ws}/<site>/log.txt")
        return 0
    print(f"Simulator output: {a.log or a.workspace.resolve() / 'simulator.log'}")
    return 1


if __name__ == "__main__":
    sys.exit(main())
