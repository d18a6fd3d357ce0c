#!/usr/bin/env python3
"""A provisioned FedUQ federation on one machine: ``nvflare provision``, mutual TLS, started from the startup kits.

This is the production path (README "Provisioned deployment") run on loopback, for a test or a dry run before the
kits go to the hospitals::

    python tools/provisioned.py up --out /tmp/feduq-prov --sites CVC-ClinicDB,ETIS-LaribPolypDB --data-root DATA
    feduq poc ...   # or the admin kit: <out>/<project>/prod_00/admin@feduq.test/startup/fl_admin.sh
    python tools/provisioned.py down --out /tmp/feduq-prov

``up`` writes a project file (server ``localhost`` on a free port, the sites, one project admin), provisions it
(certificates signed by the project's root CA; every connection is mutual TLS), allow-lists FedUQ's classes and writes
each site's ``local/feduq_site.json`` (feduq prepare-site), optionally gives a site a **strict authorization
policy** (``local/authorization.json``: no custom code, "byoc": "none", for every role), and starts server and sites
from their kits in their own process groups. ``down`` stops every process it started (pids in ``<out>/pids.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from feduq.flare.ledger import write_privacy_policy  # noqa: E402
from feduq.recipes.simulation import allow_feduq, write_site_config  # noqa: E402

ADMIN = "admin@feduq.test"
SERVER = "localhost"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def project_yaml(name: str, sites: list[str], port: int) -> str:
    """An NVFlare api_version 3 project: server ``localhost:port`` (fed learn and admin), the sites, one admin."""
    clients = "".join(f"  - name: {s}\n    type: client\n    org: org_{i}\n" for i, s in enumerate(sites))
    return (f"api_version: 3\nname: {name}\ndescription: FedUQ provisioned loopback federation\nparticipants:\n"
            f"  - name: {SERVER}\n    type: server\n    org: hub\n    fed_learn_port: {port}\n    admin_port: {port}\n"
            f"{clients}  - name: {ADMIN}\n    type: admin\n    org: hub\n    role: project_admin\n"
            "builders:\n  - path: nvflare.lighter.impl.workspace.WorkspaceBuilder\n"
            "  - path: nvflare.lighter.impl.static_file.StaticFileBuilder\n    args:\n      config_folder: config\n"
            "  - path: nvflare.lighter.impl.cert.CertBuilder\n  - path: nvflare.lighter.impl.signature.SignatureBuilder\n")


def provision(out: Path, name: str, sites: list[str], port: int) -> Path:
    """Provision the project into ``out``; returns the folder of the startup kits (``<out>/<name>/prod_00``).

    Raises:
        RuntimeError: ``nvflare provision`` failed (its output attached).
    """
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.yml").write_text(project_yaml(name, sites, port))
    nvflare = Path(sys.executable).with_name("nvflare")
    proc = subprocess.run([str(nvflare), "provision", "-p", str(out / f"{name}.yml"), "-w", str(out)],
                          capture_output=True, text=True, timeout=300)
    kits = out / name / "prod_00"
    if proc.returncode != 0 or not kits.is_dir():
        raise RuntimeError(f"nvflare provision failed ({proc.returncode}):\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return kits


def strict_policy(kit: Path) -> Path:
    """Forbid custom code on a site: ``local/authorization.json`` with ``"byoc": "none"`` for every role (the
    provisioned default lets project admins and leads ship code). Returns the file."""
    default = json.loads((kit / "local" / "authorization.json.default").read_text())
    for role, rights in default["permissions"].items():
        if rights == "any":
            rights = {"submit_job": "any", "clone_job": "any", "manage_job": "any", "download_job": "any",
                      "view": "any", "operate": "any", "shell_commands": "any"}
        if isinstance(rights, dict):
            rights["byoc"] = "none"
        default["permissions"][role] = rights
    path = kit / "local" / "authorization.json"
    path.write_text(json.dumps(default, indent=2))
    return path


def _org(kit: Path) -> str:
    text = (kit / "startup" / "sub_start.sh").read_text()
    return text.split(" org=", 1)[1].split()[0]


def start(kit: Path, server: bool) -> subprocess.Popen:
    """Start a server or site from its startup kit (what ``startup/sub_start.sh`` runs, without its restart loop),
    in a new process group, output to ``<kit>/console.log``."""
    module = "nvflare.private.fed.app.server.server_train" if server else "nvflare.private.fed.app.client.client_train"
    cmd = [sys.executable, "-u", "-m", module, "-m", str(kit), "-s", "fed_server.json" if server else "fed_client.json",
           "--set", "secure_train=true", f"org={_org(kit)}", "config_folder=config"]
    if not server:
        cmd.append(f"uid={kit.name}")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(kit), os.environ.get("PYTHONPATH")]))}
    log = open(kit / "console.log", "ab")
    return subprocess.Popen(cmd, cwd=kit, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def connected_clients(admin_kit: Path, timeout: float = 10.0) -> list[str]:
    """Names of the sites connected to the server now (admin session over mutual TLS)."""
    from nvflare.fuel.flare_api.flare_api import new_secure_session

    session = new_secure_session(ADMIN, str(admin_kit), timeout=timeout)
    try:
        return sorted(c.name for c in session.get_system_info().client_info)
    finally:
        session.close()


def wait_for_clients(admin_kit: Path, sites: list[str], timeout: float = 120.0) -> None:
    """Block until every site is connected. Raises TimeoutError naming the missing ones."""
    deadline, got = time.time() + timeout, []
    while time.time() < deadline:
        try:
            got = connected_clients(admin_kit)
        except Exception:  # noqa: BLE001 - the server is still starting
            got = []
        if set(sites) <= set(got):
            return
        time.sleep(2.0)
    raise TimeoutError(f"sites {sorted(set(sites) - set(got))} not connected after {timeout:.0f} s (connected: {got})")


def stop(procs: list[subprocess.Popen] | list[int], root: Path | None = None) -> None:
    """Kill every process group started here (server, sites), then every process still running from the kits under
    ``root`` (the job processes FLARE starts in sessions of their own)."""
    from feduq.recipes.poc import kill_processes_under

    for p in procs:
        pid = p.pid if hasattr(p, "pid") else int(p)
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        if hasattr(p, "wait"):
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
    if root is not None:
        kill_processes_under(root)


def up(out: Path, sites: list[str], data_root: str | None, strict: list[str] = (), name: str = "feduq_loop",
       port: int | None = None) -> tuple[Path, list[subprocess.Popen]]:
    """Provision, prepare and start the federation; returns (kits folder, processes). Stops what it started when a
    step fails."""
    port = port or free_port()
    kits = provision(out, name, sites, port)
    allow_feduq(kits / SERVER)
    for site in sites:
        allow_feduq(kits / site, server=False)
        write_privacy_policy(kits / site)
        write_site_config(kits / site, data_root=data_root)
        if site in strict:
            strict_policy(kits / site)
    procs = [start(kits / SERVER, server=True)]
    try:
        procs += [start(kits / site, server=False) for site in sites]
        wait_for_clients(kits / ADMIN, sites)
    except BaseException:
        stop(procs, out)
        raise
    (out / "pids.json").write_text(json.dumps([p.pid for p in procs]))
    return kits, procs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=["up", "down"])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--sites", type=lambda v: v.split(","), default=["CVC-ClinicDB", "ETIS-LaribPolypDB"])
    p.add_argument("--data-root", default=os.environ.get("FEDUQ_DATA_ROOT"))
    p.add_argument("--strict", type=lambda v: v.split(","), default=[], help="sites that refuse custom code")
    p.add_argument("--force", action="store_true", help="up: write into an --out folder that holds files FedUQ did "
                                                        "not write (they are kept)")
    a = p.parse_args(argv)
    if a.action == "down":
        pids = a.out / "pids.json"
        stop(json.loads(pids.read_text()) if pids.is_file() else [], a.out.resolve())
        if pids.is_file():  # the federation's own logs, written after `up`, are FedUQ's too
            from feduq.outputs import user_files, write_marker

            write_marker(a.out, "provisioned.py",
                         exclude=[f for f in user_files(a.out) if not f.startswith("feduq_loop/")])
        return 0
    from feduq.outputs import OutputFolderError, claim_output_folder, write_marker

    try:  # the project, kits and logs go into --out: never the data root, nor over a user's files
        out, keep = claim_output_folder(a.out, {"data root": a.data_root}, "provisioned.py", force=a.force)
        if any(f.split("/")[0] == "feduq_loop" or f == "feduq_loop.yml" for f in keep):
            raise OutputFolderError(f"provisioned.py: {out} holds a feduq_loop project FedUQ did not list (a federation "
                                    f"still up? run provisioned.py down --out {out} first), or move it away")
    except OutputFolderError as e:
        print(e, file=sys.stderr)  # "<tool>: <why>", one line
        return 2
    try:
        kits, _ = up(out, a.sites, a.data_root, a.strict)
    finally:
        write_marker(out, "provisioned.py", exclude=keep)
    print(f"federation up: kits in {kits}; admin console: {kits / ADMIN / 'startup' / 'fl_admin.sh'}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("provisioned.py", main))
