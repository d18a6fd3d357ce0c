"""Tests of the prostate, fundus, skin and breast tasks: registry, committed splits, loading, region scores, converters.

Real-data tests read ../shared/data (relative to the repository root) and are skipped when it is absent; the converter
tests fabricate tiny download layouts in tmp_path (plus the real PROMISE12 volume when present).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from feduq import data as D
from feduq.data import DataError, TASKS, get_dataset, label_classes, make_center_split, make_split, scan_center

from conftest import REPO  # noqa: E402
from conftest import SHARED_DATA as REAL_ROOT  # noqa: E402
PROMISE12 = REAL_ROOT / "prostate" / "PROMISE12-Case00_volume"
SPLIT_KEYS = ("training", "validation", "testing")
NEW_TASKS = ("prostate", "fundus", "skin", "breast")

# Committed split counts (train, val, test): seed 0, fractions 0.7/0.1/0.2 (feduq split).
COMMITTED_COUNTS = {
    "prostate": {"BIDMC": (2, 1, 3), "BMC": (109, 16, 28), "HK": (2, 1, 3), "I2CVB": (2, 1, 2),
                 "RUNMC": (357, 49, 103), "UCL": (2, 1, 3)},
    "fundus": {"Drishti-GS": (11, 1, 2), "RIM-ONE-r3": (4, 1, 1), "REFUGE-train": (4, 1, 1), "REFUGE-val": (4, 1, 1)},
    "skin": {"HAM10000-vidir_molemax": (14, 1, 3), "HAM10000-vidir_modern": (5, 1, 1), "HAM10000-rosendahl": (7, 1, 1),
             "HAM10000-vienna_dias": (1, 1, 0)},
    "breast": {"BUSI-Baheya-Cairo": (21, 3, 6), "BUS-BRA-INCa-Brazil": (21, 3, 6)},
}  # fmt: skip

needs_real = pytest.mark.skipif(
    not all((REAL_ROOT / TASKS[t].folder).is_dir() for t in NEW_TASKS),
    reason=f"real data not found at {REAL_ROOT} (../shared/data of the repo root)",
)


from conftest import load_tool as _load_tool  # noqa: E402


def _values(path) -> set[int]:
    return set(np.unique(np.asarray(Image.open(path))).tolist())


# ----------------------------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------------------------


def test_task_specs():
    assert [TASKS[t].folder for t in NEW_TASKS] == ["prostate", "fundus", "skin_lesion", "breast_us"]
    assert {t: (TASKS[t].in_channels, TASKS[t].num_classes) for t in NEW_TASKS} == {
        "prostate": (1, 2), "fundus": (3, 3), "skin": (3, 2), "breast": (1, 2)}
    assert TASKS["fundus"].eval_regions == {"disc": (1, 2), "cup": (2,)}
    assert TASKS["polyp"].folder == "polyp" and not TASKS["polyp"].eval_regions
    # class of each declared mask value: rank order, or merged foreground (prostate zone ids -> whole gland)
    assert label_classes(TASKS["prostate"], [0, 1, 2]) == [0, 1, 1]
    assert label_classes(TASKS["prostate"], [0, 1]) == [0, 1]
    assert label_classes(TASKS["fundus"], [2, 0, 1]) == [2, 0, 1]
    assert label_classes(TASKS["skin"], [0, 255]) == [0, 1]
    with pytest.raises(DataError, match=r"site 'X': labels.json declares 2 mask values \[0, 255\] but task 'fundus'"):
        label_classes(TASKS["fundus"], [0, 255], site="X")
    # group from the file stem
    assert D.stem_groups(["Case07_z012", "train_00_01", "Case30_z01"], D.PROSTATE_CASE_PATTERN) == {
        "Case07_z012": "Case07", "train_00_01": "train_00", "Case30_z01": "Case30"}
    assert D.stem_groups(["bus_0001-l", "benign_0847-s"], D.BUSBRA_PATIENT_PATTERN) == {
        "bus_0001-l": "0001", "benign_0847-s": "0847"}
    with pytest.raises(DataError, match=r"site 'S': file stem 'oops' does not match the group pattern"):
        D.stem_groups(["oops"], D.PROSTATE_CASE_PATTERN, site="S")


def test_make_split_with_fewer_than_three_groups():
    # 2 cases of 3 slices: the test split holds one whole case; train and val share the other
    split = make_split(list(range(6)), groups=["a"] * 3 + ["b"] * 3)
    assert [len(split[k]) for k in SPLIT_KEYS] == [2, 1, 3]
    owner = {k: {"a" if i < 3 else "b" for i in split[k]} for k in SPLIT_KEYS}
    assert len(owner["testing"]) == 1 and not owner["testing"] & (owner["training"] | owner["validation"])
    # the smaller group is the test case
    split = make_split(list(range(5)), groups=["t"] * 3 + ["r"] * 2)
    assert split["testing"] == [3, 4] and [len(split[k]) for k in SPLIT_KEYS] == [2, 1, 2]
    # one group: split per item; two items: one train, one val, no test
    assert [len(make_split(list(range(4)), groups=["a"] * 4)[k]) for k in SPLIT_KEYS] == [2, 1, 1]
    assert [len(make_split([1, 2])[k]) for k in SPLIT_KEYS] == [1, 1, 0]
    assert [len(make_split([1])[k]) for k in SPLIT_KEYS] == [1, 0, 0]


# ----------------------------------------------------------------------------------------------------------------
# Committed splits on the real data
# ----------------------------------------------------------------------------------------------------------------


@needs_real
@pytest.mark.parametrize("task", NEW_TASKS)
def test_committed_splits_match_make_split_and_cover_each_center(task):
    assert set(COMMITTED_COUNTS[task]) == set(TASKS[task].centers)
    for center in TASKS[task].centers:
        committed = json.loads((D.PACKAGE_SPLITS_DIR / task / f"{center}.json").read_text())
        fresh = make_center_split(REAL_ROOT, task, center, fractions=(0.7, 0.1, 0.2), seed=0)
        assert tuple(len(committed[k]) for k in SPLIT_KEYS) == COMMITTED_COUNTS[task][center], center
        for key in SPLIT_KEYS:
            assert committed[key] == fresh[key], f"{task}/{center}/{key}: stale; rerun feduq split"
        listed = [it["image"] for k in SPLIT_KEYS for it in committed[k]]
        on_disk = [Path(it["image"]).relative_to(REAL_ROOT / TASKS[task].folder / center).as_posix()
                   for it in scan_center(REAL_ROOT, task, center)]
        assert sorted(listed) == sorted(on_disk) and len(set(listed)) == len(listed), f"{task}/{center}"
        assert committed["training"] and committed["validation"], f"{task}/{center}: empty train or val"


@needs_real
def test_prostate_cases_never_straddle_test():
    spec = TASKS["prostate"]
    for center in spec.centers:
        split = json.loads((D.PACKAGE_SPLITS_DIR / "prostate" / f"{center}.json").read_text())
        stems = {k: [Path(it["image"]).stem for it in split[k]] for k in SPLIT_KEYS}
        case = D.stem_groups([s for k in SPLIT_KEYS for s in stems[k]], D.PROSTATE_CASE_PATTERN)
        if center in spec.group_column:  # RUNMC/BMC: the provenance case column and the stem agree
            column = D.read_groups(REAL_ROOT / "prostate" / center, "case")
            assert all(column[s] == case[s] for s in case)
        cases = {k: {case[s] for s in stems[k]} for k in SPLIT_KEYS}
        assert all(cases[k] for k in SPLIT_KEYS), center
        assert not cases["testing"] & (cases["training"] | cases["validation"]), center
        if len(set(case.values())) >= 3:  # with 2 cases train and val share one (documented make_split rule)
            assert not cases["training"] & cases["validation"], center
        else:
            assert split["group_note"].startswith("fewer than 3 groups")


# ----------------------------------------------------------------------------------------------------------------
# Loading one real sample per task
# ----------------------------------------------------------------------------------------------------------------


@needs_real
@pytest.mark.parametrize("task,center,stem,raw_values,classes", [
    ("prostate", "RUNMC", "Case00_z07", {0, 1, 2}, {0, 1}),  # zone ids 1 and 2 -> prostate
    ("prostate", "BIDMC", "train_00_01", {0, 1}, {0, 1}),
    ("fundus", "REFUGE-val", "V0001", {0, 1, 2}, {0, 1, 2}),
    ("skin", "HAM10000-rosendahl", "ISIC_0024377", {0, 255}, {0, 1}),
    ("breast", "BUS-BRA-INCa-Brazil", "benign_0847-s", {0, 255}, {0, 1}),
])  # fmt: skip
def test_real_sample_channels_and_labels(tmp_path, task, center, stem, raw_values, classes):
    center_dir = REAL_ROOT / TASKS[task].folder / center
    image = next(p for p in (center_dir / "images").iterdir() if p.stem == stem)
    assert _values(center_dir / "masks" / f"{stem}.png") == raw_values
    item = {"image": f"images/{image.name}", "label": f"masks/{stem}.png"}
    split_file = tmp_path / "split.json"
    split_file.write_text(json.dumps({"training": [item], "validation": [], "testing": []}))
    common = dict(data_root=REAL_ROOT, image_size=64, split_file=split_file, cache=False)
    sample = get_dataset(task, center, "train", **common)[0]
    assert tuple(sample["image"].shape) == (TASKS[task].in_channels, 64, 64)
    assert set(np.unique(sample["label"].numpy()).tolist()) == classes
    split_file.write_text(json.dumps({"training": [], "validation": [], "testing": [item]}))
    test = get_dataset(task, center, "test", **common)[0]
    assert tuple(test["label"].shape[1:]) == Image.open(center_dir / "masks" / f"{stem}.png").size


# ----------------------------------------------------------------------------------------------------------------
# Region scores (fundus disc / cup)
# ----------------------------------------------------------------------------------------------------------------


def _fundus_maps() -> tuple[torch.Tensor, torch.Tensor]:
    """8x8 class maps (0 bg, 1 rim, 2 cup). GT disc rows/cols 1-6 (36 px), cup rows/cols 2-4 (9 px). Prediction disc
    rows 1-6 x cols 2-7 (36 px, 30 shared), cup rows/cols 3-5 (9 px, 4 shared)."""
    gt, pred = torch.zeros(8, 8, dtype=torch.long), torch.zeros(8, 8, dtype=torch.long)
    gt[1:7, 1:7], gt[2:5, 2:5] = 1, 2
    pred[1:7, 2:8], pred[3:6, 3:6] = 1, 2
    return pred[None, None], gt[None, None]


def test_region_scores_match_hand_computed_dice():
    from feduq.scores.metrics import region_scores, segmentation_scores

    pred, gt = _fundus_maps()
    scores = region_scores(pred, gt, TASKS["fundus"].eval_regions)
    np.testing.assert_allclose(scores["dice"], [[2 * 30 / 72, 2 * 4 / 18]])
    assert scores["hd95"].shape == (1, 2) and (scores["hd95"] > 0).all()
    # the disc region differs from the per-class "rim" score, which segmentation_scores would give
    assert not np.isclose(segmentation_scores(pred, gt, 3)["dice"][0, 0], scores["dice"][0, 0])
    # an empty cup in both maps counts as a perfect cup
    none = region_scores(torch.where(pred == 2, 1, pred), torch.where(gt == 2, 1, gt), {"cup": (2,)})
    assert none["dice"][0, 0] == 1.0 and none["hd95"][0, 0] == 0.0


def test_evaluate_test_reports_regions(tmp_path):
    from feduq.scores.scoring import evaluate_test
    from feduq.scores.tables import write_results

    pred, gt = _fundus_maps()

    class Fixed(torch.nn.Module):  # logits whose argmax is the prediction map
        def forward(self, x):
            return torch.nn.functional.one_hot(pred[:, 0], 3).permute(0, 3, 1, 2).float() * 10

    batch = {"image": torch.zeros(1, 3, 8, 8), "label": gt.float()}
    scores = evaluate_test(Fixed(), [batch], torch.device("cpu"), 3, regions=TASKS["fundus"].eval_regions)
    np.testing.assert_allclose(scores["dice"], [[2 * 30 / 72, 2 * 4 / 18]])
    per_class = evaluate_test(Fixed(), [batch], torch.device("cpu"), 3)
    assert per_class["dice"].shape == (1, 2) and not np.allclose(per_class["dice"], scores["dice"])
    metrics = {"dice": float(scores["dice"].mean()), "hd95": float(scores["hd95"].mean()), "ece": 0.1,
               "dice_disc": float(scores["dice"][0, 0]), "dice_cup": float(scores["dice"][0, 1]),
               "hd95_disc": float(scores["hd95"][0, 0]), "hd95_cup": float(scores["hd95"][0, 1]), "num_images": 1}
    md = write_results({"REFUGE-val": metrics}, tmp_path)["markdown"].read_text()
    assert "| dice disc (%) | dice cup (%) | hd95 disc (px) | hd95 cup (px) |" in md  # the task's region order
    assert f"| {100 * (2 * 30 / 72 + 2 * 4 / 18) / 2:.2f} |" in md


# ----------------------------------------------------------------------------------------------------------------
# Converters
# ----------------------------------------------------------------------------------------------------------------


def _nifti(path: Path, array: np.ndarray, zooms=(1.0, 1.0, 3.0)) -> None:
    import nibabel as nib

    img = nib.Nifti1Image(array, np.diag([-zooms[0], -zooms[1], zooms[2], 1.0]))  # LPS+ voxel axes
    path.parent.mkdir(parents=True, exist_ok=True)
    nib.save(img, str(path))


def test_convert_prostate_fabricated_cases(tmp_path, capsys):
    tool = _load_tool("convert_prostate")
    rng = np.random.default_rng(0)
    src = tmp_path / "src"
    cases = (("Case01", "Case01_Segmentation.nii.gz", (3, 5)), ("Case02", "case02_segmentation.nii", (0, 1)))
    for case, seg_name, z_range in cases:
        vol = rng.normal(500, 100, (12, 10, 9)).astype(np.float32)
        seg = np.zeros((12, 10, 9), np.uint8)
        for z in range(z_range[0], z_range[1] + 1):
            seg[2:6, 3:7, z] = 2  # central zone
            seg[6:8, 3:7, z] = 1  # peripheral zone
        _nifti(src / "BIDMC" / f"{case}.nii.gz", vol)
        _nifti(src / "BIDMC" / seg_name, seg)
    dst = tmp_path / "dst"
    assert tool.main(["--src", str(src), "--dst", str(dst), "--size", "16"]) == 0, capsys.readouterr().err
    items = scan_center(dst, "prostate", "BIDMC")
    # slices with prostate plus 2 margin slices, clipped to the volume (9 slices: z 0..8)
    assert [it["id"] for it in items] == [f"Case01_z{z:03d}" for z in range(1, 8)] + [
        f"Case02_z{z:03d}" for z in range(0, 4)]
    assert Image.open(items[0]["image"]).size == (16, 16) and Image.open(items[0]["image"]).mode == "L"
    assert D.read_label_values(dst / "prostate" / "BIDMC") == [0, 1, 2]
    with open(dst / "prostate" / "BIDMC" / "provenance.csv") as f:
        rows = list(csv.DictReader(f))
    assert {r["case"] for r in rows} == {"Case01", "Case02"} and rows[0]["spacing_mm"] == "1x1x3"
    assert [r["prostate_in_slice"] for r in rows[:3]] == ["0", "0", "1"]
    # orientation: vol[x, y, z] -> image row y, column x (the zone-2 block spans x 2..5, y 3..6)
    mask = np.asarray(Image.open(dst / "prostate/BIDMC/masks/Case01_z004.png").resize((12, 10), Image.NEAREST))
    assert mask[4, 3] == 2 and mask[4, 7] == 1 and mask[1, 3] == 0
    split = make_center_split(dst, "prostate", "BIDMC")
    assert split["group_pattern"] == D.PROSTATE_CASE_PATTERN and split["num_groups"] == 2
    sample = get_dataset("prostate", "BIDMC", "train", data_root=dst, image_size=16,
                         split_file=D.write_split_file(split, tmp_path / "s.json"), max_items=1, cache=False)[0]
    assert set(np.unique(sample["label"].numpy()).tolist()) <= {0.0, 1.0}
    # a volume without its segmentation names the dataset and the expected file
    (src / "BIDMC" / "case02_segmentation.nii").unlink()
    capsys.readouterr()
    assert tool.main(["--src", str(src), "--dst", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "prostate MRI" in err and "Case02_segmentation.nii.gz" in err


@pytest.mark.skipif(not PROMISE12.is_dir(), reason=f"real PROMISE12 volume not found at {PROMISE12}")
def test_convert_prostate_real_promise12_volume(tmp_path):
    tool = _load_tool("convert_prostate")
    site = tmp_path / "src" / "RUNMC"
    site.mkdir(parents=True)
    for name in ("Case00.nii.gz", "Case00_segmentation.nii.gz"):
        shutil.copyfile(PROMISE12 / name, site / name)
    out = tool.convert_site(site, tmp_path / "dst", size=32)
    items = scan_center(tmp_path / "dst", "prostate", "RUNMC")
    assert [it["id"] for it in items] == [f"Case00_z{z:03d}" for z in range(14, 52)]  # prostate in z 16..49
    assert D.read_label_values(out) == [0, 1]
    middle = np.asarray(Image.open(out / "masks" / "Case00_z032.png"))
    rows, cols = np.nonzero(middle)
    assert rows.mean() < 16  # anterior up: the gland sits in the upper half of the axial slice
    assert float(np.asarray(Image.open(out / "images" / "Case00_z032.png")).max()) > 200


def test_convert_fundus_fabricated_domains(tmp_path, capsys):
    tool = _load_tool("convert_fundus")
    src = tmp_path / "Fundus"

    def pair(domain, split, name, levels):
        bg, disc, cup = levels
        mask = np.full((20, 24), bg, np.uint8)
        mask[4:16, 4:18], mask[8:12, 8:12] = disc, cup
        for kind, arr in (("image", np.dstack([mask] * 3)), ("mask", mask)):
            (src / domain / split / "ROIs" / kind).mkdir(parents=True, exist_ok=True)
            Image.fromarray(arr).save(src / domain / split / "ROIs" / kind / f"{name}.png")

    pair("Domain1", "train", "gdrishtiGS_001", (255, 128, 0))
    pair("Domain1", "test", "ndrishtiGS_002", (255, 128, 0))
    pair("Domain3", "train", "g0001", (255, 128, 0))
    dst = tmp_path / "dst"
    assert tool.main(["--src", str(src), "--dst", str(dst), "--size", "16"]) == 0, capsys.readouterr().err
    assert [it["id"] for it in scan_center(dst, "fundus", "Drishti-GS")] == ["gdrishtiGS_001", "ndrishtiGS_002"]
    assert [it["id"] for it in scan_center(dst, "fundus", "REFUGE-train")] == ["g0001"]
    mask = np.asarray(Image.open(dst / "fundus/Drishti-GS/masks/gdrishtiGS_001.png").resize((24, 20), Image.NEAREST))
    assert mask[0, 0] == 0 and mask[5, 5] == 1 and mask[10, 10] == 2  # 255 bg, 128 disc, 0 cup
    assert D.read_label_values(dst / "fundus" / "Drishti-GS") == [0, 1, 2]
    # RIGA coding (0 bg, 255 disc, 128 cup) behind --mask-coding riga, a new domain name via --domain
    pair("Domain5", "train", "img1", (0, 255, 128))
    assert tool.main(["--src", str(src), "--dst", str(dst), "--size", "0", "--mask-coding", "riga",
                      "--domain", "Domain5=BinRushed", "--only", "Domain5"]) == 0
    mask = np.asarray(Image.open(dst / "fundus/BinRushed/masks/img1.png"))
    assert mask[0, 0] == 0 and mask[5, 5] == 1 and mask[10, 10] == 2
    (src / "Domain3/train/ROIs/mask/g0001.png").unlink()
    capsys.readouterr()
    assert tool.main(["--src", str(src), "--dst", str(tmp_path / "x"), "--only", "Domain3"]) == 2
    err = capsys.readouterr().err
    assert "fundus ROI" in err and "Domain3/train/ROIs/mask/g0001.png" in err


def test_convert_skin_and_breast_fabricated(tmp_path, capsys):
    tool = _load_tool("convert_skin_breast")

    def img(path, size=(30, 20), mode="RGB", box=None):
        path.parent.mkdir(parents=True, exist_ok=True)
        if box is None:
            arr = np.random.default_rng(len(path.name)).integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            Image.fromarray(arr).convert(mode).save(path)
        else:
            arr = np.zeros((size[1], size[0]), np.uint8)
            arr[box[1]:box[3], box[0]:box[2]] = 255
            Image.fromarray(arr).save(path)

    ham = tmp_path / "HAM10000"
    meta = [("HAM_1", "ISIC_0000001", "rosendahl"), ("HAM_1", "ISIC_0000002", "rosendahl"),
            ("HAM_2", "ISIC_0000003", "rosendahl"), ("HAM_3", "ISIC_0000004", "vidir_modern")]
    ham.mkdir()
    (ham / "HAM10000_metadata.csv").write_text("lesion_id,image_id,dx,dx_type,age,sex,localization,dataset\n" + "".join(
        f"{les},{iid},nv,histo,50.0,male,back,{ds}\n" for les, iid, ds in meta))
    for i, (_, iid, _) in enumerate(meta):
        img(ham / f"HAM10000_images_part_{1 + i % 2}" / f"{iid}.jpg")
        img(ham / "HAM10000_segmentations_lesion_tschandl" / f"{iid}_segmentation.png", box=(2, 2, 10, 10))
    busi = tmp_path / "Dataset_BUSI_with_GT"
    img(busi / "benign" / "benign (1).png")
    img(busi / "benign" / "benign (1)_mask.png", box=(0, 0, 5, 5))
    img(busi / "benign" / "benign (1)_mask_1.png", box=(20, 10, 25, 15))  # second lesion: merged by OR
    img(busi / "malignant" / "malignant (2).png", mode="L")
    img(busi / "malignant" / "malignant (2)_mask.png", box=(3, 3, 9, 9))
    img(busi / "normal" / "normal (1).png")
    img(busi / "normal" / "normal (1)_mask.png", box=(0, 0, 0, 0))
    bra = tmp_path / "BUSBRA"
    for stem in ("0001-l", "0001-r", "0002-l"):
        img(bra / "Images" / f"bus_{stem}.png", mode="L")
        img(bra / "Masks" / f"mask_{stem}.png", box=(5, 5, 15, 15))
    (bra / "bus_data.csv").write_text("ID,Case,Pathology\nbus_0001-l,1,benign\nbus_0001-r,1,benign\n"
                                      "bus_0002-l,2,malignant\n")
    dst = tmp_path / "dst"
    rc = tool.main(["--dst", str(dst), "--ham10000", str(ham), "--busi", str(busi), "--busbra", str(bra),
                    "--skin-size", "16", "--breast-size", "24"])
    assert rc == 0, capsys.readouterr().err
    assert [it["id"] for it in scan_center(dst, "skin", "HAM10000-rosendahl")] == [
        "ISIC_0000001", "ISIC_0000002", "ISIC_0000003"]
    assert [it["id"] for it in scan_center(dst, "skin", "HAM10000-vidir_modern")] == ["ISIC_0000004"]
    split = make_center_split(dst, "skin", "HAM10000-rosendahl")  # lesion_id in provenance -> grouped by lesion
    assert split["group_column"] == "lesion_id" and split["num_groups"] == 2
    busi_items = scan_center(dst, "breast", "BUSI-Baheya-Cairo")
    assert [it["id"] for it in busi_items] == ["benign_001", "malignant_002"]  # normal/ left out by default
    merged = np.asarray(Image.open(busi_items[0]["label"]).resize((30, 20), Image.NEAREST))
    assert merged[1, 1] == 255 and merged[12, 22] == 255 and merged[12, 12] == 0
    assert Image.open(busi_items[0]["image"]).mode == "L" and Image.open(busi_items[0]["image"]).size == (24, 24)
    bra_items = scan_center(dst, "breast", "BUS-BRA-INCa-Brazil")
    assert [it["id"] for it in bra_items] == ["bus_0001-l", "bus_0001-r", "bus_0002-l"]
    split = make_center_split(dst, "breast", "BUS-BRA-INCa-Brazil")  # one patient = one group
    assert split["num_groups"] == 2
    with open(dst / "breast_us/BUS-BRA-INCa-Brazil/provenance.csv") as f:
        assert [r["case"] for r in csv.DictReader(f)] == ["1", "1", "2"]
    for center_dir in (dst / "skin_lesion" / "HAM10000-rosendahl", dst / "breast_us" / "BUSI-Baheya-Cairo"):
        assert D.read_label_values(center_dir) == [0, 255]
        assert all(_values(p) <= {0, 255} for p in (center_dir / "masks").iterdir())
    # wrong layouts name the dataset and the expected path
    capsys.readouterr()
    assert tool.main(["--dst", str(tmp_path / "x"), "--busbra", str(busi)]) == 2
    err = capsys.readouterr().err
    assert "BUS-BRA" in err and str(busi / "Images") in err
    (ham / "HAM10000_segmentations_lesion_tschandl" / "ISIC_0000004_segmentation.png").unlink()
    assert tool.main(["--dst", str(tmp_path / "y"), "--ham10000", str(ham)]) == 2
    assert "ISIC_0000004_segmentation.png" in capsys.readouterr().err
    assert tool.main(["--dst", str(tmp_path / "y"), "--ham10000", str(ham), "--allow-missing"]) == 0
