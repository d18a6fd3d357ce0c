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
    assert (foreign / "data.csv").read_text() == "1,2" and (foreign / "meta.json").is_file()  # --force keeps it
    assert capsys.readouterr().err == f"feduq configure: kept 1 file(s) in {foreign} that it does not write: data.csv\n"
    # a file the user adds later to a FedUQ output is not FedUQ's: refused by name, and kept with --force
    (out / "app" / "notes.txt").write_text("mine")
    with pytest.raises(SystemExit):
        configure_job.main([str(job), "-o", str(out), "--num-rounds", "5"])
    assert "app/notes.txt" in _one_line_error(capsys)
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "5", "--force"]) == 0
    assert (out / "app" / "notes.txt").read_text() == "mine"
    assert capsys.readouterr().err == f"feduq configure: kept 1 file(s) in {out} that it does not write: app/notes.txt\n"
    assert json.loads((out / "app" / "config" / "config_fed_server.json").read_text())["workflows"][0]["args"][
        "num_rounds"] == 5
    manifest = json.loads((out / OUTPUT_MARKER).read_text())
    assert "app/notes.txt" not in manifest["files"] and "meta.json" in manifest["files"]
    # a user file with a name the new output writes: refused, nothing changed
    (foreign / "meta.json").unlink()
    (foreign / OUTPUT_MARKER).unlink()  # now every file there is the user's, meta.json among them
    (foreign / "meta.json").write_text("{}")
    before = _snapshot(foreign)
    with pytest.raises(SystemExit):
        configure_job.main([str(job), "-o", str(foreign), "--force"])
    assert "is not FedUQ's and the new output writes the same name" in _one_line_error(capsys)
    assert _snapshot(foreign) == before


def test_the_data_root_of_the_environment_is_never_an_output(tmp_path, job, capsys, monkeypatch):
    """FEDUQ_DATA_ROOT=X feduq configure -o X --force (and feduq resume) once deleted the data root."""
    configure_job = load_tool("configure_job")
    root = tmp_path / "data"
    (root / "polyp" / "Kvasir-SEG").mkdir(parents=True)
    (root / "polyp" / "Kvasir-SEG" / "img.png").write_bytes(b"x")
    monkeypatch.setenv("FEDUQ_DATA_ROOT", str(root))
    for out in (root, root / "polyp" / "jobs"):
        with pytest.raises(SystemExit):
            configure_job.main([str(job), "-o", str(out), "--force"])
        assert "data root ($FEDUQ_DATA_ROOT)" in _one_line_error(capsys)
    assert (root / "polyp" / "Kvasir-SEG" / "img.png").read_bytes() == b"x" and not (root / "polyp" / "jobs").exists()


