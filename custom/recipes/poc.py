"""FedUQ's local POC federation (FLARE's proof-of-concept mode), shared by ``feduq poc`` and
``feduq run --env poc`` (:class:`FedUQPocEnv`).

One POC workspace for both: ``NVFLARE_POC_WORKSPACE``, default ``workspaces/poc`` under the current folder's
FedUQ checkout (FLARE's own default is in ``~/.nvflare``). :func:`start` provisions one client site per center
(``nvflare poc prepare -c <sites>``), writes each site's ``local/feduq_site.json`` (its data root: the site's setting,
never the job's), allow-lists FedUQ's classes, and starts server and sites; :func:`stop` stops them (and with
``clean`` deletes the workspace), killing any participant ``nvflare poc stop`` left behind.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from nvflare.recipe import PocEnv

from .simulation import allow_feduq, write_site_config
from ..flare.ledger import write_privacy_policy

ADMIN = "admin@nvidia.com"
PROJECT = "example_project"


def poc_workspace() -> Path:
    """The POC workspace: ``$NVFLARE_POC_WORKSPACE``, else ``workspaces/poc`` under the working folder (never inside
    the installed package)."""
    return Path(os.environ.get("NVFLARE_POC_WORKSPACE", "workspaces/poc")).resolve()


def kit_dir(participant: str) -> Path:
    """Startup-kit folder of a POC participant (server, a site, or the admin)."""
    return poc_workspace() / PROJECT / "prod_00" / participant


def _env() -> dict:
    env = dict(os.environ, NVFLARE_POC_WORKSPACE=str(poc_workspace()))
    # POC start scripts run `python3` from PATH: make it this environment's interpreter
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def _nvflare(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [str(Path(sys.executable).with_name("nvflare")), *args]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd[1:])} failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc


def prepare(task: str = "polyp", sites: list[str] | None = None, data_root: str | None = None,
          center_of: dict[str, str] | None = None) -> list[str]:
    """Provision a POC with one site per center of ``task`` (or the given ``sites``), its kits ready to start: FedUQ
    allow-listed on every kit, each site's privacy ledger and ``local/feduq_site.json`` written; nothing started.

    Args:
        data_root: written into every site's ``local/feduq_site.json``; None leaves the sites to
            ``FEDUQ_DATA_ROOT`` in their environment.
        center_of: site -> center, for sites not named after their center.

    Returns:
        The client site names.

    Raises:
        DataError: ``data_root`` is not a folder or lacks a center of the sites (checked before anything changes).
    """
    from ..data import get_task
    from .outcome import check_data_root
    from ..sites.centers import site_center

    sites = sites or list(get_task(task).centers)
    if data_root is not None:  # checked before the POC workspace is rebuilt: DataError naming the root/centers
        centers = sorted({(center_of or {}).get(s) or site_center(task, s) for s in sites})
        data_root = str(check_data_root(data_root, task, centers))
        from ..sites.nnunet_raw import check_site_declarations

        for note in check_site_declarations(task, data_root, centers):  # DataError naming the site, before the POC
            print(f"warning: {note}", file=sys.stderr)
    _nvflare("poc", "prepare", "-c", *sites, "--force")
    allow_feduq(kit_dir("server"))
    for site in sites:
        allow_feduq(kit_dir(site), server=False)
        write_privacy_policy(kit_dir(site))  # the site's own ledger: a job cannot remove it
        center = (center_of or {}).get(site)
        if data_root or center:
            write_site_config(kit_dir(site), data_root=data_root, center=center)
    return sites


def start(task: str = "polyp", sites: list[str] | None = None, data_root: str | None = None,
          center_of: dict[str, str] | None = None) -> list[str]:
    """Provision (:func:`prepare`) and start a POC with one site per center of ``task`` (or the given ``sites``).

    Returns:
        The client site names.

    Raises:
        DataError: ``data_root`` is not a folder or lacks a center of the sites (checked before anything changes).
    """
    sites = prepare(task, sites, data_root, center_of)
    _nvflare("poc", "start", "--timeout", "240", timeout=300)
    print(f"POC started in {poc_workspace()} with sites {sites}")
    return sites


def site_memory() -> dict[str, float]:
    """Resident memory (MiB) of each POC participant's processes, summed per participant."""
    import psutil

    root = str(kit_dir("")) + os.sep
    usage: dict[str, float] = {}
    for proc in psutil.process_iter(["cmdline", "cwd", "memory_info"]):
        try:
            text = " ".join(proc.info["cmdline"] or []) + " " + (proc.info["cwd"] or "")
            if root not in text or proc.info["memory_info"] is None:
                continue
            participant = text.split(root, 1)[1].split("/")[0].split()[0]
            usage[participant] = usage.get(participant, 0.0) + proc.info["memory_info"].rss / 2**20
        except (psutil.Error, IndexError):
            continue
    return usage


