"""feduq.predict: a trained model on unlabelled images, the review flag, bad input, the MONAI Bundle (volumes:
test_predict_volumes.py).

What predict writes is checked against what FedUQ scores (feduq evaluate's class maps of the same model and real
images, masks hidden from predict), and the review threshold against numbers computed by hand.
"""

import csv
import hashlib
import json
import os
import re
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import load_tool, small_job
from helpers import cropped_site, light_model, read_png, run_bundle


def tree_digest(folder):
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("method,args", [("fedevi", {}), ("fedavg", {"resize": "stretch", "intensity": "minmax"})])
def test_predict_label_maps_are_evaluates_predictions_at_the_original_size(tmp_path, data_root, method, args):
    from feduq.commands.site.predict import main as predict

    job = small_job(method, tmp_path / "job", network="light", image_size=64, executor_args=args)
    model = light_model(tmp_path / "model.pt")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-X")
    assert load_tool("evaluate").main(["--job", str(job), "--model", str(model), "--site-dir", str(site), "--maps", "0",
                                       "--save-predictions", "--out", str(tmp_path / "eval")]) == 0
    images = tmp_path / "unlabelled"
    shutil.copytree(site / "images", images)  # predict never sees a mask
    assert predict(["--job", str(job), "--model", str(model), "--input", str(images), "--out", str(tmp_path / "pred"),
                    "--batch-size", "3", "--no-progress"]) == 0
    evaluated = {r["image"]: r for r in csv.DictReader(open(tmp_path / "eval" / "per_image.csv"))}
    rows = {r["case"]: r for r in csv.DictReader(open(tmp_path / "pred" / "predictions.csv"))}
    assert sorted(rows) == sorted(evaluated) and len(rows) == 4
    for stem, row in rows.items():
        label = read_png(tmp_path / "pred" / stem / "label.png")
        scored = read_png(tmp_path / "eval" / "predictions" / "Hospital-X" / f"{stem}.png")
        original = Image.open(images / f"{stem}.png")
        assert label.shape == (original.height, original.width)  # rows x columns of the input
        np.testing.assert_array_equal(label, scored)
        assert set(np.unique(label)) == {0, 1}  # both classes: the comparison is not between two empty maps
        assert int(row["foreground_px"]) == int((label > 0).sum())
        primary = json.loads((tmp_path / "pred" / "scales.json").read_text())
        assert float(row["case_uncertainty"]) == pytest.approx(float(evaluated[stem]["u_total"]), abs=1e-6)
        u16 = read_png(tmp_path / "pred" / stem / "uncertainty_total.png").astype(float)
        scale = primary["scales"]["uncertainty_total.png"]
        assert u16.shape == label.shape and u16.mean() / 65535 * scale == pytest.approx(
            float(row["case_uncertainty"]), abs=2e-5)
        assert row["review"] == ""  # no threshold was chosen for this model
    # the default outputs: what a reader needs (the label map, the method's own map; the CSV always)
    assert {p.name for p in (tmp_path / "pred" / stem).iterdir()} == {"label.png", "uncertainty_total.png"}
    # a case folder gets a folder's usual permissions as its files get theirs (issue 69: it was 0700, private)
    umask = os.umask(0)
    os.umask(umask)
    assert (tmp_path / "pred" / stem).stat().st_mode & 0o777 == 0o777 & ~umask
    assert (tmp_path / "pred" / stem / "label.png").stat().st_mode & 0o777 == 0o666 & ~umask
    assert predict(["--job", str(job), "--model", str(model), "--input", str(images), "--out", str(tmp_path / "all"),
                    "--batch-size", "3", "--no-progress", "--outputs", "all"]) == 0
    expected = ({"uncertainty_total.png", "uncertainty_aleatoric.png", "uncertainty_epistemic.png",
                 "uncertainty_vacuity.png"} if method == "fedevi" else {"uncertainty_total.png"})
    assert {p.name for p in (tmp_path / "all" / stem).iterdir()} == {"label.png", "probability.png",
                                                                      "overlay.png"} | expected
    for name in ("label.png", "uncertainty_total.png"):  # the same files whatever else is asked for
        assert (tmp_path / "all" / stem / name).read_bytes() == (tmp_path / "pred" / stem / name).read_bytes()
    assert (tmp_path / "all" / "predictions.csv").read_text() == (tmp_path / "pred" / "predictions.csv").read_text()
    assert predict(["--job", str(job), "--model", str(model), "--input", str(images), "--out", str(tmp_path / "lab"),
                    "--no-progress", "--outputs", "label"]) == 0
    assert {p.name for p in (tmp_path / "lab" / stem).iterdir()} == {"label.png"}


