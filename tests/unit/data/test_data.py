"""Tests of the FedUQ data layer (feduq.data) and its tools (make_splits, make_synthetic); bad input in
test_data_errors.py, the download converters in test_convert_polyp.py.

Real-data tests read ../shared/data (relative to the repository root) and are skipped when it is absent; all other
tests fabricate tiny images in tmp_path.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from feduq import data as D
from feduq.io import transforms
from feduq.data import (
    TASKS,
    DataError,
    get_dataset,
    load_split,
    make_center_split,
    make_split,
    make_transforms,
    read_groups,
    scan_center,
)

from conftest import REPO  # noqa: E402
from conftest import SHARED_DATA as REAL_ROOT  # noqa: E402
from helpers import SPLIT_KEYS, make_site, needs_real
POLYP = TASKS["polyp"]
# Sizes of the real polyp sites (SOURCES.md): full Kvasir-SEG, CVC-ColonDB and CVC-ClinicDB, a subset of ETIS.
REAL_SIZES = {"Kvasir-SEG": 1000, "CVC-ClinicDB": 612, "CVC-ColonDB": 380, "ETIS-LaribPolypDB": 30}
# Committed split counts (train, val, test): seed 0, fractions 0.7/0.1/0.2, ColonDB grouped by video sequence,
# ClinicDB by the converter's sequence estimate (44 groups).
COMMITTED_COUNTS = {
    "Kvasir-SEG": (700, 100, 200),
    "CVC-ClinicDB": (429, 61, 122),
    "CVC-ColonDB": (266, 38, 76),
    "ETIS-LaribPolypDB": (21, 3, 6),
}


from conftest import load_tool as _load_tool  # noqa: E402


# ----------------------------------------------------------------------------------------------------------------
# Splits on the real data
# ----------------------------------------------------------------------------------------------------------------


@needs_real
@pytest.mark.parametrize("center", POLYP.centers)
def test_committed_split_matches_make_split(center):
    committed = json.loads((D.PACKAGE_SPLITS_DIR / "polyp" / f"{center}.json").read_text())
    fresh = make_center_split(REAL_ROOT, "polyp", center, fractions=(0.7, 0.1, 0.2), seed=0)
    counts = tuple(len(committed[k]) for k in SPLIT_KEYS)
    assert counts == COMMITTED_COUNTS[center]
    assert sum(counts) == REAL_SIZES[center] == len(scan_center(REAL_ROOT, "polyp", center))
    for key in SPLIT_KEYS:
        assert committed[key] == fresh[key], f"{center}/{key}: committed split is stale; rerun feduq split"
        assert all(not Path(it["image"]).is_absolute() for it in committed[key])


@needs_real
@pytest.mark.parametrize("center, n_groups", [("CVC-ColonDB", 15), ("CVC-ClinicDB", 44)])
def test_video_sequences_never_straddle_splits(center, n_groups):
    """ColonDB's official sequences and ClinicDB's estimated ones: no group in two of train/val/test."""
    center_dir = REAL_ROOT / "polyp" / center
    seq = read_groups(center_dir, "sequence")
    assert len(seq) == REAL_SIZES[center] and len(set(seq.values())) == n_groups
    split = load_split("polyp", center, data_root=REAL_ROOT)  # the committed file (no site-local split)
    per_split = {k: {seq[Path(it["image"]).stem] for it in split[k]} for k in SPLIT_KEYS}
    assert all(per_split[k] for k in SPLIT_KEYS)
    assert not per_split["training"] & per_split["validation"]
    assert not per_split["training"] & per_split["testing"]
    assert not per_split["validation"] & per_split["testing"]
    assert sum(map(len, per_split.values())) == n_groups


@needs_real
def test_per_image_split_ignores_the_sequences(tmp_path, capsys):
    """``--per-image`` (the official FedEvi split) hits the exact counts and lets sequences straddle the splits."""
    tool = _load_tool("make_splits")
    assert tool.main(["--data-root", str(REAL_ROOT), "--task", "polyp", "--centers", "CVC-ClinicDB", "--per-image",
                      "--out", str(tmp_path)]) == 0
    assert "per image (--per-image)" in capsys.readouterr().out
    split = json.loads((tmp_path / "CVC-ClinicDB.json").read_text())
    assert [len(split[k]) for k in SPLIT_KEYS] == [429, 61, 122] and split["per_image"] is True
    seq = read_groups(REAL_ROOT / "polyp" / "CVC-ClinicDB", "sequence")
    per_split = {k: {seq[Path(it["image"]).stem] for it in split[k]} for k in SPLIT_KEYS}
    assert per_split["training"] & per_split["testing"]


@needs_real
def test_make_splits_cli_prints_table(tmp_path, capsys):
    tool = _load_tool("make_splits")
    rc = tool.main(["--data-root", str(REAL_ROOT), "--task", "polyp", "--centers", "CVC-ClinicDB", "CVC-ColonDB",
                    "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    assert "CVC-ColonDB" in out and "266" in out and "sequence" in out
    assert (tmp_path / "CVC-ClinicDB.json").is_file() and (tmp_path / "CVC-ColonDB.json").is_file()


# ----------------------------------------------------------------------------------------------------------------
# make_split (pure)
# ----------------------------------------------------------------------------------------------------------------


def test_make_split_exact_counts_and_determinism():
    items = list(range(100))
    a, b, c = make_split(items, seed=0), make_split(items, seed=0), make_split(items, seed=1)
    assert [len(a[k]) for k in SPLIT_KEYS] == [70, 10, 20]
    assert a == b
    assert a != c
    assert sorted(sum((a[k] for k in SPLIT_KEYS), [])) == items


def test_make_split_keeps_groups_together():
    items = list(range(30))
    groups = [i // 5 for i in items]  # 6 groups of 5
    split = make_split(items, seed=3, groups=groups)
    owner = {}
    for key in SPLIT_KEYS:
        for i in split[key]:
            assert owner.setdefault(groups[i], key) == key, f"group {groups[i]} straddles splits"
    # targets: test floor(6.0)=6 -> one group (5), val floor(3.0)=3 -> one group (5 is closer than 0)
    assert [len(split[k]) for k in SPLIT_KEYS] == [20, 5, 5]
    assert make_split(items, seed=3, groups=groups) == split


def test_make_split_uneven_groups_and_minimum_one():
    # one huge group that fits no target must land in training; the small ones fill val/test
    groups = ["big"] * 16 + ["a", "a", "b", "c"]
    split = make_split(list(range(20)), seed=0, groups=groups)
    assert all(i in split["training"] for i in range(16))
    # pass 1 puts a, b, c (4 = target) in testing; validation (target 2) would stay empty, so the smallest group of
    # the split with most groups moves there
    assert [len(split[k]) for k in SPLIT_KEYS] == [16, 1, 3]
    assert [len(make_split([1, 2, 3])[k]) for k in SPLIT_KEYS] == [1, 1, 1]
    assert [len(make_split(list(range(5)))[k]) for k in SPLIT_KEYS] == [3, 1, 1]
    with pytest.raises(ValueError):
        make_split([1, 2, 3], fractions=(0.5, 0.5, 0.5))


# ----------------------------------------------------------------------------------------------------------------
# Datasets and transforms
# ----------------------------------------------------------------------------------------------------------------


@needs_real
def test_get_dataset_train_and_test_on_kvasir():
    ds = get_dataset("polyp", "Kvasir-SEG", "train", data_root=REAL_ROOT, image_size=64, max_items=4)
    assert len(ds) == 4
    for sample in ds:
        image, label = sample["image"], sample["label"]
        assert tuple(image.shape) == (3, 64, 64) and str(image.dtype) == "torch.float32"
        assert float(image.min()) >= 0.0 and float(image.max()) <= 1.0
        assert tuple(label.shape) == (1, 64, 64)
        assert set(np.unique(label.numpy()).tolist()) <= {0.0, 1.0}
        assert float(label.sum()) > 0  # every Kvasir image has a polyp
    test = get_dataset("polyp", "Kvasir-SEG", "test", data_root=REAL_ROOT, image_size=64, max_items=1)
    assert tuple(test[0]["image"].shape) == (3, 64, 64)
    assert tuple(test[0]["label"].shape) == (1, 384, 384)  # test labels stay at the stored resolution


def test_transforms_keep_image_and_label_aligned(tmp_path):
    center_dir = make_site(tmp_path, n=1, size=(48, 32), box=(0, 0, 20, 10))  # W=48, H=32; box at top-left
    item = {"image": str(center_dir / "images/img0.png"), "label": str(center_dir / "masks/img0.png")}
    test = make_transforms("test", 16, 3, [0, 255])(dict(item))
    label = test["label"].numpy()[0]
    assert label.shape == (48, 32)  # PILReader axes: (width, height) for image and label alike
    assert label[:20, :10].min() == 1 and label.sum() == 200
    train = make_transforms("train", 32, 3, [0, 255])
    train.set_random_state(seed=0)
    for _ in range(6):  # whatever flip is drawn, image and label flip together
        out = train(dict(item))
        agree = ((out["image"][0].numpy() > 0.5) == (out["label"][0].numpy() > 0.5)).mean()
        assert agree > 0.95


def test_letterbox_geometry_matches_the_transforms(tmp_path):
    """Hand geometry: a 50x30 (W x H) image into 32 px: scale 0.64 -> 32 x 19.2 -> 32 x 19, padded 6 before."""
    center_dir = make_site(tmp_path, n=1, size=(50, 30), box=(0, 0, 50, 30))  # all foreground
    item = {"image": str(center_dir / "images/img0.png"), "label": str(center_dir / "masks/img0.png")}
    assert D.letterbox_box((50, 30), 32) == ((0, 32), (6, 19))
    assert D.letterbox_box((30, 50), 32) == ((6, 19), (0, 32))
    out = make_transforms("val", 32, 3, [0, 255], resize="letterbox")(dict(item))
    expected = np.zeros((32, 32), np.float32)
    expected[:, 6:25] = 1.0
    assert np.array_equal(out["label"][0].numpy(), expected)  # padding is background
    image = out["image"].numpy()
    assert image[:, :, :6].max() == 0.0 and image[:, :, 25:].max() == 0.0 and image[0, :, 6:25].min() > 0.5
    with pytest.raises(DataError, match="resize='crop'"):
        make_transforms("val", 32, 3, [0, 255], site="X", resize="crop")
    with pytest.raises(ValueError, match="positive"):
        D.letterbox_box((0, 5), 32)


def test_letterboxed_test_predictions_map_back_to_the_stored_mask(tmp_path):
    """A model that thresholds the red channel segments the box perfectly in letterbox space; the crop
    before upsampling must bring that back onto the stored 50x30 mask (Dice ~1); skipping it must not."""
    import torch
    from monai.data import DataLoader, Dataset

    from feduq.scores.scoring import evaluate_test

    center_dir = make_site(tmp_path, n=1, size=(50, 30), box=(10, 5, 40, 25))
    item = {"image": str(center_dir / "images/img0.png"), "label": str(center_dir / "masks/img0.png")}

    class RedThreshold(torch.nn.Module):
        def forward(self, x):
            red = x[:, :1]
            return torch.cat([0.5 - red, red - 0.5], dim=1) * 20.0

    ds = Dataset([item], transform=make_transforms("test", 32, 3, [0, 255], resize="letterbox"))
    cpu = torch.device("cpu")
    right = evaluate_test(RedThreshold(), DataLoader(ds, batch_size=1), cpu, 2, letterbox=True)
    wrong = evaluate_test(RedThreshold(), DataLoader(ds, batch_size=1), cpu, 2, letterbox=False)
    assert right["dice"][0, 0] > 0.97 and right["hd95"][0, 0] <= 1.0
    assert wrong["dice"][0, 0] < right["dice"][0, 0] - 0.1


def test_letterbox_keeps_the_original_aspect_ratio_from_provenance(tmp_path):
    """A 50x30 stored image that the provider stretched from 100x30: the letterbox uses 100x30 (scale 0.32 -> 32 x
    9.6 -> 32 x 10, padded 11 before), and test predictions map back onto the stored 50x30 mask."""
    import torch
    from monai.data import DataLoader, Dataset

    from feduq.scores.scoring import evaluate_test

    center_dir = make_site(tmp_path, n=1, size=(50, 30), box=(10, 5, 40, 25))
    (center_dir / "provenance.csv").write_text("image_file,mask_file,orig_width,orig_height\n"
                                               "images/img0.png,masks/img0.png,100,30\n")
    assert D.read_original_sizes(center_dir) == {"img0": (100, 30)}
    item = {"image": str(center_dir / "images/img0.png"), "label": str(center_dir / "masks/img0.png"),
            "orig_size": np.array([100, 30])}
    assert D.letterbox_box((100, 30), 32) == ((0, 32), (11, 10))
    val = make_transforms("val", 32, 3, [0, 255], resize="letterbox")(dict(item))
    rows = np.flatnonzero(val["label"][0].numpy().any(axis=0))
    assert rows.min() >= 11 and rows.max() <= 20  # the box's 10 content rows start at 11

    class RedThreshold(torch.nn.Module):
        def forward(self, x):
            return torch.cat([0.5 - x[:, :1], x[:, :1] - 0.5], dim=1) * 20.0

    ds = Dataset([item], transform=make_transforms("test", 32, 3, [0, 255], resize="letterbox"))
    scores = evaluate_test(RedThreshold(), DataLoader(ds, batch_size=1), torch.device("cpu"), 2, letterbox=True)
    assert scores["dice"][0, 0] > 0.95

    (center_dir / "provenance.csv").write_text("image_file,orig_width,orig_height\nimages/img0.png,0,30\n")
    with pytest.raises(DataError, match="orig_width/orig_height of 'img0'"):
        D.read_original_sizes(center_dir)


def test_gray_image_becomes_rgb_and_bad_channels_fail(tmp_path):
    center_dir = make_site(tmp_path, n=1)
    Image.open(center_dir / "images/img0.png").convert("L").save(center_dir / "images/img0.png")
    item = {"image": str(center_dir / "images/img0.png"), "label": str(center_dir / "masks/img0.png")}
    assert tuple(make_transforms("val", 16, 3, [0, 255])(dict(item))["image"].shape) == (3, 16, 16)
    with pytest.raises(DataError, match="in_channels=2"):
        make_transforms("val", 16, 2, [0, 255], site="X")


def test_a_16_bit_gray_image_is_scaled_not_clipped_and_a_float_image_is_refused(tmp_path):
    """A real Kvasir-SEG image as 16-bit gray (v * 200 + 37) reaches the network as the 8-bit image
    rint(x * 255 / 65535) does ("raw" intensity, so a clipped image would be 255 almost everywhere; a byte shift, a
    scaling by the image's maximum or a truncation would give other values); a 32-bit float TIFF is refused by name."""
    import tifffile

    from feduq.io.transforms import make_image_transforms

    source = sorted((REAL_ROOT / "polyp" / "Kvasir-SEG" / "images").iterdir())[0]
    gray = np.asarray(Image.open(source).convert("L"))
    wide = gray.astype(np.uint16) * 200 + 37
    Image.fromarray(np.rint(wide * (255.0 / 65535.0)).astype(np.uint8)).save(tmp_path / "gray8.png")
    Image.fromarray(wide).save(tmp_path / "gray16.png")
    assert Image.open(tmp_path / "gray16.png").mode == "I;16"
    chain = make_image_transforms(64, 3, intensity="raw", site="Kvasir-SEG")
    got8 = chain({"image": str(tmp_path / "gray8.png")})["image"]
    got16 = chain({"image": str(tmp_path / "gray16.png")})["image"]
    assert float(got8.max()) > 100 and float((got16 >= 254.5).float().mean()) < 0.2
    np.testing.assert_array_equal(np.asarray(got16), np.asarray(got8))
    tifffile.imwrite(tmp_path / "float.tif", gray.astype(np.float32) / 255)
    with pytest.raises(RuntimeError) as e:  # MONAI wraps it; the site's dataset surfaces the DataError itself
        chain({"image": str(tmp_path / "float.tif")})
    assert re.search(r"site 'Kvasir-SEG'.*float\.tif is a 32-bit float image", str(D.data_error_in(e.value)))


def test_make_synthetic_loads_with_site_local_split(tmp_path, capsys):
    tool = _load_tool("make_synthetic")
    assert tool.main(["--out", str(tmp_path), "--n-per-center", "10", "--size", "32"]) == 0
    assert "SYNTHETIC" in capsys.readouterr().out
    for center in POLYP.centers:
        assert (tmp_path / "polyp" / center / "split.json").is_file()
        assert len(scan_center(tmp_path, "polyp", center)) == 10
    split = load_split("polyp", "CVC-ColonDB", data_root=tmp_path)
    assert sum(len(split[k]) for k in SPLIT_KEYS) == 10 and all(split[k] for k in SPLIT_KEYS)
    ds = get_dataset("polyp", "ETIS-LaribPolypDB", "train", data_root=tmp_path, image_size=32)
    assert len(ds) == 7
    assert tuple(ds[0]["image"].shape) == (3, 32, 32) and float(ds[0]["label"].max()) == 1.0


def test_intensity_max_divides_by_the_image_maximum_and_minmax_spans_zero_to_one():
    """The official FedEvi scaling (x / max over the whole image) keeps a dark image's offset; MONAI's
    min-max maps it onto exactly [0, 1]. Hand-made 2x2 RGB image with values 50..200."""
    import torch

    from feduq.io.transforms import _intensity

    img = torch.tensor([[[50.0, 100.0], [150.0, 200.0]]] * 3)
    by_max = _intensity("max")({"image": img})["image"]
    torch.testing.assert_close(torch.as_tensor(by_max)[0], torch.tensor([[0.25, 0.5], [0.75, 1.0]]))
    minmax = _intensity("minmax")({"image": img})["image"]
    torch.testing.assert_close(torch.as_tensor(minmax)[0], torch.tensor([[0.0, 1 / 3], [2 / 3, 1.0]]))
    black = _intensity("max")({"image": torch.zeros(1, 2, 2)})["image"]
    assert float(torch.as_tensor(black).abs().sum()) == 0.0  # no division by zero


@needs_real
def test_a_split_from_a_file_of_stems(tmp_path, capsys):
    """The official FedEvi run's split (file stems per center) as a FedUQ split file; a stem the site lacks is named."""
    tool = _load_tool("make_splits")
    stems = REAL_ROOT.parent / "peer" / "fedevi-official-polyp" / "split_seed0.json"
    if not stems.is_file():
        pytest.skip(f"{stems} not found")
    reference = json.loads(stems.read_text())["splits"]["ETIS-LaribPolypDB"]
    assert tool.main(["--data-root", str(REAL_ROOT), "--task", "polyp", "--centers", "ETIS-LaribPolypDB", "--stems",
                      str(stems), "--out", str(tmp_path / "splits")]) == 0
    assert "stems of split_seed0.json" in capsys.readouterr().out
    split = json.loads((tmp_path / "splits" / "ETIS-LaribPolypDB.json").read_text())
    for key, name in (("train", "training"), ("val", "validation"), ("test", "testing")):
        assert [Path(it["image"]).stem for it in split[name]] == reference[key]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"ETIS-LaribPolypDB": {"train": ["no-such-frame"], "val": [], "test": []}}))
    assert tool.main(["--data-root", str(REAL_ROOT), "--task", "polyp", "--centers", "ETIS-LaribPolypDB", "--stems",
                      str(bad), "--out", str(tmp_path / "splits")]) == 2
    assert "'no-such-frame'" in capsys.readouterr().err


