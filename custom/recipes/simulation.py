"""Running a FedUQ job in FLARE's simulator, and preparing a FLARE workspace for FedUQ (the one way FedUQ runs the
simulator: ``feduq simulate``, ``feduq compare`` and :class:`feduq.recipes.recipe.FedUQRecipe` with ``SimEnv``).

Before FLARE starts, the data root is resolved to an absolute path (each simulated site runs in its own workspace
folder, where a relative path means nothing) and checked to hold the job's centers (``<root>/<task folder>/<center>/``);
a missing center stops here with its name. The workspace is then made afresh, FedUQ is allow-listed
(:func:`allow_feduq`) and the absolute root is written into the sites' ``local/feduq_site.json``
(:func:`write_site_config`), and FLARE 2.9's simulator runs the job (``python -m
feduq.flare.simulator``: FLARE's ``nvflare.private.fed.app.simulator.simulator``, what its ``SimEnv`` runs, with one
race between its site threads closed, see :mod:`feduq.flare.simulator`; the ``nvflare simulator`` command is
deprecated). The simulator's exit code alone does not say that the job finished, so the outcome is read from the
workspace (:func:`feduq.recipes.outcome.simulator_outcome`).

A workspace is removed first only when that is safe (:func:`feduq.outputs.check_output_folder`): never when it is,
contains or lies inside the job or the data root, and when it is not empty only if a FedUQ tool made it (or
``force``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Callable

from ..cli import Interrupted, signal_number, sigterm_as_interrupt
from ..common.wire import SITE_CONFIG_FILE
from ..data import DATA_ROOT_ENV, DataError, get_task, job_task
from ..jobs.job_files import read_job
from ..outputs import OutputFolderError, check_output_file, check_output_folder, user_files, write_marker
from .progress import RoundProgress
from .outcome import RunOutcome, check_data_root, simulator_outcome

DEFAULT_TASK = "polyp"
SIMULATOR_MODULE = "feduq.flare.simulator"
FEDUQ_PREFIX = "feduq."
# NVFlare classes FedUQ's server uses that are not on NVFlare's default allow-list (never allowed on a site).
SERVER_NVFLARE_CLASSES = ("nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",)


def allow_feduq(workspace: str | Path, server: bool = True) -> Path:
    """Allow FedUQ's classes in ``<workspace>/local/resources.json`` (idempotent).

    Args:
        workspace: a startup kit (or a simulator workspace).
        server: also allow FLARE's ``PTFileModelPersistor`` (the server's model file reader). Pass False for a
            site's kit: a site never needs to unpickle a model file.

    An existing ``resources.json`` (or ``resources.json.default``) is kept and extended; when it
    has no allow-list, NVFlare's default list is written first so nothing else changes.
    """
    from nvflare.app_common.default_component_policy import DEFAULT_CLASS_ALLOW_LIST

    local = Path(workspace) / "local"
    local.mkdir(parents=True, exist_ok=True)
    target = local / "resources.json"
    source = target if target.is_file() else local / "resources.json.default"
    resources = json.loads(source.read_text()) if source.is_file() else {"format_version": 2}
    allow = list(resources.get("class_allow_list", DEFAULT_CLASS_ALLOW_LIST))
    if "*" not in allow:
        allow += [p for p in (FEDUQ_PREFIX, *(SERVER_NVFLARE_CLASSES if server else ())) if p not in allow]
    resources["class_allow_list"] = allow
    target.write_text(json.dumps(resources, indent=2) + "\n")
    return target


def write_site_config(
    workspace: str | Path, data_root: str | None = None, center: str | None = None, on_bad_file: str | None = None
) -> Path:
    """Write ``<workspace>/local/feduq_site.json`` with the site's data root, center and bad-file policy.

    Raises:
        FileNotFoundError: ``data_root`` is given but is not a folder.
    """
    path = Path(workspace) / "local" / SITE_CONFIG_FILE
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    if data_root is not None:
        root = Path(data_root).expanduser().resolve()
        if not root.is_dir():
            raise FileNotFoundError(f"data root {root} is not a folder")
        cfg["data_root"] = str(root)
    if center is not None:
        cfg["center"] = center
    if on_bad_file is not None:
        cfg["on_bad_file"] = on_bad_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def job_task_and_sites(job: str | Path) -> tuple[str, list[str]]:
    """The task's name (client config ``executors[0].executor.args.task``, default polyp; a declared task, which the
    job carries as its declaration, is registered in this process) and the sites of a job folder.

    Raises:
        FileNotFoundError: the job folder has no ``meta.json``.
        JobConfigError: a config file is missing or not valid JSON (:func:`feduq.jobs.jobcheck.read_job`).
    """
    client, _, meta = read_job(job)
    if meta is None:
        raise FileNotFoundError(f"{job} is not a job folder (no meta.json)")
    sites = [s for s in meta["deploy_map"].get("app", []) if s != "server"]
    executors = client.get("executors") or [{}]
    task = executors[0].get("executor", {}).get("args", {}).get("task", DEFAULT_TASK)
    return (job_task(task).name if isinstance(task, dict) else task), sites  # a declared task: registered, by name


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
    from ..sites.centers import parse_site

    spec = get_task(task)
    known = set(spec.centers) | set(spec.partition_centers)
    centers = sorted({parse_site(s)[0] for s in sites} & known)  # virtual sites read their center's folder
    root = check_data_root(data_root, task, centers)
    from ..sites.nnunet_raw import check_site_declarations

    for note in check_site_declarations(task, root, centers):  # DataError naming the site: before FLARE starts
        print(f"warning: {note}", file=sys.stderr)
    _check_some_site_tests(task, root, sites, known)
    return root


def _check_some_site_tests(task, root: Path, sites, known) -> None:
    """A run whose sites all have an empty test split would train and then fail with "no site returned test
    metrics" (the reason only in the sites' logs): refused here, naming each site's test count, before FLARE starts.
    Each site's split as it reads it with no site setting (:func:`feduq.sites.split_files.split_size`, its files not
    read; an nnU-Net site's ``split.json`` or the split made from its cases)."""
    from ..sites.centers import parse_site
    from ..sites.folder import SiteFolder

    counts = {}
    for site in sites:
        center = parse_site(site)[0]
        if center not in known:
            return  # a site named otherwise: its folder is its own (feduq prepare-site), not checked here
        counts[site] = SiteFolder.of(task, center, root, site).split_size("testing")
    if counts and not any(counts.values()):
        raise DataError(f"no site has test cases ({', '.join(f'{s}: {n}' for s, n in counts.items())}): the run would "
                        "train and then have nothing to test; give a site a 'testing' split (its split.json, or "
                        "feduq split)")


