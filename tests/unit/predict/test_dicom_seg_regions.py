"""A task with nested regions (nnU-Net's ``"gland": [1, 2], "TZ": 2``) as a DICOM SEG: each region's segment holds
every class inside it, so segments overlap as the regions do, read back by highdicom and pydicom; what each label
value means is said in the structures' names everywhere a value is named (scales.json, the bundle)."""

import numpy as np
import pytest

from helpers import write_dicom_series

REGIONS = {"gland": (1, 2), "TZ": (2,)}
NAMES = ("background", "gland", "TZ")  # a declared region task names each class after the region that paints it


def _label(shape=(12, 10, 4)):
    rng = np.random.default_rng(0)
    label = np.zeros(shape, np.uint8)
    label[2:10, 2:8, :] = 1
    label[4:8, 3:6, 1:3] = 2
    label[rng.random(shape) < 0.05] = 0
    return label


def test_a_regions_segment_covers_every_class_inside_it(tmp_path):
    import highdicom as hd
    import pydicom

    from feduq.predict.dicom_seg import SegIdentity, write_dicom_seg
    from feduq.predict.rows import structures

    label = _label()
    series = tmp_path / "series"
    write_dicom_series(np.full(label.shape, 100, np.int16), series)
    files = sorted(series.glob("*.dcm"), key=lambda f: float(pydicom.dcmread(f).ImagePositionPatient[2]))
    identity = SegIdentity("FedAvg", NAMES, {}, structures(NAMES, REGIONS))
    path = write_dicom_seg(tmp_path / "seg.dcm", files, label, identity)
    seg = hd.seg.segread(path)
    numbers = {s.SegmentLabel: int(s.SegmentNumber) for s in seg.SegmentSequence}
    assert numbers == {"gland": 1, "TZ": 2}
    z_of = {pydicom.dcmread(f).SOPInstanceUID: z for z, f in enumerate(files)}
    frames = pydicom.dcmread(path).pixel_array  # [frame, row, column], one frame per (segment, instance)
    got = {name: np.zeros(label.shape, bool) for name in numbers}
    for frame, group in zip(frames, seg.PerFrameFunctionalGroupsSequence):
        number = int(group.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
        z = z_of[group.DerivationImageSequence[0].SourceImageSequence[0].ReferencedSOPInstanceUID]
        name = next(n for n, k in numbers.items() if k == number)
        got[name][:, :, z] = frame.T.astype(bool)
    np.testing.assert_array_equal(got["gland"], np.isin(label, (1, 2)))  # the whole gland, TZ included
    np.testing.assert_array_equal(got["TZ"], label == 2)
    assert got["gland"].sum() == (label == 1).sum() + (label == 2).sum() > got["TZ"].sum() > 0
    assert (got["gland"] & got["TZ"]).sum() == (label == 2).sum()  # the segments overlap where TZ lies


def test_without_regions_each_class_is_its_own_segment(tmp_path):
    import highdicom as hd
    import pydicom

    from feduq.predict.dicom_seg import SegIdentity, write_dicom_seg

    label = _label()
    series = tmp_path / "series"
    write_dicom_series(np.full(label.shape, 100, np.int16), series)
    files = sorted(series.glob("*.dcm"), key=lambda f: float(pydicom.dcmread(f).ImagePositionPatient[2]))
    seg = hd.seg.segread(write_dicom_seg(tmp_path / "seg.dcm", files, label, SegIdentity("FedAvg", ("bg", "PZ", "TZ"))))
    assert [s.SegmentLabel for s in seg.SegmentSequence] == ["PZ", "TZ"]
    frames = pydicom.dcmread(tmp_path / "seg.dcm").pixel_array
    sums = {}
    for frame, group in zip(frames, seg.PerFrameFunctionalGroupsSequence):
        n = int(group.SegmentIdentificationSequence[0].ReferencedSegmentNumber)
        sums[n] = sums.get(n, 0) + int(frame.sum())
    assert sums == {1: int((label == 1).sum()), 2: int((label == 2).sum())}  # disjoint: no region


@pytest.mark.parametrize("regions, expected", [
    (REGIONS, {"0": "background", "1": "gland (not TZ)", "2": "gland + TZ"}),
    ({}, {"0": "background", "1": "gland", "2": "TZ"}),
])
def test_each_value_is_named_by_the_structures_it_belongs_to(regions, expected):
    from feduq.bundle.readme import value_meanings
    from feduq.predict.rows import label_meanings, structures

    assert label_meanings(NAMES, structures(NAMES, regions)) == expected
    labels, region_line = value_meanings(NAMES, [0, 1, 2], regions)
    assert labels == ", ".join(f"{k} = {v}" for k, v in expected.items())
    assert region_line == ("gland = values 1, 2; TZ = value 2" if regions else "")