@pytest.mark.parametrize("argv, message", [
    (["--num-rounds", "0"], "num_rounds must be an integer >= 1, got 0"),
    (["--task", "liver"], "liver"),
    (["--set", "network={name: light}"], "network"),
    (["--seed", "-1"], "seed must be an integer in [0, 2**32), got -1"),  # numpy refused it at the sites' start
    (["--set", "seed=-2"], "executor argument seed=-2 is out of range"),
    # contradictory options: refused instead of one silently winning
    (["--image-size", "64", "--set", "image_size=96"], "image_size is given twice: 64 and --set image_size=96"),
    (["--network", "light", "--set", "network=fedevi_unet"], "network is given twice: 'light' and --set network="),
    (["--num-rounds", "5", "--set-workflow", "num_rounds=7"], "num_rounds is given twice: 5 and --set-workflow"),
    (["--official-protocol", "--set", "resize=letterbox"],
     "official_protocol sets resize='stretch_bicubic', contradicted by resize='letterbox'"),
    (["--official-protocol", "--select-on", "val_dice"], "official_protocol sets select_on='val_loss'"),
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
    """Every converter writes through feduq.io.image_files.SiteWriter: a site is in place only once finished."""
    from PIL import Image

    from feduq.io.image_files import SiteWriter

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


def test_simulate_keeps_a_user_file_even_with_force_and_never_logs_onto_the_job(tmp_path, job, fake_root, capsys):
    """FLARE's simulator empties its workspace, so a file of the user's there is refused even with --force; --log
    onto the job's own meta.json (or an existing file) is refused."""
    simulate = load_tool("simulate")
    ws = tmp_path / "notes"
    ws.mkdir()
    (ws / "thesis.tex").write_text("years of work")
    assert simulate.main([str(job), "-w", str(ws), "--data-root", str(fake_root), "--force"]) != 0
    assert "thesis.tex" in _one_line_error(capsys) and (ws / "thesis.tex").read_text() == "years of work"
    before = _snapshot(job)
    for log, says in ((job / "meta.json", "inside the job"), (ws / "thesis.tex", "exists")):
        assert simulate.main([str(job), "-w", str(tmp_path / "ws"), "--data-root", str(fake_root), "--log",
                              str(log)]) != 0
        assert says in _one_line_error(capsys)
    assert _snapshot(job) == before and (ws / "thesis.tex").read_text() == "years of work"


def test_evaluate_out_keeps_user_files(tmp_path, capsys, data_root):
    """feduq evaluate --out: a folder of the user's is refused, --force writes beside the user's file and keeps it, and
    the result is listed in the manifest so a second run replaces it without --force."""
    evaluate = load_tool("evaluate")
    out = tmp_path / "eval"
    out.mkdir()
    (out / "mine.txt").write_text("keep")
    argv = ["--job", str(REPO / "jobs" / "fedavg"), "--model", str(_light_model(tmp_path)), "--site", "Kvasir-SEG",
            "--data-root", str(data_root), "--split", "test", "--max-items", "1", "--maps", "0", "--out", str(out)]
    assert evaluate.main(argv) == 2
    assert "mine.txt" in _one_line_error(capsys)
    assert evaluate.main(argv + ["--force"]) == 0
    capsys.readouterr()
    assert (out / "mine.txt").read_text() == "keep" and (out / "per_site.csv").is_file()
    manifest = json.loads((out / OUTPUT_MARKER).read_text())["files"]
    assert "per_site.csv" in manifest and "mine.txt" not in manifest
    (out / "mine.txt").unlink()
    assert evaluate.main(argv) == 0  # every file is FedUQ's now


def _light_model(tmp_path):
    import torch

    from feduq.jobs.jobcheck import instantiate

    server = json.loads((REPO / "jobs" / "fedavg" / "app" / "config" / "config_fed_server.json").read_text())
    spec = next(c for c in server["components"] if c["id"] == "persistor")["args"]["model"]
    path = tmp_path / "model.pt"
    torch.save({"model": instantiate(spec, "model").state_dict()}, path)
    return path


def test_make_splits_site_local_never_overwrites_a_curated_split(tmp_path, capsys, data_root):
    make_splits = load_tool("make_splits")
    root = tmp_path / "data"
    shutil.copytree(data_root / "polyp" / "ETIS-LaribPolypDB", root / "polyp" / "ETIS-LaribPolypDB")
    curated = root / "polyp" / "ETIS-LaribPolypDB" / "split.json"
    curated.write_text('{"training": [], "note": "curated by hand"}')
    argv = ["--data-root", str(root), "--task", "polyp", "--centers", "ETIS-LaribPolypDB", "--site-local"]
    assert make_splits.main(argv) == 2
    assert "split.json exists" in _one_line_error(capsys) and "curated by hand" in curated.read_text()
    assert make_splits.main(argv + ["--force"]) == 0
    assert "curated by hand" not in curated.read_text()


def test_feduq_run_export_to_refuses_a_folder_of_the_users(tmp_path, capsys):
    from feduq.run import main

    (tmp_path / "fedavg").mkdir()
    (tmp_path / "fedavg" / "notes.md").write_text("mine")
    assert main(["fedavg", "--export-to", str(tmp_path)]) == 2
    assert "notes.md" in _one_line_error(capsys)
    assert (tmp_path / "fedavg" / "notes.md").read_text() == "mine"
    assert main(["fedavg", "--export-to", str(tmp_path / "x")]) == 0
    capsys.readouterr()
    assert main(["fedavg", "--export-to", str(tmp_path / "x")]) == 0  # its own export is replaced
    assert "meta.json" in json.loads((tmp_path / "x" / "fedavg" / OUTPUT_MARKER).read_text())["files"]


def test_poc_stop_never_removes_a_folder_that_is_not_a_poc_workspace(tmp_path, monkeypatch, capsys):
    import sys
    from feduq.commands.consortium import poc as feduq_poc

    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "thesis.tex").write_text("years of work")
    monkeypatch.setenv("NVFLARE_POC_WORKSPACE", str(folder))
    assert feduq_poc.main(["stop"]) == 2
    assert "is not a FLARE POC workspace" in _one_line_error(capsys)
    assert (folder / "thesis.tex").read_text() == "years of work"


def test_a_full_disk_leaves_nothing_half_written_and_one_line(tmp_path, job):
    """A write that fails mid-output (a 300-byte file size limit stands for a full disk; as root a read-only folder
    cannot be made): feduq configure exits 1 with one line naming the file as the output would have had it, nothing
    of the new output exists, and with --force an earlier output is left as it was."""
    import resource
    import signal
    import subprocess
    import sys

    def small_disk():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write then fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))

    out = tmp_path / "out" / "job"
    cmd = [sys.executable, "-m", "feduq", "configure", str(job), "-o", str(out), "--image-size", "64"]
    proc = subprocess.run(cmd, preexec_fn=small_disk, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    line, = proc.stderr.strip().splitlines()
    assert line.startswith(f"feduq configure: {out}/") and line.endswith(
        ": File too large; nothing half-written was kept"), line
    assert list((tmp_path / "out").iterdir()) == []  # neither the output nor its staging folder
    assert load_tool("configure_job").main(cmd[4:]) == 0
    before = _snapshot(out)
    proc = subprocess.run([*cmd[:-1], "96", "--force"], preexec_fn=small_disk, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1 and "File too large" in proc.stderr
    assert _snapshot(out) == before and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["job"]


def test_an_older_marker_without_a_file_list_protects_every_file_and_force_keeps_the_users(tmp_path, job, capsys):
    """Issue 53: a FedUQ output of before the file list (``{"tool": ...}``) with a user's file added since: refused
    without --force (every file protected); --force replaces what FedUQ wrote and keeps the file changed after it."""
    import os
    import time

    configure_job = load_tool("configure_job")
    out = tmp_path / "configured"
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "3"]) == 0
    (out / OUTPUT_MARKER).write_text(json.dumps({"tool": "feduq configure"}) + "\n")  # the older form
    past = time.time() - 3600
    for p in out.rglob("*"):
        os.utime(p, (past, past))  # written two days ago, as one run
    (out / "my_notes.md").write_text("the user's notes")  # added since
    before = _snapshot(out)
    with pytest.raises(SystemExit) as e:
        configure_job.main([str(job), "-o", str(out), "--num-rounds", "4"])
    assert e.value.code == 2
    err = _one_line_error(capsys)
    assert "older FedUQ output" in err and "--force" in err and _snapshot(out) == before
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "4", "--force"]) == 0
    assert (out / "my_notes.md").read_text() == "the user's notes"
    server = json.loads((out / "app" / "config" / "config_fed_server.json").read_text())
    assert server["workflows"][0]["args"]["num_rounds"] == 4
    assert "my_notes.md" not in json.loads((out / OUTPUT_MARKER).read_text())["files"]


