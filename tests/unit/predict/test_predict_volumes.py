"""feduq.predict on volumes: NIfTI (an oblique affine), a CT volume through the multi-head 2D plan, DICOM series (the
label map in the series' geometry, a DICOM SEG read back by highdicom and pydicom).

Each output is checked against the input's own geometry and against predict's 2D path on the same slices.
"""

import csv
import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import small_job
from helpers import prostate_case, write_dicom_series
from helpers import light_model, read_png


def oblique_volume(lps, voxel=(0.6, 0.6, 3.0), degrees=12.0):
    """An LPS array stored in RAS voxel order with an oblique affine (rotated about the scanner axis)."""
    import nibabel as nib

    a = np.radians(degrees)
    rot = np.array([[np.cos(a), -np.sin(a), 0], [np.sin(a), np.cos(a), 0], [0, 0, 1]])
    affine_lps = np.eye(4)
    affine_lps[:3, :3] = np.diag([-1.0, -1.0, 1.0]) @ rot @ np.diag(voxel)  # L -> -x (RAS), P -> -y
    affine_lps[:3, 3] = [12.0, -30.0, 5.0]
    img = nib.Nifti1Image(lps, affine_lps)
    ras = nib.orientations.ornt_transform(nib.orientations.io_orientation(affine_lps),
                                          nib.orientations.axcodes2ornt(("R", "A", "S")))
    return img.as_reoriented(ras)


def test_nifti_volume_keeps_its_shape_and_oblique_affine_and_slices_equal_2d_prediction(tmp_path, data_root):
    import nibabel as nib

    from feduq.commands.site.predict import main as predict
    from feduq.io.volumes import normalise_volume

    job, model, lps = prostate_case(tmp_path, data_root)
    img = oblique_volume(lps)
    volumes = tmp_path / "volumes"
    volumes.mkdir()
    nib.save(img, volumes / "Case00.nii.gz")
    assert predict(["--job", str(job), "--model", str(model), "--input", str(volumes), "--out", str(tmp_path / "pred"),
                    "--no-progress", "--outputs", "label,uncertainty,probability"]) == 0
    out = nib.load(tmp_path / "pred" / "Case00" / "label.nii.gz")
    assert out.shape == img.shape and out.get_data_dtype() == np.uint8
    np.testing.assert_allclose(out.affine, img.affine, atol=1e-5)
    for name in ("probability", "uncertainty_total"):
        other = nib.load(tmp_path / "pred" / "Case00" / f"{name}.nii.gz")
        assert other.shape == img.shape and np.allclose(other.affine, img.affine, atol=1e-5)
    # the same slices as 2D images (as FedUQ's MRI sites were made: the volume's percentile scaling, vol[:, :, z].T)
    planes = tmp_path / "planes"
    planes.mkdir()
    u8 = normalise_volume(lps)[0]
    for z in range(lps.shape[2]):
        Image.fromarray(np.ascontiguousarray(u8[:, :, z].T)).save(planes / f"z{z}.png")
    assert predict(["--job", str(job), "--model", str(model), "--input", str(planes), "--out", str(tmp_path / "p2d"),
                    "--no-progress"]) == 0
    back = nib.orientations.ornt_transform(nib.orientations.io_orientation(img.affine),
                                           nib.orientations.axcodes2ornt(("L", "P", "S")))
    label_lps = nib.orientations.apply_orientation(np.asanyarray(out.dataobj), back)
    for z in range(lps.shape[2]):
        np.testing.assert_array_equal(label_lps[:, :, z].T, read_png(tmp_path / "p2d" / f"z{z}" / "label.png"))
    assert label_lps.any() and not label_lps.all()
    row = next(csv.DictReader(open(tmp_path / "pred" / "predictions.csv")))
    assert row["kind"] == "volume" and int(row["foreground_px"]) == int((label_lps > 0).sum())
    assert float(row["foreground_ml"]) == pytest.approx(int(row["foreground_px"]) * 0.6 * 0.6 * 3.0 / 1000, rel=1e-5)


