"""The 3D volume site (feduq.site.site3d.Site3D) on two prostate sites restacked into NIfTI volumes from
../shared/data at test time, with the slim plan derived from their federated plan: one FedAvg round in-process,
predict and the bundle, and the review rule's familiarity part (each volume's pooled bottleneck features: its
windows' encoder output, pooled; a volume unlike the calibration volumes lies farther than they do)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import nnunet_sites

from feduq.nnunet import federated_plans as fpl

NAME = "Dataset992_Prostate3D"
SITES = {"RUNMC": 4, "BMC": 3}


def _split(site_dir: Path, cases: list[str]) -> None:
    (site_dir / "split.json").write_text(json.dumps({"training": cases[:-2], "validation": cases[-2:-1],
                                                     "testing": cases[-1:]}))


@pytest.fixture(scope="module")
def volume_federation(tmp_path_factory, data_root):
    """``(data root, task declaration, slim plan)``: the plan made from the two sites' federated fingerprint."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    root = tmp_path_factory.mktemp("vol3d")
    fps = {}
    for center, n in SITES.items():
        site_dir = root / NAME / center
        cases = nnunet_sites.prostate_site(Path(data_root), center, site_dir, max_cases=n)
        _split(site_dir, sorted(cases))
    pooled = sum(SITES.values())
    for center in SITES:
        site_dir = root / NAME / center
        files = [([p], site_dir / "labelsTr" / p.name.replace("_0000", ""))
                 for p in sorted((site_dir / "imagesTr").iterdir())]
        fps[center] = fpl.site_fingerprint(files, SimpleITKIO, fpl.samples_per_case(pooled, 5e4), center)
    task = nnunet_sites.task_declaration(NAME, list(SITES))
    plans = fpl.plan_from_fingerprint(task, fpl.merge_fingerprints(fps), "SimpleITKIO")
    return root, task, fpl.slim_plan_3d(plans)


@pytest.fixture(scope="module")
def one_round_model(volume_federation, tmp_path_factory):
    """A 3D job's model after one local round at BMC (1 iteration, in-process), saved as FLARE's persistor saves it;
    the tests that predict with it copy it into their own folder (a review rule is stored beside the model file)."""
    import torch
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from feduq.site.site3d import Site3D

    root, task, slim = volume_federation
    folder = tmp_path_factory.mktemp("one_round_3d")
    site = Site3D(slim, iterations=1, task=task, num_threads=1, device="cpu", amp=False)
    site.start("BMC", {"data_root": str(root)}, folder / "site")
    out = site.train(FLModel(params=site.trainer.get_params(), params_type=ParamsType.FULL, current_round=0,
                             total_rounds=1))
    torch.save({"model": {k: torch.as_tensor(v) for k, v in out.params.items()}}, folder / "model.pt")
    return folder / "model.pt"


def test_the_slim_plan_is_the_federated_plan_made_small(volume_federation):
    _, _, slim = volume_federation
    cfg = slim["configurations"]["3d_fullres"]
    arch = cfg["architecture"]["arch_kwargs"]
    assert arch["n_stages"] == 4 and arch["features_per_stage"] == [8, 16, 32, 64] and cfg["batch_size"] == 2
    stride = np.prod(np.asarray(arch["strides"]), axis=0)
    assert all(p % s == 0 and p <= m for p, s, m in zip(cfg["patch_size"], stride, (32, 64, 64)))
    assert all(m <= lim + 1e-6 for m, lim in zip(cfg["median_image_size_in_voxels"], (32, 96, 96)))
    assert slim["plans_name"].endswith("_slim")