@pytest.mark.parametrize("age_s", [0, 3600])
def test_an_older_marker_never_licenses_deleting_a_file_the_tool_does_not_write(tmp_path, job, capsys, age_s):
    """Issue 70 item 4: an older-format marker (``{"tool": "feduq configure"}``, no file list) and the user's
    ``data.txt`` with the marker's timestamp (or older): ``--force`` deleted it, rc 0, though configure_job never
    writes that name. Now only a job folder's names are replaced; data.txt (and a file of the user's in app/custom)
    stays, and the tool says what it kept."""
    import os

    configure_job = load_tool("configure_job")
    out = tmp_path / "configured"
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "3"]) == 0
    (out / OUTPUT_MARKER).write_text(json.dumps({"tool": "feduq configure"}) + "\n")  # the older form
    (out / "data.txt").write_text("the user's data")
    (out / "app" / "custom" / "my_loss.py").write_text("# the user's code")
    stamp = (out / OUTPUT_MARKER).stat().st_mtime_ns - age_s * 1_000_000_000
    for f in out.rglob("*"):
        os.utime(f, ns=(stamp, stamp))  # the same timestamp as the marker (or an hour older)
    capsys.readouterr()
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "4", "--force"]) == 0
    assert (out / "data.txt").read_text() == "the user's data"
    assert (out / "app" / "custom" / "my_loss.py").read_text() == "# the user's code"
    server = json.loads((out / "app" / "config" / "config_fed_server.json").read_text())
    assert server["workflows"][0]["args"]["num_rounds"] == 4  # the job's own files were replaced
    err = capsys.readouterr().err
    assert "kept 2 file(s)" in err and "app/custom/my_loss.py, data.txt" in err
    listed = json.loads((out / OUTPUT_MARKER).read_text())["files"]
    assert "data.txt" not in listed and "app/config/config_fed_server.json" in listed