def test_review_threshold_by_hand():
    from feduq.review.rule import ReviewError, choose_threshold

    # sorted by uncertainty; mean Dice of the accepted: .9, .85, .8667, .775, .68 -> the widest reaching .85 is 3 cases,
    # and the threshold lies midway between the 3rd (.3) and the 4th (.4)
    t = choose_threshold([0.3, 0.1, 0.5, 0.2, 0.4], [0.9, 0.9, 0.3, 0.8, 0.5], 0.85, uncertainty="total")
    assert t.threshold == pytest.approx(0.35) and t.coverage == pytest.approx(0.6) and t.accepted_dice == pytest.approx(2.6 / 3)
    assert t.all_dice == pytest.approx(3.4 / 5) and t.n_cases == 5
    assert [t.flag(u) for u in (0.3, 0.35, 0.36, float("nan"))] == [False, False, True, True]
    # tied uncertainties are accepted or flagged together: {.1} 1.0, {.1, .2, .2} .833, all .875 -> only {.1} >= .9
    t = choose_threshold([0.1, 0.2, 0.2, 0.4], [1.0, 1.0, 0.5, 1.0], 0.9)
    assert t.threshold == pytest.approx(0.15) and t.coverage == 0.25 and t.accepted_dice == 1.0
    t = choose_threshold([0.1, 0.2, 0.2, 0.4], [1.0, 1.0, 0.5, 1.0], 0.875)  # all four reach .875
    assert t.threshold == 0.4 and t.coverage == 1.0  # everything accepted: the largest uncertainty
    with pytest.raises(ReviewError, match="best accepted set has 0.600"):
        choose_threshold([0.1, 0.2], [0.6, 0.2], 0.7)
    with pytest.raises(ReviewError, match=r"\(0, 1\]"):
        choose_threshold([0.1], [0.6], 80)