def test_stretch_bicubic_is_pils_bicubic_resize_of_the_stored_image(data_root):
    """resize="stretch_bicubic" (the official FedEvi code's resize, a candidate cause of the CVC-ColonDB difference):
    the image equals PIL's ``Image.resize((128, 128), BICUBIC)`` of the stored file exactly; the mask stays nearest."""
    from PIL import Image

    center = data_root / "polyp" / "CVC-ColonDB"
    image = sorted((center / "images").iterdir())[0]
    mask = center / "masks" / f"{image.stem}.png"
    t = D.make_transforms("val", 128, 3, [0, 255], resize="stretch_bicubic", intensity="raw")
    out = t({"image": str(image), "label": str(mask)})
    pil = np.asarray(Image.open(image).convert("RGB").resize((128, 128), Image.BICUBIC)).astype(np.float32)
    np.testing.assert_array_equal(np.asarray(out["image"]).transpose(2, 1, 0), pil)
    assert set(np.unique(np.asarray(out["label"]))) <= {0.0, 1.0} and tuple(out["label"].shape) == (1, 128, 128)


def _official_polyp_sample(image: Path, mask: Path, size: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """The FedEvi authors' data path for a stored polyp frame, written out by hand: PIL's bicubic resize of the image
    and nearest of the mask (the reference run's 128 px input), mask >= 128 -> 1, the image divided by its own maximum
    (official ``ToTensor``). Returns the image ``[H, W, 3]`` float32 and the mask ``[H, W]`` int."""
    from PIL import Image

    img = np.asarray(Image.open(image).convert("RGB").resize((size, size), Image.BICUBIC)).astype(np.float32)
    lab = (np.asarray(Image.open(mask).convert("L").resize((size, size), Image.NEAREST)) >= 128).astype(np.int64)
    return img / img.max(), lab


def test_the_official_protocols_train_input_is_the_authors_up_to_their_random_flip(data_root):
    """The candidates "intensity scaling" and "augmentation order" of jobs/fedevi/README.md, closed by identity: with
    resize="stretch_bicubic" and intensity="max", FedUQ's training sample of a CVC-ColonDB frame equals the authors'
    (PIL bicubic to 128, their RandomFlip, then x / max) with no flip, a flip of the first or of the second axis, image
    and mask together, for every draw; all three occur, about half unflipped; the val sample equals the unflipped one."""
    center = data_root / "polyp" / "CVC-ColonDB"
    frames = sorted((center / "images").iterdir())[:2]
    outcomes = []
    for image in frames:
        mask = center / "masks" / f"{image.stem}.png"
        img, lab = _official_polyp_sample(image, mask)
        official = {"none": (img, lab), "rows": (img[::-1], lab[::-1]), "columns": (img[:, ::-1], lab[:, ::-1])}
        val = D.make_transforms("val", 128, 3, [0, 255], resize="stretch_bicubic", intensity="max")
        out = val({"image": str(image), "label": str(mask)})
        np.testing.assert_allclose(np.asarray(out["image"]).transpose(2, 1, 0), img, rtol=0, atol=1e-6)
        np.testing.assert_array_equal(np.asarray(out["label"])[0].T, lab)
        train = D.make_transforms("train", 128, 3, [0, 255], resize="stretch_bicubic", intensity="max")
        train.set_random_state(seed=0)
        for _ in range(24):
            out = train({"image": str(image), "label": str(mask)})
            got = np.asarray(out["image"]).transpose(2, 1, 0), np.asarray(out["label"])[0].T
            match = [k for k, (i, m) in official.items() if np.allclose(got[0], i, atol=1e-6) and (got[1] == m).all()]
            assert len(match) == 1, match
            outcomes.append(match[0])
    counts = {k: outcomes.count(k) for k in ("none", "rows", "columns")}
    assert min(counts.values()) > 0 and 0.3 < counts["none"] / len(outcomes) < 0.7, counts


@pytest.mark.parametrize("resize", ["stretch", "letterbox", "stretch_bicubic"])
def test_a_site_caches_uint8_and_reads_back_the_uncached_float32_samples(data_root, resize):
    """The cache a site keeps (issue 40: memory) holds label and image as uint8, a quarter of their float32 bytes;
    reading it gives exactly the samples of the uncached pipeline, seeded random flips included, at every stage (a
    test label on its stored grid); and the image differs from the float32 resample by at most half an 8-bit step
    (none after PIL's bicubic, whose 8-bit output is kept exactly)."""
    import torch
    from monai.transforms import Compose

    for split in ("train", "val", "test"):
        kw = dict(data_root=data_root, image_size=64, max_items=3, resize=resize, intensity="max", seed=5)
        cached = D.get_dataset("polyp", "CVC-ColonDB", split, cache=True, **kw)
        plain = D.get_dataset("polyp", "CVC-ColonDB", split, cache=False, **kw)
        stored = cached._cache[0]
        assert stored["label"].dtype == stored["image"].dtype == torch.uint8
        assert stored["image"].element_size() * stored["image"].numel() == 3 * 64 * 64
        for _ in range(2):  # two epochs: the flips differ between draws and agree between the two datasets
            for i in range(len(plain)):
                a, b = cached[i], plain[i]
                assert a["image"].dtype == a["label"].dtype == torch.float32
                assert torch.equal(a["image"], b["image"]) and torch.equal(a["label"], b["label"]), (split, i)
                assert transforms.EIGHT_BIT_KEY not in a
        # the float32 image before the 8-bit step: the same chain cut before it
        chain = plain.transform.transforms
        cut = next(i for i, t in enumerate(chain) if isinstance(getattr(t, "func", None), transforms._Compact))
        before = Compose(list(chain[:cut]))(dict(plain.data[0]))["image"]
        expand = next(t for t in chain if isinstance(t, transforms._Expand))  # after the train stage's flip
        after = Compose([*chain[: cut + 1], expand])(dict(plain.data[0]))["image"]
        if resize == "stretch_bicubic":  # 0..255 whole numbers, kept exactly
            assert torch.equal(after, before.as_tensor())
        else:  # [0, 1], to the nearest 1/255
            err = (after - before.as_tensor()).abs().max().item()
            assert 0 < err <= 0.5 / 255 + 1e-7, err
        assert stored["label"].shape[-1] == (384 if split == "test" else 64)


@pytest.mark.parametrize("resize", ["stretch", "letterbox"])
def test_a_resized_mask_stays_on_its_image(tmp_path, resize):
    """A 384 px image holding one bright 48 x 36 px rectangle (columns 201-248, off the 4 px grid) with that rectangle
    as its mask, resized to 96: the mask is PIL's nearest resize of the stored mask, and its centroid lies within the
    grid's quantisation (0.25 training px here) of the image's brightness centroid. With corner-aligned nearest
    (MONAI's "nearest", FedUQ before) the mask lay 0.75 training px off along the columns."""
    from PIL import Image

    img = np.zeros((384, 384), np.uint8)
    img[100:136, 201:249] = 255
    Image.fromarray(np.stack([img] * 3, -1)).save(tmp_path / "image.png")
    Image.fromarray(img).save(tmp_path / "mask.png")
    out = D.make_transforms("val", 96, 3, [0, 255], resize=resize, intensity="minmax")(
        {"image": str(tmp_path / "image.png"), "label": str(tmp_path / "mask.png")})
    image, mask = np.asarray(out["image"])[0], np.asarray(out["label"])[0]

    def centroid(w):
        grid = np.indices(w.shape).astype(float)
        return (grid * w).reshape(2, -1).sum(1) / w.sum()

    pil = np.asarray(Image.fromarray(img).resize((96, 96), Image.NEAREST)).T / 255  # [W, H] as PILReader
    np.testing.assert_array_equal(mask, pil)
    np.testing.assert_allclose(centroid(mask), centroid(image), atol=0.2501)
    assert mask.sum() == 12 * 9  # 48 x 36 stored px -> 12 x 9 at 96
