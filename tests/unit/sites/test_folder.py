"""A site's folder, its layout decided once (:class:`feduq.sites.folder.SiteFolder`): the same questions answered for
FedUQ's own layout and for nnU-Net's raw dataset, and half an nnU-Net dataset refused naming what it lacks."""

import json
from pathlib import Path

import pytest

from feduq.data import DataError, load_split
from feduq.sites.folder import SiteFolder
from helpers import REAL_ROOT, make_site, needs_real


def test_a_site_in_feduqs_layout(tmp_path):
    center_dir = make_site(tmp_path, "Kvasir-SEG", n=5)
    split = {"training": [{"image": f"images/img{i}.png", "label": f"masks/img{i}.png"} for i in (0, 1, 2)],
             "validation": [{"image": "images/img3.png", "label": "masks/img3.png"}],
             "testing": [{"image": "images/img4.png", "label": "masks/img4.png"}]}
    (center_dir / "split.json").write_text(json.dumps(split))
    folder = SiteFolder.of("polyp", "Kvasir-SEG", tmp_path)
    assert (folder.nnunet, folder.layout, folder.path, folder.site) == (False, "feduq", center_dir, "Kvasir-SEG")
    assert [folder.split_size(k) for k in ("training", "validation", "testing")] == [3, 1, 1]
    assert folder.training_images() == [(center_dir / "images" / f"img{i}.png").resolve() for i in (0, 1, 2)]
    assert folder.training_images(max_items=2) == folder.training_images()[:2]
    assert folder.training_images() == [Path(i["image"]).resolve() for i in
                                        load_split("polyp", "Kvasir-SEG", tmp_path)["training"]]
    assert folder.groups() == (None, "group")  # Kvasir-SEG's images are independent
    clinic = make_site(tmp_path, "CVC-ClinicDB", n=2)  # its frames come in video sequences, named in provenance.csv
    (clinic / "provenance.csv").write_text("image_file,sequence\nimages/img0.png,7\nimages/img1.png,9\n")
    assert SiteFolder.of("polyp", "CVC-ClinicDB", tmp_path).groups() == ({"img0": "7", "img1": "9"}, "sequence")


def test_half_an_nnunet_dataset_is_named_as_that(tmp_path):
    center_dir = make_site(tmp_path, n=2)
    (center_dir / "imagesTr").mkdir()
    with pytest.raises(DataError, match=r"site 'CVC-ClinicDB': .*imagesTr.* dataset\.json"):
        SiteFolder.of("polyp", "CVC-ClinicDB", tmp_path)


@needs_real
def test_a_site_in_nnunets_layout(tmp_path):
    """The polyp task as a task file, its site written as nnU-Net's raw dataset (4 cases a split): the same questions,
    answered from its case names."""
    import nnunet_sites

    task = nnunet_sites.polyp_task(REAL_ROOT, tmp_path / "data", ["CVC-ClinicDB"], 4)
    folder = SiteFolder.of(str(task), "CVC-ClinicDB", tmp_path / "data")
    assert folder.nnunet and folder.layout == "nnunet" and (folder.path / "dataset.json").is_file()
    assert [folder.split_size(k) for k in ("training", "validation", "testing")] == [4, 4, 4]
    images = folder.training_images()
    assert len(images) == 4 and all(p.parent.name == "imagesTr" and p.name.endswith("_0000.png") for p in images)
    assert folder.groups() == (None, "group")  # the task file groups no cases: each case is a unit
    declared = json.loads(task.read_text())  # the same site under a task that groups its cases
    declared["name"] = "Dataset904_PolypGrouped"
    declared["feduq"]["group_pattern"] = {"*": r"(\d)\d*"}  # a made-up grouping: by the case name's first digit
    grouped = tmp_path / "data" / "Dataset904_PolypGrouped.json"
    grouped.write_text(json.dumps(declared))
    (tmp_path / "data" / "Dataset904_PolypGrouped").mkdir()
    (tmp_path / "data" / "Dataset904_PolypGrouped" / "CVC-ClinicDB").symlink_to(folder.path, target_is_directory=True)
    table, unit = SiteFolder.of(str(grouped), "CVC-ClinicDB", tmp_path / "data").groups()
    cases = [p.name[: -len("_0000.png")] for p in (folder.path / "imagesTr").iterdir()]
    assert unit == "group" and table == {c: c[0] for c in cases}
