"""Options and files a verb cannot use: each case ends in one line naming the file, folder or parameter and what was
expected, exit code 2, before anything is written (``--help``: the usage, exit 0)."""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, load_tool, small_job

SITES = ["Kvasir-SEG", "CVC-ColonDB"]


def _tree(folder: Path) -> dict:
    """Every file and folder under ``folder`` with its bytes and modification time (what "nothing written" keeps)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None, p.stat().st_mtime_ns)
            for p in sorted(folder.rglob("*"))}


def _one_line(text: str) -> str:
    text = text.strip()
    assert text and text.count("\n") == 0, text
    return text


class _Payload:
    """Unpickling this makes the folder ``path``: it must never happen."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_virtual_federation_resume_names_a_checkpoint_that_is_no_torch_checkpoint(tmp_path, data_root, capsys):
    """Item 1: a truncated checkpoint.pt, a plain pickle, a pickle whose payload would run code (plain or inside
    torch's zip) and a torch file of something else: one line naming the file, exit 2, the folder untouched, the
    payload never run (was a 21-line traceback, after log.txt was made)."""
    import torch

    from feduq.outputs import write_marker

    job = small_job("fedevi", tmp_path / "job", sites=SITES)
    ran = tmp_path / "payload-ran"
    whole = tmp_path / "whole.pt"
    torch.save({"model": {"w": torch.zeros(64)}, "meta": {"feduq_last_completed_round": 0}}, whole)
    cases = {
        "truncated": (whole.read_bytes()[:100], "is truncated or damaged"),
        "pickle": (pickle.dumps({"a": 1}), "is not a torch checkpoint (it is a plain pickle, not read)"),
        "payload": (pickle.dumps(_Payload(ran)), "is not a torch checkpoint"),
        "payload-in-zip": (None, "refused: it needs code to load"),
        "other-torch-file": (None, "is a torch file but not this tool's checkpoint"),
    }
    vf = load_tool("virtual_federation")
    for name, (data, words) in cases.items():
        out = tmp_path / name
        out.mkdir()
        if name == "payload-in-zip":
            torch.save({"model": _Payload(ran)}, out / "checkpoint.pt")
        elif name == "other-torch-file":
            torch.save({"a": 1}, out / "checkpoint.pt")
        else:
            (out / "checkpoint.pt").write_bytes(data)
        write_marker(out, "feduq virtual")
        before = _tree(out)
        code = vf.main([str(job), "--data-root", str(data_root), "--out", str(out), "--resume", "--num-threads", "1"])
        line = _one_line(capsys.readouterr().err)
        assert code == 2, (name, line)
        assert str(out / "checkpoint.pt") in line and words in line, (name, line)
        assert _tree(out) == before, name  # no log.txt, marker untouched
        assert not ran.exists(), name


def test_prepare_site_refuses_a_kit_that_does_not_exist(tmp_path, capsys):
    """Item 2: a startup kit that does not exist (mistyped in a POC/provisioned project, or in a folder that does not
    exist either) was made as a new folder; now refused naming it, nothing made. An existing folder is prepared as
    before."""
    project = tmp_path / "prod_00"
    (project / "server" / "startup").mkdir(parents=True)
    (project / "server" / "startup" / "fed_server.json").write_text("{}")
    (project / "site-1" / "startup").mkdir(parents=True)
    (project / "site-1" / "startup" / "fed_client.json").write_text("{}")
    before = _tree(tmp_path)
    prepare_site = load_tool("prepare_site")
    for kit, argv, words in [
        (project / "site-9", [], f"no startup kit of the FLARE project in {project} has this name (its kits: server, "
                                 "site-1)"),
        (project / "server-1", ["--server"], "its kits: server, site-1"),
        (tmp_path / "nowhere" / "site-1", ["--data-root", str(tmp_path)], f"nor its folder {tmp_path / 'nowhere'}"),
    ]:
        assert prepare_site.main([str(kit), *argv]) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"feduq prepare-site: error: {kit} does not exist") and words in line, line
        assert "expected an existing FLARE startup kit" in line
        assert _tree(tmp_path) == before
    assert prepare_site.main([str(project / "site-1")]) == 0  # an existing kit: prepared as before
    assert (project / "site-1" / "local" / "privacy.json").is_file()


RUN_SH = REPO / "benchmarks" / "feda3i-isic50" / "run.sh"


def test_feda3i_isic50_run_sh_help_and_a_missing_data_root(tmp_path):
    """Item 3: ``--help`` was taken as the data root; a data root that does not exist made the work folder and then
    failed as ``site '?'``. Now --help/-h print the usage (exit 0), and a missing or wrong data root is one line
    (exit 2) before anything is made. Only the argument checks run here (no training)."""
    env = {**os.environ, "FEDA3I_ARCHIVE": str(tmp_path / "archive")}

    def run(*args):
        return subprocess.run(["bash", str(RUN_SH), *args], capture_output=True, text=True, env=env, timeout=60)

    for flag in ("--help", "-h"):
        proc = run(flag)
        assert proc.returncode == 0, proc.stderr
        assert "bash benchmarks/feda3i-isic50/run.sh ../shared/data workspaces/feda3i-isic50" in proc.stdout
        assert not proc.stderr
    work = tmp_path / "work"
    for args, words in [
        ((str(tmp_path / "no-data"), str(work)), f"data root '{tmp_path / 'no-data'}' is not a folder"),
        ((str(tmp_path), str(work)), f"data root '{tmp_path}' has no skin_lesion/ISIC-2017/"),
        ((), "expected 2 arguments"),
        ((str(tmp_path / "no-data"),), "expected 2 arguments"),
    ]:
        proc = run(*args)
        line = _one_line(proc.stderr)
        assert proc.returncode == 2 and words in line, (args, line)
        assert not proc.stdout
        assert sorted(p.name for p in tmp_path.iterdir()) == [], args  # no work folder, no archive