def test_a_users_file_under_a_name_the_tool_writes_in_the_markers_tick_is_never_replaced(tmp_path, job, capsys):
    """An older-format marker and a user's own ``meta.json`` (not a job's: no name, no deploy_map) with the marker's
    very timestamp: the timestamp cannot tell it from the tool's, so its content does; --force refuses in one line
    naming it, and changes nothing. The job's own files in that tick are still the tool's (replaced)."""
    import os

    configure_job = load_tool("configure_job")
    out = tmp_path / "configured"
    assert configure_job.main([str(job), "-o", str(out), "--num-rounds", "3"]) == 0
    (out / OUTPUT_MARKER).write_text(json.dumps({"tool": "feduq configure"}) + "\n")  # the older form
    stamp = (out / OUTPUT_MARKER).stat().st_mtime_ns
    for f in out.rglob("*"):
        os.utime(f, ns=(stamp, stamp))
    from feduq.outputs import user_files

    assert user_files(out) == []  # the job's own files in the marker's tick: the tool's
    (out / "meta.json").write_text(json.dumps({"patients": 12, "note": "the user's"}))
    os.utime(out / "meta.json", ns=(stamp, stamp))
    assert user_files(out) == ["meta.json"]
    before = _snapshot(out)
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        configure_job.main([str(job), "-o", str(out), "--num-rounds", "4", "--force"])
    assert e.value.code == 2
    err = _one_line_error(capsys)
    assert f"{out / 'meta.json'} is not FedUQ's" in err and "move it away" in err, err
    assert _snapshot(out) == before and json.loads((out / "meta.json").read_text())["patients"] == 12


def test_a_killed_runs_folder_is_still_feduqs_and_the_users_kept_files_stay(tmp_path):
    """A tool killed mid-run (SIGKILL: no ``finally``) leaves only the claim's manifest; the next claim of the same
    folder (a resumed sweep) replaces the run's files without --force and keeps the user's files of the first claim."""
    from feduq.outputs import claim_output_folder, user_files, write_marker

    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.md").write_text("the user's")
    with pytest.raises(OutputFolderError, match="notes.md"):
        claim_output_folder(out, {}, "tool.py")
    out, keep = claim_output_folder(out, {}, "tool.py", force=True)
    assert keep == ["notes.md"]
    (out / "sites" / "a").mkdir(parents=True)
    (out / "sites" / "a" / "round_3.pt").write_bytes(b"w")
    (out / "log.txt").write_text("round 3")  # ... killed here
    assert user_files(out) == ["notes.md"]
    with pytest.raises(OutputFolderError, match="notes.md"):  # the user's file still asks for --force ...
        claim_output_folder(out, {}, "tool.py")
    out, keep = claim_output_folder(out, {}, "tool.py", force=True)  # ... which keeps it, the run's files go
    assert keep == ["notes.md"] and sorted(p.name for p in out.rglob("*") if p.is_file()) == [OUTPUT_MARKER,
                                                                                             "notes.md"]
    (out / "log.txt").write_text("done")
    write_marker(out, "tool.py", exclude=keep)
    assert json.loads((out / OUTPUT_MARKER).read_text()) == {"tool": "tool.py", "files": ["log.txt"]}
    (out / "later.md").write_text("added after the run finished")
    with pytest.raises(OutputFolderError, match="later.md"):
        claim_output_folder(out, {}, "tool.py")

    sweep = tmp_path / "sweep_run"  # a resumed sweep: nobody's files but the killed run's, no --force
    claim_output_folder(sweep, {}, "tool.py")
    (sweep / "log.txt").write_text("round 7")
    claim_output_folder(sweep, {}, "tool.py")
    assert [p.name for p in sweep.iterdir()] == [OUTPUT_MARKER]


