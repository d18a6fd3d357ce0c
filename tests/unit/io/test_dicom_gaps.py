"""Issue 65 item 1: a DICOM series with a missing slice, unevenly spaced slices or a file that is not one of its
images is refused in one line naming the folder and the positions or the file (exit 2, nothing written), unless
``predict --resample-gaps`` resamples it onto an even grid over its true extent; an evenly spaced series is read as
before."""

import csv

import numpy as np
import pytest

from helpers import prostate_case, write_dicom_series


def linear_series(lps):
    """Five slices, each the first plus z times a fixed difference (int16): the middle slice is the mean of its two
    neighbours, so a linear interpolation of the others gives it back exactly."""
    base = lps[:, :, 0].astype(np.int32)
    diff = (lps[:, :, 2].astype(np.int32) - base) // 4
    return np.stack([base + z * diff for z in range(5)], axis=-1).astype(np.int16)


def run(job, model, inputs, out, *extra):
    from feduq.commands.site.predict import main as predict

    return predict(["--job", str(job), "--model", str(model), "--input", str(inputs), "--out", str(out),
                    "--no-progress", *extra])


def ml(out, case):
    with open(out / "predictions.csv", newline="") as f:
        (row,) = [r for r in csv.DictReader(f) if r["case"] == case]
    return float(row["foreground_ml"]), int(row["foreground_px"])


def test_a_series_missing_its_middle_slice_is_refused_naming_the_folder_and_the_gap(tmp_path, data_root, capsys):
    job, model, lps = prostate_case(tmp_path, data_root)
    series = tmp_path / "inputs" / "Case00_dicom"
    series.parent.mkdir()
    write_dicom_series(linear_series(lps), series)  # z = 7.5, 10.5, 13.5, 16.5, 19.5 mm
    (series / "slice002.dcm").unlink()
    capsys.readouterr()
    assert run(job, model, series.parent, tmp_path / "pred") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("feduq predict: error: ") and str(series) in err, err
    assert "3 mm apart but 6 mm between 10.5 mm (slice001.dcm) and 16.5 mm (slice003.dcm)" in err, err
    assert "1 slice missing" in err and "--resample-gaps" in err, err
    assert not (tmp_path / "pred").exists()


def test_unevenly_spaced_slices_are_refused_and_a_repeated_position_too(tmp_path):
    from feduq.io.volumes import VolumeError, read_volume

    lps = (np.arange(6 * 5 * 5).reshape(6, 5, 5) % 17).astype(np.int16)
    write_dicom_series(lps, tmp_path / "s")
    import pydicom

    ds = pydicom.dcmread(tmp_path / "s" / "slice002.dcm")
    ds.ImagePositionPatient = [-20.0, 15.0, 7.5 + 2 * 3.0 + 0.4]  # 3.4 mm then 2.6 mm: uneven, nothing missing
    ds.save_as(tmp_path / "s" / "slice002.dcm")
    with pytest.raises(VolumeError, match=r"3 mm apart but 3\.4 mm between 10\.5 mm \(slice001\.dcm\) and 13\.9 mm "
                                          r"\(slice002\.dcm\); 1 more uneven step; .* grid of its 3 mm spacing") as e:
        read_volume(tmp_path / "s")
    assert "missing" not in str(e.value) and "\n" not in str(e.value)
    # the grid is the series' own 3 mm spacing (the step most steps agree with), never its smallest step (2.6 mm)
    vol = read_volume(tmp_path / "s", resample_gaps=True)  # 12 mm in 4 steps of 3 mm, ends kept
    assert vol.shape == (6, 5, 5) and vol.spacing == pytest.approx((0.6, 0.6, 3.0))
    assert vol.source_slices == (0, 1, 2, 3, 4)  # 7.5, 10.5, 13.9 (13.5), 16.5, 19.5 mm
    np.testing.assert_array_equal(vol.lps[:, :, [0, 1, 3, 4]], lps[:, :, [0, 1, 3, 4]])  # on the grid: unchanged
    ds.ImagePositionPatient = [-20.0, 15.0, 10.5]
    ds.save_as(tmp_path / "s" / "slice002.dcm")
    with pytest.raises(VolumeError, match=r"slice001\.dcm and slice002\.dcm are both at 10\.5 mm"):
        read_volume(tmp_path / "s", resample_gaps=True)