def multi_head_model(path, dropout=0.3, seed=0):
    """A seeded multi-head CT model in the form the CT server releases it (backbone + a kidney and a spleen head)."""
    from feduq.nnunet import pipeline as nc

    torch.manual_seed(seed)
    pipeline = nc.SitePipeline(nc.site_plans(nc.load_plans("ct_2d_slim"), "reference"), ["kidney"], dropout)
    net = pipeline.build_network()
    named = dict(net.named_parameters())
    params = {n: named[n].detach().clone() for n in nc.backbone_names(net)}
    last = net.decoder.seg_layers[-1]
    for site, organs in (("KiTS19", ["kidney"]), ("MSD-Task09-Spleen", ["spleen"])):
        params[f"head::{site}::weight"] = torch.randn(len(organs) + 1, *last.weight.shape[1:]) * 0.5
        params[f"head::{site}::bias"] = torch.tensor([0.5] + [0.0] * len(organs))
    torch.save({"params": params, "head_organs": {"KiTS19": ["kidney"], "MSD-Task09-Spleen": ["spleen"]}}, path)
    return path


def test_ct_volume_and_slice_through_the_2d_plan_give_one_label_map_with_the_organ_names(tmp_path, data_root):
    """A real CT volume (HU, RAS, 3 mm) and a real 8-bit CT slice through a FUNAvg multi-head model: the label map keeps
    the input's shape and affine, its values are the global organ ids named in scales.json, the CSV gives mL per organ."""
    import nibabel as nib

    from feduq.commands.site.predict import main as predict

    job = small_job("funavg", tmp_path / "job", sites=["KiTS19", "MSD-Task09-Spleen"], image_size=None,
                    local_epochs=None, max_items=3, executor_args={"plans": "ct_2d_slim", "inference_samples": 2,
                                                                   "device": "cpu"})
    model = multi_head_model(tmp_path / "multi_head_model.pt")
    source = nib.load(data_root / "abdominal_ct" / "TotalSegmentator-example_volume" / "example_ct_sm.nii.gz")
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    nib.save(source.slicer[:, :, 12:15], inputs / "abdomen.nii.gz")  # 3 slices of 122 x 101 at 3 mm
    shutil.copy(data_root / "abdominal_ct" / "KiTS19" / "images" / "10036_103.png", inputs / "kits_slice.png")
    assert predict(["--job", str(job), "--model", str(model), "--input", str(inputs), "--out", str(tmp_path / "pred"),
                    "--no-progress"]) == 0
    scales = json.loads((tmp_path / "pred" / "scales.json").read_text())
    assert scales["label"] == {"0": "background", "1": "liver", "2": "kidney", "3": "spleen", "4": "pancreas"}
    assert scales["organs_predicted"] == ["kidney", "spleen"]
    image = nib.load(inputs / "abdomen.nii.gz")
    label = nib.load(tmp_path / "pred" / "abdomen" / "label.nii.gz")
    assert label.shape == image.shape == (122, 101, 3)
    np.testing.assert_allclose(label.affine, image.affine, atol=1e-5)
    values = np.asanyarray(label.dataobj)
    assert set(np.unique(values)) <= {0, 2, 3} and (values > 0).any() and (values == 0).any()
    u = np.asanyarray(nib.load(tmp_path / "pred" / "abdomen" / "uncertainty_total.nii.gz").dataobj)
    assert u.shape == image.shape and 0 <= u.min() and u.max() < 1 and u.max() > 0
    rows = {r["case"]: r for r in csv.DictReader(open(tmp_path / "pred" / "predictions.csv"))}
    for organ, gid in (("kidney", 2), ("spleen", 3)):
        assert int(rows["abdomen"][f"px_{organ}"]) == int((values == gid).sum())
        assert float(rows["abdomen"][f"ml_{organ}"]) == pytest.approx((values == gid).sum() * 27 / 1000)
    slice_label = read_png(tmp_path / "pred" / "kits_slice" / "label.png")
    assert slice_label.shape == read_png(inputs / "kits_slice.png").shape
    assert set(np.unique(slice_label)) <= {0, 2, 3}


def test_dicom_series_gives_the_label_map_of_the_same_volume_in_the_series_geometry(tmp_path, data_root):
    import nibabel as nib

    from feduq.commands.site.predict import main as predict

    job, model, lps = prostate_case(tmp_path, data_root)
    inputs = tmp_path / "inputs"
    inputs.mkdir()
    write_dicom_series(lps, inputs / "Case00_dicom")
    affine = np.diag([-0.6, -0.6, 3.0, 1.0])  # the same voxels as NIfTI: LPS axes, RAS world
    affine[:3, 3] = [20.0, -15.0, 7.5]
    nib.save(nib.Nifti1Image(lps, affine), inputs / "Case00_nifti.nii.gz")
    assert predict(["--job", str(job), "--model", str(model), "--input", str(inputs), "--out", str(tmp_path / "pred"),
                    "--no-progress"]) == 0
    from_dicom = nib.load(tmp_path / "pred" / "Case00_dicom" / "label.nii.gz")
    from_nifti = nib.load(tmp_path / "pred" / "Case00_nifti" / "label.nii.gz")
    np.testing.assert_allclose(from_dicom.affine, affine, atol=1e-4)  # the series' origin, spacing and direction
    assert from_dicom.shape == lps.shape
    np.testing.assert_array_equal(np.asanyarray(from_dicom.dataobj), np.asanyarray(from_nifti.dataobj))
    assert np.asanyarray(from_dicom.dataobj).any()
    assert not (tmp_path / "pred" / "Case00_nifti" / "segmentation.dcm").exists()  # a SEG only for a DICOM series