def test_calibrated_threshold_is_stored_with_the_model_and_flags_predict_cases(tmp_path, data_root, capsys):
    from feduq.commands.site.predict import main as predict
    from feduq.review.rule import CASE_SCORES, choose_threshold, review_file

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-L", per_center=3)
    assert predict(["--job", str(job), "--model", str(model), "--input", str(site / "images"),
                    "--out", str(tmp_path / "before"), "--no-progress"]) == 0
    assert "no review flag is written" in capsys.readouterr().out
    assert load_tool("evaluate").main(["--job", str(job), "--model", str(model), "--site-dir", str(site), "--maps", "0",
                                       "--out", str(tmp_path / "eval")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "eval" / "per_image.csv")))
    u, dice = [float(r["u_total"]) for r in rows], [float(r["dice"]) for r in rows]
    order = np.argsort(u)
    prefix = np.cumsum(np.asarray(dice)[order]) / np.arange(1, len(u) + 1)  # accepted Dice of the k most certain
    target = float(prefix[:-1].max())  # reached by a set that leaves a case out (the seeded model allows one)
    # certified (the default): 6 images, each its own patient, cannot certify 0.5 at delta 0.1: one line naming
    # how many would be needed, exit 2, nothing stored
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(site),
                    "--target-dice", "0.5", "--units", "images"]) == 2
    err = capsys.readouterr().err
    assert "these 6 labelled images cannot certify a mean Dice of 0.500 at any coverage (delta 0.1)" in err
    assert re.search(r"(about \d+ images like these would be needed|no practical number of images)", err)
    assert not review_file(model).exists()
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(site),
                    "--target-dice", "0.5", "--delta", "1.5"]) == 2
    assert "--delta 1.5: a certified rule needs both in (0, 1)" in capsys.readouterr().err
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(site),
                    "--target-dice", str(target), "--uncertified"]) == 0
    stored = json.loads(review_file(model).read_text())
    assert stored["score"] in CASE_SCORES and stored["familiarity"] is None  # 6 cases: too few for familiarity
    assert stored["size_floor"] > 0  # every labelled crop holds a polyp
    assert stored["model_sha256"] == hashlib.sha256(model.read_bytes()).hexdigest()
    said = capsys.readouterr().out
    assert f"accepts {100 * stored['coverage']:.1f} %" in said and "not certified" in said
    assert stored["certificate"] is None
    if stored["score"] == "u_mean" and stored["coverage"] < 1:  # the image mean: predict's case_uncertainty
        expected = choose_threshold(u, dice, target)
        assert stored["threshold"] == pytest.approx(expected.threshold)
    assert predict(["--job", str(job), "--model", str(model), "--input", str(site / "images"),
                    "--out", str(tmp_path / "after"), "--no-progress"]) == 0
    assert "review rule was chosen empirically on 6 labelled cases" in capsys.readouterr().out
    predicted = list(csv.DictReader(open(tmp_path / "after" / "predictions.csv")))
    column = {"u_mean": "case_uncertainty"}.get(stored["score"], stored["score"])
    for r in predicted:  # each reason recomputed from the row's own numbers and the stored rule
        reasons = (["implausible size"] if float(r["area_fraction"]) < stored["size_floor"] else []) + (
            ["uncertain"] if float(r[column]) > stored["threshold"] else [])
        assert r["review_reason"] == "; ".join(reasons) and r["review"] == ("yes" if reasons else "no"), r
    assert {r["case"] for r in predicted} == {r["image"] for r in rows}
    # a threshold of another model is refused, not used
    light_model(model, seed=4)
    assert predict(["--job", str(job), "--model", str(model), "--input", str(site / "images"),
                    "--out", str(tmp_path / "other"), "--no-progress"]) == 2
    assert "belongs to another model file" in capsys.readouterr().err


@pytest.mark.parametrize("case", ["unreadable", "channels", "no_spacing", "other_network", "out_inside_input",
                                  "outputs", "diverged"])
