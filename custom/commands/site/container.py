"""``feduq container``: check a FLARE startup kit and start it in FedUQ's container image (a site's IT runs this).

    feduq container check /opt/feduq/CVC-ClinicDB --data /srv/feduq-data            # checks only, prints the command
    feduq container start /opt/feduq/CVC-ClinicDB --data /srv/feduq-data [--gpus all]
    feduq container start /opt/feduq/feduq-server.example.org                       # the server's kit: no data

The kit is what ``nvflare provision`` wrote (the project made with ``feduq project --docker-image IMAGE``: its
``startup/docker.sh`` names the image; ``--image`` overrides). The container has the same layout as NVFlare's
docker.sh: the kit at ``/workspace`` (its certificates, logs and job folders stay on the host), the site's data folder
read-only at ``/data`` (the kit's ``local/feduq_site.json`` gets ``"data_root": "/data"``; its center and bad-file
policy are kept; the server's job store and snapshots, ``/tmp/nvflare``, are the kit's ``storage/``), the FLARE
server or client started as in ``startup/sub_start.sh``, as the kit folder's owner
(``--user`` to choose), detached, named after the participant. Unlike docker.sh it takes a ``--network`` (default
``host``; a server container on a user network gets its participant name as network alias, so sites on that network
reach it by the name in their certificates) and publishes no port.

Before any container starts each input is checked and a bad one is refused in one line naming it (exit 2): a kit
that is not a FLARE server or client kit, a kit of another project than ``--project``, a missing data folder or one
without the site's center folder (``<data>/<task>/<center>/``), an image that is missing or is not FedUQ's (no
``io.feduq.version`` label), ``--gpus`` where the machine has no NVIDIA GPU, a kit owned by root (the container
would run as root; ``--user`` to say so), no container engine.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from ...cli import verb_parser

DATA_IN_CONTAINER = "/data"
WORKSPACE_IN_CONTAINER = "/workspace"
SERVER_STORAGE, SERVER_STORAGE_IN_CONTAINER = "storage", "/tmp/nvflare"
FEDUQ_LABEL = "io.feduq.version"
SERVER_MODULE = "nvflare.private.fed.app.server.server_train"
CLIENT_MODULE = "nvflare.private.fed.app.client.client_train"


class KitError(ValueError):
    """A bad input to ``feduq container``; its message is the one line the verb prints."""


def read_kit(kit: Path) -> dict:
    """The participant a startup kit is for: ``{"kind": "server"|"client", "name", "project", "org", "image",
    "server_name"}`` (``image``: the ``DOCKER_IMAGE`` of ``startup/docker.sh``, or None).

    Raises:
        KitError: the folder is missing, is an admin kit, or has no FLARE server/client configuration.
    """
    startup = kit / "startup"
    if not kit.is_dir():
        raise KitError(f"kit {kit} is not a folder")
    if (startup / "fed_admin.json").is_file():
        raise KitError(f"kit {kit} is an admin's kit: submit jobs from it (feduq run --env prod), do not start it")
    kind = "server" if (startup / "fed_server.json").is_file() else "client" if (startup / "fed_client.json").is_file() \
        else None
    if kind is None:
        raise KitError(f"kit {kit} is not a FLARE startup kit (no startup/fed_server.json or startup/fed_client.json)")
    try:
        conf = json.loads((startup / f"fed_{kind}.json").read_text())
        server = conf["servers"][0]
        project, server_name = server["name"], server.get("identity") or server["service"]["target"].split(":")[0]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise KitError(f"kit {kit}: startup/fed_{kind}.json is not a provisioned FLARE configuration ({e})") from e
    sub_start = (startup / "sub_start.sh").read_text() if (startup / "sub_start.sh").is_file() else ""
    org = re.search(r"\borg=(\S+)", sub_start)
    docker_sh = (startup / "docker.sh").read_text() if (startup / "docker.sh").is_file() else ""
    image = re.search(r"^\s*DOCKER_IMAGE=(\S+)", docker_sh, re.M)
    name = server_name if kind == "server" else conf.get("client", {}).get("fqsn") or kit.name
    return {"kind": kind, "name": name, "project": project, "org": org.group(1) if org else None,
            "image": image.group(1) if image else None, "server_name": server_name}


def site_center(kit: Path, name: str) -> str:
    """The center a site's data is under: ``center`` of its ``local/feduq_site.json``, else the site's name.

    Raises:
        KitError: the file exists but is not a JSON object.
    """
    path = kit / "local" / "feduq_site.json"
    if not path.is_file():
        return name
    try:
        cfg = json.loads(path.read_text())
        if not isinstance(cfg, dict):
            raise ValueError("not a JSON object")
    except ValueError as e:
        raise KitError(f"{path} is not FedUQ's site configuration ({e})") from e
    return cfg.get("center") or name


def check_data(data: Path, center: str) -> None:
    """A site's data folder must be a folder holding ``<task>/<center>/``.

    Raises:
        KitError: it is missing, not a folder, or holds no center folder of that name.
    """
    if not data.exists():
        raise KitError(f"data folder {data} does not exist (the site's data root, holding <task>/{center}/)")
    if not data.is_dir():
        raise KitError(f"data folder {data} is not a folder")
    if not any((task / center).is_dir() for task in data.iterdir() if task.is_dir()):
        raise KitError(f"data folder {data} holds no {center}/ of any task (expected {data}/<task>/{center}/)")


def has_nvidia_gpu() -> bool:
    """Whether this machine shows an NVIDIA GPU (a ``/dev/nvidia<N>`` device, or ``nvidia-smi -L`` lists one)."""
    if any(re.fullmatch(r"nvidia\d+", p.name) for p in Path("/dev").glob("nvidia*")):
        return True
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def image_version(engine: str, image: str) -> str:
    """FedUQ's version in ``image`` (its ``io.feduq.version`` label); inspects, starts nothing.

    Raises:
        KitError: the engine does not know the image, or the image has no FedUQ label.
    """
    try:
        out = subprocess.run([engine, "image", "inspect", image, "--format", "{{json .Config.Labels}}"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise KitError(f"{engine} could not inspect image {image} ({e})") from e
    if out.returncode != 0:
        raise KitError(f"image {image} not found by {engine} (build it: docs/how-to/containers.md, or pull it)")
    labels = json.loads(out.stdout.strip() or "null") or {}
    if not labels.get(FEDUQ_LABEL):
        raise KitError(f"image {image} has no FedUQ in it (no {FEDUQ_LABEL} label): build FedUQ's image from "
                       "docker/Containerfile")
    return labels[FEDUQ_LABEL]


def run_command(engine: str, kit: Path, part: dict, image: str, data: Path | None, network: str, user: str,
                gpus: str | None, name: str | None) -> list[str]:
    """The engine's ``run`` command line that starts the kit's participant in ``image`` (detached, removed on exit)."""
    cname = re.sub(r"[^A-Za-z0-9_.-]", "_", name or part["name"])
    cmd = [engine, "run", "-d", "--rm", "--name", cname, "--hostname", cname[:63], "--user", user,
           "--network", network, "--ipc", "host", "-e", "HOME=/tmp", "-e", "PYTHONPATH=/workspace/local/custom",
           "-v", f"{kit}:{WORKSPACE_IN_CONTAINER}", "-w", WORKSPACE_IN_CONTAINER]
    if part["kind"] == "server":  # FLARE's job store and snapshots (/tmp/nvflare) outlive the container, in the kit
        cmd += ["-v", f"{kit / SERVER_STORAGE}:{SERVER_STORAGE_IN_CONTAINER}"]
        if network not in ("host", "none"):
            cmd += ["--network-alias", part["server_name"]]
    if data is not None:
        cmd += ["-v", f"{data}:{DATA_IN_CONTAINER}:ro"]
    if gpus:
        cmd += ["--gpus", gpus] if Path(engine).name == "docker" else ["--device", f"nvidia.com/gpu={gpus}"]
    module, conf = (SERVER_MODULE, "fed_server.json") if part["kind"] == "server" else (CLIENT_MODULE, "fed_client.json")
    sets = ["secure_train=true", "config_folder=config"] + ([f"org={part['org']}"] if part["org"] else [])
    if part["kind"] == "client":
        sets.append(f"uid={part['name']}")
    return cmd + [image, "python3", "-u", "-m", module, "-m", WORKSPACE_IN_CONTAINER, "-s", conf, "--set", *sets]


def prepare(a) -> tuple[list[str], dict]:
    """Every check of ``feduq container``, in order; returns (the run command, the kit's participant).

    Raises:
        KitError: the first bad input, named.
    """
    kit = Path(a.kit).expanduser().resolve()
    part = read_kit(kit)
    if a.project and part["project"] != a.project:
        raise KitError(f"kit {kit} is for project {part['project']!r}, not {a.project!r}: a kit from another "
                       "provisioning")
    data = None
    if part["kind"] == "client":
        if a.data is None:
            raise KitError(f"kit {kit} is the site {part['name']}'s: --data DIR (its data root) is needed")
        data = Path(a.data).expanduser().resolve()
        check_data(data, site_center(kit, part["name"]))
    elif a.data is not None:
        raise KitError(f"kit {kit} is the server's: the server gets no data (leave out --data)")
    if a.gpus and not has_nvidia_gpu():
        raise KitError(f"--gpus {a.gpus} asked, but this machine has no NVIDIA GPU (no /dev/nvidia0, no nvidia-smi)")
    engine = a.engine or shutil.which("podman") or shutil.which("docker")
    if not engine or not shutil.which(engine):
        raise KitError(f"no container engine: {a.engine or 'podman or docker'} is not installed")
    image = a.image or part["image"]
    if not image:
        raise KitError(f"kit {kit} names no image (no startup/docker.sh: provision with feduq project --docker-image)"
                       "; or give --image")
    part["feduq_version"] = image_version(engine, image)
    st = kit.stat()
    if a.user is None and st.st_uid == 0:
        raise KitError(f"kit {kit} is owned by root: the container would run as root; give the kit to the site's "
                       "service user (chown -R) or pass --user UID:GID")
    user = a.user or f"{st.st_uid}:{st.st_gid}"
    return (run_command(engine, kit, part, image, data, a.network, user, a.gpus, a.name),
            {**part, "kit": kit, "image_used": image})


def set_data_root(kit: Path) -> Path:
    """Write ``"data_root": "/data"`` (the mounted data) into the kit's ``local/feduq_site.json``, keeping its other
    keys; returns the file.

    Raises:
        OSError: the file cannot be written.
    """
    path = kit / "local" / "feduq_site.json"
    cfg = json.loads(path.read_text()) if path.is_file() else {}
    cfg["data_root"] = DATA_IN_CONTAINER
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg, indent=2) + "\n")
    return path


def main(argv=None) -> int:
    """``feduq container {check,start} KIT``: exit 0 (checked / started), 2 (a bad input, one line), or the engine's
    exit code when ``run`` fails."""
    p = verb_parser("feduq container", description=__doc__)
    p.add_argument("action", choices=["check", "start"], help="check: the checks and the command; start: also run it")
    p.add_argument("kit", help="the participant's startup kit folder (what nvflare provision wrote)")
    p.add_argument("--data", help="a site's data root (holds <task>/<center>/), mounted read-only at /data")
    p.add_argument("--gpus", help="GPUs for the container: all, or a device list (docker --gpus / podman CDI)")
    p.add_argument("--image", help="the image (default: the one the kit's startup/docker.sh names)")
    p.add_argument("--project", help="refuse a kit of any other project (the project name in the kit)")
    p.add_argument("--network", default="host", help="the container's network (default host; none publishes ports)")
    p.add_argument("--engine", help="podman or docker (default: podman when installed, else docker)")
    p.add_argument("--user", help="uid:gid the container runs as (default: the kit folder's owner)")
    p.add_argument("--name", help="the container's name (default: the participant's name)")
    a = p.parse_args(argv)
    try:
        cmd, part = prepare(a)
    except KitError as e:
        print(f"feduq container: {e}", file=sys.stderr)
        return 2
    print(f"{part['kind']} {part['name']} of project {part['project']} in image {part['image_used']} "
          f"(FedUQ {part['feduq_version']}):\n  " + " ".join(cmd))
    if a.action == "check":
        return 0
    if part["kind"] == "client":
        set_data_root(part["kit"])
    else:
        storage = part["kit"] / SERVER_STORAGE
        storage.mkdir(exist_ok=True)
        if os.geteuid() == 0:  # the container's user must own it
            uid, gid = (int(v) for v in cmd[cmd.index("--user") + 1].split(":"))
            os.chown(storage, uid, gid)
    out = subprocess.run(cmd, capture_output=True, text=True)
    if out.returncode != 0:
        print(f"feduq container: {cmd[0]} run failed ({out.returncode}): {out.stderr.strip()[-500:]}", file=sys.stderr)
        return out.returncode
    print(f"started container {out.stdout.strip()[:12]}; its log: {part['kit'] / 'log.txt'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
