"""No tool deletes what it did not create (feduq.outputs): every case that once deleted a user's files.

Each test builds its own inputs under tmp_path (a copy of a committed job, a fake data root with a sentinel file), runs
the tool as a user would, and checks that the inputs survive byte for byte and the tool exits non-zero with one line.
"""

from __future__ import annotations

import json
import shutil

import pytest

from conftest import REPO, load_tool
from feduq.outputs import OUTPUT_MARKER, OutputFolderError, check_output_folder, staged_folder

CENTERS = ("Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB")


def _snapshot(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def job(tmp_path):
    """A copy of jobs/fedavg (so a bug can never touch the repository's jobs)."""
    return shutil.copytree(REPO / "jobs" / "fedavg", tmp_path / "jobs" / "fedavg")


@pytest.fixture
def fake_root(tmp_path):
    """A data root with the four polyp center folders and one image each (only names are checked before FLARE)."""
    root = tmp_path / "data"
    for center in CENTERS:
        (root / "polyp" / center / "images").mkdir(parents=True)
        (root / "polyp" / center / "images" / "1.jpg").write_bytes(b"not really an image")
    return root


def _one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    err = (captured.err or captured.out).strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("target", ["data root", "job", "inside data root"])
def test_simulate_never_removes_the_data_root_or_the_job(tmp_path, job, fake_root, capsys, target):
    simulate = load_tool("simulate")
    ws = {"data root": fake_root, "job": job, "inside data root": fake_root / "polyp"}[target]
    before_root, before_job = _snapshot(fake_root), _snapshot(job)
    rc = simulate.main([str(job), "-w", str(ws), "--data-root", str(fake_root)])
    assert rc != 0
    err = _one_line_error(capsys)
    assert str(ws.resolve()) in err and ("is the" in err or "contains the" in err or "lies inside the" in err)
    assert _snapshot(fake_root) == before_root and _snapshot(job) == before_job


def test_simulate_refuses_a_foreign_workspace_unless_forced(tmp_path, job, fake_root, capsys):
    simulate = load_tool("simulate")
    ws = tmp_path / "notes"
    ws.mkdir()
    (ws / "thesis.tex").write_text("years of work")
    assert simulate.main([str(job), "-w", str(ws), "--data-root", str(fake_root)]) != 0
    err = _one_line_error(capsys)
    assert "thesis.tex" in err and "--force" in err
    assert (ws / "thesis.tex").read_text() == "years of work"


def test_configure_job_never_writes_over_its_job_or_a_folder_around_it(tmp_path, job, capsys):
    configure_job = load_tool("configure_job")
    (job.parent / "unrelated.txt").write_text("keep me")
    before = _snapshot(job.parent)
    for out in (job, job.parent, job / "app"):
        with pytest.raises(SystemExit) as e:
            configure_job.main([str(job), "-o", str(out), "--num-rounds", "2"])
        assert e.value.code == 2
        err = _one_line_error(capsys)
        assert str(out.resolve()) in err and "job" in err
    assert _snapshot(job.parent) == before


def test_a_refused_configuration_leaves_the_existing_output_as_it_was(tmp_path, job, capsys):
    configure_job = load_tool("configure_job")
    out = tmp_path / "configured"
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "3"]) == 0
    assert (out / OUTPUT_MARKER).is_file()
    before = _snapshot(out)
    with pytest.raises(SystemExit) as e:
        configure_job.main([str(job), "-o", str(out), "--set", "lr=-1"])
    assert e.value.code == 2 and "lr" in _one_line_error(capsys)
    assert _snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["configured", "jobs"]  # no staging folder left
    # a folder it made is replaced; one it did not make is refused, naming a file, unless --force
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "4"]) == 0
    server = json.loads((out / "app" / "config" / "config_fed_server.json").read_text())
    assert server["workflows"][0]["args"]["num_rounds"] == 4
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "data.csv").write_text("1,2")
    with pytest.raises(SystemExit):
        configure_job.main([str(job), "-o", str(foreign)])
    assert "data.csv" in _one_line_error(capsys) and (foreign / "data.csv").is_file()
    assert configure_job.main([str(job), "-o", str(foreign), "--force"]) == 0
    assert not (foreign / "data.csv").exists() and (foreign / "meta.json").is_file()


