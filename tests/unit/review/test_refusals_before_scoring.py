"""Refusals that need only which cases were given come before any case is scored: the model's training cases in a
calibration, a certified calibration on a site whose images cannot be grouped by patient, and a 3D case whose label
volume lies on another grid than its image (naming both files). Each test makes scoring raise if it is reached."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from conftest import REPO, small_job
from helpers import light_model


def _never_scored(monkeypatch):
    import feduq.site.evaluation as evaluation

    def scored(*a, **k):
        raise AssertionError("a case was scored before the refusal")

    monkeypatch.setattr(evaluation, "evaluate_site", scored)


def _polyp_site(tmp_path, data_root, items):
    site = tmp_path / "data" / "Hospital-T"
    (site / "images").mkdir(parents=True)
    (site / "masks").mkdir()
    src = data_root / "polyp" / "Kvasir-SEG"
    shutil.copy(src / "labels.json", site)
    for item in items:
        shutil.copy(src / item["image"], site / "images")
        shutil.copy(src / item["label"], site / "masks")
    return site


def _kvasir_split():
    return json.loads((REPO / "custom" / "splits" / "polyp" / "Kvasir-SEG.json").read_text())


def test_a_calibration_on_training_cases_is_refused_before_scoring(tmp_path, data_root, capsys, monkeypatch):
    from feduq.commands.site.predict import main as predict

    split = _kvasir_split()
    site = _polyp_site(tmp_path, data_root, [split["training"][0], split["training"][1], split["testing"][0]])
    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    _never_scored(monkeypatch)
    for extra in ([], ["--uncertified"]):
        assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(site),
                        "--data-root", str(data_root), "--target-dice", "0.5", *extra]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "site Hospital-T: 2 of its 3 labelled cases are training cases" in err, err
        assert "--allow-training-cases" in err and "scored" not in err
    assert not (tmp_path / "model.pt.review.json").exists()


def test_a_certified_calibration_on_a_site_without_patients_is_refused_before_scoring(tmp_path, data_root, capsys,
                                                                                      monkeypatch):
    from feduq.commands.site.predict import main as predict

    site = _polyp_site(tmp_path, data_root, _kvasir_split()["testing"][:3])
    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    _never_scored(monkeypatch)
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(site),
                    "--target-dice", "0.5"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "site 'Hospital-T'" in err and "cannot be told apart by patient" in err, err
    assert "--unit-pattern" in err and "--units images" in err
    assert not (tmp_path / "model.pt.review.json").exists()


def test_a_label_volume_on_another_grid_is_refused_naming_both_files(tmp_path):
    """On the case list (before any case of the site is scored, in evaluation and calibration alike)."""
    import nibabel as nib

    from feduq.data import DataError
    from feduq.io.volume_checks import check_case_files

    image, label = tmp_path / "case_0000.nii.gz", tmp_path / "case.nii.gz"
    affine = np.diag([0.6, 0.6, 3.0, 1.0])
    nib.save(nib.Nifti1Image(np.zeros((40, 32, 12), np.float32), affine), str(image))
    nib.save(nib.Nifti1Image(np.zeros((40, 32, 11), np.uint8), affine), str(label))
    with pytest.raises(DataError) as e:
        check_case_files({"channels": [image], "label": label}, "RUNMC")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("site 'RUNMC'")
    assert str(label) in msg and str(image) in msg and "40 x 32 x 11" in msg and "40 x 32 x 12" in msg
    nib.save(nib.Nifti1Image(np.zeros((40, 32, 12), np.uint8), affine), str(label))
    check_case_files({"channels": [image], "label": label}, "RUNMC")  # one grid: accepted


def test_a_3d_calibration_with_a_label_on_another_grid_is_refused_before_scoring(tmp_path, data_root, capsys,
                                                                                 monkeypatch):
    import nibabel as nib
    import torch

    import nnunet_sites
    from feduq.nnunet.planned import PlannedNetwork
    from feduq.commands.site.predict import main as predict
    from feduq.nnunet import federated_plans as fpl
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    NAME = "Dataset993_ProstateGrid"  # a task of its own: another declaration under one name is refused
    site_dir = tmp_path / NAME / "BMC"
    cases = sorted(nnunet_sites.prostate_site(data_root, "BMC", site_dir, max_cases=2))
    files = [([p], site_dir / "labelsTr" / p.name.replace("_0000", "")) for p in sorted((site_dir / "imagesTr").iterdir())]
    task = nnunet_sites.task_declaration(NAME, ["BMC"])
    slim = fpl.slim_plan_3d(fpl.plan_from_fingerprint(
        task, fpl.merge_fingerprints({"BMC": fpl.site_fingerprint(files, SimpleITKIO, 5000, "BMC")}), "SimpleITKIO"))
    job = small_job("fedavg", tmp_path / "job", task=task, sites=["BMC"], configuration="3d_fullres", plans=slim)
    torch.save({"model": PlannedNetwork(slim, "3d_fullres", 1, 3).state_dict()}, tmp_path / "model.pt")
    bad = site_dir / "labelsTr" / f"{cases[-1]}.nii.gz"
    given = nib.load(str(bad))
    nib.save(nib.Nifti1Image(np.asarray(given.dataobj)[:, :, :-1], given.affine), str(bad))
    _never_scored(monkeypatch)
    assert predict(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--calibrate", "--site-dir",
                    str(site_dir), "--target-dice", "0.5", "--uncertified"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{cases[-1]}.nii.gz" in err and f"{cases[-1]}_0000.nii.gz" in err, err
    assert "on one grid" in err
