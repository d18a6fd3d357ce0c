"""Tests of the abdominal CT task (feduq.data.ct): per-site label sets, case splits, reading PNG slices and NIfTI volumes.

Real-data tests read ../shared/data/abdominal_ct (relative to the repository root) and are skipped when it is absent;
the error-path tests work on temporary copies of a small real site or on tiny fabricated NIfTI volumes in tmp_path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from PIL import Image

from feduq.data import ct
from feduq.data import TASKS, DataError, make_center_split

from conftest import REPO  # noqa: E402
from conftest import SHARED_DATA as REAL_ROOT  # noqa: E402
CT_DIR = REAL_ROOT / "abdominal_ct"
SPLIT_KEYS = ("training", "validation", "testing")

# Site organs (global order) and committed split sizes: images (train, val, test), cases (train, val, test).
EXPECTED = {
    "NIH-Pancreas-CT": (("pancreas",), (367, 51, 103), (43, 6, 12)),
    "KiTS19": (("kidney",), (16, 3, 5), (1, 1, 3)),
    "MSD-Task09-Spleen": (("spleen",), (14, 1, 3), (7, 1, 2)),
    "3D-IRCADb-01": (("liver",), (26, 3, 7), (10, 1, 5)),
    "CHAOS-CT": (("liver",), (13, 5, 2), (2, 1, 1)),
    "CURVAS-Erlangen": (("liver", "kidney", "pancreas"), (0, 0, 108), (0, 0, 14)),
}

needs_real = pytest.mark.skipif(not CT_DIR.is_dir(), reason=f"real CT data not found at {CT_DIR}")


def _copy_site(tmp_path: Path, center: str = "CHAOS-CT") -> Path:
    """A temporary copy of a small real site under <tmp>/abdominal_ct/<center>; returns the center folder."""
    dst = tmp_path / "abdominal_ct" / center
    shutil.copytree(CT_DIR / center, dst)
    return dst


def _save_nifti(path: Path, array: np.ndarray, zooms=(2.0, 3.0, 4.0)) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(nib.Nifti1Image(array, np.diag([*zooms, 1.0])), str(path))  # positive diagonal = RAS voxel order


def _volume_site(root: Path, center: str = "Toy-CT", cases=("vol01", "vol02", "vol03"), shape=(6, 5, 4)) -> Path:
    """A site of NIfTI volumes only: labels 1 = right kidney, 2 = left kidney, 3 = liver."""
    center_dir = root / "abdominal_ct" / center
    rng = np.random.default_rng(0)
    for case in cases:
        _save_nifti(center_dir / "images" / f"{case}.nii.gz", rng.normal(0, 100, shape).astype(np.int16))
        _save_nifti(center_dir / "masks" / f"{case}.nii.gz", rng.integers(0, 4, shape).astype(np.uint8))
    labels = {"0": "background", "1": "right_kidney", "2": "left_kidney", "3": "Liver"}
    (center_dir / "labels.json").write_text(json.dumps({"labels": labels}))
    return center_dir


# ----------------------------------------------------------------------------------------------------------------
# Registry and label spaces
# ----------------------------------------------------------------------------------------------------------------


def test_registry_and_held_out():
    spec = TASKS["ct"]
    assert (spec.folder, spec.in_channels, spec.class_names) == (
        "abdominal_ct", 1, ("background", "liver", "kidney", "spleen", "pancreas"))
    assert ct.ORGANS == spec.class_names and ct.HELD_OUT == ("CURVAS-Erlangen",)
    assert ct.training_centers() == ("NIH-Pancreas-CT", "KiTS19", "MSD-Task09-Spleen", "3D-IRCADb-01", "CHAOS-CT")
    assert set(spec.centers) == set(ct.training_centers()) | set(ct.HELD_OUT)
    assert ct.local_to_global(("liver", "kidney", "pancreas")) == [0, 1, 2, 4]
    assert ct.local_to_global(()) == [0]
    with pytest.raises(DataError, match="stomach"):
        ct.local_to_global(("stomach",))
    with pytest.raises(DataError, match="global order"):
        ct.local_to_global(("pancreas", "liver"))


@needs_real
@pytest.mark.parametrize("center", sorted(EXPECTED))
def test_label_sets_of_every_center(center):
    organs = ct.site_organs(REAL_ROOT, center)
    assert organs == EXPECTED[center][0]
    lut = ct.site_label_lut(REAL_ROOT, center)
    assert lut[0] == 0 and sorted(set(lut.values())) == list(range(len(organs) + 1))
    g = ct.local_to_global(organs)
    assert [ct.ORGANS[i] for i in g[1:]] == list(organs)


@needs_real
def test_curvas_labels_renumbered_in_global_order():
    # CURVAS raw ids: 1 pancreas, 2 kidney, 3 liver -> local (liver, kidney, pancreas) = 1, 2, 3 -> global 1, 2, 4
    assert ct.site_label_lut(REAL_ROOT, "CURVAS-Erlangen") == {0: 0, 1: 3, 2: 2, 3: 1}
    item = next(i for i in ct.ct_items(REAL_ROOT, "CURVAS-Erlangen", "test") if i["name"] == "r1_10001_509")
    raw = np.asarray(Image.open(item["label"]))
    _, mask, _ = ct.read_case(item, ct.site_label_lut(REAL_ROOT, "CURVAS-Erlangen"), "CURVAS-Erlangen")
    for raw_value, local in ((0, 0), (1, 3), (2, 2), (3, 1)):
        assert (raw == raw_value).any() and np.all(mask[raw == raw_value] == local)


@needs_real
def test_kits_tumour_is_merged_into_kidney():
    lut = ct.site_label_lut(REAL_ROOT, "KiTS19")
    assert lut == {0: 0, 1: 1, 2: 1}
    items = ct.ct_items(REAL_ROOT, "KiTS19", "train") + ct.ct_items(REAL_ROOT, "KiTS19", "test")
    item = next(i for i in items if (np.asarray(Image.open(i["label"])) == 2).any())
    raw = np.asarray(Image.open(item["label"]))
    image, mask, spacing = ct.read_case(item, lut, "KiTS19")
    kidney_local = ct.site_organs(REAL_ROOT, "KiTS19").index("kidney") + 1
    assert np.all(mask[raw == 2] == kidney_local) and np.all(mask[raw == 1] == kidney_local)
    assert ct.local_to_global(ct.site_organs(REAL_ROOT, "KiTS19"))[kidney_local] == ct.ORGANS.index("kidney")
    assert image.dtype == np.float32 and image.shape == (256, 256) and mask.dtype == np.int16 and spacing is None


@needs_real
def test_unknown_label_ignored_label_and_missing_labels_json(tmp_path):
    center_dir = _copy_site(tmp_path)
    labels = {"0": "background", "1": "liver", "2": "hepatic vessel"}
    (center_dir / "labels.json").write_text(json.dumps({"labels": labels}))
    with pytest.raises(DataError, match=r"CHAOS-CT.*'hepatic vessel'.*global label space.*pancreas"):
        ct.site_organs(tmp_path, "CHAOS-CT")
    labels["2"] = "stomach"  # explicitly ignored: becomes background
    (center_dir / "labels.json").write_text(json.dumps({"labels": labels}))
    assert ct.site_organs(tmp_path, "CHAOS-CT") == ("liver",)
    assert ct.site_label_lut(tmp_path, "CHAOS-CT") == {0: 0, 1: 1, 2: 0}
    (center_dir / "labels.json").unlink()
    with pytest.raises(DataError, match=r"CHAOS-CT.*labels\.json is missing"):
        ct.site_label_lut(tmp_path, "CHAOS-CT")


@needs_real
def test_undeclared_mask_value_and_png_size_mismatch(tmp_path):
    center_dir = _copy_site(tmp_path)
    lut = ct.site_label_lut(tmp_path, "CHAOS-CT")
    item = ct.ct_items(tmp_path, "CHAOS-CT", "train")[0]
    mask = np.asarray(Image.open(item["label"])).copy()
    mask[0, 0] = 7
    Image.fromarray(mask).save(item["label"])
    with pytest.raises(DataError, match=rf"masks/{item['name']}\.png holds values \[7\]"):
        ct.read_case(item, lut, "CHAOS-CT")
    Image.fromarray(mask[:100]).save(item["label"])
    with pytest.raises(DataError, match=rf"masks/{item['name']}\.png.*images/{item['name']}\.png"):
        ct.ct_items(tmp_path, "CHAOS-CT", "train")
    with pytest.raises(DataError, match=r"\(100, 256\).*\(256, 256\)"):
        ct.read_case(item, lut, "CHAOS-CT")
    assert (center_dir / "labels.json").is_file()


# ----------------------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------------------


@needs_real
@pytest.mark.parametrize("center", sorted(EXPECTED))
def test_splits_disjoint_by_case_and_cover_every_image(center):
    items = {k: ct.ct_items(REAL_ROOT, center, k) for k in SPLIT_KEYS}
    cases = {k: {i["case"] for i in v} for k, v in items.items()}
    assert tuple(len(items[k]) for k in SPLIT_KEYS) == EXPECTED[center][1]
    assert tuple(len(cases[k]) for k in SPLIT_KEYS) == EXPECTED[center][2]
    assert not cases["training"] & cases["validation"] and not cases["training"] & cases["testing"]
    assert not cases["validation"] & cases["testing"]
    listed = [i["image"] for v in items.values() for i in v]
    assert len(listed) == len(set(listed))
    # compared resolved: ../shared may be a symbolic link (issue 65)
    assert {str(Path(x).resolve()) for x in listed} == {str(p.resolve()) for p in (CT_DIR / center / "images").iterdir()
                                                        if p.suffix == ".png"}
    assert all(set(i) >= {"image", "label", "case", "name"} and Path(i["label"]).stem == i["name"]
               for v in items.values() for i in v)
    # the committed file is what the split procedure gives today (seed 0, 0.7/0.1/0.2 by case)
    committed = json.loads((REPO / "custom" / "splits" / "ct" / f"{center}.json").read_text())
    fresh = ct.make_ct_split(REAL_ROOT, center)
    assert all(committed[k] == fresh[k] for k in SPLIT_KEYS)
    if center not in ct.HELD_OUT:  # the same as the generic procedure with the registry's case rule
        generic = make_center_split(REAL_ROOT, "ct", center)
        assert all(generic[k] == fresh[k] for k in SPLIT_KEYS)


@needs_real
def test_case_ids_from_provenance_and_stems():
    first = {c: ct.ct_items(REAL_ROOT, c, "test")[0] for c in EXPECTED}
    assert {c: (i["name"], i["case"]) for c, i in first.items() if c in ("KiTS19", "MSD-Task09-Spleen")} == {
        "KiTS19": ("10038_68", "10038"), "MSD-Task09-Spleen": ("10012_spleen_9", "spleen_9")}
    assert first["CURVAS-Erlangen"]["case"] == "10001" and first["CURVAS-Erlangen"]["name"].startswith("r1_10001_")
    assert first["NIH-Pancreas-CT"]["case"].startswith("PANCREAS_")


@needs_real
def test_curvas_is_test_only(tmp_path):
    assert ct.ct_items(REAL_ROOT, "CURVAS-Erlangen", "train") == []
    assert ct.ct_items(REAL_ROOT, "CURVAS-Erlangen", "val") == []
    assert "CURVAS-Erlangen" not in ct.training_centers()
    split = json.loads((REPO / "custom" / "splits" / "ct" / "CURVAS-Erlangen.json").read_text())
    split["training"], split["testing"] = split["testing"][:1], split["testing"][1:]
    bad = tmp_path / "split.json"
    bad.write_text(json.dumps(split))
    with pytest.raises(DataError, match="held-out site CURVAS-Erlangen"):
        ct.ct_items(REAL_ROOT, "CURVAS-Erlangen", "test", split_file=bad)
    with pytest.raises(DataError, match="unknown split"):
        ct.ct_items(REAL_ROOT, "CURVAS-Erlangen", "holdout")


@needs_real
def test_make_splits_tool_writes_the_committed_ct_files(tmp_path, capsys):
    from conftest import load_tool

    rc = load_tool("make_splits").main(["--data-root", str(REAL_ROOT), "--task", "ct", "--centers", "CHAOS-CT",
                                        "CURVAS-Erlangen", "--out", str(tmp_path)])
    assert rc == 0 and "CURVAS-Erlangen" in capsys.readouterr().out
    for center in ("CHAOS-CT", "CURVAS-Erlangen"):
        committed = REPO / "custom" / "splits" / "ct" / f"{center}.json"
        assert (tmp_path / f"{center}.json").read_text() == committed.read_text()


# ----------------------------------------------------------------------------------------------------------------
# Orientation and NIfTI volumes
# ----------------------------------------------------------------------------------------------------------------


@needs_real
def test_msd_spleen_slices_are_flipped_to_radiological_and_the_others_left_alone():
    for center, fix in (("MSD-Task09-Spleen", "flip_lr"), ("NIH-Pancreas-CT", ""), ("KiTS19", "")):
        item = ct.ct_items(REAL_ROOT, center, "test")[0]
        assert item["orientation_fix"] == fix
        image, mask, _ = ct.read_case(item, ct.site_label_lut(REAL_ROOT, center), center)
        raw_image, raw_mask = np.asarray(Image.open(item["image"])), np.asarray(Image.open(item["label"]))
        expect = (lambda a: a[:, ::-1]) if fix else (lambda a: a)
        assert np.array_equal(image, expect(raw_image)) and np.array_equal(mask, expect(raw_mask))
    # spleen (patient left) ends up on image right after the flip
    item = ct.ct_items(REAL_ROOT, "MSD-Task09-Spleen", "train")[0]
    _, mask, _ = ct.read_case(item, {0: 0, 1: 1}, "MSD-Task09-Spleen")
    assert np.nonzero(mask)[1].mean() > mask.shape[1] / 2


def test_volume_site_items_split_and_reorientation(tmp_path):
    center_dir = _volume_site(tmp_path)
    assert ct.site_organs(tmp_path, "Toy-CT") == ("liver", "kidney")
    lut = ct.site_label_lut(tmp_path, "Toy-CT")
    assert lut == {0: 0, 1: 2, 2: 2, 3: 1}
    split = ct.make_ct_split(tmp_path, "Toy-CT")
    assert sorted(g for k in SPLIT_KEYS for g in split["groups"][k]) == ["vol01", "vol02", "vol03"]
    assert all(len(split[k]) == 1 for k in SPLIT_KEYS)
    (center_dir / "split.json").write_text(json.dumps(split))  # site-local split overrides the packaged one
    item = ct.ct_items(tmp_path, "Toy-CT", "train")[0]
    assert item["case"] == item["name"] == Path(split["training"][0]["image"]).name[: -len(".nii.gz")]
    image, mask, spacing = ct.read_case(item, lut, "Toy-CT")
    raw = np.asarray(nib.load(item["image"]).dataobj)
    raw_mask = np.asarray(nib.load(item["label"]).dataobj)
    # RAS (x, y, z) -> LPS -> [Z, H, W]: z kept, y (anterior up) reversed, x (patient left) reversed
    assert image.shape == mask.shape == (4, 5, 6) and spacing == (4.0, 3.0, 2.0)
    assert np.array_equal(image, raw.transpose(2, 1, 0)[:, ::-1, ::-1].astype(np.float32))
    assert np.array_equal(mask, np.vectorize(lut.get)(raw_mask).transpose(2, 1, 0)[:, ::-1, ::-1])
    assert image.dtype == np.float32 and mask.dtype == np.int16


def test_volume_mask_shape_mismatch_and_unreadable_volume(tmp_path):
    center_dir = _volume_site(tmp_path)
    _save_nifti(center_dir / "masks" / "vol02.nii.gz", np.zeros((6, 5, 3), np.uint8))
    item = {"image": str(center_dir / "images" / "vol02.nii.gz"), "label": str(center_dir / "masks" / "vol02.nii.gz"),
            "case": "vol02", "name": "vol02"}
    msg = r"Toy-CT.*masks/vol02\.nii\.gz has shape \(6, 5, 3\) but image images/vol02\.nii\.gz has shape \(6, 5, 4\)"
    with pytest.raises(DataError, match=msg):
        ct.read_case(item, ct.site_label_lut(tmp_path, "Toy-CT"), "Toy-CT")
    with pytest.raises(DataError, match=msg):
        ct.make_ct_split(tmp_path, "Toy-CT")
    (center_dir / "images" / "vol02.nii.gz").write_bytes(b"not a nifti file")
    with pytest.raises(DataError, match=r"cannot read NIfTI file images/vol02\.nii\.gz"):
        ct.read_case(item, {0: 0, 1: 1, 2: 1, 3: 2}, "Toy-CT")


@needs_real
def test_real_volume_keeps_hu_and_spacing(tmp_path):
    src = CT_DIR / "TotalSegmentator-example_volume"
    if not src.is_dir():
        pytest.skip("TotalSegmentator example volume not present")
    center_dir = tmp_path / "abdominal_ct" / "TS-volume"
    for sub in ("images", "masks"):
        (center_dir / sub).mkdir(parents=True)
    shutil.copy(src / "example_ct_sm.nii.gz", center_dir / "images" / "s01.nii.gz")
    seg = nib.load(str(src / "example_seg_MODEL_PREDICTION.nii.gz"))
    liver = (np.asarray(seg.dataobj) == 5).astype(np.uint8)  # TotalSegmentator v2 id 5 = liver (model prediction)
    nib.save(nib.Nifti1Image(liver, seg.affine), str(center_dir / "masks" / "s01.nii.gz"))
    (center_dir / "labels.json").write_text(json.dumps({"labels": {"0": "background", "1": "liver"}}))
    (item,) = ct.scan_ct_center(tmp_path, "TS-volume")
    image, mask, spacing = ct.read_case(item, ct.site_label_lut(tmp_path, "TS-volume"), "TS-volume")
    assert image.shape == mask.shape == (30, 101, 122) and spacing == (3.0, 3.0, 3.0)
    assert image.min() < -500 and image.max() > 500  # HU, not windowed
    assert mask.sum() == liver.sum() > 0
    assert np.nonzero(mask)[2].mean() < mask.shape[2] / 2  # the liver (patient right) on image left
