"""The exported MONAI Bundle flags as predict does (issue 52 item 4): run by MONAI's own runner without FedUQ, each
image's review decision, reasons and case scores equal predict's predictions.csv under a rule with all three parts
(implausible size, unfamiliar input, uncertain) active on the same real images."""

import csv
import json
import shutil

import numpy as np
import pytest

from conftest import small_job
from helpers import cropped_site, light_model, run_bundle


def midway(values, k):
    """A threshold between the k-th and (k+1)-th smallest values: no case lies on it."""
    v = np.sort(np.asarray(values, dtype=np.float64))
    return float((v[k] + v[k + 1]) / 2)


def test_the_bundle_writes_predicts_review_decision_and_reasons_per_image(tmp_path, data_root):
    from feduq.predict.files import read_plane
    from feduq.predict.planes import Predictor
    from feduq.review.rule import Familiarity, ReviewThreshold, save_threshold
    from feduq.commands.site.predict import main as predict
    from feduq.site.evaluation import client_config, load_model

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    images = cropped_site(data_root, tmp_path / "data" / "H", centers=["Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB"],
                          per_center=4) / "images"
    files = sorted(images.iterdir())
    assert len(files) == 12
    # the scores and features predict computes, to place each part's threshold inside their range
    predictor = Predictor(load_model(client_config(job), model, device="cpu"), batch_size=4)
    predictor.take_features()
    res = predictor.planes([read_plane(f, 3)[0] for f in files])
    features = np.stack([r["features"] for r in res])
    stats = {k: [r["stats"][k] for r in res] for k in ("u_boundary", "area_fraction")}
    familiarity = Familiarity.fit(features)
    familiarity.threshold = midway(familiarity.distance(features), 8)  # the 3 farthest images are unfamiliar
    rule = ReviewThreshold(uncertainty="total", threshold=midway(stats["u_boundary"], 7), target_dice=0.8,
                           coverage=0.5, accepted_dice=0.8, all_dice=0.7, n_cases=12, score="u_boundary",
                           size_floor=midway(stats["area_fraction"], 2), familiarity=familiarity.__dict__)
    rule.certificate = {"k": 40, "delta": 0.1, "bound": 0.8,
                        "scores_tested": ["u_mean", "u_foreground", "u_boundary"], "method": "Learn then Test",
                        "sites": ["Hospital-H"], "cases": {"Hospital-H/c0": "ab" * 32}}  # issue 64: a certified rule
    save_threshold(rule, model)

    assert predict(["--job", str(job), "--model", str(model), "--input", str(images), "--out", str(tmp_path / "pred"),
                    "--no-progress"]) == 0
    rows = {r["case"]: r for r in csv.DictReader(open(tmp_path / "pred" / "predictions.csv"))}
    reasons = [r["review_reason"] for r in rows.values()]
    for part in ("implausible size", "unfamiliar input", "uncertain"):  # every part flags some image, not all
        assert 0 < sum(part in r for r in reasons) < 12, (part, reasons)

    bundle = tmp_path / "bundle"
    assert predict(["--job", str(job), "--model", str(model), "--export-bundle", str(bundle)]) == 0
    assert json.loads((bundle / "configs" / "review.json").read_text())["score"] == "u_boundary"
    meta = json.loads((bundle / "configs" / "metadata.json").read_text())
    # the certificate travels with it, but no case name (issue 68: a rule certified before lists them; hospital file
    # names may hold patient numbers)
    assert meta["feduq"]["review_threshold"]["certificate"] == {k: v for k, v in rule.certificate.items()
                                                                if k != "cases"}
    assert "Hospital-H/c0" not in (bundle / "configs" / "metadata.json").read_text() + (
        bundle / "configs" / "review.json").read_text() + (bundle / "docs" / "README.md").read_text()
    assert ("Certified for Hospital-H (40 cases labelled there): there, the accepted images' mean Dice is at least "
            "80.0 % with probability at least 90 %") in (bundle / "docs" / "README.md").read_text()
    run_bundle(bundle, images, tmp_path / "monai")
    for f in files:
        got = json.loads((tmp_path / "monai" / f"{f.stem}_review.json").read_text())
        want = rows[f.stem]
        assert (got["review"], got["review_reason"]) == (want["review"], want["review_reason"]), f.stem
        for key in ("u_foreground", "u_boundary", "area_fraction", "familiarity_distance"):
            assert got[key] == pytest.approx(float(want[key]), rel=1e-5, abs=1e-7), (f.stem, key)


def test_a_bundle_without_a_review_rule_writes_no_review_and_ships_no_review_code(tmp_path):
    from feduq.commands.site.predict import main as predict

    job = small_job("fedavg", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    assert predict(["--job", str(job), "--model", str(model), "--export-bundle", str(tmp_path / "bundle")]) == 0
    config = json.loads((tmp_path / "bundle" / "configs" / "inference.json").read_text())
    assert "write_review" not in config and not (tmp_path / "bundle" / "scripts" / "case_scores.py").exists()
    assert sorted(p.name for p in (tmp_path / "bundle" / "scripts").iterdir()) == ["__init__.py", "bundle_inputs.py"]
    assert "none stored" in (tmp_path / "bundle" / "docs" / "README.md").read_text()


@pytest.mark.parametrize("case", ["corrupt", "empty", "missing"])
def test_monai_runner_stops_in_one_line_on_a_bad_dataset_dir(tmp_path, data_root, case):
    """Issue 65: MONAI's runner on a folder with a corrupt PNG printed 188 lines without naming the file; on a missing
    or empty --dataset_dir it ended with exit 0 ("dataloader is empty"). The bundle's input check names the file or
    the folder in one line, exit 2, before any image is segmented."""
    import subprocess
    import sys

    from feduq.commands.site.predict import main as predict

    job = small_job("fedavg", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    bundle = tmp_path / "bundle"
    assert predict(["--job", str(job), "--model", str(model), "--export-bundle", str(bundle)]) == 0
    images = tmp_path / "images"
    if case != "missing":
        shutil.copytree(cropped_site(data_root, tmp_path / "data" / "H", per_center=1) / "images", images)
    if case == "empty":
        for f in images.iterdir():
            f.unlink()
    bad = None
    if case == "corrupt":
        bad = sorted(images.iterdir())[1]
        bad.write_bytes(bad.read_bytes()[:200])
    out = tmp_path / "out"
    argv = ["monai.bundle", "run", "--config_file", str(bundle / "configs" / "inference.json"), "--bundle_root",
            str(bundle), "--dataset_dir", str(images), "--output_dir", str(out)]
    code = (f"import runpy, sys; sys.modules['feduq'] = None; sys.argv = {argv!r}; "
            "runpy.run_module('monai.bundle', run_name='__main__', alter_sys=True)")
    run = subprocess.run([sys.executable, "-I", "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert run.returncode == 2, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("bundle: error:")]
    want = {"corrupt": f"{bad}: cannot read this image", "empty": f"--dataset_dir {images} holds no images",
            "missing": f"--dataset_dir {images} is not a folder"}[case]
    assert len(errors) == 1 and want in errors[0], run.stderr[-3000:]
    assert "Traceback" not in run.stderr
    assert not out.exists() or not any(out.glob("*_seg.png"))