def test_fedavg_trains_one_3d_round_and_tests_each_case_in_mm(volume_federation, tmp_path):
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from feduq.common.wire import FedUQMetaKey
    from feduq.site.site3d import Site3D

    root, task, slim = volume_federation
    lines = []
    site = Site3D(slim, iterations=2, task=task, num_threads=1, device="cpu", amp=False)
    site.log = lines.append
    site.start("RUNMC", {"data_root": str(root)}, tmp_path)
    assert site.ready() and site.batch_size == 2
    assert any("train/val/test = 2/1/1 cases" in m and "3d_fullres" in m for m in lines), lines
    assert any("2 iterations a local epoch x 2 local epochs = 4 steps a round" in m for m in lines), lines
    used = json.loads((tmp_path / "split_used.json").read_text())  # the run's own split, at the site
    cases = sorted(p.name[:-len("_0000.nii.gz")] for p in (root / NAME / "RUNMC" / "imagesTr").iterdir())
    assert (used["training"], used["validation"], used["testing"]) == (cases[:2], cases[2:3], cases[3:])
    init = site.trainer.get_params()
    out = site.train(FLModel(params={k: v.copy() for k, v in init.items()}, params_type=ParamsType.FULL,
                             current_round=0, total_rounds=4))
    assert all(np.isfinite(np.asarray(v)).all() for v in out.params.values())
    assert any(not np.array_equal(np.asarray(out.params[k]), init[k]) for k in out.params)
    assert out.meta[FedUQMetaKey.NUM_SAMPLES] == 2  # the aggregation weight: training cases
    (train,) = [json.loads(m.split(" ", 1)[1]) for m in lines if m.startswith("FEDUQ_TRAIN ")]
    assert train["steps"] == 4  # what the first line said: iterations x local epochs
    # nnU-Net's poly schedule over the job's 4 rounds: after round 0, lr = 0.01 (1 - 1/4)^0.9
    assert site.trainer.optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * 0.75 ** 0.9)
    tested = site.test(FLModel(params=out.params, params_type=ParamsType.FULL))
    m = tested.metrics
    assert m["num_cases"] == 1 and 0.0 <= m["dice"] <= 1.0 and m["hd95_mm"] >= 0.0
    assert {"dice_PZ", "dice_TZ", "hd95_mm_PZ", "hd95_mm_TZ"} <= set(m)
    rows = (tmp_path / "per_case_test.csv").read_text().splitlines()
    assert len(rows) == 2 and "volume_ml_PZ" in rows[0]


METHODS_3D = ("fedprox", "fedbn", "fedavgm", "fedper", "fedevi", "feduaa", "graphfedseg")


@pytest.mark.parametrize("method", METHODS_3D)
def test_every_other_method_trains_one_local_3d_round(volume_federation, method, tmp_path):
    """Each listed method's site part on the 3D network, one local round off FLARE: finite weights that moved, the
    method's statistics beside them, and its local entries kept home."""
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from feduq.common.wire import FedUQMetaKey
    from feduq.registry import method_site_part, spec_of
    from feduq.site.site3d import Site3D

    root, task, slim = volume_federation
    spec = spec_of(method)
    site = Site3D(slim, iterations=1, task=task, num_threads=1, device="cpu", amp=False,
                  method=method_site_part(method)(**spec.site_args))
    site.start("BMC", {"data_root": str(root)}, tmp_path)
    init = site.trainer.get_params()
    out = site.train(FLModel(params={k: v.copy() for k, v in init.items()}, params_type=ParamsType.FULL,
                             current_round=0, total_rounds=2))
    assert all(np.isfinite(np.asarray(v)).all() for v in out.params.values())
    assert any(not np.array_equal(np.asarray(out.params[k]), init[k]) for k in out.params)
    local = set(init) - set(out.params)  # what never left the site
    if method == "fedbn":  # nnU-Net's instance norm affine parameters
        assert local and all(".norm." in k for k in local), sorted(local)[:4]
    elif method == "feduaa":  # every deep-supervision head
        assert local == {k for k in init if k.startswith("net.decoder.seg_layers.")}
    elif method == "fedper":  # its personal layers: the last (the full-resolution head) by default
        last = len(slim["configurations"]["3d_fullres"]["architecture"]["arch_kwargs"]["strides"]) - 2
        assert local == {k for k in init if k.startswith(f"net.decoder.seg_layers.{last}.")}
    elif method == "fedevi":
        assert local == set() and {FedUQMetaKey.NUM_VAL_SAMPLES} <= set(out.meta)
    else:
        assert local == set()