def test_dicom_series_gives_a_dicom_seg_that_references_its_instances_with_the_label_maps_pixels(tmp_path, data_root):
    """Issue 52 item 5: read back with highdicom and pydicom, the SEG's frames are the source slices (SOP instance
    UIDs, positions), its pixels the NIfTI label map, its segment the task's label with SNOMED CT's prostate code and
    the algorithm FedUQ's method."""
    import highdicom as hd
    import nibabel as nib
    import pydicom

    import feduq
    from feduq.commands.site.predict import main as predict

    job, model, lps = prostate_case(tmp_path, data_root)
    series = tmp_path / "inputs" / "Case00_dicom"
    series.parent.mkdir()
    write_dicom_series(lps, series)
    assert predict(["--job", str(job), "--model", str(model), "--input", str(series.parent), "--out",
                    str(tmp_path / "pred"), "--no-progress"]) == 0
    label = np.asanyarray(nib.load(tmp_path / "pred" / "Case00_dicom" / "label.nii.gz").dataobj)  # [x, y, z]
    assert label.any() and not label.all()
    sources = sorted((pydicom.dcmread(p) for p in series.glob("*.dcm")), key=lambda d: float(d.ImagePositionPatient[2]))
    seg = hd.seg.segread(tmp_path / "pred" / "Case00_dicom" / "segmentation.dcm")
    assert seg.SOPClassUID == "1.2.840.10008.5.1.4.1.1.66.4"  # Segmentation Storage
    assert seg.StudyInstanceUID == sources[0].StudyInstanceUID and seg.FrameOfReferenceUID == sources[0].FrameOfReferenceUID
    assert seg.PatientID == "FEDUQ-TEST"
    (segment,) = seg.SegmentSequence
    assert segment.SegmentLabel == "prostate" and segment.SegmentedPropertyTypeCodeSequence[0].CodeValue == "41216001"
    assert segment.SegmentAlgorithmType == "AUTOMATIC"
    algorithm = segment.SegmentationAlgorithmIdentificationSequence[0]
    assert algorithm.AlgorithmName == "FedUQ FedAvg" and algorithm.AlgorithmVersion == feduq.__version__
    referenced = [i.ReferencedSOPInstanceUID for i in seg.ReferencedSeriesSequence[0].ReferencedInstanceSequence]
    assert sorted(referenced) == sorted(d.SOPInstanceUID for d in sources)
    z_of = {d.SOPInstanceUID: z for z, d in enumerate(sources)}
    frames = pydicom.dcmread(tmp_path / "pred" / "Case00_dicom" / "segmentation.dcm").pixel_array  # [frame, row, col]
    assert frames.shape == (lps.shape[2], lps.shape[1], lps.shape[0])
    seen = []
    for frame, group in zip(frames, seg.PerFrameFunctionalGroupsSequence):
        uid = group.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID
        z = z_of[uid]
        seen.append(z)
        assert [float(v) for v in group.PlanePositionSequence[0].ImagePositionPatient] == pytest.approx(
            [float(v) for v in sources[z].ImagePositionPatient])
        np.testing.assert_array_equal(frame, label[:, :, z].T)
    assert sorted(seen) == list(range(lps.shape[2]))