def test_a_failed_sweep_run_is_run_again_over_its_own_simulator_log(tmp_path, job, fake_root, monkeypatch):
    """feduq compare reruns a failed run in its workspace with the log inside it (``<ws>/simulator.log``): the workspace
    is FedUQ's, so its log goes with it (it was refused: 'simulator.log exists')."""
    from feduq.outputs import write_marker
    from feduq.recipes import simulation

    ws = tmp_path / "runs" / "fedavg_s0"
    (ws / "server").mkdir(parents=True)
    (ws / "simulator.log").write_text("the failed run's output")
    write_marker(ws, "feduq simulate")

    def started(*args, **kwargs):
        raise RuntimeError("the simulator starts")

    monkeypatch.setattr(simulation, "run_process_group", started)
    with pytest.raises(RuntimeError, match="the simulator starts"):
        simulation.simulate(job, ws, fake_root, log=ws / "simulator.log")
    with pytest.raises(OutputFolderError, match="exists"):  # a log outside the workspace is still never replaced
        (tmp_path / "kept.log").write_text("a user's log")
        simulation.simulate(job, ws, fake_root, log=tmp_path / "kept.log")


def test_force_never_writes_over_a_users_file_under_a_name_the_tool_writes(tmp_path, capsys):
    """Issue 65 item 3: with --force, feduq reference, feduq virtual and benchmark_sites.py wrote over a
    user's per_client_table.md / sites.md although they promise to keep the user's files; now every tool that claims
    a folder refuses as feduq configure does, naming the file, before anything is written."""
    from feduq.outputs import claim_output_folder

    out = tmp_path / "out"
    (out / "site-a").mkdir(parents=True)
    (out / "per_client_table.md").write_text("mine")
    (out / "notes.md").write_text("also mine")
    with pytest.raises(OutputFolderError, match=r"per_client_table.md is not FedUQ's and the new output writes the "
                                                r"same name; move it away first"):
        claim_output_folder(out, {}, "tool.py", force=True, writes=("per_client_table.*", "*/per_image_test.csv"))
    assert sorted(p.name for p in out.iterdir()) == ["notes.md", "per_client_table.md", "site-a"]  # nothing written
    (out / "per_client_table.md").unlink()
    (out / "site-a" / "per_image_test.csv").write_text("mine too")
    with pytest.raises(OutputFolderError, match="site-a/per_image_test.csv"):  # a pattern over sub-folders
        claim_output_folder(out, {}, "tool.py", force=True, writes=("per_client_table.*", "*/per_image_test.csv"))
    (out / "site-a" / "per_image_test.csv").unlink()
    _, keep = claim_output_folder(out, {}, "tool.py", force=True, writes=("per_client_table.*",))
    assert keep == ["notes.md"] and (out / "notes.md").read_text() == "also mine"