def site_job_logs(job_id: str) -> dict[str, Path]:
    """Each POC site's log of job ``job_id`` (``<site kit>/<job_id>/log.txt``), for the sites that ran it."""
    prod = kit_dir("")
    if not prod.is_dir():
        return {}
    return {d.name: d / job_id / "log.txt" for d in sorted(prod.iterdir())
            if d.name not in ("server", ADMIN) and (d / job_id / "log.txt").is_file()}


def parent_logs() -> dict[str, Path]:
    """Each POC participant's parent-process log (``<kit>/log.txt``: the server's and every site's), where FLARE
    records a job process that ended (:func:`feduq.recipes.outcome.vanished_job_processes`)."""
    prod = kit_dir("")
    if not prod.is_dir():
        return {}
    return {d.name: d / "log.txt" for d in sorted(prod.iterdir()) if d.name != ADMIN and (d / "log.txt").is_file()}


def kill_processes_under(root: str | Path) -> int:
    """Kill this machine's processes whose command line or working folder lies under ``root`` (a federation's server,
    sites and the job processes FLARE started for them in sessions of their own, which a process-group kill of the
    site misses) and wait for them (10 s at most). Returns how many were found."""
    import psutil

    root = str(Path(root).resolve()) + os.sep
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        try:
            if proc.pid != os.getpid() and root in " ".join(proc.info["cmdline"] or []) + " " + (proc.info["cwd"] or ""):
                found.append(proc)
        except psutil.Error:
            continue
    for proc in found:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(found, timeout=10)
    return len(found)


def is_poc_workspace(folder: Path) -> bool:
    """A folder ``nvflare poc prepare`` made: its ``project.yml`` or a ``<project>/prod_00`` of startup kits."""
    return (folder / "project.yml").is_file() or any(p.is_dir() for p in folder.glob("*/prod_00"))


def stop(clean: bool = True) -> None:
    """Stop server and clients; with ``clean`` also delete the POC workspace.

    Raises:
        RuntimeError: the POC workspace folder is not one (:func:`is_poc_workspace`): nothing is stopped or removed.

    Participants that ``nvflare poc stop`` could not stop (e.g. after a failed start) are killed, so
    no process of this POC outlives the call.
    """
    import shutil

    ws = poc_workspace()
    if not ws.exists():
        return
    if not is_poc_workspace(ws):
        raise RuntimeError(f"{ws} is not a FLARE POC workspace (no project.yml and no */prod_00); nothing was stopped "
                           "or removed (check NVFLARE_POC_WORKSPACE)")
    try:
        _nvflare("poc", "stop", timeout=180)
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        print(f"nvflare poc stop: {e}")
    kill_processes_under(kit_dir(""))
    if clean:
        try:
            _nvflare("poc", "clean", timeout=120)
        except (RuntimeError, subprocess.TimeoutExpired):
            shutil.rmtree(poc_workspace(), ignore_errors=True)


def running_sites() -> list[str] | None:
    """The client sites of the POC in :func:`poc_workspace` when its server is running, else None."""
    from nvflare.tool.poc.poc_commands import is_poc_running, setup_service_config

    ws = str(poc_workspace())
    try:  # as FLARE's PocEnv asks: no workspace or no service config means no POC
        project_config, service_config = setup_service_config(ws)
        if not is_poc_running(ws, service_config, project_config):
            return None
    except Exception:  # noqa: BLE001 - FLARE raises various errors for a missing or partial workspace
        return None
    prod = kit_dir("")
    return sorted(d.name for d in prod.iterdir() if (d / "startup" / "fed_client.json").is_file())


class FedUQPocEnv(PocEnv):
    """FLARE's ``PocEnv`` on FedUQ's POC: a POC already running in :func:`poc_workspace` with the job's sites is used
    as it is (FLARE's own ``PocEnv`` would stop it and provision a fresh one, losing each site's data root); otherwise
    one is started for the job's sites with ``data_root`` (:func:`start`) and :attr:`started_here` is set, so the
    caller stops it after the run.

    Args:
        clients: the job's sites.
        task: the task whose centers the sites are (their data is ``<data_root>/<task>/<center>``).
        data_root: written into each started site's local config; None: the sites read ``FEDUQ_DATA_ROOT``.

    Raises:
        ValueError: a running POC lacks some of the job's sites (names them and the POC's).
    """

    def __init__(self, *, clients: list[str], task: str = "polyp", data_root: str | None = None, **kwargs):
        os.environ["NVFLARE_POC_WORKSPACE"] = str(poc_workspace())  # FLARE's PocEnv reads the same workspace
        super().__init__(clients=clients, **kwargs)
        self.task, self.data_root, self.started_here = task, data_root, False

    def deploy(self, job) -> str:
        sites = running_sites()
        if sites is None:
            start(self.task, sites=list(self.clients), data_root=self.data_root)
            self.started_here = True
        elif not set(self.clients) <= set(sites):
            raise ValueError(f"the POC running in {poc_workspace()} has sites {sites}, not the job's "
                             f"{sorted(set(self.clients) - set(sites))}; stop it (feduq poc stop) or "
                             "run the job's sites")
        return self._get_session_manager().submit_job(job)