def test_a_dicom_series_without_a_frame_of_reference_stops_predict_unless_the_seg_is_left_out(tmp_path, data_root,
                                                                                              capsys):
    from feduq.commands.site.predict import main as predict

    job, model, lps = prostate_case(tmp_path, data_root)
    series = tmp_path / "inputs" / "Case00_dicom"
    series.parent.mkdir()
    write_dicom_series(lps, series, frame_of_reference=False)
    args = ["--job", str(job), "--model", str(model), "--input", str(series.parent), "--no-progress"]
    capsys.readouterr()
    assert predict(args + ["--out", str(tmp_path / "pred")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "FrameOfReferenceUID" in err and "dicom_seg" in err, err
    assert not (tmp_path / "pred").exists()
    assert predict(args + ["--out", str(tmp_path / "pred2"), "--outputs", "label,uncertainty"]) == 0
    assert (tmp_path / "pred2" / "Case00_dicom" / "label.nii.gz").is_file()
    assert not (tmp_path / "pred2" / "Case00_dicom" / "segmentation.dcm").exists()


def test_a_declared_volume_task_takes_dicom_series_beside_nnunet_named_files(tmp_path, data_root, capsys):
    """A declared one-channel volume task (slice-wise 2D job) predicts a DICOM series folder as a case: its label
    file ``<folder>.nii.gz`` in the series' geometry is the label of the same voxels given as ``<case>_0000.nii.gz``,
    and its DICOM Segmentation's frames carry that label. A series for a two-channel task, or a series and files of
    one case name, are refused in one line before anything is written."""
    import highdicom as hd
    import nibabel as nib
    import pydicom

    import nnunet_sites
    from feduq.core.networks import build_network
    from feduq.commands.site.predict import main as predict

    task = nnunet_sites.task_declaration("Dataset961_SeriesIn", ["A", "B"])
    job = small_job("fedavg", tmp_path / "job", task=task, sites=["A", "B"], network="light", image_size=64)
    torch.save({"model": build_network("light", 1, 3, init_seed=1).state_dict()}, tmp_path / "model.pt")
    nnunet_sites.prostate_site(data_root, "RUNMC", tmp_path / "src", max_cases=1)
    (case,) = sorted((tmp_path / "src" / "imagesTr").iterdir())
    inputs = tmp_path / "in"
    inputs.mkdir()
    shutil.copy(case, inputs / "nifti_0000.nii.gz")
    vol = nib.load(case)
    lps = np.asarray(vol.dataobj)  # stored in LPS voxel order (affine diag(-sx, -sy, sz)), origin 0
    write_dicom_series(lps, inputs / "series", spacing=tuple(float(z) for z in vol.header.get_zooms()),
                       origin=(0.0, 0.0, 0.0))
    args = ["--job", str(job), "--model", str(tmp_path / "model.pt"), "--no-progress"]
    assert predict([*args, "--input", str(inputs), "--out", str(tmp_path / "pred")]) == 0
    from_nifti, from_series = (nib.load(tmp_path / "pred" / f"{n}.nii.gz") for n in ("nifti", "series"))
    np.testing.assert_allclose(from_series.affine, from_nifti.affine, atol=1e-4)
    label = np.asarray(from_series.dataobj)
    np.testing.assert_array_equal(label, np.asarray(from_nifti.dataobj))
    assert label.any()
    seg_file = tmp_path / "pred" / "series" / "segmentation.dcm"
    seg, pixels = hd.seg.segread(seg_file), pydicom.dcmread(seg_file).pixel_array
    instances = [pydicom.dcmread(p) for p in (inputs / "series").glob("*.dcm")]
    z_of = {d.SOPInstanceUID: round(float(d.ImagePositionPatient[2]) / vol.header.get_zooms()[2]) for d in instances}
    assert len(pixels) == 2 * lps.shape[2]  # a frame per instance and segment (PZ, TZ)
    for frame, group in zip(pixels, seg.PerFrameFunctionalGroupsSequence):
        z = z_of[group.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID]
        k = int(group.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
        np.testing.assert_array_equal(frame, (label[:, :, z] == k).T)
    assert not (tmp_path / "pred" / "nifti" / "segmentation.dcm").exists()

    shutil.copytree(inputs / "series", inputs / "nifti")
    capsys.readouterr()
    assert predict([*args, "--input", str(inputs), "--out", str(tmp_path / "twice")]) == 2
    assert not (tmp_path / "twice").exists()
    assert (f"input {inputs / 'nifti'}: case 'nifti' is given twice, as a DICOM series and as nifti_0000.nii.gz"
            in capsys.readouterr().err)
    from feduq.predict.declared_cases import find_declared_cases
    from feduq.data import job_task
    from feduq.predict.files import PredictError

    two = job_task(nnunet_sites.task_declaration("Dataset962_SeriesTwo", ["A", "B"], channels=("T2", "ADC")))
    with pytest.raises(PredictError) as e:
        find_declared_cases(inputs, two)
    assert str(e.value).startswith(f"input {inputs / 'nifti'}: a DICOM series is one volume of one channel; task "
                                   "'Dataset962_SeriesTwo' declares 2 channels ['T2', 'ADC']")
