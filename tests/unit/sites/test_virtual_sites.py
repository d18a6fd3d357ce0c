"""Virtual sites: a seeded IID partition of one center (FedA3I's 50 x 40 ISIC-2017 sites), and site-local splits."""

import csv
import json

import pytest

from feduq import data as fdata
from feduq.sites.centers import make_partition, parse_site, partition_file, virtual_site_name


def test_site_names_round_trip_and_bad_parts_are_refused():
    assert virtual_site_name("ISIC-2017", 7, 50) == "ISIC-2017-p07of50"
    assert parse_site("ISIC-2017-p07of50") == ("ISIC-2017", 7, 50)
    assert parse_site("Kvasir-SEG") == ("Kvasir-SEG", None, None)
    with pytest.raises(fdata.DataError, match="part 50 is not in 0..49"):
        parse_site("ISIC-2017-p50of50")


def test_partition_is_disjoint_covering_seeded_and_balanced():
    split = {"training": [{"image": f"images/{i}.png", "label": f"masks/{i}.png"} for i in range(95)],
             "validation": [{"image": f"images/v{i}.png", "label": f"masks/v{i}.png"} for i in range(5)],
             "testing": [{"image": "images/t.png", "label": "masks/t.png"}]}
    part = make_partition(split, "C", 8, seed=3, val_fraction=0.1)
    images = [it["image"] for s in part["sites"].values() for key in ("training", "validation") for it in s[key]]
    assert sorted(images) == sorted(it["image"] for it in split["training"] + split["validation"])  # each once
    sizes = [len(s["training"]) + len(s["validation"]) for s in part["sites"].values()]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 100
    assert all(len(s["validation"]) == 2 for s in part["sites"].values())  # ceil(0.1 * 12 or 13)
    assert part == make_partition(split, "C", 8, seed=3, val_fraction=0.1)
    assert part != make_partition(split, "C", 8, seed=4, val_fraction=0.1)
    with pytest.raises(ValueError, match="num_sites=101"):
        make_partition(split, "C", 101)


def test_isic2017_as_fedA3I_50_sites_of_40_with_the_official_validation_images_as_common_test(data_root):
    part = json.loads(partition_file("skin", "ISIC-2017", 50).read_text())
    assert len(part["sites"]) == 50
    assert all(len(s["training"]) + len(s["validation"]) == 40 for s in part["sites"].values())
    with open(data_root / "skin_lesion" / "ISIC-2017" / "provenance.csv") as f:
        official = {r["image_file"]: r["isic2017_split"] for r in csv.DictReader(f)}
    assert {official[it["image"]] for it in part["testing"]} == {"validation"} and len(part["testing"]) == 150
    pooled = [it["image"] for s in part["sites"].values() for k in ("training", "validation") for it in s[k]]
    assert len(set(pooled)) == 2000 and {official[i] for i in pooled} == {"train"}
    s = fdata.site_split("skin", "ISIC-2017-p07of50", data_root)
    assert s["center"] == "ISIC-2017" and (len(s["training"]), len(s["validation"]), len(s["testing"])) == (36, 4, 150)
    assert len(fdata.get_dataset("skin", "ISIC-2017", "val", data_root=data_root, image_size=32,
                                 site="ISIC-2017-p07of50")) == 4


def test_a_site_local_split_comes_first(tmp_path, data_root):
    center = tmp_path / "polyp" / "Kvasir-SEG"
    (center / "splits").mkdir(parents=True)
    for name in ("images", "masks"):
        (center / name).symlink_to(data_root / "polyp" / "Kvasir-SEG" / name)
    own = fdata.site_split("polyp", "Kvasir-SEG-p3of10", data_root)
    own["training"] = own["training"][:5]
    (center / "splits" / "Kvasir-SEG-p3of10.json").write_text(json.dumps(own))
    assert len(fdata.site_split("polyp", "Kvasir-SEG-p3of10", tmp_path)["training"]) == 5
    assert len(fdata.site_split("polyp", "Kvasir-SEG-p4of10", tmp_path)["training"]) == 72  # the committed part
    with pytest.raises(fdata.DataError, match="not a center of task 'polyp' nor a virtual site"):
        fdata.site_split("polyp", "Elsewhere-p1of2", data_root)