@pytest.mark.sim
@pytest.mark.parametrize("method", ["fedavg", "fedevi"])
def test_a_3d_job_runs_in_flares_simulator_with_per_case_dice_and_hd95_in_mm(volume_federation, method, tmp_path):
    """The job configured with ``configuration="3d_fullres"`` and the slim federated plan (carried in the job), one
    round of 2 iterations per site in FLARE's simulator: the per-client table holds Dice and HD95 in mm per structure,
    each site keeps its per-case file, and the server's model is the sites' planned network."""
    import csv

    from conftest import small_job
    from feduq.recipes.simulation import simulate

    root, task, slim = volume_federation
    job = small_job(method, tmp_path / "job", task=task, sites=list(SITES), configuration="3d_fullres", plans=slim,
                    num_rounds=1, executor_args={"iterations": 2})
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    model = next(c for c in server["components"] if c["id"] == "persistor")["args"]["model"]
    assert model["path"] == "feduq.nnunet.planned.PlannedNetwork" and model["args"]["plans"] == slim
    outcome = simulate(job, tmp_path / "ws", root, echo=lambda s: None)
    assert outcome.ok, outcome.summary()
    rows = {r["client"]: r for r in csv.DictReader(open(outcome.table))}
    assert set(SITES) <= set(rows)
    for site in SITES:
        assert 0.0 <= float(rows[site]["dice"]) <= 1.0 and float(rows[site]["hd95_mm"]) > 0
        assert rows[site]["dice_TZ"] and rows[site]["hd95_mm_PZ"]
        (per_case,) = (tmp_path / "ws" / site).rglob("per_case_test.csv")
        assert len(per_case.read_text().splitlines()) == 2  # one test case, its header
    if method == "fedavg":  # feduq evaluate scores the global model as the sites' test task does: whole volumes
        from feduq.site.evaluation import evaluate_job

        per_site, result = evaluate_job(tmp_path / "ws", out=tmp_path / "ev", sites=["BMC"], data_root=root,
                                        split="test", maps=1, save_predictions=True)
        (row,) = per_site
        assert row["n_cases"] == 1 and row["dice"] == pytest.approx(float(rows["BMC"]["dice"]), abs=1e-6)
        assert row["hd95_mm"] == pytest.approx(float(rows["BMC"]["hd95_mm"]), abs=1e-4)
        assert row["ece_monai"] == pytest.approx(float(rows["BMC"]["ece"]), abs=1e-5)  # on the preprocessed grid
        (case,) = result["BMC"]["per_image"]  # every structure's own numbers, as the site's table gives them
        assert case["hd95_mm_PZ"] == pytest.approx(float(rows["BMC"]["hd95_mm_PZ"]), abs=1e-4)
        assert case["dice_TZ"] == pytest.approx(float(rows["BMC"]["dice_TZ"]), abs=1e-6)
        assert len(list((tmp_path / "ev" / "predictions" / "BMC").glob("*.nii.gz"))) == 1


def test_a_3d_job_that_cannot_run_is_refused_in_one_line(volume_federation, tmp_path):
    from conftest import small_job
    from feduq.jobs.jobcheck import JobConfigError

    root, task, slim = volume_federation

    def refused(method="fedavg", **kw):
        kw.setdefault("task", task)
        kw.setdefault("sites", list(SITES))
        with pytest.raises(JobConfigError) as e:
            small_job(method, tmp_path / f"job{len(list(tmp_path.iterdir()))}", configuration="3d_fullres", **kw)
        assert "\n" not in str(e.value)
        return str(e.value)

    assert "cannot train with configuration '3d_fullres': its noise estimate scores 2D" in refused("feda3i", plans=slim)
    assert "task 'polyp' holds 2D images" in refused(task="polyp", sites=["Kvasir-SEG"], plans=slim)
    assert "needs the federation's nnU-Net plans: give --plans FILE" in refused()
    assert "no '3d_fullres' configuration (it has ['2d'])" in refused(plans="ct_2d_slim")
    two = json.loads(json.dumps(slim))
    two["configurations"]["3d_fullres"]["normalization_schemes"] *= 2
    assert "were made for 2 channel(s)" in refused(plans=two) and "has 1: ['T2']" in refused(plans=two)
    assert "DP-SGD is not built for configuration '3d_fullres'" in refused(
        plans=slim, executor_args={"dp": {"epsilon": 10.0, "max_grad_norm": 1.0}})