def test_bad_input_is_named_and_nothing_is_written_or_touched(tmp_path, data_root, capsys, case):
    import nibabel as nib

    from feduq.commands.site.predict import main as predict

    task = {"channels": "prostate", "no_spacing": "prostate"}.get(case, "polyp")
    sites = ["RUNMC", "BMC"] if task == "prostate" else None
    job = small_job("fedavg", tmp_path / "job", task=task, sites=sites, network="light", image_size=64)
    model = light_model(tmp_path / "model.pt", in_channels=1 if task == "prostate" else 3)
    inputs = tmp_path / "inputs"
    shutil.copytree(cropped_site(data_root, tmp_path / "data" / "H") / "images", inputs)
    out = tmp_path / "out"
    expected = {"unreadable": "cannot read this image", "channels": "the model takes 1 (gray) channel",
                "no_spacing": "has no spacing", "other_network": "does not fit the job's network",
                "out_inside_input": "lies inside the input",
                "outputs": "--outputs label,heatmap: expected a comma-separated list of label, uncertainty",
                "diverged": None}[case]
    if case == "unreadable":
        bad = sorted(inputs.iterdir())[1]
        bad.write_bytes(bad.read_bytes()[:80])
        expected = f"{bad.name}: cannot read this image"
    elif case == "no_spacing":
        shutil.rmtree(inputs)
        inputs.mkdir()
        # no affine: nibabel writes sform and qform code 0 (no scanner geometry)
        nib.save(nib.Nifti1Image(np.ones((8, 8, 3), np.int16), None), inputs / "vol.nii.gz")
    elif case == "other_network":
        light_model(model, in_channels=1)
    elif case == "diverged":  # a diverged run's model (one Inf, then NaN) gave NaN scores and empty maps, exit 0
        state = torch.load(model, weights_only=True)
        name = next(k for k, v in state["model"].items() if v.is_floating_point() and v.numel() > 1)
        state["model"][name].view(-1)[:2] = torch.tensor([float("nan"), float("inf")])
        torch.save(state, model)
        expected = f"parameter {name!r} holds 1 NaN and 1 Inf of {state['model'][name].numel()} values"
    elif case == "out_inside_input":
        out = inputs / "predictions"
    before = tree_digest(inputs)
    assert predict(["--job", str(job), "--model", str(model), "--input", str(inputs), "--out", str(out),
                    "--no-progress"] + (["--outputs", "label,heatmap"] if case == "outputs" else [])) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("feduq predict: error:") and expected in err[0], err
    assert not out.exists() and tree_digest(inputs) == before


def test_a_failed_write_stops_predict_and_leaves_no_half_written_case(tmp_path, data_root, monkeypatch):
    """The pipeline's worker threads write each case; the third write fails (a full disk): predict raises that error
    (no success reported), the cases written before it are whole, and no staged or half-written folder is left."""
    import feduq.predict.files as files
    from feduq.predict.pipeline import predict
    from feduq.site.evaluation import client_config, load_model

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    images = cropped_site(data_root, tmp_path / "data" / "H") / "images"
    loaded = load_model(client_config(job), model, device="cpu")
    real, calls = files._png16, []

    def png16(array, scale, path):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(array, scale, path)

    monkeypatch.setattr(files, "_png16", png16)
    with pytest.raises(OSError, match="No space left"):
        predict(loaded, images, tmp_path / "out", batch_size=2, progress=False, threads=2)
    left = sorted(p.name for p in (tmp_path / "out").iterdir() if p.is_dir())
    assert not [n for n in left if n.startswith(".")]  # no staged folder
    assert len(left) == 3 and all({f.name for f in (tmp_path / "out" / n).iterdir()} ==
                                  {"label.png", "uncertainty_total.png"} for n in left)
    assert not (tmp_path / "out" / "predictions.csv").exists()


@pytest.mark.parametrize("method,args", [("fedevi", {}), ("fedavg", {"resize": "stretch", "intensity": "minmax"})])
def test_monai_bundle_runner_gives_predicts_label_maps(tmp_path, data_root, method, args):
    """The exported bundle is run by MONAI's own runner in a fresh interpreter without FedUQ on its path."""
    from feduq.commands.site.predict import main as predict

    job = small_job(method, tmp_path / "job", network="light", image_size=64, executor_args=args)
    model = light_model(tmp_path / "model.pt")
    images = cropped_site(data_root, tmp_path / "data" / "Hospital-X") / "images"
    bundle = tmp_path / "bundle"
    assert predict(["--job", str(job), "--model", str(model), "--export-bundle", str(bundle)]) == 0
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["network_data_format"]["outputs"]["pred"]["channel_def"] == {"0": "background", "1": "polyp"}
    assert predict(["--job", str(job), "--model", str(model), "--input", str(images), "--out", str(tmp_path / "pred"),
                    "--no-progress"]) == 0
    run_bundle(bundle, images, tmp_path / "monai")
    scales = json.loads((tmp_path / "pred" / "scales.json").read_text())["scales"]
    stems = sorted(p.stem for p in images.iterdir())
    assert len(stems) == 4
    for stem in stems:
        label = read_png(tmp_path / "pred" / stem / "label.png")
        np.testing.assert_array_equal(read_png(tmp_path / "monai" / f"{stem}_seg.png"), label)
        assert set(np.unique(label)) == {0, 1}
        u_monai = read_png(tmp_path / "monai" / f"{stem}_uncertainty_total.png").astype(int)
        u_pred = read_png(tmp_path / "pred" / stem / "uncertainty_total.png").astype(int)
        assert np.abs(u_monai - u_pred).max() <= 1  # MONAI's writer truncates, predict rounds
        assert scales["uncertainty_total.png"] == pytest.approx(meta["feduq"]["uncertainty_scale"]["total"])
    # plain PyTorch loads the network without FedUQ or MONAI
    net = torch.jit.load(str(bundle / "models" / "model.ts"))
    assert tuple(net(torch.zeros(1, 3, 64, 64)).shape) == (1, 2, 64, 64)