def test_a_series_folder_with_a_file_that_is_not_dicom_is_refused_naming_the_file(tmp_path, data_root, capsys):
    job, model, lps = prostate_case(tmp_path, data_root)
    series = tmp_path / "inputs" / "Case00_dicom"
    series.parent.mkdir()
    write_dicom_series(lps, series)
    (series / "slice003.dcm").write_bytes(b"not a DICOM file, a damaged transfer\n")
    capsys.readouterr()
    for extra in ((), ("--resample-gaps",)):  # resampling does not make up for a file it cannot read
        assert run(job, model, series.parent, tmp_path / "pred", *extra) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"{series}: slice003.dcm is not a DICOM file" in err, err
        assert not (tmp_path / "pred").exists()


def test_resample_gaps_fills_the_missing_slice_on_the_true_grid_and_the_volume_is_the_complete_series(
        tmp_path, data_root, capsys):
    """The slices are linear in z, so the resampled series is the complete one: the same label map, affine and mL;
    ITK's even spread (4 slices 4 mm apart) would have given a third more per slice. The SEG references the 4
    instances, each frame the label map's slice at the instance's position."""
    import nibabel as nib
    import pydicom

    job, model, lps = prostate_case(tmp_path, data_root)
    lps = linear_series(lps)
    full, gap = tmp_path / "full" / "Case00_dicom", tmp_path / "gap" / "Case00_dicom"
    full.parent.mkdir()
    gap.parent.mkdir()
    write_dicom_series(lps, full)
    write_dicom_series(lps, gap)
    (gap / "slice002.dcm").unlink()
    assert run(job, model, full.parent, tmp_path / "pred_full") == 0
    capsys.readouterr()
    assert run(job, model, gap.parent, tmp_path / "pred_gap", "--resample-gaps") == 0
    note = [line for line in capsys.readouterr().out.splitlines() if "resampled" in line]
    assert note == [f"note: {gap}: 4 unevenly spaced slices resampled onto 5 slices 3 mm apart from 7.5 to 19.5 mm "
                    f"along the slice normal (--resample-gaps)"], note
    want = nib.load(tmp_path / "pred_full" / "Case00_dicom" / "label.nii.gz")
    got = nib.load(tmp_path / "pred_gap" / "Case00_dicom" / "label.nii.gz")
    assert got.shape == want.shape == lps.shape
    np.testing.assert_allclose(got.affine, want.affine, atol=1e-4)  # origin 7.5 mm, 3 mm slices
    np.testing.assert_allclose(got.header.get_zooms(), (0.6, 0.6, 3.0), atol=1e-5)
    label = np.asanyarray(got.dataobj)
    np.testing.assert_array_equal(label, np.asanyarray(want.dataobj))
    assert label.any() and label[:, :, 2].any()
    got_ml, got_px = ml(tmp_path / "pred_gap", "Case00_dicom")
    want_ml, want_px = ml(tmp_path / "pred_full", "Case00_dicom")
    assert got_px == want_px == int((label > 0).sum())
    assert got_ml == pytest.approx(want_ml) and got_ml == pytest.approx(got_px * 0.6 * 0.6 * 3.0 / 1000)
    kept = (label[:, :, [0, 1, 3, 4]] > 0).sum()  # what the even spread at 4 mm would have claimed
    assert got_ml != pytest.approx(kept * 0.6 * 0.6 * 4.0 / 1000)
    seg = pydicom.dcmread(tmp_path / "pred_gap" / "Case00_dicom" / "segmentation.dcm")
    assert seg.pixel_array.shape == (4, lps.shape[1], lps.shape[0])
    z_of = {pydicom.dcmread(p).SOPInstanceUID: z for p, z in zip(sorted(gap.glob("*.dcm")), (0, 1, 3, 4))}
    seen = []
    for frame, group in zip(seg.pixel_array, seg.PerFrameFunctionalGroupsSequence):  # each frame on its instance
        z = z_of[group.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID]
        assert float(group.PlanePositionSequence[0].ImagePositionPatient[2]) == pytest.approx(7.5 + 3.0 * z)
        np.testing.assert_array_equal(frame, label[:, :, z].T)
        seen.append(z)
    assert sorted(seen) == [0, 1, 3, 4]


