"""A consortium's own task, end to end in FLARE's simulator: a task file (nnU-Net's dataset.json + "feduq") whose two
sites are nnU-Net raw datasets of NIfTI volumes under names no FedUQ code holds (the prostate RUNMC and BMC slices
stacked back into volumes at test time, tests/nnunet_sites.py); the per-site table is per volume (Dice per case,
HD95 in mm), a site annotating a subset of the labels trains with the marginal loss, and predict writes each
held-back volume's label file in the input's geometry."""

from __future__ import annotations

import csv
import json

import nibabel as nib
import numpy as np
import pytest

import nnunet_sites

SITES = {"Nijmegen-West": "RUNMC", "Boston-East": "BMC"}  # site name -> the shared center its volumes come from


def _task(tmp_path, data_root, name, channels=("T2",), partial: str | None = None, cases: int = 4):
    root = tmp_path / "data"
    for site, center in SITES.items():
        labels, keep = (({"background": 0, "TZ": 1}, {2}) if site == partial else (None, None))
        site_dir = root / name / site
        names = nnunet_sites.prostate_site(data_root, center, site_dir, max_cases=cases, channels=channels,
                                           labels=labels, keep=keep)
        if keep:  # the partial site writes its TZ with its own value 1 (its dataset.json says so)
            for f in (site_dir / "labelsTr").iterdir():
                img = nib.load(f)
                nib.save(nib.Nifti1Image((np.asarray(img.dataobj) == 2).astype(np.uint8), img.affine), f)
        (site_dir / "split.json").write_text(json.dumps(  # 2 training, 1 validation, 1 test volume per site
            {"training": names[:2], "validation": [names[2]], "testing": [names[3]]}))
    task = tmp_path / f"{name}.json"
    task.write_text(json.dumps(nnunet_sites.task_declaration(name, list(SITES), channels=channels)))
    return root, task


def _run(method, root, task, work):
    from nvflare.recipe import SimEnv

    from feduq.recipes.recipe import FedUQRecipe

    recipe = FedUQRecipe(method, task=str(task), data_root=str(root), image_size=32, num_rounds=1, local_epochs=1,
                         executor_args={"network": {"name": "light"}, "num_threads": 1})
    assert recipe.sites == list(SITES)  # the task file's sites are the job's
    recipe.run(SimEnv(clients=recipe.sites, workspace_root=str(work)))
    ws = work / recipe.name
    with open(ws / "server" / "simulate_job" / "results" / "per_client_table.csv") as f:
        return ws, {r["client"]: r for r in csv.DictReader(f)}


@pytest.mark.sim
def test_fedevi_on_two_channel_volume_sites_scores_per_case_and_predicts_in_the_input_geometry(tmp_path, data_root):
    root, task = _task(tmp_path, data_root, "Dataset931_TwoChannelMR", channels=("T2", "ADC"))
    ws, table = _run("fedevi", root, task, tmp_path / "work")
    for site in SITES:
        row = table[site]
        assert row["num_cases"] == "1" and int(row["num_images"]) > 10  # one test volume, scored as one case
        assert 0.0 <= float(row["dice"]) <= 1.0 and float(row["hd95_mm"]) > 0.0  # HD95 in mm, not pixels
        per_case = list(csv.DictReader(open(ws / site / "simulate_job" / "per_case_test.csv")))
        assert len(per_case) == 1 and per_case[0]["case"] == sorted(
            nnunet_sites.prostate_cases(data_root, SITES[site]))[3].lower()
        assert float(per_case[0]["dice"]) == pytest.approx(float(row["dice"]), abs=1e-6)
        assert float(per_case[0]["reference_ml_TZ"]) > 1.0  # the reference gland zone has a volume in mL
    from feduq.site.evaluation import evaluate_job

    per_site, _ = evaluate_job(ws, out=tmp_path / "ev", sites=list(SITES), data_root=root, split="test", maps=0)
    for row in per_site:  # feduq evaluate scores the same model on the same test volume as the site's test task
        assert row["n_cases"] == 1
        assert row["dice"] == pytest.approx(float(table[row["site"]]["dice"]), abs=1e-6)
        assert row["hd95_mm"] == pytest.approx(float(table[row["site"]]["hd95_mm"]), abs=1e-4)
    config = ws / "server" / "simulate_job" / "app_server" / "config" / "config_fed_client.json"
    carried = json.loads(config.read_text())["executors"][0]["executor"]["args"]["task"]
    assert carried["channel_names"] == {"0": "T2", "1": "ADC"}  # the job carries the declaration (self-contained)

    held_back = tmp_path / "new"
    nnunet_sites.prostate_site(data_root, "RUNMC", tmp_path / "src", max_cases=6, channels=("T2", "ADC"))
    held_back.mkdir()
    for f in sorted((tmp_path / "src" / "imagesTr").glob("case05_*")):
        f.rename(held_back / f.name)
    from feduq.commands.site.predict import main as predict_main

    assert predict_main(["--job", str(ws), "--input", str(held_back), "--out", str(tmp_path / "pred"),
                         "--no-progress"]) == 0
    src, out = nib.load(held_back / "case05_0000.nii.gz"), nib.load(tmp_path / "pred" / "case05.nii.gz")
    assert out.shape == src.shape and np.allclose(out.affine, src.affine)
    assert set(np.unique(np.asarray(out.dataobj)).tolist()) <= {0, 1, 2}  # the task's label values
    # the MONAI Bundle of the declared volume task, run by MONAI's own runner without FedUQ: the same label volume
    from helpers import run_bundle

    assert predict_main(["--job", str(ws), "--export-bundle", str(tmp_path / "bundle")]) == 0
    (tmp_path / "bout").mkdir()
    run_bundle(tmp_path / "bundle", held_back, tmp_path / "bout")
    theirs = nib.load(tmp_path / "bout" / "case05.nii.gz")
    assert theirs.shape == src.shape and np.allclose(theirs.affine, src.affine)
    np.testing.assert_array_equal(np.asarray(theirs.dataobj), np.asarray(out.dataobj))
    mine_u = nib.load(tmp_path / "pred" / "case05" / "uncertainty_total.nii.gz").get_fdata()
    np.testing.assert_allclose(nib.load(tmp_path / "bout" / "case05_uncertainty_total.nii.gz").get_fdata(), mine_u,
                               atol=1e-4)
    (row,) = list(csv.DictReader(open(tmp_path / "pred" / "predictions.csv")))
    assert row["case"] == "case05" and row["kind"] == "volume"
    voxel_ml = float(np.prod(src.header.get_zooms()[:3])) / 1000
    assert float(row["foreground_ml"]) == pytest.approx(int(row["foreground_px"]) * voxel_ml, rel=1e-6)


@pytest.mark.sim
def test_fedavg_with_a_site_annotating_a_subset_trains_with_the_marginal_loss(tmp_path, data_root):
    root, task = _task(tmp_path, data_root, "Dataset932_PartialMR", partial="Boston-East")
    ws, table = _run("fedavg", root, task, tmp_path / "work")
    assert set(SITES) <= set(table)
    log = (ws / "Boston-East" / "log.txt").read_text()
    assert "partial labels: annotates ['TZ'] (marginal loss over the others)" in log
    assert "partial labels" not in (ws / "Nijmegen-West" / "log.txt").read_text()
    per_case = list(csv.DictReader(open(ws / "Boston-East" / "simulate_job" / "per_case_test.csv")))
    assert "dice_TZ" in per_case[0] and "dice_PZ" not in per_case[0]  # scored on what it annotates
