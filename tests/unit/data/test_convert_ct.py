"""feduq convert ct on tiny synthetic NIfTI versions of the MSD, BTCV, KiTS, AMOS and TotalSegmentator layouts."""

from __future__ import annotations

import csv
import gzip
import json
from pathlib import Path

import numpy as np
import pytest

nib = pytest.importorskip("nibabel")

from conftest import load_tool  # noqa: E402

tool = load_tool("convert_ct")

SHAPE = (8, 8, 3)
ZOOMS = (0.75, 0.8, 2.5)
AMOS_LABELS = {"0": "background", "1": "spleen", "2": "right kidney", "3": "left kidney", "4": "gall bladder",
               "5": "esophagus", "6": "liver", "7": "stomach", "8": "arota", "9": "postcava", "10": "pancreas",
               "11": "right adrenal gland", "12": "left adrenal gland", "13": "duodenum", "14": "bladder",
               "15": "prostate/uterus"}


def affine(zooms=ZOOMS):
    a = np.diag([-zooms[0], -zooms[1], zooms[2], 1.0])
    a[:3, 3] = [10.0, -20.0, 30.0]
    return a


def write(path: Path, data, zooms=ZOOMS, dtype=None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    data = np.asarray(data, dtype=dtype or np.asarray(data).dtype)
    nib.Nifti1Image(data, affine(zooms)).to_filename(str(path))
    return path


def ct(seed=0):
    return np.random.default_rng(seed).integers(-1000, 1000, SHAPE).astype(np.int16)


def mask(ids, seed=0):
    """A label map holding every id in ``ids`` (plus background)."""
    m = np.zeros(SHAPE, np.uint8)
    for k, v in enumerate(ids):
        m.flat[k * 5 + seed] = v
    return m


def run(args, capsys):
    rc = tool.main([str(a) for a in args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def labels_of(center: Path) -> dict:
    return json.loads((center / "labels.json").read_text())


def rows_of(center: Path) -> list[dict]:
    with (center / "provenance.csv").open(newline="") as f:
        return list(csv.DictReader(f))


def check_pair(center: Path, case: str, src_image: Path, src_mask: np.ndarray | None = None):
    img, msk = (nib.load(str(center / d / f"{case}.nii.gz")) for d in ("images", "masks"))
    assert img.header.get_zooms()[:3] == pytest.approx(ZOOMS) and msk.header.get_zooms()[:3] == pytest.approx(ZOOMS)
    assert np.allclose(img.affine, affine()) and np.allclose(msk.affine, affine())
    assert np.array_equal(np.asanyarray(img.dataobj), np.asanyarray(nib.load(str(src_image)).dataobj))
    assert msk.get_data_dtype() == np.uint8
    if src_mask is not None:
        assert np.array_equal(np.asanyarray(msk.dataobj), src_mask)


def make_msd(root: Path, labels=None, n=2) -> Path:
    (root).mkdir(parents=True, exist_ok=True)
    (root / "dataset.json").write_text(json.dumps({"name": "Spleen", "labels": labels or {"0": "background",
                                                                                          "1": "spleen"}}))
    for i in range(n):
        write(root / "imagesTr" / f"spleen_{i}.nii.gz", ct(i))
        write(root / "labelsTr" / f"spleen_{i}.nii.gz", mask([1], i))
    (root / "imagesTr" / "._spleen_0.nii.gz").write_bytes(b"\x00\x05macOS")  # AppleDouble junk: skipped
    (root / "labelsTr" / "._spleen_0.nii.gz").write_bytes(b"\x00\x05macOS")
    return root


def test_msd(tmp_path, capsys):
    src = make_msd(tmp_path / "Task09_Spleen")
    rc, out, err = run(["--layout", "msd", "--src", src, "--out", tmp_path / "out"], capsys)
    assert rc == 0, err
    center = tmp_path / "out" / "Task09_Spleen"  # default center: the task folder
    assert sorted(p.name for p in (center / "images").iterdir()) == ["spleen_0.nii.gz", "spleen_1.nii.gz"]
    assert sorted(p.name for p in (center / "masks").iterdir()) == ["spleen_0.nii.gz", "spleen_1.nii.gz"]
    assert labels_of(center)["labels"] == {"0": "background", "1": "spleen"}
    rows = rows_of(center)
    assert [(r["stem"], r["case"], r["original_image_path"], r["original_mask_path"]) for r in rows] == [
        (f"spleen_{i}", f"spleen_{i}", f"imagesTr/spleen_{i}.nii.gz", f"labelsTr/spleen_{i}.nii.gz") for i in (0, 1)]
    assert rows[0]["spacing_mm"] == "0.75x0.8x2.5" and rows[0]["shape"] == "8x8x3"
    assert rows[0]["labels_present"] == "0;1" and rows[0]["mask_affine_matches_image"] == "1"
    for i in (0, 1):
        check_pair(center, f"spleen_{i}", src / "imagesTr" / f"spleen_{i}.nii.gz", mask([1], i))
        assert (center / "images" / f"spleen_{i}.nii.gz").read_bytes() == (
            src / "imagesTr" / f"spleen_{i}.nii.gz").read_bytes()
    assert not list((tmp_path / "out").glob(".*partial"))


def test_msd_lesion_label_named_after_the_organ(tmp_path, capsys):
    src = make_msd(tmp_path / "Task03_Liver", labels={"0": "background", "1": "liver", "2": "cancer"})
    rc, _, err = run(["--layout", "msd", "--src", src, "--out", tmp_path / "out", "--center", "lits"], capsys)
    assert rc == 0, err
    assert labels_of(tmp_path / "out" / "lits")["labels"] == {"0": "background", "1": "liver", "2": "liver_tumor"}


def test_4d_singleton_image_and_affine_mismatch(tmp_path, capsys):
    src = make_msd(tmp_path / "Task09_Spleen", n=1)
    write(src / "imagesTr" / "spleen_0.nii.gz", ct(0)[..., None])  # [x, y, z, 1]: stored as 3D
    write(src / "labelsTr" / "spleen_0.nii.gz", mask([1], 0), zooms=(1.0, 1.0, 2.5))  # same shape, other spacing
    rc, _, err = run(["--layout", "msd", "--src", src, "--out", tmp_path / "out"], capsys)
    assert rc == 0 and "warning" in err and str(src / "labelsTr" / "spleen_0.nii.gz") in err
    center = tmp_path / "out" / "Task09_Spleen"
    image = nib.load(str(center / "images" / "spleen_0.nii.gz"))
    assert image.shape == SHAPE and image.header.get_zooms() == pytest.approx(ZOOMS)
    assert np.array_equal(np.asanyarray(image.dataobj), ct(0))
    assert nib.load(str(center / "masks" / "spleen_0.nii.gz")).header.get_zooms() == pytest.approx((1.0, 1.0, 2.5))
    assert rows_of(center)[0]["mask_affine_matches_image"] == "0"


def test_btcv(tmp_path, capsys):
    src = tmp_path / "RawData" / "Training"
    write(src / "img" / "img0001.nii.gz", ct(1))
    write(src / "label" / "label0001.nii.gz", mask(range(1, 14), 1))
    write(src / "img" / "img0002.nii", ct(2))  # uncompressed source: gzipped on copy
    write(src / "label" / "label0002.nii.gz", mask([6, 11], 2), dtype=np.float32)  # float mask: stored as uint8
    rc, out, err = run(["--layout", "btcv", "--src", src, "--out", tmp_path / "out"], capsys)
    assert rc == 0, err
    assert "2 cases" in out
    center = tmp_path / "out" / "btcv"
    labels = labels_of(center)["labels"]
    assert len(labels) == 14 and labels["1"] == "spleen" and labels["6"] == "liver" and labels["11"] == "pancreas"
    assert labels["2"] == "right_kidney" and labels["3"] == "left_kidney" and labels["13"] == "left_adrenal_gland"
    assert labels["9"] == "inferior_vena_cava" and labels["10"] == "portal_vein_and_splenic_vein"
    assert [r["case"] for r in rows_of(center)] == ["0001", "0002"]
    assert rows_of(center)[1]["original_image_path"] == "img/img0002.nii"
    check_pair(center, "0001", src / "img" / "img0001.nii.gz", mask(range(1, 14), 1))
    check_pair(center, "0002", src / "img" / "img0002.nii", mask([6, 11], 2))
    with gzip.open(center / "images" / "0002.nii.gz") as f:
        assert f.read() == (src / "img" / "img0002.nii").read_bytes()


@pytest.mark.parametrize("kits21", [False, True])
def test_kits(tmp_path, capsys, kits21):
    src = tmp_path / "kits" / "data"
    ids = [1, 2, 3] if kits21 else [1, 2]
    for i in range(2):
        write(src / f"case_0000{i}" / "imaging.nii.gz", ct(i))
        write(src / f"case_0000{i}" / "segmentation.nii.gz", mask(ids, i))
    write(src / "case_00210" / "imaging.nii.gz", ct(9))  # test case without segmentation
    rc, _, err = run(["--layout", "kits", "--src", src, "--out", tmp_path / "out"], capsys)
    assert rc == 0, err
    center = tmp_path / "out" / "kits"
    labels = labels_of(center)
    expected = {"0": "background", "1": "kidney", "2": "kidney_tumor", **({"3": "kidney_cyst"} if kits21 else {})}
    assert labels["labels"] == expected
    assert "case_00210" in labels["note"] and "skipped" in labels["note"]
    assert [r["case"] for r in rows_of(center)] == ["case_00000", "case_00001"]
    assert rows_of(center)[0]["original_mask_path"] == "case_00000/segmentation.nii.gz"
    check_pair(center, "case_00001", src / "case_00001" / "imaging.nii.gz", mask(ids, 1))


def make_amos(src: Path) -> Path:
    src.mkdir(parents=True)
    (src / "dataset.json").write_text(json.dumps({"name": "AMOS", "labels": AMOS_LABELS}))
    for folder, case in (("Tr", "amos_0001"), ("Tr", "amos_0540"), ("Va", "amos_0008")):
        write(src / f"images{folder}" / f"{case}.nii.gz", ct(int(case[-2:])))
        write(src / f"labels{folder}" / f"{case}.nii.gz", mask(range(1, 16), 0))
    write(src / "imagesTs" / "amos_0002.nii.gz", ct(3))  # unlabelled test image: ignored
    return src


def test_amos(tmp_path, capsys):
    src = make_amos(tmp_path / "amos22")
    rc, _, err = run(["--layout", "amos", "--src", src, "--out", tmp_path / "out"], capsys)
    assert rc == 0, err
    center = tmp_path / "out" / "amos"
    labels = labels_of(center)
    assert len(labels["labels"]) == 16
    assert [labels["labels"][k] for k in ("2", "4", "8", "9", "15")] == [
        "right_kidney", "gallbladder", "aorta", "inferior_vena_cava", "prostate_uterus"]
    assert "MRI" in labels["note"]
    rows = rows_of(center)
    assert [(r["case"], r["source_split"]) for r in rows] == [("amos_0001", "imagesTr"), ("amos_0008", "imagesVa")]
    check_pair(center, "amos_0008", src / "imagesVa" / "amos_0008.nii.gz", mask(range(1, 16), 0))
    rc, _, err = run(["--layout", "amos", "--src", src, "--out", tmp_path / "out", "--center", "amos_all",
                      "--include-mri"], capsys)
    assert rc == 0, err
    assert [r["case"] for r in rows_of(tmp_path / "out" / "amos_all")] == ["amos_0001", "amos_0540", "amos_0008"]
    for f in (src / "labelsVa").iterdir():  # validation labels not released: imagesVa skipped with a note
        f.unlink()
    (src / "labelsVa").rmdir()
    rc, _, err = run(["--layout", "amos", "--src", src, "--out", tmp_path / "out", "--center", "amos_tr"], capsys)
    assert rc == 0, err
    assert [r["case"] for r in rows_of(tmp_path / "out" / "amos_tr")] == ["amos_0001"]
    assert "labelsVa" in labels_of(tmp_path / "out" / "amos_tr")["note"]


def make_totalseg(src: Path, structures=("liver", "spleen", "kidney_left", "kidney_right", "pancreas", "aorta")):
    for s in ("s0001", "s0002"):
        write(src / s / "ct.nii.gz", ct(int(s[-1])))
        for k, name in enumerate(structures):
            binary = np.zeros(SHAPE, np.uint8)
            binary.flat[k * 4: k * 4 + 4] = 1
            write(src / s / "segmentations" / f"{name}.nii.gz", binary)
    return src


def test_totalsegmentator_default_structures(tmp_path, capsys):
    src = make_totalseg(tmp_path / "Totalsegmentator_dataset")
    rc, _, err = run(["--layout", "totalsegmentator", "--src", src, "--out", tmp_path / "out"], capsys)
    assert rc == 0, err
    center = tmp_path / "out" / "totalsegmentator"
    assert labels_of(center)["labels"] == {"0": "background", "1": "liver", "2": "spleen", "3": "kidney_left",
                                           "4": "kidney_right", "5": "pancreas"}
    expected = np.zeros(SHAPE, np.uint8)
    for k in range(5):  # aorta (6th file) not requested
        expected.flat[k * 4: k * 4 + 4] = k + 1
    check_pair(center, "s0001", src / "s0001" / "ct.nii.gz", expected)
    rows = rows_of(center)
    assert [r["case"] for r in rows] == ["s0001", "s0002"]
    assert rows[0]["original_mask_path"] == "s0001/segmentations" and rows[0]["overlap_voxels"] == "0"


def test_totalsegmentator_structures_order_and_overlap(tmp_path, capsys):
    src = make_totalseg(tmp_path / "ts")
    write(src / "s0001" / "segmentations" / "aorta.nii.gz", np.ones(SHAPE, np.uint8))  # overlaps everything
    rc, _, err = run(["--layout", "totalsegmentator", "--src", src, "--out", tmp_path / "out", "--structures",
                      "spleen,liver,aorta", "--limit", "1"], capsys)
    assert rc == 0, err
    center = tmp_path / "out" / "totalsegmentator"
    assert labels_of(center)["labels"] == {"0": "background", "1": "spleen", "2": "liver", "3": "aorta"}
    rows = rows_of(center)
    assert len(rows) == 1 and rows[0]["overlap_voxels"] == "8"
    assert np.all(np.asanyarray(nib.load(str(center / "masks" / "s0001.nii.gz")).dataobj) == 3)


def test_limit_and_overwrite(tmp_path, capsys):
    src = make_msd(tmp_path / "Task09_Spleen", n=3)
    args = ["--layout", "msd", "--src", src, "--out", tmp_path / "out", "--center", "spleen"]
    assert run(args + ["--limit", "1"], capsys)[0] == 0
    assert len(rows_of(tmp_path / "out" / "spleen")) == 1
    rc, _, err = run(args, capsys)
    assert rc == 2 and str(tmp_path / "out" / "spleen") in err and "--overwrite" in err
    assert run(args + ["--overwrite"], capsys)[0] == 0
    assert len(rows_of(tmp_path / "out" / "spleen")) == 3
    assert "limited" not in labels_of(tmp_path / "out" / "spleen")["note"].lower()


def _shape_mismatch(src):
    write(src / "labelsTr" / "spleen_1.nii.gz", np.zeros((8, 8, 4), np.uint8))
    return src / "labelsTr" / "spleen_1.nii.gz", "shape"


def _undeclared_value(src):
    write(src / "labelsTr" / "spleen_1.nii.gz", mask([1, 2], 1))
    return src / "labelsTr" / "spleen_1.nii.gz", "[2]"


def _negative_value(src):
    write(src / "labelsTr" / "spleen_1.nii.gz", np.where(mask([1], 1) > 0, -1, 0).astype(np.int16))
    return src / "labelsTr" / "spleen_1.nii.gz", "[-1]"


def _non_integer_mask(src):
    write(src / "labelsTr" / "spleen_1.nii.gz", mask([1], 1) * 0.5, dtype=np.float32)
    return src / "labelsTr" / "spleen_1.nii.gz", "non-integer"


def _unreadable_image(src):
    (src / "imagesTr" / "spleen_1.nii.gz").write_bytes(b"not a nifti file")
    return src / "imagesTr" / "spleen_1.nii.gz", "cannot read"


def _truncated_image(src):
    path = src / "imagesTr" / "spleen_1.nii.gz"
    write(path, np.random.default_rng(0).integers(-1000, 1000, (64, 64, 3)).astype(np.int16))
    write(src / "labelsTr" / "spleen_1.nii.gz", np.zeros((64, 64, 3), np.uint8))
    path.write_bytes(path.read_bytes()[:2000])  # header readable, data stream cut
    return path, "cannot read"


def _missing_mask(src):
    (src / "labelsTr" / "spleen_1.nii.gz").unlink()
    return src / "labelsTr" / "spleen_1.nii.gz", "no mask"


def _missing_dataset_json(src):
    (src / "dataset.json").unlink()
    return src / "dataset.json", "missing"


@pytest.mark.parametrize("breaker", [_shape_mismatch, _undeclared_value, _negative_value, _non_integer_mask,
                                     _unreadable_image, _truncated_image, _missing_mask, _missing_dataset_json])
def test_msd_errors_exit_2_naming_the_file(tmp_path, capsys, breaker):
    src = make_msd(tmp_path / "Task09_Spleen")
    bad_file, words = breaker(src)
    rc, _, err = run(["--layout", "msd", "--src", src, "--out", tmp_path / "out"], capsys)
    assert rc == 2
    assert str(bad_file) in err and words in err, err
    assert not (tmp_path / "out" / "Task09_Spleen").exists()
    assert not list((tmp_path / "out").glob(".*")) if (tmp_path / "out").exists() else True


def test_totalsegmentator_errors(tmp_path, capsys):
    src = make_totalseg(tmp_path / "ts")
    args = ["--layout", "totalsegmentator", "--src", src, "--out", tmp_path / "out"]
    rc, _, err = run(args + ["--structures", "liver,gallbladder"], capsys)
    assert rc == 2 and str(src / "s0001" / "segmentations" / "gallbladder.nii.gz") in err and "missing" in err
    bad = write(src / "s0002" / "segmentations" / "spleen.nii.gz", mask([1, 2], 0))
    rc, _, err = run(args, capsys)
    assert rc == 2 and str(bad) in err and "[2]" in err
    rc, _, err = run(args + ["--structures", "liver,liver"], capsys)
    assert rc == 2 and "twice" in err
    assert not (tmp_path / "out" / "totalsegmentator").exists()


def test_layout_errors(tmp_path, capsys):
    rc, _, err = run(["--layout", "kits", "--src", tmp_path / "nowhere", "--out", tmp_path / "out"], capsys)
    assert rc == 2 and str(tmp_path / "nowhere") in err
    rc, _, err = run(["--layout", "kits", "--src", tmp_path, "--out", tmp_path / "out", "--center", "../x"], capsys)
    assert rc == 2 and "../x" in err
    (tmp_path / "k0" / "case_00000").mkdir(parents=True)  # KiTS21 repo before the imaging download
    write(tmp_path / "k0" / "case_00000" / "segmentation.nii.gz", mask([1]))
    rc, _, err = run(["--layout", "kits", "--src", tmp_path / "k0", "--out", tmp_path / "out"], capsys)
    assert rc == 2 and str(tmp_path / "k0" / "case_00000" / "imaging.nii.gz") in err
    (tmp_path / "empty").mkdir()
    rc, _, err = run(["--layout", "btcv", "--src", tmp_path / "empty", "--out", tmp_path / "out"], capsys)
    assert rc == 2 and str(tmp_path / "empty" / "img") in err
    write(tmp_path / "k" / "case_00000" / "imaging.nii.gz", ct())
    write(tmp_path / "k" / "case_00000" / "segmentation.nii.gz", mask([1, 4]))  # 4: not a KiTS label
    rc, _, err = run(["--layout", "kits", "--src", tmp_path / "k", "--out", tmp_path / "out"], capsys)
    assert rc == 2 and str(tmp_path / "k" / "case_00000" / "segmentation.nii.gz") in err and "[4]" in err
    with pytest.raises(SystemExit) as e:
        tool.main(["--layout", "nope", "--src", "x", "--out", "y"])
    assert e.value.code == 2
