"""feduq convert polyp: the public download layouts of Kvasir-SEG, CVC-ClinicDB, CVC-ColonDB and ETIS-LaribPolypDB
into FedUQ's site layout (images, masks, labels.json, the sequence groups), and its errors.

Fabricated downloads in tmp_path; one test reads the shared CVC-ClinicDB (../shared/data) and is skipped without it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import load_tool as _load_tool
from feduq.data import read_groups, read_label_values, scan_center
from helpers import REAL_ROOT, needs_real


def _fake_pair(image_path: Path, mask_path: Path, size=(40, 30), mask_levels=(0, 255), fmt=None) -> None:
    image_path.parent.mkdir(parents=True, exist_ok=True)
    mask_path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(len(str(image_path)))
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(image_path, format=fmt)
    mask = np.full((size[1], size[0]), mask_levels[0], np.uint8)
    mask[5:15, 8:20] = mask_levels[1]
    Image.fromarray(mask).save(mask_path, format=fmt)


def test_converters_produce_the_site_layout(tmp_path, capsys):
    tool = _load_tool("convert_polyp")
    src = tmp_path / "downloads"
    for stem in ("cju1", "cju2"):  # Kvasir-SEG: JPEG images and JPEG masks
        _fake_pair(src / "kvasir/images" / f"{stem}.jpg", src / "kvasir/masks" / f"{stem}.jpg")
    for n in (1, 2):  # CVC-ClinicDB: TIFF Original + Ground Truth
        _fake_pair(src / "clinic/Original" / f"{n}.tif", src / "clinic/Ground Truth" / f"{n}.tif", fmt="TIFF")
    for n in (1, 2):  # ETIS original release: ETIS-LaribPolypDB/<n>.tif + Ground Truth/p<n>.tif, masks 0/1
        _fake_pair(src / "etis/ETIS-LaribPolypDB" / f"{n}.tif", src / "etis/Ground Truth" / f"p{n}.tif",
                   mask_levels=(0, 1), fmt="TIFF")
    for n in (1, 40, 77):  # CVC-ColonDB: <n>.tiff / p<n>.tiff (77 is .tif in the release), cp<n> ignored
        ext = "tif" if n == 77 else "tiff"
        _fake_pair(src / "colondb" / f"{n}.{ext}", src / "colondb" / f"p{n}.{ext}", fmt="TIFF")
    _fake_pair(src / "colondb/cp1.tiff", src / "colondb/cp1_mask_unused.png", fmt="TIFF")

    dst = tmp_path / "data"
    rc = tool.main(["--dst", str(dst), "--size", "24", "--kvasir", str(src / "kvasir"), "--clinicdb",
                    str(src / "clinic"), "--etis", str(src / "etis"), "--colondb", str(src / "colondb")])
    assert rc == 0, capsys.readouterr().err
    expected = {"Kvasir-SEG": ["cju1", "cju2"], "CVC-ClinicDB": ["1", "2"], "ETIS-LaribPolypDB": ["1", "2"],
                "CVC-ColonDB": ["seq01_frame001", "seq02_frame040", "seq05_frame077"]}
    for center, stems in expected.items():
        items = scan_center(dst, "polyp", center)
        assert [it["id"] for it in items] == stems
        assert read_label_values(dst / "polyp" / center) == [0, 255]
        for it in items:
            assert Image.open(it["image"]).size == (24, 24) and Image.open(it["image"]).mode == "RGB"
            values = set(np.unique(np.array(Image.open(it["label"]))).tolist())
            assert values == {0, 255}, f"{center}: mask values {values}"
    groups = read_groups(dst / "polyp" / "CVC-ColonDB", "sequence")
    assert groups == {"seq01_frame001": "1", "seq02_frame040": "2", "seq05_frame077": "5"}

    # --size 0 keeps the original size; a wrong layout names the dataset and the expected path
    assert tool.main(["--dst", str(tmp_path / "orig"), "--size", "0", "--kvasir", str(src / "kvasir")]) == 0
    assert Image.open(tmp_path / "orig/polyp/Kvasir-SEG/images/cju1.jpg").size == (40, 30)
    capsys.readouterr()
    assert tool.main(["--dst", str(tmp_path / "x"), "--clinicdb", str(src / "kvasir")]) == 2
    err = capsys.readouterr().err
    assert "CVC-ClinicDB" in err and "Ground Truth" in err and str(src / "kvasir") in err
    assert tool.colondb_sequence(300) == 15 and tool.colondb_sequence(301) == 4


def _release_tiff(path: Path, array: np.ndarray) -> None:
    """A TIFF as CVC-ClinicDB's release ships its frames: 3 samples per pixel tagged BlackIsZero (Pillow refuses it)."""
    import tifffile

    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {"photometric": "minisblack", "planarconfig": "contig"} if array.ndim == 3 else {}
    tifffile.imwrite(path, array, **extra)


