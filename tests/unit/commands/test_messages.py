"""Bad input to a tool ends in one line naming the file, site or parameter and a non-zero exit, never a traceback
(the weak cases of a careless user's session)."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest
from PIL import Image

from conftest import REPO, load_tool, one_image_site


def _one_line(capsys) -> str:
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err, err
    return err


@pytest.fixture
def site_with_01_mask(tmp_path, data_root):
    """A site folder whose mask uses 0/1 while labels.json declares 0/255."""
    site, stem = one_image_site(data_root, tmp_path / "Hospital-X")
    mask = np.zeros(Image.open(site / "masks" / f"{stem}.png").size[::-1], np.uint8)
    mask[10:40, 10:40] = 1
    Image.fromarray(mask).save(site / "masks" / f"{stem}.png")
    return site, stem


def test_evaluate_names_a_mask_with_undeclared_values(tmp_path, site_with_01_mask, capsys):
    site, stem = site_with_01_mask
    evaluate = load_tool("evaluate")
    rc = evaluate.main(["--job", str(REPO / "jobs" / "fedavg"), "--model", str(_tiny_model(tmp_path)),
                        "--site-dir", str(site), "--out", str(tmp_path / "eval"), "--maps", "0"])
    assert rc == 2
    err = _one_line(capsys)
    assert f"mask masks/{stem}.png holds pixel values [1] not declared in labels.json" in err


def _tiny_model(tmp_path):
    """The committed FedAvg job's network, freshly initialised, saved as FLARE's persistor saves it."""
    import torch

    from feduq.core.networks import FedEviUNet

    path = tmp_path / "model.pt"
    torch.save({"model": FedEviUNet(in_channels=3, out_channels=2, init_seed=0).state_dict()}, path)
    return path


@pytest.mark.parametrize("argv, words", [
    (["--device", "cuda:7"], "--device cuda:7"),
    (["--max-items", "-1"], "argument --max-items: expected an integer >= 1, got -1"),
    (["--site", "Hospital-X"], "site 'Hospital-X' is named twice"),  # the --site-dir folder's own name
])
def test_evaluate_names_a_bad_option(tmp_path, site_with_01_mask, capsys, argv, words):
    import torch

    if argv[0] == "--device" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 CUDA devices")
    evaluate = load_tool("evaluate")
    base = ["--job", str(REPO / "jobs" / "fedavg"), "--site-dir", str(site_with_01_mask[0]),
            "--out", str(tmp_path / "eval")]
    if argv[0] == "--max-items":  # argparse: its usage, then the one error line
        with pytest.raises(SystemExit) as e:
            evaluate.main(base + argv)
        assert e.value.code == 2
        assert words in capsys.readouterr().err.strip().splitlines()[-1]
    else:
        assert evaluate.main(base + argv) == 2
        assert words in _one_line(capsys)
    assert not (tmp_path / "eval").exists()


def test_prepare_site_checks_the_data_root_first_and_keeps_the_persistor_on_the_server(tmp_path, capsys):
    prepare_site = load_tool("prepare_site")
    assert prepare_site.main([str(tmp_path / "kit"), "--data-root", str(tmp_path / "nowhere")]) == 2
    assert "--data-root" in _one_line(capsys) and not (tmp_path / "kit").exists()
    persistor = "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor"
    assert prepare_site.main([str(tmp_path / "site"), "--data-root", str(tmp_path)]) == 0
    assert prepare_site.main([str(tmp_path / "server"), "--server"]) == 0
    site = json.loads((tmp_path / "site" / "local" / "resources.json").read_text())["class_allow_list"]
    server = json.loads((tmp_path / "server" / "local" / "resources.json").read_text())["class_allow_list"]
    assert "feduq." in site and persistor not in site
    assert "feduq." in server and persistor in server


def test_poc_start_checks_the_data_root_before_touching_the_poc_workspace(tmp_path, capsys, monkeypatch):
    from feduq.commands.consortium import poc as feduq_poc

    import feduq.recipes.poc

    monkeypatch.setattr(feduq.recipes.poc, "_nvflare", lambda *a, **k: pytest.fail("the POC must not be rebuilt"))
    assert feduq_poc.main(["start", "--data-root", str(tmp_path / "nowhere")]) == 2
    assert str(tmp_path / "nowhere") in _one_line(capsys)


@pytest.mark.parametrize("tool, argv, words", [
    ("simulate", ["JOB", "-w", "OUT", "-t", "0"], "feduq simulate: error: -t/--threads 0: expected an integer >= 1"),
    ("make_splits", ["--task", "polyp", "--fractions", "0.5", "0.5", "0.5", "--out", "OUT"],
     "--fractions 0.5 0.5 0.5: expected three shares >= 0 that sum to 1"),
    ("make_splits", ["--task", "polyp", "--virtual", "0", "--out", "OUT"], "--virtual 0: expected an integer >= 1"),
    ("evaluate", ["--job", "JOB", "--site", "Kvasir-SEG", "--maps", "-1", "--out", "OUT"],
     "feduq evaluate: error: --maps -1: expected an integer >= 0"),
])
def test_a_meaningless_count_is_refused_in_one_line_before_anything_runs(tmp_path, data_root, capsys, tool, argv,
                                                                         words):
    """Values that were accepted and failed later or meant nothing (issue 53): each is one line, exit 2, nothing
    written (a simulator with no thread would start no site and wait)."""
    out = tmp_path / "out"
    argv = [{"JOB": str(REPO / "jobs" / "fedavg"), "OUT": str(out)}.get(a, a) for a in argv]
    assert load_tool(tool).main(argv + ["--data-root", str(data_root)]) == 2
    assert words in _one_line(capsys)
    assert not out.exists()


@pytest.mark.parametrize("argv, words", [
    (["--rounds", "0"], "--rounds 0: expected an integer >= 1"),
    (["--paired-baseline", "fedbn"], "--paired-baseline fedbn: not one of --methods (fedevi)"),
    (["--review-target", "0.8"], "--review-target judges the review flag at a held-out site: give --holdout"),
    (["--review-target", "80", "--holdout", "ETIS-LaribPolypDB"], "--review-target 80.0: a mean Dice in (0, 1]"),
])
def test_compare_refuses_a_sweep_it_cannot_run_before_starting_it(tmp_path, data_root, capsys, argv, words):
    compare = load_tool("compare")
    with pytest.raises(SystemExit) as e:  # argparse: its usage, then the one error line
        compare.main(["--task", "polyp", "--methods", "fedevi", "--data-root", str(data_root),
                      "--out", str(tmp_path / "cmp")] + argv)
    assert e.value.code == 2
    assert words in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "cmp").exists()


@pytest.mark.parametrize("argv, words", [
    (["--network", "nosuch"], "unknown network 'nosuch'"),
    (["--image-size", "40"], "image_size=40 is not a multiple of 16, the total stride of network FedEviUNet"),
    (["--network", "light", "--image-size", "16"], "image_size=16 is too small for network SegUNet: it needs >= 32"),
])
def test_train_reference_refuses_a_network_it_cannot_train_before_reading_data(tmp_path, data_root, capsys, argv,
                                                                               words):
    """An unknown network, or a size the network cannot take (16 px: the light network's deepest level would be 1 x 1,
    which instance normalisation cannot train on): one line, exit 2, no output folder (it failed after writing one)."""
    train_reference = load_tool("train_reference")
    out = tmp_path / "ref"
    with pytest.raises(SystemExit) as e:
        train_reference.main(["--task", "polyp", "--mode", "local", "--rounds", "1", "--max-items", "4", "--out", str(out),
                              "--data-root", str(data_root)] + argv)
    assert e.value.code == 2 and words in _one_line(capsys)
    assert not out.exists()


def test_a_folder_given_as_the_model_file_is_named_as_a_folder(tmp_path, capsys):
    """predict --model FOLDER said the folder "does not exist" (issue 53): now it says what it is."""
    from feduq.commands.site.predict import main as predict

    (tmp_path / "models").mkdir()
    assert predict(["--job", str(REPO / "jobs" / "fedavg"), "--model", str(tmp_path / "models"), "--input",
                    str(tmp_path), "--out", str(tmp_path / "out")]) == 2
    assert f"model file {tmp_path / 'models'} is a folder; pass a model file" in _one_line(capsys)
    assert not (tmp_path / "out").exists()


def test_prepare_site_refuses_a_center_no_task_has(tmp_path, capsys):
    """--center Foo was written into the site's config and the site stopped at its first task (issue 53); a virtual
    site of a center is a center."""
    prepare = load_tool("prepare_site")
    assert prepare.main([str(tmp_path / "site"), "--center", "Foo"]) == 2
    assert "--center 'Foo' is not a center of any FedUQ task (polyp: Kvasir-SEG" in _one_line(capsys)
    assert not (tmp_path / "site").exists()
    assert prepare.main([str(tmp_path / "site"), "--center", "Kvasir-SEG-p1of10"]) == 0


def test_feduq_run_export_to_a_file_is_one_line(tmp_path, capsys):
    """--export-to naming a file was a NotADirectoryError traceback (issue 53); the file is left as it was."""
    from feduq.run import main as run

    target = tmp_path / "afile"
    target.write_text("mine\n")
    assert run(["fedavg", "--export-to", str(target)]) == 2
    assert f"--export-to {target} is a file" in _one_line(capsys)
    assert target.read_text() == "mine\n"


@pytest.mark.parametrize("value", ["", "Kvasir-SEG,,CVC-ClinicDB", " "])
def test_an_empty_sites_list_is_refused_not_read_as_every_site(tmp_path, capsys, value):
    """--sites "" meant every site (issue 53): an empty value or an empty name is refused by every command that takes
    --sites, naming the option."""
    from feduq.run import main as run

    with pytest.raises(SystemExit) as e:
        load_tool("configure_job").main([str(REPO / "jobs" / "fedavg"), "-o", str(tmp_path / "job"), "--sites", value])
    assert e.value.code == 2
    assert "argument --sites: expected comma-separated site names" in capsys.readouterr().err.strip().splitlines()[-1]
    with pytest.raises(SystemExit) as e:
        run(["fedavg", "--sites", value, "--export-to", str(tmp_path / "exp")])
    assert e.value.code == 2 and "argument --sites" in capsys.readouterr().err
    assert not (tmp_path / "job").exists() and not (tmp_path / "exp").exists()


@pytest.mark.parametrize("argv, words", [
    (["--set-workflow", "num_rounds=-1"], "workflow argument num_rounds must be an integer >= 1, got -1"),
    (["--set-workflow", "min_clients=0"], "workflow argument min_clients must be an integer >= 1, got 0"),
    (["--site-set", "Kvasir-SEG:device=tpu"], "feduq run: --site-set: site 'Kvasir-SEG': device='tpu' is out of range"),
    (["--resources", "Kvasir-SEG=1:1000"], "--resources Kvasir-SEG=1:1000: expected 0..64 GPUs and 0 < GiB per GPU"),
    (["--resources", "Kvasir-SEG=-1"], "--resources Kvasir-SEG=-1: expected 0..64 GPUs"),
])
def test_feduq_run_refuses_values_that_would_fail_later_or_wait_forever(tmp_path, capsys, argv, words):
    """Issue 53: a negative round count, a device no site has and a GPU memory no GPU holds were accepted (the job
    failed at the site, or FLARE's resource manager waited forever); now one line, exit 2, nothing written."""
    from feduq.run import main as run

    assert run(["fedavg", *argv, "--export-to", str(tmp_path / "exp")]) == 2
    assert words in _one_line(capsys)
    assert not (tmp_path / "exp").exists()


def test_a_malformed_privacy_policy_is_named_before_resources_json_is_changed(tmp_path, capsys):
    """Issue 53: feduq prepare-site changed local/resources.json, then failed on a malformed local/privacy.json without
    naming it; now the policy is read first and named, and nothing is changed."""
    site = tmp_path / "site-1"
    (site / "local").mkdir(parents=True)
    (site / "local" / "privacy.json").write_text("{ not json")
    (site / "local" / "resources.json.default").write_text('{"format_version": 2, "components": []}\n')
    before = {p.name: p.read_bytes() for p in (site / "local").iterdir()}
    assert load_tool("prepare_site").main([str(site)]) == 2
    line = _one_line(capsys)
    assert str(site / "local" / "privacy.json") in line and "not a readable FLARE privacy policy" in line
    assert {p.name: p.read_bytes() for p in (site / "local").iterdir()} == before


def test_poc_submit_without_a_poc_or_a_job_is_one_line(tmp_path, capsys, monkeypatch):
    """Issue 53: feduq poc submit with no POC running, or a folder that is no job, was FLARE's AssertionError
    traceback; now one line each, exit 2."""
    from feduq.commands.consortium import poc as feduq_poc

    monkeypatch.setenv("NVFLARE_POC_WORKSPACE", str(tmp_path / "no-poc"))
    assert feduq_poc.main(["submit", str(tmp_path / "nosuch")]) == 2
    assert "is not a job folder (no meta.json)" in _one_line(capsys)
    assert feduq_poc.main(["submit", str(REPO / "jobs" / "fedavg")]) == 2
    assert "no POC here (no admin startup kit at" in _one_line(capsys)