def is_simulator_workspace(folder: Path) -> bool:
    """A workspace an earlier ``feduq simulate`` made: the ``local/feduq_site.json`` and ``local/resources.json`` it
    writes before the simulator starts (the simulator itself deletes anything else it did not make)."""
    return (folder / "local" / SITE_CONFIG_FILE).is_file() and (folder / "local" / "resources.json").is_file()


def simulator_command(job: Path, ws: Path, threads: int) -> list[str]:
    """FLARE 2.9's simulator entry point as its ``SimEnv`` starts it, through :mod:`feduq.flare.simulator` (same
    arguments; ``nvflare simulator`` is deprecated)."""
    return [sys.executable, "-m", SIMULATOR_MODULE, str(job), "-w", str(ws), "-t", str(threads)]


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
    """Check the data, prepare a fresh workspace, run FLARE's simulator and read the outcome.

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
        The run's :class:`~feduq.recipes.outcome.RunOutcome` (a non-zero simulator exit code also makes it fail).

    Raises:
        DataError: as :func:`resolve_and_check`, or :class:`~feduq.outputs.OutputFolderError` for a workspace
            that must not be replaced; both before anything is started or removed.
        FileNotFoundError: ``job`` is not a job folder.
    """
    job, ws = Path(job).resolve(), Path(ws).resolve()
    root = resolve_and_check(job, data_root)
    _, sites = job_task_and_sites(job)
    ws = check_output_folder(ws, {"job": job, "data root": root}, "feduq simulate", force=force,
                             recognise=is_simulator_workspace)  # (the simulator itself removes a marker file)
    theirs = user_files(ws, is_simulator_workspace)
    if theirs:  # FLARE's simulator empties its workspace when it starts: --force cannot keep them
        raise OutputFolderError(f"feduq simulate: the workspace {ws} holds {theirs[0]}, which no FedUQ tool wrote, and "
                                "FLARE's simulator empties its workspace; move it away or choose another workspace")
    if log is not None and not Path(log).resolve().is_relative_to(ws):  # a log inside ws goes with it (checked above)
        log = check_output_file(log, {"job": job, "data root": root}, "feduq simulate", force=force)
    if ws.exists():
        shutil.rmtree(ws)
    allow_feduq(ws)
    write_site_config(ws, data_root=str(root))
    env = {**os.environ, DATA_ROOT_ENV: str(root), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    cmd = simulator_command(job, ws, threads or max(1, len(sites)))
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
    except KeyboardInterrupt as e:  # the simulator's processes are gone; say how this workspace goes on
        raise Interrupted(_resume_note(job, ws, progress), signal_number(e)) from None
    finally:
        sink.close()
        if ws.is_dir():  # the manifest of the whole workspace: a file added later is the user's
            write_marker(ws, "feduq simulate")
    outcome = simulator_outcome(ws)
    if rc != 0:
        outcome.ok = False
        note = f"the simulator exited with code {rc}"
        outcome.server_error = f"{outcome.server_error} ({note})" if outcome.server_error else note
    return outcome


def _resume_note(job: Path, ws: Path, progress: RoundProgress) -> str:
    """The line of an interrupted simulator run: the rounds its last global model holds, and the command that continues
    from it (the job is copied into ``WS/job`` so that it outlives a temporary export)."""
    from ..core.checkpoints import load_checkpoint

    checkpoint = ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt"
    saved = None
    if checkpoint.is_file():
        try:
            meta = load_checkpoint(checkpoint).get("meta_props") or {}
            saved = int(meta["feduq_last_completed_round"]) + 1
        except (KeyError, TypeError, ValueError, AttributeError):  # CheckpointError (a ValueError): unreadable
            saved = None  # cut off while being written: not a model to go on from
    if saved is None:
        return (f"the simulator's processes are stopped ({progress.rounds_done} of {progress.num_rounds} rounds "
                "aggregated, no global model saved yet); run it again")
    kept = ws / "job"
    if ws.is_dir() and not kept.exists():
        shutil.copytree(job, kept)
    return (f"the simulator's processes are stopped ({saved} of {progress.num_rounds} rounds saved) and {ws} is kept; "
            f"continue with: feduq resume {kept} --checkpoint {checkpoint} -o <new job folder>")


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
    with sigterm_as_interrupt():
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
