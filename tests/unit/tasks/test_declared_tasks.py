"""Tasks declared in a file (nnU-Net v2's dataset.json + "feduq") and their sites in nnU-Net's raw layout.

Declarations are parsed from hand-written JSON; the sites are built at test time in tmp_path from ../shared/data
(tests/nnunet_sites.py: prostate RUNMC slices stacked into NIfTI volumes, Kvasir-SEG images as 2D nnU-Net PNG files)
and the tests are skipped without it. Every error is checked by its whole one-line message. DECLARED is a
process-global registry, so every test declares its tasks under names of its own.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
import torch
from PIL import Image

import nnunet_sites as ns
from feduq.data import DataError, get_dataset, get_task, job_task
from feduq.sites import nnunet_raw as nr
from feduq.tasks.declared import parse_declaration

SRC = "the job's task declaration"


def raises(message: str, fn, *args, **kwargs) -> str:
    """Run ``fn``; assert it raises DataError whose one-line message is exactly ``message``."""
    with pytest.raises(DataError) as info:
        fn(*args, **kwargs)
    text = str(info.value)
    assert "\n" not in text
    assert text == message
    return text


@pytest.fixture(scope="module")
def prostate_base(tmp_path_factory) -> tuple[Path, list[str]]:
    """Three RUNMC cases as an nnU-Net site (one T2 channel, labels PZ=1 / TZ=2), with a split.json training on all."""
    from conftest import SHARED_DATA

    if not (SHARED_DATA / "prostate" / "RUNMC" / "provenance.csv").is_file():
        pytest.skip(f"real data not found at {SHARED_DATA}")
    site = tmp_path_factory.mktemp("base") / "site"
    cases = ns.prostate_site(SHARED_DATA, "RUNMC", site, max_cases=3)
    write_split(site, training=cases)
    return site, cases


def write_split(site: Path, training=(), validation=(), testing=()) -> Path:
    path = site / "split.json"
    path.write_text(json.dumps({"training": list(training), "validation": list(validation), "testing": list(testing)}))
    return path


def prostate_task(tmp_path: Path, base, name: str, **kw):
    """Task ``name`` (declared by dict) with site A = a copy of the base prostate site; returns (root, site dir)."""
    job_task(ns.task_declaration(name, ["A", "B"], **kw))
    root = tmp_path / "root"
    shutil.copytree(base[0], root / name / "A")
    return root.resolve(), (root / name / "A").resolve()


def site_json(site: Path, **changes) -> Path:
    path = site / "dataset.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))
    return path


def load(name, root, split="train", **kw):
    return get_dataset(name, "A", split, data_root=root, image_size=32, cache=True, **kw)


# ---------------------------------------------------------------------------------------------------------------
# 1. Declaration parsing
# ---------------------------------------------------------------------------------------------------------------


def test_valid_declaration_gives_classes_channels_and_default_normalisation():
    raw = ns.task_declaration("Dataset901_parse", ["A", "B", "C"], channels=("T2", "noNorm", "rescale_to_0_1"),
                              held_out=["C"])
    d = parse_declaration(raw)
    assert d.class_names == ("background", "PZ", "TZ")
    assert d.label_values == (0, 1, 2)
    assert d.channel_names == ("T2", "noNorm", "rescale_to_0_1")
    assert d.normalization == (("zscore", None, None, None, None), ("noNorm", None, None, None, None),
                               ("rescale_to_0_1", None, None, None, None))
    assert d.kind == "3d" and d.normalised_at_read and not d.regions
    assert d.score == {"PZ": (1,), "TZ": (2,)} and d.held_out == ("C",) and d.source == SRC
    spec = job_task(raw)
    assert spec.in_channels == 3 and spec.num_classes == 3 and spec.centers == ("A", "B", "C")
    assert spec.eval_regions == {"PZ": (1,), "TZ": (2,)} and spec.folder == "Dataset901_parse"
    assert job_task(raw) is spec and get_task("Dataset901_parse") is spec  # declaring it again returns it
    # a "CT" channel has no default window: the declaration must give one
    ct = ns.task_declaration("Dataset902_ct", ["A", "B"], channels=("CT",))
    assert parse_declaration(ct).missing_windows == (0,)  # no window: computed from the sites' fingerprints
    ct["feduq"]["normalization"] = {"0": {"scheme": "CT", "window": [200, -100]}}
    raises("the job's task declaration: feduq.normalization.0: CT needs " '"window": [low, high] with low < high in '
           'the stored units (HU), got [200, -100] (declare it, e.g. {"scheme": "CT", "window": [-160, 240]}, or '
           'leave it out and compute it with feduq fingerprint)', parse_declaration, ct)
    ct["feduq"]["normalization"] = {"0": {"scheme": "CT", "window": [-100, 200]}}
    assert parse_declaration(ct).normalization == (("CT", -100.0, 200.0, None, None),)


def test_regions_give_painted_class_names_and_eval_regions():
    raw = ns.task_declaration("Dataset903_regions", ["A", "B"],
                              labels={"background": 0, "gland": [1, 2], "TZ": [2]})
    raw["regions_class_order"] = [1, 2]
    spec = job_task(raw)
    assert spec.regions and spec.label_values == (0, 1, 2)
    assert spec.class_names == ("background", "gland", "TZ")
    assert spec.eval_regions == {"gland": (1, 2), "TZ": (2,)}


# ---------------------------------------------------------------------------------------------------------------
# 2. Bad task files
# ---------------------------------------------------------------------------------------------------------------


def task_file(tmp_path: Path, raw, name="task.json") -> str:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return str(path)


MISSING = "is missing (nnU-Net's dataset.json needs name, channel_names, labels and file_ending)"


@pytest.mark.parametrize("case", ["not_json", "no_channels", "no_labels", "value_twice", "unknown_feduq_key",
                                  "regions_without_order", "builtin_name", "region_twice"])
def test_bad_task_file_names_the_key(tmp_path, case):
    raw = ns.task_declaration(f"Dataset910_{case}", ["A", "B"])
    if case == "not_json":
        path = task_file(tmp_path, "{this is: not json")
        raises(f"task file {path} is not JSON: Expecting property name enclosed in double quotes: line 1 column 2 "
               "(char 1)", get_task, path)
        return
    expected = {
        "no_channels": f"channel_names: {MISSING}",
        "no_labels": f"labels: {MISSING}",
        "value_twice": "labels.TZ: declares the label value 1 that 'PZ' already has",
        "unknown_feduq_key": "feduq.site: is not a FedUQ key (known: ['configuration', 'folder', 'group_column', "
                             "'group_column_if_present', 'group_pattern', 'held_out', 'hyperparameters', 'layout', "
                             "'merge_foreground', 'normalization', 'partition_sites', 'score', 'sites'])",
        "regions_without_order": "regions_class_order: is missing: labels use nnU-Net's region syntax (lists of "
                                 "values)",
        "builtin_name": "name: 'polyp' is a built-in task's name; give the declared task its own (nnU-Net's "
                        "DatasetNNN_Name)",
        "region_twice": "labels.prostate: covers the same label values [1, 2] as 'gland': one structure declared twice",
    }[case]
    if case == "no_channels":
        del raw["channel_names"]
    elif case == "no_labels":
        del raw["labels"]
    elif case == "value_twice":
        raw["labels"] = {"background": 0, "PZ": 1, "TZ": 1}
    elif case == "unknown_feduq_key":
        raw["feduq"]["site"] = "A"
    elif case == "regions_without_order":
        raw["labels"] = {"background": 0, "gland": [1, 2], "TZ": 2}
    elif case == "region_twice":
        raw["labels"] = {"background": 0, "gland": [1, 2], "prostate": [2, 1], "TZ": 2}
        raw["regions_class_order"] = [1, 3, 2]
    else:
        raw["name"] = "polyp"
    path = task_file(tmp_path, raw)
    raises(f"task file {path}: {expected}", get_task, path)


def test_same_name_declared_twice_differently(tmp_path):
    raw = ns.task_declaration("Dataset911_twice", ["A", "B"])
    first = task_file(tmp_path, raw, "first.json")
    spec = job_task(first)
    assert get_task(task_file(tmp_path, raw, "same.json")) is spec  # the same content again: the same task
    raw["feduq"]["held_out"] = ["B"]
    second = task_file(tmp_path, raw, "second.json")
    raises(f"task file {second}: name: 'Dataset911_twice' is already declared differently (by task file {first}); one name, "
           "one declaration", get_task, second)
    raises("the job's task declaration: name: 'Dataset911_twice' is already declared differently (by "
           f"task file {first}); one name, one declaration", job_task, raw)


# ---------------------------------------------------------------------------------------------------------------
# 3. Bad sites
# ---------------------------------------------------------------------------------------------------------------


def test_site_channels_and_labels_must_be_the_tasks(tmp_path, prostate_base):
    name = "Dataset920_site_json"
    root, site = prostate_task(tmp_path, prostate_base, name)
    path = site_json(site, channel_names={"0": "ADC"})
    raises(f"site 'A': {path}: channel_names ['ADC'] differ from the task's ['T2'] (same names, same order)",
           load, name, root)
    site_json(site, channel_names={"0": "T2"}, labels={"background": 0, "PZ": 1, "CZ": 2})
    raises(f"site 'A': {path}: label 'CZ' is not a label or region of task '{name}' (['background', 'PZ', 'TZ']); a "
           "site's structures are the task's, by name, or a subset of them", load, name, root)


def test_case_without_a_channel_file(tmp_path, data_root):
    name = "Dataset921_two_channels"
    job_task(ns.task_declaration(name, ["A", "B"], channels=("T2", "ADC")))
    site = (tmp_path / name / "A").resolve()
    cases = ns.prostate_site(data_root, "RUNMC", site, max_cases=2, channels=("T2", "ADC"))
    (site / "imagesTr" / f"{cases[1]}_0001.nii.gz").unlink()
    raises(f"site 'A': imagesTr/: case '{cases[1]}' has no channel file {cases[1]}_0001.nii.gz",
           load, name, tmp_path)


def test_label_of_another_shape(tmp_path, prostate_base):
    name = "Dataset922_label_shape"
    root, site = prostate_task(tmp_path, prostate_base, name)
    case = prostate_base[1][0]
    image = nib.load(site / "imagesTr" / f"{case}_0000.nii.gz")
    nib.save(nib.Nifti1Image(np.zeros((10, 12, 3), np.uint8), image.affine), site / "labelsTr" / f"{case}.nii.gz")
    # refused on the case list, from the headers, before any voxel is read (both files named)
    raises(f"site 'A': {site / 'labelsTr' / f'{case}.nii.gz'}: this label volume is 10 x 12 x 3 voxels but its image "
           f"{site / 'imagesTr' / f'{case}_0000.nii.gz'} is {' x '.join(map(str, image.shape[:3]))}: a case's files "
           "must lie on one grid", load, name, root)


def test_label_value_the_site_does_not_declare(tmp_path, data_root):
    name = "Dataset923_undeclared"
    job_task(ns.task_declaration(name, ["A", "B"]))
    site = (tmp_path / name / "A").resolve()
    # the site annotates TZ only and declares it as 1, but its label maps still hold TZ's task value 2
    cases = ns.prostate_site(data_root, "RUNMC", site, max_cases=1, labels={"background": 0, "TZ": 1}, keep={2})
    raises(f"site 'A': labelsTr/{cases[0]}.nii.gz holds label value(s) [2] not declared in the site's dataset.json "
           "[0, 1]", load, name, tmp_path)


def test_mixed_endings_and_empty_images(tmp_path, prostate_base):
    name = "Dataset924_endings"
    root, site = prostate_task(tmp_path, prostate_base, name)
    Image.fromarray(np.zeros((8, 8), np.uint8)).save(site / "imagesTr" / "stray_0000.png")
    raises(f"site 'A': imagesTr/stray_0000.png does not end in the site's file_ending '.nii.gz' "
           f"({site / 'dataset.json'}); one file ending per dataset", load, name, root)
    for path in (site / "imagesTr").iterdir():
        path.unlink()
    raises(f"site 'A': {site / 'imagesTr'} holds no images", load, name, root)


def test_volumes_where_the_task_declares_2d_files_and_the_reverse(tmp_path, prostate_base, data_root):
    name = "Dataset925_png_task"
    root, site = prostate_task(tmp_path, prostate_base, name, file_ending=".png")
    raises(f"site 'A': {site / 'dataset.json'}: file_ending '.nii.gz' is 3D volumes but task '{name}' declares "
           "2D images ('.png')", load, name, root)
    name = "Dataset926_nifti_task"
    job_task(ns.task_declaration(name, ["A", "B"], channels=("R", "G", "B"),
                                 labels={"background": 0, "polyp": 1}))
    site = root / name / "A"
    ns.polyp_site(data_root, "Kvasir-SEG", site, kvasir_stems(data_root, 1))
    raises(f"site 'A': {site / 'dataset.json'}: file_ending '.png' is 2D images but task '{name}' declares "
           "3D volumes ('.nii.gz')", load, name, root)


# ---------------------------------------------------------------------------------------------------------------
# 4. Identities with closed forms
# ---------------------------------------------------------------------------------------------------------------


def read_cases(spec, site: Path):
    labels = nr.read_site_labels(site, spec, "A")
    cases = nr.list_cases(site, spec, "A", labels)
    return labels, {case: nr.read_case(case, files, spec, labels, "A") for case, files in cases.items()}


def test_nifti_route_gives_the_png_slices(tmp_path, prostate_base, data_root):
    name = "Dataset930_nonorm"
    root, site = prostate_task(tmp_path, prostate_base, name, normalization={"0": "noNorm"})
    _, read = read_cases(get_task(name), site)
    assert sorted(read) == prostate_base[1]
    src = data_root / "prostate" / "RUNMC"
    for (case, rows), data in zip(ns.prostate_cases(data_root, "RUNMC").items(), read.values()):
        image, label = data["image"], data["label"]
        assert image.dtype == np.float32 and label.dtype == np.uint8
        assert image.shape == (1, 384, 384, len(rows)) and label.shape == image.shape
        for z, row in enumerate(rows):
            png = np.asarray(Image.open(src / row["image_file"])).T.astype(np.float32)
            mask = np.asarray(Image.open(src / row["mask_file"])).T
            assert np.array_equal(image[0, :, :, z], png), (case, z)
            assert np.array_equal(label[0, :, :, z], mask), (case, z)
        spacing = [float(v) for v in rows[0]["spacing_mm"].split("x")]
        scale = float(rows[0]["orig_width"]) / 384
        assert np.allclose(data["spacing"], (spacing[0] * scale, spacing[1] * scale, spacing[2]))


def test_zscore_and_rescale_per_case(tmp_path, data_root):
    name = "Dataset931_zscore"
    spec = job_task(ns.task_declaration(name, ["A", "B"], channels=("T2", "rescale_to_0_1")))
    site = tmp_path / name / "A"
    ns.prostate_site(data_root, "RUNMC", site, max_cases=2, channels=("T2", "rescale_to_0_1"))
    _, read = read_cases(spec, site)
    assert len(read) == 2
    for data in read.values():
        t2, rescaled = data["image"][0].astype(np.float64), data["image"][1]
        assert abs(t2.mean()) < 1e-5 and abs(t2.std() - 1) < 1e-5
        assert rescaled.min() == 0.0 and rescaled.max() == 1.0
        # channel 1 is 255 - channel 0, so rescaled = 1 - (x - min) / (max - min) = 1 - rescaled copy of t2
        lo, hi = t2.min(), t2.max()
        assert np.allclose(rescaled, 1 - (t2 - lo) / (hi - lo), atol=1e-5)


def test_normalise_channel_closed_forms():
    x = np.array([[-300.0, -100.0], [50.0, 200.0], [500.0, 125.0]], np.float64)
    window = nr.normalise_channel(x, ("CT", -100.0, 200.0, None, None))
    assert window.dtype == np.float32
    assert window.tolist() == [[0.0, 0.0], [0.5, 1.0], [1.0, 0.75]]
    standard = nr.normalise_channel(x, ("CT", -100.0, 200.0, 50.0, 100.0))
    assert standard.tolist() == [[-1.5, -1.5], [0.0, 1.5], [1.5, 0.75]]
    y = np.array([1, 2, 3, 4], np.uint8)
    assert np.allclose(nr.normalise_channel(y, ("zscore",) + (None,) * 4), (np.arange(1, 5) - 2.5) / np.sqrt(1.25),
                       atol=1e-6)
    assert nr.normalise_channel(y, ("rescale_to_0_1",) + (None,) * 4).tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1])
    assert nr.normalise_channel(np.array([0, 51, 255]), ("rgb_to_0_1",) + (None,) * 4).tolist() == \
        pytest.approx([0.0, 0.2, 1.0])
    assert nr.normalise_channel(y, ("noNorm",) + (None,) * 4).tolist() == [1.0, 2.0, 3.0, 4.0]
    # a constant array: zscore and rescale give zeros, not NaN
    assert nr.normalise_channel(np.full(5, 7.0), ("zscore",) + (None,) * 4).tolist() == [0.0] * 5
    assert nr.normalise_channel(np.full(5, 7.0), ("rescale_to_0_1",) + (None,) * 4).tolist() == [0.0] * 5


def kvasir_stems(data_root: Path, n: int) -> list[str]:
    return sorted(p.stem for p in (data_root / "polyp" / "Kvasir-SEG" / "images").iterdir())[:n]


def test_2d_polyp_site_equals_the_builtin_task(tmp_path, data_root):
    name = "Dataset932_polyp2d"
    job_task({"name": name, "channel_names": {"0": "R", "1": "G", "2": "B"}, "labels": {"background": 0, "polyp": 1},
              "file_ending": ".png", "feduq": {"sites": ["Kvasir-SEG", "B"],
                                               "normalization": {str(c): "noNorm" for c in range(3)}}})
    stems = kvasir_stems(data_root, 3)
    site = tmp_path / name / "Kvasir-SEG"
    ns.polyp_site(data_root, "Kvasir-SEG", site, stems)
    write_split(site, testing=stems)
    decathlon = tmp_path / "builtin_split.json"
    decathlon.write_text(json.dumps({"training": [], "validation": [], "testing": [
        {"image": f"images/{s}.jpg", "label": f"masks/{s}.png"} for s in stems]}))
    args = dict(resize="stretch", intensity="max", image_size=64, cache=False)
    declared = get_dataset(name, "Kvasir-SEG", "test", data_root=tmp_path, **args)
    builtin = get_dataset("polyp", "Kvasir-SEG", "test", data_root=data_root, split_file=decathlon, **args)
    assert len(declared) == len(builtin) == 3
    for i in range(3):
        a, b = declared[i], builtin[i]
        assert a["image"].shape == b["image"].shape == (3, 64, 64)
        assert torch.equal(torch.as_tensor(a["image"]), torch.as_tensor(b["image"])), stems[i]
        assert a["label"].shape == b["label"].shape == (1, 384, 384)
        assert torch.equal(torch.as_tensor(a["label"]), torch.as_tensor(b["label"])), stems[i]
        assert set(torch.unique(torch.as_tensor(a["label"])).tolist()) == {0.0, 1.0}


def test_palette_label_png_reads_its_indices_as_the_builtin_layout_does(tmp_path, data_root):
    """A 2D label map saved as a palette PNG holds label values as palette indices: FedUQ's own layout reads the
    indices (PILReader without a converter); the nnU-Net route must give the same values, not the palette colours."""
    name = "Dataset933_palette"
    spec = job_task({"name": name, "channel_names": {"0": "R", "1": "G", "2": "B"},
                     "labels": {"background": 0, "polyp": 1}, "file_ending": ".png", "feduq": {"sites": ["A", "B"]}})
    stem = kvasir_stems(data_root, 1)[0]
    site = tmp_path / name / "A"
    ns.polyp_site(data_root, "Kvasir-SEG", site, [stem])
    mask = np.asarray(Image.open(site / "labelsTr" / f"{stem}.png"))
    palette = Image.fromarray(mask, mode="P")
    palette.putpalette([0, 0, 0, 0, 255, 0] + [0] * 762)  # index 1 drawn green (red component 0)
    palette.save(site / "labelsTr" / f"{stem}.png")
    assert Image.open(site / "labelsTr" / f"{stem}.png").mode == "P" and set(np.unique(mask).tolist()) == {0, 1}
    _, read = read_cases(spec, site)
    assert np.unique(read[stem]["label"]).tolist() == [0, 1]
    assert np.array_equal(read[stem]["label"][0], mask.T)


# ---------------------------------------------------------------------------------------------------------------
# 5. Partial labels
# ---------------------------------------------------------------------------------------------------------------


def test_partial_labels_map_site_values_to_task_classes(tmp_path, data_root):
    name = "Dataset940_partial"
    spec = job_task(ns.task_declaration(name, ["A", "B"]))
    site = (tmp_path / name / "A").resolve()
    cases = ns.prostate_site(data_root, "RUNMC", site, max_cases=2, labels={"background": 0, "TZ": 1}, keep={2})
    for case in cases:  # TZ written with the site's own value 1
        path = site / "labelsTr" / f"{case}.nii.gz"
        img = nib.load(path)
        seg = np.asarray(img.dataobj)
        assert set(np.unique(seg).tolist()) == {0, 2}
        nib.save(nib.Nifti1Image(np.where(seg == 2, 1, 0).astype(np.uint8), img.affine), path)
    write_split(site, training=cases)
    labels = nr.read_site_labels(site, spec, "A")
    # groups: background with the unannotated PZ, then TZ (the site's value 1)
    assert labels.annotated == ((0, 1), (2,)) and labels.value_to_class == {0: 0, 1: 2}
    assert labels.file_ending == ".nii.gz" and labels.names == ("TZ",)
    assert nr.annotated_classes(name, tmp_path, "A") == ((0, 1), (2,))
    items = nr.nnunet_items(name, "A", "train", data_root=tmp_path)
    assert set(np.unique(np.concatenate([it["label"].ravel() for it in items])).tolist()) == {0, 2}
    ds = get_dataset(name, "A", "train", data_root=tmp_path, image_size=64, cache=True)
    assert len(ds) == len(items) == sum(len(r) for r in list(ns.prostate_cases(data_root, "RUNMC").values())[:2])
    values = set(torch.unique(torch.cat([torch.as_tensor(ds[i]["label"]).flatten() for i in range(len(ds))])).tolist())
    assert values == {0.0, 2.0}


# ---------------------------------------------------------------------------------------------------------------
# 6. Splits by case
# ---------------------------------------------------------------------------------------------------------------


def test_splits_keep_cases_whole(tmp_path, data_root):
    name = "Dataset950_splits"
    job_task(ns.task_declaration(name, ["A", "B"]))
    site = (tmp_path / name / "A").resolve()
    cases = ns.prostate_site(data_root, "RUNMC", site, max_cases=6)
    slices = {c.lower(): len(r) for c, r in ns.prostate_cases(data_root, "RUNMC").items()}
    by_split = {s: nr.nnunet_items(name, "A", s, data_root=tmp_path) for s in ("train", "val", "test")}
    case_sets = {s: {it["case"] for it in items} for s, items in by_split.items()}
    assert nr.annotated_classes(name, tmp_path, "A") is None  # a site annotating every class
    assert all(case_sets.values())
    assert not (case_sets["train"] & case_sets["val"] or case_sets["train"] & case_sets["test"]
                or case_sets["val"] & case_sets["test"])
    assert set().union(*case_sets.values()) == set(cases)
    for s, items in by_split.items():
        assert len(items) == sum(slices[c] for c in case_sets[s])  # every slice of a case, in its split only
        assert all(re.fullmatch(rf"{it['case']}_z\d{{3}}", it["id"]) for it in items)
    path = write_split(site, training=cases[:4], validation=["case99"], testing=cases[4:])
    raises(f"site 'A': split file {path}: 'validation' lists case 'case99', which imagesTr/ lacks",
           load, name, tmp_path)


def test_explicit_split_file_that_does_not_exist(tmp_path, prostate_base):
    """An explicit split_file that is missing must raise (as load_split does for a built-in task's site), not fall
    back silently to a split made here."""
    name = "Dataset951_no_split_file"
    root, _ = prostate_task(tmp_path, prostate_base, name)
    missing = tmp_path / "nope.json"
    with pytest.raises(DataError, match=rf"^site 'A': .*{re.escape(str(missing))}"):
        nr.nnunet_items(name, "A", "train", data_root=root, split_file=missing)


# ---------------------------------------------------------------------------------------------------------------
# 7. NRRD and MHA volumes (SimpleITK) give what the same volume gives as NIfTI
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("ending", [".nrrd", ".mha"])
def test_nrrd_and_mha_sites_read_as_their_nifti_twins(tmp_path, data_root, ending):
    import SimpleITK as sitk

    from feduq.io.volumes import read_volume

    src = tmp_path / "nifti" / "Dataset941_twins" / "A"
    cases = ns.prostate_site(data_root, "RUNMC", src, max_cases=2)
    dst = tmp_path / "other" / "Dataset941_twins" / "A"
    for sub in ("imagesTr", "labelsTr"):
        (dst / sub).mkdir(parents=True)
        for f in (src / sub).iterdir():
            sitk.WriteImage(sitk.ReadImage(str(f)), str(dst / sub / f.name.replace(".nii.gz", ending)))
    site_json = json.loads((src / "dataset.json").read_text())
    (dst / "dataset.json").write_text(json.dumps({**site_json, "file_ending": ending}))
    a, b = read_volume(src / "imagesTr" / f"{cases[0]}_0000.nii.gz"), read_volume(dst / "imagesTr" / f"{cases[0]}_0000{ending}")
    np.testing.assert_array_equal(a.lps, b.lps)
    np.testing.assert_allclose(a.affine, b.affine, atol=1e-5)
    assert a.spacing == pytest.approx(b.spacing)
    items = {}
    for name, root, end in (("nifti", tmp_path / "nifti", ".nii.gz"), ("other", tmp_path / "other", ending)):
        task = ns.task_declaration("Dataset941_twins", ["A"], file_ending=end)
        if name == "other":  # the same task name may not be declared twice differently: a second name, same data
            task["name"] = f"Dataset942_twins{ending[1:]}"
            (root / "Dataset941_twins").rename(root / task["name"])
        items[name] = nr.nnunet_items(job_task(task), "A", "train", data_root=root)
    assert len(items["nifti"]) == len(items["other"]) > 0
    for x, y in zip(items["nifti"], items["other"]):
        np.testing.assert_array_equal(x["image"], y["image"])
        np.testing.assert_array_equal(x["label"], y["label"])


# ---------------------------------------------------------------------------------------------------------------
# 8. What a second reader found: scored subsets, other layouts, non-finite values, label endings
# ---------------------------------------------------------------------------------------------------------------
def test_a_scored_subset_is_what_the_test_scores():
    spec = job_task(ns.task_declaration("Dataset981_subset", ["A"], score=["TZ"]))
    assert spec.eval_regions == {"TZ": (2,)}  # not every class: the one named
    assert job_task(ns.task_declaration("Dataset982_all", ["A"])).eval_regions == {"PZ": (1,), "TZ": (2,)}


def test_a_declared_volume_site_in_feduqs_layout_and_non_finite_values_are_refused(tmp_path, data_root):
    shutil.copytree(data_root / "prostate" / "BMC", tmp_path / "Dataset983_layout" / "A")
    raises(f"site 'A': {tmp_path / 'Dataset983_layout' / 'A'} is not an nnU-Net raw dataset (dataset.json and "
           "imagesTr/); task 'Dataset983_layout' declares 3D volumes, which FedUQ reads from nnU-Net's layout only "
           "(its own layout serves a 2D task whose channels are all noNorm)",
           get_dataset, job_task(ns.task_declaration("Dataset983_layout", ["A"])), "A", "train", data_root=tmp_path)
    site = tmp_path / "nan" / "Dataset984_nan" / "A"
    cases = ns.prostate_site(data_root, "RUNMC", site, max_cases=1)
    img = nib.load(site / "imagesTr" / f"{cases[0]}_0000.nii.gz")
    data = np.asarray(img.dataobj).astype(np.float32)
    data[0, 0, 0] = np.nan
    nib.save(nib.Nifti1Image(data, img.affine), site / "imagesTr" / f"{cases[0]}_0000.nii.gz")
    raises(f"site 'A': case '{cases[0]}': its image holds NaN or infinite values ({cases[0]}_0000.nii.gz)",
           nr.nnunet_items, job_task(ns.task_declaration("Dataset984_nan", ["A"])), "A", "train", data_root=tmp_path / "nan",
           split_file=_split_file(tmp_path, cases))


def _split_file(tmp_path, cases):
    path = tmp_path / "split.json"
    path.write_text(json.dumps({"training": cases, "validation": [], "testing": []}))
    return path


def test_two_ct_phases_and_jpeg_refused(tmp_path):
    """JPEG is refused at the task file as nnU-Net v2's 2D reader refuses it (lossy label maps); BMP labels are
    written back as PNG."""
    from feduq.tasks.declared import parse_declaration as parse
    from feduq.flare.fingerprint import fingerprint_channels

    two = job_task(ns.task_declaration("Dataset985_phases", ["A"], channels=("CT", "CT")))
    assert fingerprint_channels(two) == {"0_CT": 0, "1_CT": 1}  # two phases of one name: two features
    for ending in (".jpg", ".JPEG"):
        path = task_file(tmp_path, {**ns.task_declaration("Dataset986_jpeg", ["A"]), "file_ending": ending})
        raises(f"task file {path}: file_ending: file_ending {ending!r} is not read: nnU-Net's 2D reader takes PNG, "
               "BMP and TIFF, not JPEG, whose lossy compression gives label files values no one drew; store images "
               "and labels as .png", get_task, path)
    bmp = parse({**ns.task_declaration("Dataset986_bmp", ["A"]), "file_ending": ".bmp"})
    assert bmp.label_ending == ".png" and parse(ns.task_declaration("Dataset987_nii", ["A"])).label_ending == ".nii.gz"


@pytest.mark.parametrize("ending, reader, accepted", [
    (".png", "NaturalImage2DIO", True), (".tif", "NaturalImage2DIO", True), (".png", "None", True),
    (".nii.gz", "SimpleITKIO", True), (".nii.gz", "NibabelIOWithReorient", True), (".mha", "SimpleITKIO", True),
    (".tif", "Tiff3DIO", False), (".png", "SimpleITKIO", False), (".nrrd", "NibabelIO", False)])
def test_overwrite_image_reader_writer_honoured_only_as_feduq_reads(tmp_path, ending, reader, accepted):
    """nnU-Net's reader override is accepted when it names the reader FedUQ reads the ending with, else refused."""
    raw = {**ns.task_declaration("Dataset988_reader", ["A"]), "file_ending": ending,
           "overwrite_image_reader_writer": reader}
    if accepted:
        assert parse_declaration(raw).file_ending == ending
        return
    readers = {".tif": "NaturalImage2DIO", ".png": "NaturalImage2DIO", ".nrrd": "SimpleITKIO"}[ending]
    raises(f"{SRC}: overwrite_image_reader_writer: {reader!r} is not how FedUQ reads {ending} files ({readers} is): "
           "remove the key or name that reader", parse_declaration, raw)


def test_hyperparameters_shape_checked_in_the_task_file():
    """feduq.hyperparameters is method -> object of executor arguments; names are checked where a job is configured."""
    raw = ns.task_declaration("Dataset989_hp", ["A"])
    ok = parse_declaration({**raw, "feduq": {**raw["feduq"], "hyperparameters": {"fedevi": {"kl_weight": 1e-5}}}})
    assert ok.hyperparameters == {"fedevi": {"kl_weight": 1e-5}}
    raises(f"{SRC}: feduq.hyperparameters.fedevi: must be a non-empty object of executor arguments, e.g. "
           '{"kl_weight": 1e-05}, got 1e-05', parse_declaration,
           {**raw, "feduq": {**raw["feduq"], "hyperparameters": {"fedevi": 1e-5}}})
    raises(f"{SRC}: feduq.hyperparameters: must map method names to objects of executor arguments, e.g. "
           '{"fedevi": {"kl_weight": 1e-05}}, got [1]', parse_declaration,
           {**raw, "feduq": {**raw["feduq"], "hyperparameters": [1]}})
