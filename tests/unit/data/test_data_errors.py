"""Bad input to the FedUQ data layer: every error names the site and the file (a missing data root, a mask of another
size, an image without its mask, a split naming a file outside its site, a corrupt header, a truncated JPEG).

Tiny images fabricated in tmp_path; the truncated-file test copies four real Kvasir-SEG frames (../shared/data) and is
skipped without them.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from feduq.data import (
    DATA_ROOT_ENV,
    DataError,
    get_dataset,
    get_task,
    load_split,
    read_label_values,
    resolve_data_root,
    scan_center,
)
from helpers import REAL_ROOT, SPLIT_KEYS, make_site, write_pair, needs_real


def test_missing_data_root_names_site_and_env_var(monkeypatch, tmp_path):
    monkeypatch.delenv(DATA_ROOT_ENV, raising=False)
    with pytest.raises(DataError, match=r"site 'Kvasir-SEG'.*FEDUQ_DATA_ROOT"):
        resolve_data_root(None, site="Kvasir-SEG")
    with pytest.raises(DataError, match=r"site 'Kvasir-SEG'.*FEDUQ_DATA_ROOT"):
        get_dataset("polyp", "Kvasir-SEG", "train")
    missing = tmp_path / "nowhere"
    monkeypatch.setenv(DATA_ROOT_ENV, str(missing))
    with pytest.raises(DataError, match=r"site 'ETIS-LaribPolypDB'.*nowhere.*FEDUQ_DATA_ROOT"):
        load_split("polyp", "ETIS-LaribPolypDB")
    monkeypatch.setenv(DATA_ROOT_ENV, str(tmp_path))
    assert resolve_data_root() == tmp_path.resolve()


def test_a_relative_data_root_means_the_folder_the_command_was_started_from(monkeypatch, tmp_path):
    """export FEDUQ_DATA_ROOT=../data in /x/project, then a FLARE site process in its own workspace (another working
    directory, $PWD still /x/project): the root is /x/data. An argument's relative path is not re-based, and a root
    found nowhere names both folders it was tried against."""
    (tmp_path / "data").mkdir()
    launch, workspace = tmp_path / "project", tmp_path / "ws" / "site-1"
    launch.mkdir()
    workspace.mkdir(parents=True)
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("PWD", str(launch))
    monkeypatch.setenv(DATA_ROOT_ENV, "../data")
    assert resolve_data_root(site="Kvasir-SEG") == (tmp_path / "data").resolve()
    with pytest.raises(DataError, match=r"does not exist"):
        resolve_data_root("../data", site="Kvasir-SEG")  # ws/data: an argument is the caller's own path
    monkeypatch.setenv(DATA_ROOT_ENV, "../elsewhere")
    with pytest.raises(DataError, match=rf"working directory {workspace} and the folder it was started from "
                                        rf"\({launch}\)"):
        resolve_data_root(site="Kvasir-SEG")


def test_mask_size_mismatch_names_site_and_file(tmp_path):
    center_dir = make_site(tmp_path, n=2)
    write_pair(center_dir, "img1", mask_size=(16, 16))
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': mask masks/img1.png is 16x16 but image "
                                        r"images/img1.png is 32x24"):
        scan_center(tmp_path, "polyp", "CVC-ClinicDB")


def test_image_without_mask_and_mask_without_image(tmp_path):
    center_dir = make_site(tmp_path, n=3)
    (center_dir / "masks/img1.png").unlink()
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': image images/img1.png has no mask"):
        scan_center(tmp_path, "polyp", "CVC-ClinicDB")
    (center_dir / "images/img1.png").unlink()
    (center_dir / "images/img2.png").unlink()
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': mask masks/img2.png has no image"):
        scan_center(tmp_path, "polyp", "CVC-ClinicDB")


@pytest.mark.parametrize("name", ["../ETIS-LaribPolypDB/images/img0.png", "ABSOLUTE"])
def test_a_split_naming_a_file_outside_its_site_is_refused(tmp_path, name):
    """A site's split.json may name only its own files: another site's (``../``) or an absolute path elsewhere is
    refused naming the file, before anything is read."""
    make_site(tmp_path, "ETIS-LaribPolypDB", n=1)
    center_dir = make_site(tmp_path, n=2)
    if name == "ABSOLUTE":
        name = str(tmp_path / "polyp" / "ETIS-LaribPolypDB" / "images" / "img0.png")
    (center_dir / "split.json").write_text(json.dumps({
        "training": [{"image": name, "label": "masks/img1.png"}],
        "validation": [{"image": "images/img1.png", "label": "masks/img1.png"}], "testing": []}))
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': split file .*'training' image .*img0.png lies outside "
                                        r"the site folder"):
        load_split("polyp", "CVC-ClinicDB", data_root=tmp_path)


def test_corrupt_header_missing_folders_and_labels(tmp_path):
    center_dir = make_site(tmp_path, n=2)
    (center_dir / "images/img0.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"\x00" * 5)
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': cannot read image header of images/img0.png"):
        scan_center(tmp_path, "polyp", "CVC-ClinicDB")
    with pytest.raises(DataError, match=r"site 'ETIS-LaribPolypDB': center folder .*ETIS-LaribPolypDB does not"):
        scan_center(tmp_path, "polyp", "ETIS-LaribPolypDB")
    (center_dir / "labels.json").unlink()
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': labels file .*labels.json is missing"):
        read_label_values(center_dir)
    for sub in ("masks", "images"):
        for f in (center_dir / sub).iterdir():
            f.unlink()
        (center_dir / sub).rmdir()
        with pytest.raises(DataError, match=rf"site 'CVC-ClinicDB': folder .*{sub} is missing"):
            scan_center(tmp_path, "polyp", "CVC-ClinicDB")
    with pytest.raises(DataError, match="known tasks"):
        get_task("nope")


def test_split_listing_missing_file_and_bad_mask_values(tmp_path):
    center_dir = make_site(tmp_path, n=3)
    split = {k: [{"image": f"images/img{i}.png", "label": f"masks/img{i}.png"}] for i, k in enumerate(SPLIT_KEYS)}
    (center_dir / "split.json").write_text(json.dumps(split))
    assert len(load_split("polyp", "CVC-ClinicDB", data_root=tmp_path)["testing"]) == 1
    split["testing"].append({"image": "images/ghost.png", "label": "masks/ghost.png"})
    explicit = tmp_path / "my_split.json"
    explicit.write_text(json.dumps(split))  # an explicit split_file wins over the site-local split.json
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': image images/ghost.png does not exist"):
        load_split("polyp", "CVC-ClinicDB", data_root=tmp_path, split_file=explicit)
    # a mask pixel value that labels.json does not declare
    mask = np.array(Image.open(center_dir / "masks/img0.png"))
    mask[0, 0] = 128
    Image.fromarray(mask).save(center_dir / "masks/img0.png")
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': mask masks/img0.png holds pixel values \[128\]"):
        get_dataset("polyp", "CVC-ClinicDB", "train", data_root=tmp_path, image_size=16)
    # a split a site reads once (its test) is checked when built, not kept: the same error, at the same time
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': mask masks/img0.png holds pixel values \[128\]"):
        get_dataset("polyp", "CVC-ClinicDB", "train", data_root=tmp_path, image_size=16, cache="check")
    lazy = get_dataset("polyp", "CVC-ClinicDB", "train", data_root=tmp_path, image_size=16, cache=False)
    with pytest.raises(RuntimeError):  # unchecked: only when read
        lazy[0]


def test_a_site_reading_one_split_opens_that_splits_files_once(tmp_path, monkeypatch):
    """A site builds its three splits one by one: each reads the headers of its own pairs, so every file is opened
    once per site start (not three times), a bad file in another split is found when that split is built, and a file
    listed in two splits is refused whichever split is read."""
    import feduq.sites.split_files as split_files

    center_dir = make_site(tmp_path, n=4)
    split = {"training": [{"image": f"images/img{i}.png", "label": f"masks/img{i}.png"} for i in (0, 1)],
             "validation": [{"image": "images/img2.png", "label": "masks/img2.png"}],
             "testing": [{"image": "images/img3.png", "label": "masks/img3.png"}]}
    (center_dir / "split.json").write_text(json.dumps(split))
    opened = []
    real_check = split_files.check_pair
    monkeypatch.setattr(split_files, "check_pair", lambda image, *a: (opened.append(image.name), real_check(image, *a)))
    sizes = [len(get_dataset("polyp", "CVC-ClinicDB", s, data_root=tmp_path, image_size=16, cache=False))
             for s in ("train", "val", "test")]
    assert sizes == [2, 1, 1]
    assert sorted(opened) == ["img0.png", "img1.png", "img2.png", "img3.png"]  # each file once
    assert len(load_split("polyp", "CVC-ClinicDB", data_root=tmp_path)["testing"]) == 1 and len(opened) == 8  # all
    write_pair(center_dir, "img3", mask_size=(16, 16))  # the test split's pair goes bad
    assert len(get_dataset("polyp", "CVC-ClinicDB", "train", data_root=tmp_path, image_size=16, cache=False)) == 2
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': mask masks/img3.png is 16x16"):
        get_dataset("polyp", "CVC-ClinicDB", "test", data_root=tmp_path, image_size=16, cache=False)
    split["testing"] = [{"image": "images/img0.png", "label": "masks/img0.png"}]  # a training file also in testing
    (center_dir / "split.json").write_text(json.dumps(split))
    for name in ("train", "val"):
        with pytest.raises(DataError, match=r"lists images/img0.png in both 'training' and 'testing'"):
            get_dataset("polyp", "CVC-ClinicDB", name, data_root=tmp_path, image_size=16, cache=False)


@needs_real
def test_truncated_file_fails_with_its_name_or_is_skipped_when_the_site_says_so(tmp_path, caplog):
    """A file whose header reads fine but whose body is cut off (a half-copied JPEG)."""
    import shutil

    src = REAL_ROOT / "polyp" / "Kvasir-SEG"
    site = tmp_path / "polyp" / "Kvasir-SEG"
    (site / "images").mkdir(parents=True)
    (site / "masks").mkdir()
    shutil.copy(src / "labels.json", site / "labels.json")
    stems = sorted(p.stem for p in (src / "images").iterdir())[:4]
    for stem in stems:
        shutil.copy(src / "images" / f"{stem}.jpg", site / "images" / f"{stem}.jpg")
        shutil.copy(src / "masks" / f"{stem}.png", site / "masks" / f"{stem}.png")
    bad = site / "images" / f"{stems[0]}.jpg"
    bad.write_bytes(bad.read_bytes()[:2000])
    split = {"training": [{"image": f"images/{s}.jpg", "label": f"masks/{s}.png"} for s in stems],
             "validation": [], "testing": []}
    (site / "split.json").write_text(json.dumps(split))
    with pytest.raises(DataError, match=rf"site 'Kvasir-SEG': cannot decode images/{stems[0]}.jpg"):
        get_dataset("polyp", "Kvasir-SEG", "train", data_root=tmp_path, image_size=32)
    with caplog.at_level("WARNING", logger="feduq.data"):
        ds = get_dataset("polyp", "Kvasir-SEG", "train", data_root=tmp_path, image_size=32, on_bad_file="skip")
    assert len(ds) == 3
    assert f"cannot decode images/{stems[0]}.jpg" in caplog.text and "skipped" in caplog.text
    (site / "masks" / f"{stems[1]}.png").unlink()  # a listed mask vanished: skipped too
    assert len(get_dataset("polyp", "Kvasir-SEG", "train", data_root=tmp_path, image_size=32, on_bad_file="skip")) == 2