@pytest.mark.parametrize("tool,argv,name", [
    ("train_reference", ["--mode", "local", "--task", "polyp", "--max-items", "2"], "per_client_table.md"),
    ("benchmark_sites", [str(REPO / "jobs" / "fedavg")], "sites.md"),
    ("virtual_federation", [str(REPO / "jobs" / "fedavg")], "per_client_table.md"),
])
def test_the_tools_that_claim_a_folder_keep_a_users_file_with_force(tmp_path, data_root, capsys, tool, argv, name):
    out = tmp_path / "out"
    out.mkdir()
    (out / name).write_text("mine")
    try:
        code = load_tool(tool).main([*argv, "--data-root", str(data_root), "--out", str(out), "--force"])
    except SystemExit as e:  # a tool that exits from its argument checks
        code = e.code
    assert code == 2
    err = capsys.readouterr().err
    assert f"{name} is not FedUQ's and the new output writes the same name" in err
    assert sorted(p.name for p in out.iterdir()) == [name] and (out / name).read_text() == "mine"


def test_virtual_federation_resumes_only_its_own_folder(tmp_path, data_root, capsys):
    """Issue 65 item 4: --resume into a folder without FedUQ's marker (a user's table beside a checkpoint.pt) wrote
    over the table; now refused before anything is written."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"not ours")
    (out / "per_client_table.md").write_text("mine")
    code = load_tool("virtual_federation").main([str(REPO / "jobs" / "fedavg"), "--data-root", str(data_root),
                                                 "--out", str(out), "--resume"])
    assert code == 2 and "is not a folder FedUQ's feduq virtual wrote" in capsys.readouterr().err
    assert (out / "per_client_table.md").read_text() == "mine" and (out / "checkpoint.pt").read_bytes() == b"not ours"
    assert sorted(p.name for p in out.iterdir()) == ["checkpoint.pt", "per_client_table.md"]


def test_an_older_marker_keeps_a_file_written_right_after_it_with_force(tmp_path):
    """Issue 65 item 6: a file written after an older-format marker is the user's however soon after (a 2 s slack
    counted it as FedUQ's and --force deleted it)."""
    from feduq.outputs import claim_output_folder

    out = tmp_path / "old"
    out.mkdir()
    (out / "table.csv").write_text("FedUQ's")
    (out / OUTPUT_MARKER).write_text(json.dumps({"tool": "tool.py"}) + "\n")
    (out / "data.txt").write_text("the user's, a moment later")
    import os

    marker_ns = (out / OUTPUT_MARKER).stat().st_mtime_ns  # a moment later, whatever the file system's clock step
    os.utime(out / "table.csv", ns=(marker_ns, marker_ns))
    os.utime(out / "data.txt", ns=(marker_ns + 1_000_000, marker_ns + 1_000_000))
    _, keep = claim_output_folder(out, {}, "tool.py", force=True, writes=["table.csv"])
    assert keep == ["data.txt"] and (out / "data.txt").read_text() == "the user's, a moment later"
    assert not (out / "table.csv").exists()


def test_a_table_the_user_edited_after_feduq_wrote_it_is_kept(tmp_path, data_root, capsys):
    """Issue 65: --resume replaced a run table the user had edited: a file FedUQ listed but changed after FedUQ's
    manifest was written (feduq.outputs.edited_since_marker) is not written over by feduq virtual --resume."""
    import os

    from feduq.outputs import edited_since_marker, write_marker

    out = tmp_path / "run"
    out.mkdir()
    (out / "checkpoint.pt").write_bytes(b"ours")
    (out / "per_client_table.md").write_text("FedUQ's table")
    write_marker(out, "feduq virtual")
    assert edited_since_marker(out) == []
    (out / "per_client_table.md").write_text("FedUQ's table, with the user's remarks")
    later = (out / OUTPUT_MARKER).stat().st_mtime_ns + 1_000_000_000  # edited a second later, on any file system
    os.utime(out / "per_client_table.md", ns=(later, later))
    assert edited_since_marker(out) == ["per_client_table.md"]
    code = load_tool("virtual_federation").main([str(REPO / "jobs" / "fedavg"), "--data-root", str(data_root),
                                                 "--out", str(out), "--resume"])
    assert code == 2 and "per_client_table.md is not FedUQ's and the new output writes the same name" in \
        capsys.readouterr().err
    assert (out / "per_client_table.md").read_text() == "FedUQ's table, with the user's remarks"