def test_an_evenly_spaced_series_reads_unchanged_with_or_without_resample_gaps(tmp_path, data_root, capsys):
    import nibabel as nib

    from feduq.io.volumes import read_volume

    job, model, lps = prostate_case(tmp_path, data_root)
    series = tmp_path / "inputs" / "Case00_dicom"
    series.parent.mkdir()
    write_dicom_series(lps, series)
    (series / ".DS_Store").write_bytes(b"\0\1")  # hidden files are not the series' business
    for flag in (False, True):
        vol = read_volume(series, resample_gaps=flag)
        assert vol.lps.dtype == np.int16 and vol.source_slices == () and vol.resampled == ""
        np.testing.assert_array_equal(vol.lps, lps)
    capsys.readouterr()
    assert run(job, model, series.parent, tmp_path / "pred") == 0
    assert run(job, model, series.parent, tmp_path / "pred2", "--resample-gaps") == 0
    assert "resampled" not in capsys.readouterr().out
    a, b = (nib.load(tmp_path / p / "Case00_dicom" / "label.nii.gz") for p in ("pred", "pred2"))
    affine = np.diag([-0.6, -0.6, 3.0, 1.0])
    affine[:3, 3] = [20.0, -15.0, 7.5]
    np.testing.assert_allclose(a.affine, affine, atol=1e-4)
    np.testing.assert_allclose(b.affine, affine, atol=1e-4)
    np.testing.assert_array_equal(np.asanyarray(a.dataobj), np.asanyarray(b.dataobj))
    assert ml(tmp_path / "pred", "Case00_dicom") == ml(tmp_path / "pred2", "Case00_dicom")
    assert (tmp_path / "pred" / "Case00_dicom" / "segmentation.dcm").is_file()


@pytest.mark.parametrize("z, message", [
    # three slices 3 mm apart, then one at 2,500 mm: a wrong position, not a gap (it became 828 made-up slices)
    ((7.5, 10.5, 13.5, 2500.0), r"2486\.5 mm between 13\.5 mm \(slice002\.dcm\) and 2500 mm \(slice003\.dcm\) is "
                                r"828\.8 times the series' 3 mm spacing; --resample-gaps fills gaps of at most 4 steps"),
    # a 0.05 mm step then 900 mm: the grid was the smallest step (18,001 slices, run until killed)
    ((7.5, 7.55, 907.5), r"899\.95 mm between 7\.55 mm \(slice001\.dcm\) and 907\.5 mm \(slice002\.dcm\) is 1\.8e\+04 "
                         r"times the series' 0\.05 mm spacing"),
])
def test_an_impossible_resample_is_refused_in_one_line_before_any_pixel_is_read(tmp_path, z, message):
    """Issue 70 item 2: ``--resample-gaps`` refuses a gap wider than 4 of the series' steps, in one line naming the
    folder and the two instances (it exited 0 with a 5,735.6 mL volume, or ran until killed)."""
    import time

    import pydicom

    from feduq.io.volumes import MAX_GAP_STEPS, VolumeError, read_volume

    lps = (np.arange(6 * 5 * len(z)).reshape(6, 5, len(z)) % 17).astype(np.int16)
    write_dicom_series(lps, tmp_path / "s")
    for i, position in enumerate(z):
        ds = pydicom.dcmread(tmp_path / "s" / f"slice{i:03d}.dcm")
        ds.ImagePositionPatient = [-20.0, 15.0, position]
        ds.save_as(tmp_path / "s" / f"slice{i:03d}.dcm")
    t0 = time.perf_counter()
    with pytest.raises(VolumeError, match=message) as e:
        read_volume(tmp_path / "s", resample_gaps=True)
    assert time.perf_counter() - t0 < 5 and "\n" not in str(e.value) and str(tmp_path / "s") in str(e.value)
    assert MAX_GAP_STEPS == 4


def test_a_grid_of_more_slices_than_stated_is_refused():
    from pathlib import Path

    from feduq.io.volumes import MAX_RESAMPLED_SLICES, _resampling_refusal

    positions = np.concatenate([np.arange(0, 5000 * 0.5, 0.5), [2500.0 + 1.5]])  # 5,000 slices at 0.5 mm, one gap
    names = [f"i{k}" for k in range(len(positions))]
    assert _resampling_refusal(Path("S"), names, positions) == (
        f"S: cannot resample: 2501.5 mm at the series' 0.5 mm spacing is 5004 slices, more than --resample-gaps makes "
        f"({MAX_RESAMPLED_SLICES})")
    assert _resampling_refusal(Path("S"), names[:1001], np.concatenate([positions[:1000], [501.5]])) is None