def _job_and_checkpoint(tmp_path: Path) -> tuple[Path, Path]:
    """A small FedEvi job and a checkpoint of its network (round 0 completed) in ``tmp_path/ws``."""
    import torch

    from feduq.jobs.jobcheck import instantiate

    job = small_job("fedevi", tmp_path / "job", sites=SITES)
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    persistor = next(c for c in server["components"] if c["id"] == "persistor")
    model = instantiate(persistor["args"]["model"], "model")
    ws = tmp_path / "ws"
    ws.mkdir()
    torch.save({"model": model.state_dict(), "meta_props": {
        "feduq_last_completed_round": 0, "fedevi_beta": {s: 1 / len(SITES) for s in SITES}}}, ws / "FL_global_model.pt")
    return job, ws


def test_resume_job_names_a_checkpoint_folder_and_the_best_model_once(tmp_path, capsys):
    """Item 4: ``--checkpoint <a folder>`` said "does not exist"; now it says it is a folder and which file is
    expected. A best model beside the checkpoint that cannot be loaded was named in a doubled prefix ("the best model
    beside the checkpoint (P): the best model beside the checkpoint (P) P: ..."); now once."""
    import torch

    job, ws = _job_and_checkpoint(tmp_path)
    out = tmp_path / "out" / "resumed"
    (tmp_path / "out").mkdir()
    resume_job = load_tool("resume_job")
    before = _tree(tmp_path)
    assert resume_job.main([str(job), "--checkpoint", str(ws), "-o", str(out)]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line == (f"feduq resume: error: --checkpoint {ws} is a folder, not a checkpoint file: expected the "
                    f"server's checkpoint file, e.g. {ws / 'FL_global_model.pt'}, which is there"), line
    assert _tree(tmp_path) == before

    best = ws / "best_FL_global_model.pt"
    for content, words in [(_Payload(tmp_path / "payload-ran"), "refused: it needs code to load"),
                           ({"model": {"w": torch.zeros(2)}}, "does not fit the job's network")]:
        torch.save(content, best)
        before = _tree(tmp_path)
        assert resume_job.main([str(job), "--checkpoint", str(ws / "FL_global_model.pt"), "-o", str(out)]) == 2
        line = _one_line(capsys.readouterr().err)
        assert line.startswith(f"feduq resume: error: the best model beside the checkpoint {best}") and words in line
        assert line.count("feduq resume") == 1 and line.count("error:") == 1, line
        assert line.count("the best model beside the checkpoint") == 1 and line.count(str(best)) == 1, line
        assert _tree(tmp_path) == before and not (tmp_path / "payload-ran").exists()


def test_make_noisy_labels_takes_a_model_starting_with_a_minus(tmp_path, capsys):
    """Item 5: ``--model -5,-10,3,2`` failed in argparse ("expected one argument"); now the value is read, and the
    noise model names what is wrong with it (MU_MAX must be >= 0), exit 2, nothing written. A valid model given
    that way (``-0,...``) runs."""
    from helpers import fake_center

    tool = load_tool("make_noisy_labels")
    data, out = tmp_path / "data", tmp_path / "out"
    fake_center(data, "ISIC-2017")
    base = ["--data-root", str(data), "--task", "skin", "--sites", "ISIC-2017", "--out", str(out)]
    assert tool.main([*base, "--model", "-5,-10,3,2"]) == 2
    line = _one_line(capsys.readouterr().err)
    assert line.startswith("error: --model -5,-10,3,2: mu_max must be >= 0, got -5.0"), line
    assert not out.exists()
    assert tool.main([*base, "--model", "-0,-10,3,0.2", "--seed", "1"]) == 0
    noise = json.loads((out / "skin_lesion" / "ISIC-2017" / "noise" / "ISIC-2017.json").read_text())
    assert noise["model"] == {"mu_max": 0.0, "mu_min": -10.0, "sigma_max": 3.0, "p_d": 0.2}


def test_job_check_refuses_num_rounds_below_one(tmp_path):
    """Item 6: a hand-edited job with ``num_rounds: -1`` ran no round and ended with "no global model to evaluate";
    the job check (before a run, and at the workflow's start-up on the app the server received) names the parameter
    and its value."""
    from nvflare.apis.fl_constant import FLContextKey

    from feduq.jobs.jobcheck import JobConfigError, validate_job, validate_running_app

    job = small_job("fedevi", tmp_path / "job", sites=SITES)
    path = job / "app" / "config" / "config_fed_server.json"
    server = json.loads(path.read_text())
    server["workflows"][0]["args"]["num_rounds"] = -1
    path.write_text(json.dumps(server, indent=2))
    words = ("config_fed_server.json: server workflow 'controller' (feduq.flare.controller.FedUQController): "
             "num_rounds=-1 must be an integer >= 1")
    with pytest.raises(JobConfigError, match=r"num_rounds=-1 must be an integer >= 1") as e:
        validate_job(job)
    assert _one_line(str(e.value)).startswith(words)

    class Ctx:  # what the workflow's start-up reads of FLARE's context
        def get_prop(self, key, default=None):
            return str(job / "app") if key == FLContextKey.APP_ROOT else default

    with pytest.raises(JobConfigError) as e:
        validate_running_app(Ctx())
    assert str(e.value).startswith(words)