def test_clinicdb_release_tiffs_convert_with_the_sequence_estimate(tmp_path, capsys):
    """Frames 1-4: two near-identical pairs (differ by 5 grey levels) separated by a scene change (by 120): the estimate
    gives 2 groups. The release's RGB TIFF cannot be opened by Pillow, and is read pixel-exactly by tifffile."""
    from PIL import UnidentifiedImageError

    tool = _load_tool("convert_polyp")
    src = tmp_path / "release"
    base = np.random.default_rng(0).integers(0, 120, (30, 40, 3), dtype=np.uint8)
    frames = {1: base, 2: base + 5, 3: base + 120, 4: base + 125}
    mask = np.zeros((30, 40), np.uint8)
    mask[4:12, 6:20] = 255
    for n, frame in frames.items():
        _release_tiff(src / "Original" / f"{n}.tif", frame)
        _release_tiff(src / "Ground Truth" / f"{n}.tif", mask)
    with pytest.raises(UnidentifiedImageError):
        Image.open(src / "Original" / "1.tif")

    assert tool.main(["--dst", str(tmp_path / "out"), "--size", "0", "--image-format", "png",
                      "--clinicdb", str(src)]) == 0, capsys.readouterr().err
    site = tmp_path / "out" / "polyp" / "CVC-ClinicDB"
    np.testing.assert_array_equal(np.asarray(Image.open(site / "images" / "3.png")), frames[3])
    np.testing.assert_array_equal(np.asarray(Image.open(site / "masks" / "2.png")), mask)
    assert read_groups(site, "sequence") == {"1": "est00", "2": "est00", "3": "est01", "4": "est01"}
    assert "ESTIMATE" in json.loads((site / "labels.json").read_text())["note"]
    assert sorted(p.name for p in site.parent.iterdir()) == ["CVC-ClinicDB"]  # no staging folder left


def test_an_unreadable_file_stops_the_conversion_naming_it_and_leaves_nothing(tmp_path, capsys):
    tool = _load_tool("convert_polyp")
    src = tmp_path / "release"
    for n in (1, 2):
        _release_tiff(src / "Original" / f"{n}.tif", np.full((20, 20, 3), 60 * n, np.uint8))
        _release_tiff(src / "Ground Truth" / f"{n}.tif", np.zeros((20, 20), np.uint8))
    bad = src / "Original" / "2.tif"
    bad.write_bytes(b"II*\x00" + b"\x00" * 20)  # a TIFF header with no readable page
    dst = tmp_path / "out"
    assert tool.main(["--dst", str(dst), "--clinicdb", str(src)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(bad) in err and "tifffile" in err and "Traceback" not in err
    assert not (dst / "polyp").exists() or list((dst / "polyp").iterdir()) == []

    # an existing site stays as it was when the replacement fails, even with --overwrite
    good = dst / "polyp" / "CVC-ClinicDB"
    good.mkdir(parents=True)
    (good / "keep.txt").write_text("x")
    assert tool.main(["--dst", str(dst), "--clinicdb", str(src), "--overwrite"]) == 2
    assert sorted(p.name for p in (dst / "polyp").iterdir()) == ["CVC-ClinicDB"]
    assert [p.name for p in good.iterdir()] == ["keep.txt"]


@needs_real
def test_the_converter_reproduces_the_shared_clinicdb_sequence_estimate():
    """The shared CVC-ClinicDB's provenance ``sequence`` (44 groups) is the converter's rule on its stored frames."""
    import csv

    tool = _load_tool("convert_polyp")
    site = REAL_ROOT / "polyp" / "CVC-ClinicDB"
    with (site / "provenance.csv").open() as f:
        rows = sorted(csv.DictReader(f), key=lambda r: int(Path(r["image_file"]).stem))
    assert len(rows) == 612
    estimate = tool.estimate_sequences([site / r["image_file"] for r in rows])
    assert estimate == [r["sequence"] for r in rows]
    assert len(set(estimate)) == 44
