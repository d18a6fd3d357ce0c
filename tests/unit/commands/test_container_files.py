"""FedUQ's container files without a container engine (issue 80): the project template with ``docker_image``
provisions (real ``nvflare provision``) kits whose ``startup/docker.sh`` names the image and mounts the kit (with
``local/feduq_site.json``) and the data read-only; ``feduq container`` builds the same layout and refuses each bad
input in one line before the engine runs anything; docker/Containerfile's stages and pins; the shell tools parse.
The engine is a stub script that records its arguments (tools/container_check.sh runs the real thing)."""

import configparser
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

IMAGE = "feduq:0.1.0"
SITE = "CVC-ClinicDB"
SERVER = "feduq-server.example.org"


@pytest.fixture(scope="module")
def kits(tmp_path_factory):
    """The template with ``--docker-image``, provisioned by NVFlare; returns the folder of the kits."""
    from feduq.commands.consortium import project

    out = tmp_path_factory.mktemp("prov")
    assert project.main(["--docker-image", IMAGE, "--out", str(out / "project.yml")]) == 0
    nvflare = Path(sys.executable).with_name("nvflare")
    proc = subprocess.run([str(nvflare), "provision", "-p", str(out / "project.yml"), "-w", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    kits = out / "feduq_polyp" / "prod_00"
    if os.geteuid() == 0:  # a site's kit belongs to its service user, not root (feduq container refuses root's)
        for kit in kits.iterdir():
            os.chown(kit, 10001, 10001)
    return kits


@pytest.fixture
def engine(tmp_path):
    """A stub ``podman``: ``image inspect`` knows ``feduq:0.1.0`` (with FedUQ's label) and ``plain`` (no label);
    ``run`` prints a container id. Every call is appended to ``calls.txt``."""
    stub = tmp_path / "podman"
    stub.write_text(f"""#!/bin/sh
echo "$@" >> {tmp_path}/calls.txt
if [ "$1" = image ]; then
  case "$3" in {IMAGE}) echo '{{"io.feduq.version": "0.1.0"}}';; plain) echo 'null';; *) exit 125;; esac
  exit 0
fi
echo 0123456789abcdef0123
""")
    stub.chmod(0o755)
    return stub


def data_root(tmp_path, center=SITE):
    (tmp_path / "data" / "polyp" / center).mkdir(parents=True)
    return tmp_path / "data"


def calls(tmp_path):
    path = tmp_path / "calls.txt"
    return path.read_text().splitlines() if path.is_file() else []


def test_the_template_with_docker_image_provisions_kits_whose_docker_sh_starts_the_image(kits, tmp_path):
    text = (kits.parent.parent / "project.yml").read_text()
    assert re.search(r"StaticFileBuilder\n    args:\n      docker_image: feduq:0\.1\.0\n", text)
    for name in [SERVER, SITE, "Kvasir-SEG", "CVC-ColonDB", "ETIS-LaribPolypDB"]:
        assert f"DOCKER_IMAGE={IMAGE}\n" in (kits / name / "startup" / "docker.sh").read_text(), name
    # NVFlare's site docker.sh, run with a docker that records: the image, the kit (local/feduq_site.json is in it)
    # at /workspace, the data read-only at /data, FLARE's client for this site
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "docker").write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {tmp_path}/docker_args\n')
    (fake / "docker").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "MY_DATA_DIR": str(tmp_path / "data")}
    subprocess.run(["bash", str(kits / SITE / "startup" / "docker.sh"), "-d"], env=env, check=True,
                   capture_output=True, timeout=30)
    args = (tmp_path / "docker_args").read_text().splitlines()
    assert IMAGE in args and f"--name={SITE}" in args
    assert f"{kits / SITE / 'startup'}/..:/workspace/" in args and f"{tmp_path / 'data'}:/data/:ro" in args
    assert f"uid={SITE}" in args[-1] and "client_train" in args[-1]


def test_project_refuses_an_image_name_docker_sh_could_not_hold(tmp_path, capsys):
    from feduq.commands.consortium import project

    assert project.main(["--docker-image", "feduq 0.1.0; rm -rf /", "--out", str(tmp_path / "p.yml")]) == 2
    assert "is not an image name" in capsys.readouterr().err and not (tmp_path / "p.yml").exists()