def test_predict_and_the_bundle_write_the_label_and_uncertainty_volumes_on_the_inputs_grid(volume_federation,
                                                                                           one_round_model, tmp_path,
                                                                                           monkeypatch):
    """A 3D job's model (one local round in-process) predicts a held-back volume: ``<case>.nii.gz`` as nnU-Net writes
    it and the method's uncertainty volume, both in the input's shape and affine; its row gives each zone in mL (the
    voxel count times the input's voxel volume). The exported MONAI Bundle, run by MONAI's own runner in an
    interpreter where FedUQ cannot be imported, writes the same label volume exactly."""
    import csv
    import shutil

    import nibabel as nib

    from conftest import small_job
    from feduq.commands.site.predict import main as predict

    root, task, slim = volume_federation
    shutil.copy(one_round_model, tmp_path / "model.pt")
    job_fedavg = small_job("fedavg", tmp_path / "job_fedavg", task=task, sites=list(SITES),
                           configuration="3d_fullres", plans=slim)
    case = sorted((root / NAME / "BMC" / "imagesTr").iterdir())[-1]
    for folder in ("in", "in_all"):
        (tmp_path / folder).mkdir()
        shutil.copy(case, tmp_path / folder / case.name)
    # the same volume as a DICOM series (the NIfTI's LPS voxel order, spacing and origin): a case of its own
    from feduq.io.volumes import read_volume
    from helpers import write_dicom_series

    vol = read_volume(case)
    write_dicom_series(vol.lps, tmp_path / "in_all" / "series01", spacing=vol.spacing, origin=(0.0, 0.0, 0.0))
    # the review rule chosen on BMC's test split (that same case, scored whole in 3D), then applied by predict; the
    # calibration's scored cases kept to compare with predict's row
    import feduq.review.calibration as calibration

    scored, labelled_cases = [], calibration.labelled_cases
    monkeypatch.setattr(calibration, "labelled_cases", lambda *a, **k: scored.append(labelled_cases(*a, **k))
                        or scored[-1])
    assert predict(["--job", str(job_fedavg), "--model", str(tmp_path / "model.pt"), "--calibrate", "--site", "BMC",
                    "--split", "test", "--data-root", str(root), "--uncertified", "--target-dice", "0.01"]) == 0
    assert (tmp_path / "model.pt.review.json").is_file()
    _with_a_familiarity_part(scored, tmp_path / "model.pt")
    assert predict(["--job", str(job_fedavg), "--model", str(tmp_path / "model.pt"), "--input",
                    str(tmp_path / "in_all"), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    name = case.name.replace("_0000.nii.gz", "")
    given, label = nib.load(str(case)), nib.load(str(tmp_path / "out" / f"{name}.nii.gz"))
    _the_series_gives_the_same_label_and_its_dicom_seg(tmp_path / "in_all" / "series01", tmp_path / "out", label)
    assert label.shape == given.shape and np.allclose(label.affine, given.affine, atol=1e-4)
    assert set(np.unique(np.asarray(label.dataobj)).tolist()) <= {0, 1, 2}
    (u,) = (tmp_path / "out" / name).glob("uncertainty_*.nii.gz")
    u_name = u.name[len("uncertainty_"):-len(".nii.gz")]
    u = nib.load(str(u))
    assert u.shape == given.shape and np.allclose(u.affine, given.affine, atol=1e-4)
    assert np.isfinite(np.asarray(u.dataobj)).all() and float(np.asarray(u.dataobj).max()) > 0
    row, _ = csv.DictReader(open(tmp_path / "out" / "predictions.csv"))
    _calibration_scores_are_predicts(scored, tmp_path / "model.pt", row)
    voxel_ml = float(np.prod(given.header.get_zooms()[:3])) / 1000
    lab = np.asarray(label.dataobj)
    from scipy import ndimage

    for zone in (1, 2):  # the job's keep_largest_component: one piece per zone (a one-round model predicts many)
        assert ndimage.label(lab == zone, structure=np.ones((3, 3, 3)))[1] <= 1, zone
    assert float(row["ml_PZ"]) == pytest.approx((lab == 1).sum() * voxel_ml, rel=1e-4)
    assert float(row["ml_TZ"]) == pytest.approx((lab == 2).sum() * voxel_ml, rel=1e-4)
    assert row["shape"] == " x ".join(map(str, given.shape))  # nibabel's (x, y, z), not nnU-Net's array order
    # NIfTI inputs only, every output asked: no PNG scales, no SEG and no overlay listed, and the overlay said
    assert predict(["--job", str(job_fedavg), "--model", str(tmp_path / "model.pt"), "--input", str(tmp_path / "in"),
                    "--out", str(tmp_path / "out_all"), "--outputs", "all", "--no-progress"]) == 0
    scales = json.loads((tmp_path / "out_all" / "scales.json").read_text())
    assert "png16" not in scales and "scales" not in scales
    assert "overlay" not in scales["outputs"] and "dicom_seg" not in scales["outputs"] and "probability" in scales[
        "outputs"]
    assert not list((tmp_path / "out_all").rglob("*.png"))
    # the MONAI Bundle under MONAI's runner (nnU-Net, MONAI and SimpleITK only): predict's label volume exactly
    from helpers import run_bundle

    assert predict(["--job", str(job_fedavg), "--model", str(tmp_path / "model.pt"), "--export-bundle",
                    str(tmp_path / "bundle")]) == 0
    (tmp_path / "bundle_out").mkdir()
    run_bundle(tmp_path / "bundle", tmp_path / "in", tmp_path / "bundle_out")
    bundled = nib.load(str(tmp_path / "bundle_out" / f"{name}.nii.gz"))
    assert np.array_equal(np.asarray(bundled.dataobj), lab) and np.allclose(bundled.affine, given.affine, atol=1e-4)
    ub = np.asarray(nib.load(str(tmp_path / "bundle_out" / f"{name}_uncertainty_{u_name}.nii.gz")).dataobj)
    assert np.allclose(ub, np.asarray(u.dataobj), atol=1e-4)
    # the stored review rule travels in the bundle: its decision and reasons for the case are predict's
    decided = json.loads((tmp_path / "bundle_out" / f"{name}_review.json").read_text())
    assert (decided["review"], decided["review_reason"]) == (row["review"], row["review_reason"])
    assert decided["u_mean"] == pytest.approx(float(row["case_uncertainty"]), rel=1e-4)
    # the familiarity part: the bundle pools the volume's windows as predict does (models/features.ts)
    assert decided["familiarity_distance"] == pytest.approx(float(row["familiarity_distance"]), rel=1e-4, abs=1e-6)


def _with_a_familiarity_part(scored, model) -> None:
    """The stored rule given a familiarity part fitted on the calibrated volume's features and ten nearby points
    (one volume is too few to fit one on), so that predict and the bundle apply it to the same volume."""
    from dataclasses import asdict

    from feduq.review.rule import Familiarity, load_threshold, save_threshold

    ((_, features, _, _),) = scored
    rule = load_threshold(model)
    rng = np.random.default_rng(0)
    spread = features[0] * (1 + 0.05 * rng.standard_normal((12, features.shape[1])))
    rule.familiarity = asdict(Familiarity.fit(spread))
    save_threshold(rule, model)


def _calibration_scores_are_predicts(scored, model, row) -> None:
    """The review rule is chosen on the scale predict applies it: the calibration's case scores of the held-back case
    (``feduq.site.evaluation_3d``) are predict's row for it, and predict's decision is the stored rule's."""
    from feduq.review.rule import load_threshold

    ((cases, features, _, rows),) = scored
    assert features.shape == (1, 64) and [r["image"] for r in rows] == [row["case"]]  # the slim plan's bottleneck
    for theirs, ours in (("u_mean", "case_uncertainty"), ("u_foreground", "u_foreground"),
                         ("u_boundary", "u_boundary"), ("area_fraction", "area_fraction")):
        assert float(cases[theirs][0]) == pytest.approx(float(row[ours]), rel=1e-6, abs=1e-9), theirs
    rule = load_threshold(model)
    # predict's features of the volume are the calibration's: its distance is the calibrated features' distance
    from feduq.review.rule import Familiarity

    assert float(row["familiarity_distance"]) == pytest.approx(
        float(Familiarity(**rule.familiarity).distance(features)[0]), rel=1e-6)
    reasons = rule.reasons({"u_mean": float(row["case_uncertainty"]),
                            **{k: float(row[k]) for k in ("u_foreground", "u_boundary", "area_fraction")}},
                           features[0])
    assert row["review"] == ("yes" if reasons else "no") and row["review_reason"] == "; ".join(reasons)


def _the_series_gives_the_same_label_and_its_dicom_seg(series: Path, out: Path, nifti_label) -> None:
    """A DICOM series input of a 3D job: its label volume (``series01.nii.gz``, the series' geometry) is the label
    of the same voxels given as NIfTI, and its DICOM Segmentation (read by highdicom) has one frame per instance,
    each referencing its instance, with the label's pixels."""
    import highdicom as hd
    import nibabel as nib
    import pydicom

    from_series = nib.load(str(out / "series01.nii.gz"))
    np.testing.assert_allclose(from_series.affine, nifti_label.affine, atol=1e-4)
    lab = np.asarray(from_series.dataobj)
    assert np.array_equal(lab, np.asarray(nifti_label.dataobj)) and lab.any()
    sources = sorted((pydicom.dcmread(p) for p in series.glob("*.dcm")), key=lambda d: float(d.ImagePositionPatient[2]))
    seg = hd.seg.segread(out / "series01" / "segmentation.dcm")
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["PZ", "TZ"]
    z_of = {d.SOPInstanceUID: z for z, d in enumerate(sources)}
    pixels = pydicom.dcmread(out / "series01" / "segmentation.dcm").pixel_array  # [frame, row, col], binary
    seen = {}
    for frame, group in zip(pixels, seg.PerFrameFunctionalGroupsSequence):
        z = z_of[group.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID]
        segment = int(group.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
        seen[(z, segment)] = True
        np.testing.assert_array_equal(frame, (lab[:, :, z] == segment).T)
    assert set(seen) == {(z, k) for z in range(lab.shape[2]) for k in (1, 2)}  # every instance, both segments


def test_a_site_annotating_one_zone_trains_3d_with_the_marginal_loss(volume_federation, tmp_path, data_root):
    """A third site that labels only the transition zone (its own value 2 named TZ): read by name as the task's TZ,
    the peripheral zone merged into its background group, FedAvg's loss marginalised (not nnU-Net's plain Dice + CE),
    and its test scored on TZ only."""
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from feduq.site.site3d import Site3D

    _, task, slim = volume_federation
    root = tmp_path / "data"
    name = "Dataset995_ProstateTZOnly"  # a task of its own: one name, one declaration
    site_dir = root / name / "TZ-only"
    cases = sorted(nnunet_sites.prostate_site(Path(data_root), "BMC", site_dir, max_cases=3,
                                              labels={"background": 0, "TZ": 2}, keep=[2]))
    _split(site_dir, cases)
    task = {**task, "name": name, "feduq": {**task["feduq"], "sites": ["TZ-only"]}}
    lines = []
    site = Site3D(slim, iterations=1, task=task, num_threads=1, device="cpu", amp=False)
    site.log = lines.append
    site.start("TZ-only", {"data_root": str(root)}, tmp_path / "run")
    assert any("partial labels: annotates ['TZ']" in m for m in lines), lines
    assert site.annotated == ((0, 1), (2,))
    init = site.trainer.get_params()
    out = site.train(FLModel(params=init, params_type=ParamsType.FULL, current_round=0, total_rounds=1))
    assert all(np.isfinite(np.asarray(v)).all() for v in out.params.values())
    m = site.test(FLModel(params=out.params, params_type=ParamsType.FULL)).metrics
    assert "dice_PZ" not in m and m["num_cases"] == 1


def test_the_site_acceptance_report_runs_on_a_3d_job_with_and_without_a_stored_rule(volume_federation, one_round_model,
                                                                                    tmp_path):
    """The report of a 3D job's model on a site's held-back volume: its worst-case pictures come from the 3D network
    (the volume predicted whole, cut at the largest reference slice), and a stored rule without a familiarity term
    decides each case (were a TypeError and a conv3d shape error)."""
    import csv
    import shutil

    from PIL import Image

    from conftest import small_job
    from feduq.commands.site.predict import main as predict

    root, task, slim = volume_federation
    model = tmp_path / "model.pt"
    shutil.copy(one_round_model, model)
    job = small_job("fedavg", tmp_path / "job", task=task, sites=list(SITES), configuration="3d_fullres", plans=slim)
    where = ["--site", "BMC", "--split", "test", "--data-root", str(root)]
    for rule in (False, True):
        if rule:
            assert predict(["--job", str(job), "--model", str(model), "--calibrate", *where, "--uncertified",
                            "--target-dice", "0.01"]) == 0
        report = tmp_path / f"report_{rule}"
        assert predict(["--job", str(job), "--model", str(model), "--report", *where, "--out", str(report)]) == 0
        page = (report / "report.html").read_text()
        rows = list(csv.DictReader(open(report / "cases.csv")))
        assert len(rows) == 1 and rows[0]["site"] == "BMC"
        assert (rows[0]["review"] in ("yes", "no")) == rule  # decided by the stored rule, blank without one
        pictures = sorted(report.glob("worst_*.png"))
        assert pictures and all(p.name in page for p in pictures)
        with Image.open(pictures[0]) as im:
            w, h = im.size
        assert w > 2 * h - 10 and h > 16  # the slice beside its uncertainty map, at the volume's in-plane size


# ---- the review rule's familiarity part for the 3D network (the module's sites and plan, shared)
def _network(slim):
    from feduq.nnunet.planned import PlannedNetwork

    return PlannedNetwork(slim, "3d_fullres", 1, 3, init_seed=3).eval()


def test_a_volumes_features_are_the_mean_of_its_windows_bottleneck(volume_federation):
    """Against nnU-Net's own window steps and the encoder's last stage taken by hand, on a volume larger than the
    patch along two axes and smaller along the third (zero-padded evenly, as MONAI's sliding window pads)."""
    from nnunetv2.inference.sliding_window_prediction import compute_steps_for_sliding_window

    from feduq.nnunet.volume_inference import volume_features

    _, _, slim = volume_federation
    net = _network(slim)
    patch = slim["configurations"]["3d_fullres"]["patch_size"]
    rng = np.random.default_rng(0)
    data = rng.normal(size=(1, patch[0] - 4, patch[1] + 21, patch[2] + 40)).astype(np.float32)
    got = volume_features(net.bottleneck, data, patch, torch.device("cpu"))
    padded = np.pad(data, ((0, 0), (2, 2), (0, 0), (0, 0)))
    steps = compute_steps_for_sliding_window(padded.shape[1:], patch, 0.5)
    assert [len(s) for s in steps] == [1, 2, 3]
    pooled = []
    with torch.no_grad():
        for z in steps[0]:
            for y in steps[1]:
                for x in steps[2]:
                    w = torch.from_numpy(padded[None, :, z:z + patch[0], y:y + patch[1], x:x + patch[2]].copy())
                    deepest = net.net.encoder(w)[-1]
                    assert deepest.shape[1] == 64  # the slim plan's last stage
                    pooled.append(deepest.mean(dim=(2, 3, 4))[0].double().numpy())
    assert got.shape == (64,) and got.dtype == np.float64
    assert np.allclose(got, np.mean(pooled, axis=0), rtol=1e-5, atol=1e-6)
    assert np.abs(np.std(pooled, axis=0)).max() > 1e-3  # the windows differ: the mean is not any one window's


def test_a_blank_volume_lies_beyond_the_threshold_and_a_held_out_real_one_within(volume_federation, tmp_path,
                                                                                data_root):
    """Familiarity fitted on ten real RUNMC volumes' features (a seeded, untrained network: what it measures is the
    input, not what a model learned): another RUNMC volume lies within the threshold; the same volume blanked (one
    intensity, as a failed acquisition or a wrongly scaled export reads after nnU-Net's z-score) lies far beyond it.
    Whether a trained model's features tell a new scanner apart is the held-out-site measurement's question, not a
    unit test's."""
    import SimpleITK as sitk

    import nnunet_sites
    from feduq.data import get_task
    from feduq.review.rule import Familiarity
    from feduq.nnunet.volume_inference import volume_features
    from feduq.site.site3d import Site3D

    _, task, slim = volume_federation
    site_dir = tmp_path / NAME / "RUNMC"
    nnunet_sites.prostate_site(Path(data_root), "RUNMC", site_dir, max_cases=11)
    net = _network(slim)
    site = Site3D(slim, iterations=1, task=task, num_threads=1, device="cpu", amp=False)
    pipe = site.make_pipeline(get_task(site.task_name))

    def features(path):
        data, _, _ = pipe.preprocess_files([path], None)
        return volume_features(net.bottleneck, data, pipe.patch_size, torch.device("cpu"))

    images = sorted((site_dir / "imagesTr").iterdir())
    rule = Familiarity.fit(np.stack([features(p) for p in images[:10]]))
    held_out = rule.distance(features(images[10])[None])[0]
    assert held_out <= rule.threshold, (held_out, rule.threshold)
    real = sitk.ReadImage(str(images[10]))
    blank = sitk.GetImageFromArray(np.full(sitk.GetArrayFromImage(real).shape, 100.0, np.float32))
    blank.CopyInformation(real)
    sitk.WriteImage(blank, str(tmp_path / "blank_0000.nii.gz"))
    d = rule.distance(features(tmp_path / "blank_0000.nii.gz")[None])[0]
    assert d > 5 * rule.threshold, (d, rule.threshold)