def test_a_model_resized_with_pils_bicubic_filter_is_not_exported_as_a_bundle(tmp_path, capsys):
    """resize="stretch_bicubic" has no MONAI transform: the export stops with one line instead of writing a bundle
    whose preprocessing is not the model's."""
    from feduq.commands.site.predict import main as predict

    job = small_job("fedavg", tmp_path / "job", network="light", image_size=64,
                    executor_args={"resize": "stretch_bicubic"})
    model = light_model(tmp_path / "model.pt")
    assert predict(["--job", str(job), "--model", str(model), "--export-bundle", str(tmp_path / "bundle")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "resize='stretch_bicubic' (PIL's bicubic filter) is not exported" in err[0], err
    assert not (tmp_path / "bundle").exists()


@pytest.mark.parametrize("resize", ["stretch", "letterbox"])
def test_a_16_bit_gray_image_reaches_predict_and_the_bundle_as_a_site_sees_it(tmp_path, data_root, resize):
    """A real Kvasir-SEG frame as 16-bit gray (v * 200 + 37: neither a multiple of 257 nor reaching 65535, so a byte
    shift, a scaling by the image's maximum or a truncation would give other values) reaches a 3-channel network as the
    8-bit image rint(x * 255 / 65535), through predict's reader and the exported bundle's preprocessing (built and run
    by MONAI's ConfigParser), equal to the site pipeline's; Pillow's convert("RGB") alone clips it at 255. An in-memory
    mode "I" image goes through the bundle's converter as through gray_to_8bit: kept when <= 255, scaled when wider."""
    from monai.bundle import ConfigParser

    from feduq.io.transforms import gray_to_8bit, make_image_transforms
    from feduq.bundle.export import inference_config
    from feduq.predict.files import read_plane

    source = sorted((data_root / "polyp" / "Kvasir-SEG" / "images").iterdir())[0]
    wide = np.asarray(Image.open(source).convert("L")).astype(np.uint16) * 200 + 37
    expected = np.rint(wide * (255.0 / 65535.0)).astype(np.uint8)
    assert expected.max() < 250 and len(np.unique(expected)) > 100
    Image.fromarray(expected).save(tmp_path / "expected8.png")
    Image.fromarray(wide).save(tmp_path / "gray16.png")
    assert Image.open(tmp_path / "gray16.png").mode == "I;16"
    assert float((np.asarray(Image.open(tmp_path / "gray16.png").convert("RGB")) == 255).mean()) > 0.9  # Pillow clips
    a16, _ = read_plane(tmp_path / "gray16.png", 3)
    assert a16.shape == (3, wide.shape[1], wide.shape[0])
    np.testing.assert_array_equal(a16, np.repeat(expected.T[None].astype(np.float32), 3, axis=0))
    # the same frame as a 16-bit TIFF: predict reads it with tifffile, a site with Pillow; both scale by 255 / 65535
    # (not by the image's maximum, which a converter's 8-bit reading uses), for a 3- and a 1-channel network
    import tifffile

    tifffile.imwrite(tmp_path / "gray16.tif", wide)
    t16, _ = read_plane(tmp_path / "gray16.tif", 3)
    np.testing.assert_array_equal(t16, a16)
    site_tif = make_image_transforms(64, 3, resize=resize, intensity="max", site="Kvasir-SEG")
    np.testing.assert_array_equal(np.asarray(site_tif({"image": str(tmp_path / "gray16.tif")})["image"]),
                                  np.asarray(site_tif({"image": str(tmp_path / "gray16.png")})["image"]))
    t1, _ = read_plane(tmp_path / "gray16.tif", 1)
    np.testing.assert_array_equal(t1, wide.T[None].astype(np.float32))
    np.testing.assert_array_equal(t1, read_plane(tmp_path / "gray16.png", 1)[0])
    parser = ConfigParser(inference_config(64, 3, resize, "max", 2, True, 4, ["total"]))
    pre = parser.get_parsed_content("preprocessing")
    site = make_image_transforms(64, 3, resize=resize, intensity="max", site="Kvasir-SEG")
    b16, b8 = (pre({"image": str(tmp_path / n)})["image"] for n in ("gray16.png", "expected8.png"))
    np.testing.assert_array_equal(np.asarray(b16), np.asarray(b8))
    np.testing.assert_allclose(np.asarray(b16), np.asarray(site({"image": str(tmp_path / "gray16.png")})["image"]),
                               rtol=0, atol=1e-6)
    convert = parser.get_parsed_content("preprocessing#transforms#0#converter")
    ramp = np.arange(256, dtype=np.int32).reshape(16, 16)
    for values in (ramp, ramp * 250 + 37):
        img = Image.fromarray(values, "I")
        want = values if values.max() <= 255 else np.rint(values * (255.0 / 65535.0))
        np.testing.assert_array_equal(np.asarray(gray_to_8bit(img)), want)
        np.testing.assert_array_equal(np.asarray(convert(img))[..., 0], want)


def test_a_declared_2d_task_predicts_and_exports_a_bundle_that_monai_runs_to_the_same_label_files(tmp_path, data_root):
    """A declared 2D task with two gray channels z-scored per image (nnU-Net's default for "T2"/"ADC"), its inputs
    named as nnU-Net names them: predict writes <case>.png of the task's label values, and the exported bundle, run by
    MONAI's own bundle runner without FedUQ, writes the same files from the same channel files (its
    scripts/channel_io.py is the sites' reader)."""
    import nnunet_sites

    from feduq.core.networks import build_network
    from feduq.commands.site.predict import main as predict

    name = "Dataset961_TwoChannel2D"
    root = tmp_path / "data"
    nnunet_sites.prostate_slices_site(data_root, "RUNMC", root / name / "Hospital-A", max_cases=1)
    task = nnunet_sites.task_declaration(name, ["Hospital-A"], channels=("T2", "ADC"), file_ending=".png")
    job = small_job("fedavg", tmp_path / "job", task=task, sites=["Hospital-A"], network="light")
    torch.save({"model": build_network("light", 2, 3, init_seed=3).state_dict()}, tmp_path / "model.pt")
    new = tmp_path / "new"
    cases = nnunet_sites.prostate_slices_site(data_root, "BMC", tmp_path / "src", max_cases=1, folder="new")[5:8]
    new.mkdir()
    for case in cases:
        for c in (0, 1):
            shutil.copy(tmp_path / "src" / "new" / f"{case}_{c:04d}.png", new)
    assert predict(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--input", str(new), "--out",
                    str(tmp_path / "pred"), "--no-progress"]) == 0
    bundle = tmp_path / "bundle"
    assert predict(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--export-bundle", str(bundle)]) == 0
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    assert meta["network_data_format"]["inputs"]["image"]["channel_def"] == {"0": "T2", "1": "ADC"}
    (tmp_path / "bout").mkdir()
    run_bundle(bundle, new, tmp_path / "bout")
    for case in cases:
        mine, theirs = read_png(tmp_path / "pred" / f"{case}.png"), read_png(tmp_path / "bout" / f"{case}.png")
        assert mine.shape == theirs.shape == read_png(new / f"{case}_0000.png").shape
        np.testing.assert_array_equal(mine, theirs)
    assert set(np.unique(np.concatenate([read_png(tmp_path / "pred" / f"{c}.png").ravel() for c in cases]))) > {0}


def test_a_certified_rule_records_its_site_and_cases_and_predict_says_for_whom_it_holds(tmp_path, data_root, capsys,
                                                                                        monkeypatch):
    """Issue 64: the scoring of labelled cases is predict's own (tested above); here the cases are given (60 of one
    site: 45 confident of Dice 0.95, 15 uncertain of Dice 0.2), so the certificate is known: target 0.8 certified at
    delta 0.1, the rule names the site and counts (no case name: issue 68), the cases and their hashes stay in the
    site-local record beside the site's folder, and predict's note says the promise holds there only. A site whose
    images cannot be told apart by patient is refused unless --units images says each is its own patient."""
    import feduq.review.calibration as calibration
    from feduq.review.calibration import case_hashes
    from feduq.review.rule import review_file
    from feduq.commands.site.predict import main as predict

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-L", per_center=1)
    score = np.r_[np.full(45, 0.02), np.full(15, 0.3)]
    cases = {"u_mean": score, "u_foreground": score, "u_boundary": score, "area_fraction": np.full(60, 0.1),
             "mask_fraction": np.full(60, 0.1), "dice": np.r_[np.full(45, 0.95), np.full(15, 0.2)]}
    rows = [{"site": "Hospital-L", "image": f"c{i}", "sha256": f"{i:064x}"} for i in range(60)]
    def scored(*a, center_dirs=None, **k):
        center_dirs["Hospital-L"] = site
        return cases, None, ["Hospital-L:all"], rows

    monkeypatch.setattr(calibration, "labelled_cases", scored)
    calibrate = ["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(site),
                 "--target-dice", "0.8"]
    assert predict(calibrate) == 2
    assert ("site 'Hospital-L': its labelled images cannot be told apart by patient" in capsys.readouterr().err
            and not review_file(model).exists())
    assert predict([*calibrate, "--units", "images"]) == 0
    said = capsys.readouterr().out
    assert "it accepts 75.0 % with mean Dice 95.00 %" in said
    assert ("certified: at Hospital-L the accepted cases' mean Dice is >= 80.0 % with probability >= 90 % over the 60 "
            "images, each its own patient drawn") in said
    stored = json.loads(review_file(model).read_text())
    c = stored["certificate"]
    assert c["k"] == 60 and c["n_units"] == 60 and c["unit"] == "image" and c["delta"] == 0.1 and c["bound"] == 0.8
    assert c["sites"] == ["Hospital-L"] and "cases" not in c and "Hospital-L/c" not in review_file(model).read_text()
    local = json.loads((site.parent / "Hospital-L.feduq-calibration.json").read_text())
    assert local["digest"] == c["digest"] and local["cases"]["Hospital-L/c7"] == {"unit": "Hospital-L/c7",
                                                                                 "sha256": f"{7:064x}"}
    from feduq.review.calibration import calibration_digest

    assert calibration_digest(local["salt"], {k: (v["unit"], v["sha256"]) for k, v in local["cases"].items()}) == \
        c["digest"] != calibration_digest("another salt", {k: (v["unit"], v["sha256"]) for k, v in
                                                           local["cases"].items()})
    assert 0.02 <= stored["threshold"] < 0.3
    assert predict(["--job", str(job), "--model", str(model), "--input", str(site / "images"),
                    "--out", str(tmp_path / "pred"), "--no-progress"]) == 0
    assert ("the review rule is certified for Hospital-L (60 images, each its own patient labelled, delta 0.1): for "
            "cases of that site the accepted ones' mean Dice is >= 80.0 %") in capsys.readouterr().out
    # each case's hash is over its image and mask files' bytes, in name order
    image = sorted((site / "images").iterdir())[0]
    mask = next((site / "masks").glob(image.stem + ".*"))
    expected = hashlib.sha256(b"".join(f.read_bytes() for f in sorted([image, mask]))).hexdigest()
    assert case_hashes(site, [image.stem, "absent"]) == {image.stem: expected, "absent": None}


def test_a_region_tasks_areas_and_label_meanings_are_the_regions(tmp_path, data_root):
    """Issue 69: nnU-Net's nested structures (``"gland": [1, 2], "TZ": [2]``, regions_class_order [1, 2]): predict's
    ``px_gland`` counts the whole gland (values 1 and 2 of the label file it writes), not value 1 alone, ``px_TZ``
    value 2, and scales.json says what each value means and which values make each region."""
    import nnunet_sites

    from feduq.core.networks import build_network
    from feduq.commands.site.predict import main as predict

    name = "Dataset962_Regions2D"
    labels = {"background": 0, "gland": [1, 2], "TZ": [2]}
    site = tmp_path / "data" / name / "Hospital-A"
    nnunet_sites.prostate_slices_site(data_root, "RUNMC", site, max_cases=1, channels=("T2",))
    nnunet_sites.write_site_json(site, ("T2",), labels, ".png", len(list((site / "labelsTr").iterdir())))
    task = nnunet_sites.task_declaration(name, ["Hospital-A"], channels=("T2",), labels=labels, file_ending=".png")
    task["regions_class_order"] = [1, 2]
    job = small_job("fedavg", tmp_path / "job", task=task, sites=["Hospital-A"], network="light")
    torch.save({"model": build_network("light", 1, 3, init_seed=5).state_dict()}, tmp_path / "model.pt")
    new = tmp_path / "new"
    new.mkdir()
    for f in sorted((site / "imagesTr").iterdir())[6:10]:
        shutil.copy(f, new)
    assert predict(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--input", str(new), "--out",
                    str(tmp_path / "pred"), "--no-progress", "--outputs", "label,probability"]) == 0
    rows = list(csv.DictReader(open(tmp_path / "pred" / "predictions.csv")))
    assert len(rows) == 4
    # one probability map per region: the gland holds every foreground class, so its probability is the foreground's
    # (1 - p_background); the nested TZ's is no larger anywhere, and not the same map
    case = tmp_path / "pred" / rows[0]["case"]
    gland, tz, fg = (read_png(case / f"probability{n}.png").astype(np.int64) for n in ("_gland", "_TZ", ""))
    assert np.abs(gland - fg).max() <= 1 and (tz <= gland + 1).all() and (tz < gland - 1000).any()
    for row in rows:
        written = read_png(tmp_path / "pred" / f"{row['case']}.png")  # the task's values, nnU-Net's painting
        assert int(row["px_gland"]) == int(np.isin(written, [1, 2]).sum())
        assert int(row["px_TZ"]) == int((written == 2).sum())
    assert sum(int(r["px_gland"]) > int(r["px_TZ"]) > 0 for r in rows) >= 1  # the two differ somewhere
    scales = json.loads((tmp_path / "pred" / "scales.json").read_text())
    assert scales["label"] == {"0": "background", "1": "gland (not TZ)", "2": "gland + TZ"}
    assert scales["regions"] == {"gland": [1, 2], "TZ": [2]}
    assert {"probability_gland.png": 1.0, "probability_TZ.png": 1.0}.items() <= scales["scales"].items()