def test_container_start_mounts_the_kit_and_the_data_read_only_and_points_the_site_at_it(kits, engine, tmp_path,
                                                                                        capsys):
    from feduq.commands.site import container

    data = data_root(tmp_path)
    (kits / SITE / "local" / "feduq_site.json").write_text(json.dumps({"center": SITE, "on_bad_file": "skip"}))
    assert container.main(["start", str(kits / SITE), "--data", str(data), "--engine", str(engine),
                           "--network", "feduq-net", "--project", "feduq_polyp"]) == 0
    run, = [shlex.split(c) for c in calls(tmp_path) if c.startswith("run ")]
    assert run[run.index("-v") + 1] == f"{kits / SITE}:/workspace"
    assert f"{data}:/data:ro" in run and run[run.index("--network") + 1] == "feduq-net"
    assert run[run.index(IMAGE) + 1:run.index(IMAGE) + 5] == ["python3", "-u", "-m", container.CLIENT_MODULE]
    assert f"uid={SITE}" in run and "org=hospital_clinic_barcelona" in run and "--gpus" not in run
    st = (kits / SITE).stat()
    assert run[run.index("--user") + 1] == f"{st.st_uid}:{st.st_gid}"
    cfg = json.loads((kits / SITE / "local" / "feduq_site.json").read_text())
    assert cfg == {"center": SITE, "on_bad_file": "skip", "data_root": "/data"}
    assert "started container 0123456789ab" in capsys.readouterr().out


def test_the_server_container_is_reachable_by_its_certificate_name_on_a_private_network(kits, engine, tmp_path):
    from feduq.commands.site import container

    assert container.main(["check", str(kits / SERVER), "--engine", str(engine), "--network", "feduq-net"]) == 0
    assert not any(c.startswith("run ") for c in calls(tmp_path))  # check starts nothing
    cmd, part = container.prepare(container_args(kits / SERVER, engine, network="feduq-net"))
    assert part["kind"] == "server" and cmd[cmd.index("--network-alias") + 1] == SERVER
    assert "/data:ro" not in " ".join(cmd) and container.SERVER_MODULE in cmd and "-p" not in cmd
    assert f"{kits / SERVER}/storage:/tmp/nvflare" in cmd  # FLARE's job store outlives the container


def container_args(kit, engine, **kw):
    from argparse import Namespace

    base = dict(kit=str(kit), data=None, gpus=None, image=None, project=None, network="host", engine=str(engine),
                user=None, name=None)
    return Namespace(**{**base, **kw})