@pytest.mark.parametrize("argv, message", [
    (["--num-rounds", "0"], "num_rounds must be an integer >= 1, got 0"),
    (["--task", "liver"], "liver"),
    (["--set", "network={name: light}"], "network"),
])
def test_configure_job_names_the_bad_parameter(tmp_path, job, capsys, argv, message):
    configure_job = load_tool("configure_job")
    with pytest.raises(SystemExit) as e:
        configure_job.main([str(job), "-o", str(tmp_path / "out"), *argv])
    assert e.value.code == 2 and message in _one_line_error(capsys)
    assert not (tmp_path / "out").exists()


def test_check_output_folder_rules(tmp_path):
    data = tmp_path / "data"
    (data / "x").mkdir(parents=True)
    ckpt = tmp_path / "ws" / "server" / "FL_global_model.pt"
    ckpt.parent.mkdir(parents=True)
    ckpt.write_bytes(b"weights")
    inputs = {"data root": data, "checkpoint": ckpt}
    for out, words in ((data, "is the data root"), (data / "x", "lies inside the data root"),
                       (tmp_path / "ws", "contains the checkpoint"), (tmp_path, "contains the data root")):
        with pytest.raises(OutputFolderError, match=words):
            check_output_folder(out, inputs, "tool", force=True)  # --force never lifts these
    assert check_output_folder(tmp_path / "new", inputs, "tool") == (tmp_path / "new").resolve()
    with pytest.raises(OutputFolderError, match="refusing"):
        check_output_folder("/", {}, "tool", force=True)


def test_staged_folder_moves_into_place_only_when_complete(tmp_path):
    out = tmp_path / "site"
    with pytest.raises(RuntimeError):
        with staged_folder(out, marker="t") as stage:
            (stage / "half.txt").write_text("x")
            raise RuntimeError("decoder failed")
    assert list(tmp_path.iterdir()) == []
    with staged_folder(out, marker="t") as stage:
        (stage / "whole.txt").write_text("x")
    assert sorted(p.name for p in out.iterdir()) == [OUTPUT_MARKER, "whole.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["site"]


def test_resume_job_never_writes_over_its_job(tmp_path, job, capsys):
    import torch

    resume_job = load_tool("resume_job")
    ckpt = tmp_path / "server" / "FL_global_model.pt"
    ckpt.parent.mkdir()
    torch.save({"model": {"w": torch.zeros(2)}, "meta_props": {"feduq_last_completed_round": 1}}, ckpt)
    before = _snapshot(job)
    for out in (job, job.parent):
        assert resume_job.main([str(job), "--checkpoint", str(ckpt), "-o", str(out)]) == 2
        assert "job" in _one_line_error(capsys)
    assert _snapshot(job) == before and ckpt.is_file()


def test_a_site_writer_moves_only_a_finished_site_into_place(tmp_path):
    """Every converter writes through feduq.image_files.SiteWriter: a site is in place only once finished."""
    from PIL import Image

    from feduq.image_files import SiteWriter

    image, mask = Image.new("RGB", (4, 4), (10, 20, 30)), Image.new("L", (4, 4), 255)
    with pytest.raises(OutputFolderError, match="not finished"):
        with SiteWriter(tmp_path / "A", what="A") as site:
            site.add("x", image, mask, orig_width=4)
    assert list(tmp_path.iterdir()) == []  # nothing half-written, no staging folder left
    with SiteWriter(tmp_path / "A", what="A", image_format="jpg") as site:
        row = site.add("x", image, mask, orig_width=4)
        site.finish(["image_file", "mask_file", "orig_width"], {"0": "background", "255": "lesion"}, "made by a test")
    assert row == {"image_file": "images/x.jpg", "mask_file": "masks/x.png", "orig_width": 4}
    assert (tmp_path / "A" / "provenance.csv").read_text().splitlines() == [
        "image_file,mask_file,orig_width", "images/x.jpg,masks/x.png,4"]
    assert json.loads((tmp_path / "A" / "labels.json").read_text()) == {
        "labels": {"0": "background", "255": "lesion"}, "note": "made by a test"}
    assert Image.open(tmp_path / "A" / "masks" / "x.png").getpixel((0, 0)) == 255
    with pytest.raises(OutputFolderError, match="not empty"):
        SiteWriter(tmp_path / "A", what="A").__enter__()
