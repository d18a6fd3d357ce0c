"""The federated nnU-Net plan (feduq.nnunet.federated_plans): two prostate sites restacked into NIfTI volumes from
../shared/data at test time; the merged fingerprint against nnU-Net's own fingerprint of the pooled cases, and the
plan against nnU-Net's own plan of that fingerprint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from nnunet_sites import prostate_site

from feduq.nnunet import federated_plans as fpl

SITES = {"RUNMC": 3, "BMC": 2}
VOXELS = 5e4  # nnU-Net's 10e7 foreground samples scaled down (both sides use the same number)
DECLARATION = {"name": "Dataset991_ProstateFed", "channel_names": {"0": "T2"},
               "labels": {"background": 0, "PZ": 1, "TZ": 2}, "file_ending": ".nii.gz"}


def _cases(site_dir: Path) -> list:
    return [([p], site_dir / "labelsTr" / p.name.replace("_0000", "")) for p in sorted((site_dir / "imagesTr").iterdir())]


@pytest.fixture(scope="module")
def federation(tmp_path_factory, data_root):
    """The two sites, their fingerprints with nnU-Net's per-case samples of the pooled count, and nnU-Net's own
    fingerprint and plan of the pooled cases (``nnUNetv2``'s extractor and planner on one raw folder of both)."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    tmp = tmp_path_factory.mktemp("fedplan")
    sites = {}
    for center, n in SITES.items():  # the data root tmp/sites/<task>/<site>, with every case in training
        site_dir = tmp / "sites" / DECLARATION["name"] / center
        prostate_site(Path(data_root), center, site_dir, max_cases=n)
        sites[center] = _cases(site_dir)
        names = [Path(images[0]).name.replace("_0000.nii.gz", "") for images, _ in sites[center]]
        (site_dir / "split.json").write_text(json.dumps({"training": names, "validation": [], "testing": []}))
    pooled = sum(len(c) for c in sites.values())
    fps = {c: fpl.site_fingerprint(v, SimpleITKIO, fpl.samples_per_case(pooled, VOXELS), c) for c, v in sites.items()}
    # nnU-Net on the pooled raw folder: cases named s<i>_<case> so its sorted order is the sites' order
    raw = tmp / "raw" / "Dataset991_ProstateFed"
    for folder in ("imagesTr", "labelsTr"):
        (raw / folder).mkdir(parents=True)
    for i, (center, cases) in enumerate(sites.items()):
        for images, label in cases:
            os.symlink(images[0], raw / "imagesTr" / f"s{i}_{Path(images[0]).name}")
            os.symlink(label, raw / "labelsTr" / f"s{i}_{Path(label).name}")
    (raw / "dataset.json").write_text(json.dumps({**{k: v for k, v in DECLARATION.items() if k != "name"},
                                                  "numTraining": pooled}))
    env = dict(os.environ, nnUNet_raw=str(tmp / "raw"), nnUNet_preprocessed=str(tmp / "pre"),
               nnUNet_results=str(tmp / "res"))
    code = ("from nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor import "
            "DatasetFingerprintExtractor as D\n"
            f"d = D(991, 1); d.num_foreground_voxels_for_intensitystats = {VOXELS}; d.show_progress_bar = False\n"
            "d.run()\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    subprocess.run([str(Path(sys.executable).parent / "nnUNetv2_plan_experiment"), "-d", "991"], env=env, check=True,
                   capture_output=True)
    pre = tmp / "pre" / "Dataset991_ProstateFed"
    return {"sites": sites, "fps": fps, "pooled": pooled, "root": tmp / "sites",
            "nnunet": json.loads((pre / "dataset_fingerprint.json").read_text()),
            "nnunet_plans": json.loads((pre / "nnUNetPlans.json").read_text())}


def test_the_merged_fingerprint_is_nnunets_fingerprint_of_the_pooled_cases(federation):
    merged = fpl.merge_fingerprints(federation["fps"])
    ref = federation["nnunet"]
    assert merged["spacings"] == ref["spacings"] and merged["shapes_after_crop"] == ref["shapes_after_crop"]
    assert merged["median_relative_size_after_cropping"] == ref["median_relative_size_after_cropping"]
    got, want = merged["foreground_intensity_properties_per_channel"]["0"], ref[
        "foreground_intensity_properties_per_channel"]["0"]
    assert got["min"] == want["min"] and got["max"] == want["max"]
    # nnU-Net averages float32 samples (np.mean in float32): equal to its rounding
    assert got["mean"] == pytest.approx(want["mean"], rel=1e-6) and got["std"] == pytest.approx(want["std"], rel=1e-6)
    # percentiles from the sites' 2001-level quantile functions: within 0.5 % of nnU-Net's 0.5-99.5 range (here the
    # stored values are whole numbers, so the pooled step CDF and its linear reading differ by under one grey level)
    span = want["percentile_99_5"] - want["percentile_00_5"]
    for key in ("percentile_00_5", "median", "percentile_99_5"):
        assert abs(got[key] - want[key]) <= 0.005 * span, (key, got[key], want[key])


def test_sites_sampling_by_their_own_count_do_not_give_nnunets_numbers(federation):
    """The negative control: a site drawing ``10e7 // its own cases`` voxels per case (not the pooled count) changes
    the pooled mean and standard deviation, so the pooled count must reach the sites first."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    own = {c: fpl.site_fingerprint(v, SimpleITKIO, fpl.samples_per_case(len(v), VOXELS), c)
           for c, v in federation["sites"].items()}
    got = fpl.merge_fingerprints(own)["foreground_intensity_properties_per_channel"]["0"]
    want = federation["nnunet"]["foreground_intensity_properties_per_channel"]["0"]
    assert abs(got["mean"] - want["mean"]) > 1e-6 * abs(want["mean"])


def test_the_federated_plan_is_nnunets_plan_of_the_pooled_fingerprint(federation):
    plans = fpl.plan_from_fingerprint(DECLARATION, fpl.merge_fingerprints(federation["fps"]), "SimpleITKIO")
    ref = federation["nnunet_plans"]
    assert plans["configurations"]["3d_fullres"] == ref["configurations"]["3d_fullres"]
    for key in set(ref) - {"configurations", "foreground_intensity_properties_per_channel", "plans_name",
                           "dataset_name"}:
        assert plans[key] == ref[key], key


def test_a_site_without_foreground_cannot_be_fingerprinted_and_is_named(federation, tmp_path):
    import nibabel as nib
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    images, label = federation["sites"]["BMC"][0]
    empty = nib.load(str(label))
    nib.save(nib.Nifti1Image(np.zeros(empty.shape, np.uint8), empty.affine), str(tmp_path / "empty.nii.gz"))
    with pytest.raises(fpl.FingerprintError, match="site 'BMC': no foreground voxel .label > 0. in any of its 1 "
                                                   "training cases"):
        fpl.site_fingerprint([(images, tmp_path / "empty.nii.gz")], SimpleITKIO, 100, "BMC")


@pytest.mark.sim
def test_the_plan_job_in_flare_gives_the_plan_of_the_sites_numbers(federation, tmp_path):
    """``feduq plan`` (FLARE's simulator; the ledger filter on every site): its plan is the in-process
    plan of the same site fingerprints exactly, and its fingerprint file the merged one."""
    import subprocess

    from conftest import REPO

    task = tmp_path / "task.json"
    task.write_text(json.dumps({**DECLARATION, "feduq": {"sites": list(SITES)}}))
    out = tmp_path / "out" / "plans.json"
    res = subprocess.run([sys.executable, "-m", "feduq", "plan", "--task", str(task),
                          "--data-root", str(federation["root"]), "--out", str(out), "--foreground-voxels",
                          str(VOXELS), "-w", str(tmp_path / "ws")], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    merged = fpl.merge_fingerprints({s: federation["fps"][s] for s in sorted(SITES)})  # the server's order: by name
    assert json.loads((tmp_path / "out" / "plans_fingerprint.json").read_text()) == json.loads(json.dumps(merged))
    assert json.loads(out.read_text()) == fpl.plan_from_fingerprint(DECLARATION, merged, "SimpleITKIO")
    slim = json.loads((tmp_path / "out" / "plans_slim.json").read_text())
    assert slim["configurations"]["3d_fullres"]["architecture"]["arch_kwargs"]["n_stages"] == 4
    ledgers = sorted((tmp_path / "ws").rglob("privacy_ledger.csv"))
    assert len(ledgers) == 2 and all("spacings,per_case:3" in p.read_text() for p in ledgers)