@pytest.mark.parametrize("case, expected", [
    ("missing data", "data folder {tmp}/nowhere does not exist"),
    ("data without the center", "holds no CVC-ClinicDB/ of any task"),
    ("image without FedUQ", "image plain has no FedUQ in it (no io.feduq.version label)"),
    ("image missing", "image feduq:9.9 not found by"),
    ("another project", "is for project 'feduq_polyp', not 'feduq_other': a kit from another provisioning"),
    ("gpu where none is", "--gpus all asked, but this machine has no NVIDIA GPU"),
    ("no kit", "is not a FLARE startup kit"),
    ("kit owned by root", "is owned by root: the container would run as root"),
])
def test_each_bad_input_is_one_line_naming_it_before_any_container_starts(kits, engine, tmp_path, capsys,
                                                                        monkeypatch, case, expected):
    from feduq.commands.site import container

    monkeypatch.setattr(container, "has_nvidia_gpu", lambda: False)
    data = data_root(tmp_path)
    kit = kits / SITE
    extra = {"missing data": ["--data", str(tmp_path / "nowhere")],
             "data without the center": ["--data", str(data_root(tmp_path / "other", "Kvasir-SEG"))],
             "image without FedUQ": ["--data", str(data), "--image", "plain"],
             "image missing": ["--data", str(data), "--image", "feduq:9.9"],
             "another project": ["--data", str(data), "--project", "feduq_other"],
             "gpu where none is": ["--data", str(data), "--gpus", "all"],
             "no kit": ["--data", str(data)], "kit owned by root": ["--data", str(data)]}[case]
    if case == "no kit":
        kit = tmp_path / "data"
    if case == "kit owned by root":
        if os.geteuid() != 0:
            pytest.skip("only root can give a kit to root")
        import shutil

        kit = tmp_path / "root_kit"
        shutil.copytree(kits / SITE, kit)
        os.chown(kit, 0, 0)
    site_json = kit / "local" / "feduq_site.json"
    before = site_json.read_text() if site_json.is_file() else None
    assert container.main(["start", str(kit), "--engine", str(engine), *extra]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("feduq container: ")
    assert expected.format(tmp=tmp_path) in err[0]
    assert not any(c.startswith("run ") for c in calls(tmp_path))
    assert (site_json.read_text() if site_json.is_file() else None) == before  # the kit is left as it was


def test_gpus_go_to_the_engine_as_it_spells_them(kits, engine, tmp_path, monkeypatch):
    from feduq.commands.site import container

    monkeypatch.setattr(container, "has_nvidia_gpu", lambda: True)
    data = data_root(tmp_path)
    cmd, _ = container.prepare(container_args(kits / SITE, engine, data=str(data), gpus="all"))
    assert cmd[cmd.index("--device") + 1] == "nvidia.com/gpu=all"  # podman: CDI
    docker = tmp_path / "docker"
    docker.write_text(engine.read_text())
    docker.chmod(0o755)
    cmd, _ = container.prepare(container_args(kits / SITE, docker, data=str(data), gpus="all"))
    assert cmd[cmd.index("--gpus") + 1] == "all"


def containerfile():
    return (REPO / "docker" / "Containerfile").read_text()


def test_the_containerfile_base_is_an_arg_torch_is_setup_cfgs_and_held_and_the_user_is_not_root():
    text = containerfile()
    instructions = [ln for ln in re.sub(r"\\\n", " ", text).splitlines() if ln.strip() and not ln.startswith("#")]
    assert instructions[0].startswith("ARG BASE=")  # before the first FROM: the base is a build argument
    froms = [ln.split() for ln in instructions if ln.startswith("FROM ")]
    assert froms[0][1] == "${BASE}" and [f[-1] for f in froms] == ["system", "deps", "feduq"]
    assert froms[1][1] == "system" and froms[2][1] == "deps"  # dependencies before FedUQ's wheel
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    pinned = re.search(r"^torch==(\S+)$", cfg["options"]["install_requires"], re.M).group(1)
    assert f"ARG TORCH_VERSION={pinned}" in instructions
    run_lines = [ln for ln in instructions if ln.startswith("RUN ")]
    torch_i = next(i for i, ln in enumerate(run_lines) if 'install ${TORCH_INDEX:+' in ln)
    later = [ln for ln in run_lines[torch_i + 1:] if "pip.sh install" in ln]
    assert later and all("-c /opt/feduq/constraints.txt" in ln for ln in later)  # nothing may replace torch
    assert all("--mount=type=secret,id=pipca" in ln for ln in run_lines if "pip.sh install" in ln)
    users = [ln.split()[1] for ln in instructions if ln.startswith("USER ")]
    assert users[-1] == "feduq" and users[-1] not in ("root", "0")
    assert 'io.feduq.version="${FEDUQ_VERSION}"' in text  # what feduq container checks


def test_the_image_gets_no_data_no_kit_and_no_credentials():
    copies = [ln.split()[1:] for ln in containerfile().splitlines() if ln.startswith(("COPY ", "ADD "))]
    sources = [c[0] for c in copies]
    assert sources == ["docker/pip.sh", "setup.cfg", "dist/feduq-${FEDUQ_VERSION}-py3-none-any.whl",
                       "docker/python3"]
    assert not re.search(r"(?i)^\s*(ENV|ARG)\s+\S*(PIP_CERT|PASSWORD|TOKEN|KEY)\b", containerfile(), re.M)
    ignore = (REPO / ".containerignore").read_text().split()
    assert ignore[ignore.index("*"):] == ["*", "!setup.cfg", "!dist/feduq-*.whl", "!docker/"]
    assert (REPO / ".dockerignore").read_text() == (REPO / ".containerignore").read_text()
    assert "exec /opt/feduq/bin/python3" in (REPO / "docker" / "python3").read_text()  # a wrapper, not a symlink


@pytest.mark.parametrize("tool", ["container_check.sh", "container_build.sh"])
def test_the_container_tools_parse(tool):
    proc = subprocess.run(["bash", "-n", str(REPO / "tools" / tool)], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr


def test_nvflare_deploy_prepare_turns_a_site_kit_into_a_parent_container_running_feduqs_image(kits, tmp_path):
    """The documented route (docker/deploy/): NVFlare's own ``deploy prepare`` with FedUQ's docker.yaml, then
    ``feduq prepare-site`` on the prepared kit (prepare drops local/resources.json, FedUQ's allow-list), and FedUQ's
    study_runtime.yaml parsed by FLARE's own loader: the job containers mount the data read-only where
    feduq_site.json points."""
    import shutil

    import yaml
    from nvflare.app_opt.job_launcher.study_runtime import load_study_runtime_file

    from feduq.commands.site import prepare_site

    kit = tmp_path / SITE
    shutil.copytree(kits / SITE, kit)
    nvflare = Path(sys.executable).with_name("nvflare")
    out = tmp_path / "prepared"
    proc = subprocess.run([str(nvflare), "deploy", "prepare", str(kit), "--config",
                           str(REPO / "docker" / "deploy" / "docker.yaml"), "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert 'DOCKER_IMAGE=${NVFL_P_IMAGE:-"feduq:0.1.0"}' in (out / "startup" / "start_docker.sh").read_text()
    assert not (out / "local" / "resources.json").exists()
    assert prepare_site.main([str(out)]) == 0
    resources = json.loads((out / "local" / "resources.json").read_text())
    launcher, = [c for c in resources["components"] if c["id"] == "docker_launcher"]
    assert launcher["args"]["default_python_path"] == "/usr/local/bin/python3"  # the image's wrapper
    assert "feduq." in json.dumps(resources["class_allow_list"])
    runtime = load_study_runtime_file(str(REPO / "docker" / "deploy" / "study_runtime.yaml"), "docker")["default"]
    mount, = runtime.datasets
    assert (mount.mount_path, mount.read_only, runtime.container_image) == ("/data/default/feduq", True, IMAGE)
    assert yaml.safe_load((REPO / "docker" / "deploy" / "docker.yaml").read_text())["parent"]["docker_image"] == IMAGE
