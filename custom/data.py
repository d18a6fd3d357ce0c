"""One dataset API for every 2D multi-center segmentation task: ``(task, center, split) -> samples``.

On-disk layout of a site (one folder per center, FLamby style)::

    <data_root>/<task>/<center>/images/<stem>.<png|jpg>   image (RGB or 8-bit gray)
    <data_root>/<task>/<center>/masks/<stem>.png          mask, same stem, pixel values listed in labels.json
    <data_root>/<task>/<center>/labels.json               {"labels": {"0": "background", "255": "polyp"}, ...}
    <data_root>/<task>/<center>/provenance.csv            per-file metadata (used for grouped splits)
    <data_root>/<task>/<center>/split.json                optional site-local split (overrides the packaged one)

``<task>`` is the task's folder, :attr:`TaskSpec.folder` (the task name unless ``data_dir`` says otherwise: skin ->
``skin_lesion``, breast -> ``breast_us``). Images and masks are paired by file stem. Class index ``i`` is the ``i``-th
smallest mask pixel value listed in ``labels.json`` (polyp: 0 -> 0 background, 255 -> 1 polyp), unless the task
merges foreground ids (:attr:`TaskSpec.merge_foreground`, prostate: 0 -> 0, 1 and 2 -> 1); see :func:`label_classes`.

Splits are MONAI decathlon JSON files (``{"training": [{"image": "images/x.jpg", "label": "masks/x.png"}, ...],
"validation": [...], "testing": [...]}``) with paths relative to the center folder. The lookup order is: an explicit
``split_file`` argument, then ``<center>/split.json`` at the site, then the committed file
``feduq/splits/<task>/<center>.json``.

Every problem with the input data raises :class:`DataError`; its message names the site and the offending file or
folder.

Tensor conventions of :func:`get_dataset` samples (see :func:`make_transforms`)::

    sample["image"]: float32 MetaTensor [in_channels, S, S], values in [0, 1]           (S = image_size)
    sample["label"]: float32 MetaTensor [1, S, S] holding class indices 0..C-1
                     (stage "test": [1, W0, H0], the stored resolution, not resized)

Like every MONAI 2D pipeline built on ``PILReader``, the two spatial axes are (width, height) of the stored PNG/JPEG,
i.e. transposed relative to ``numpy.asarray(PIL.Image.open(f))``. Image and label get identical treatment, and MONAI's
``PILWriter`` transposes back when saving, so predictions round-trip to correctly oriented files.
"""

from __future__ import annotations

import csv
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

__all__ = [
    "DATA_ROOT_ENV",
    "IMAGE_SUFFIXES",
    "SPLIT_KEYS",
    "DataError",
    "TaskSpec",
    "TASKS",
    "get_task",
    "task_folder",
    "label_classes",
    "resolve_data_root",
    "read_label_values",
    "read_groups",
    "stem_groups",
    "scan_center",
    "make_split",
    "make_center_split",
    "write_split_file",
    "load_split",
    "make_transforms",
    "get_dataset",
]

_LOG = logging.getLogger("feduq.data")
DATA_ROOT_ENV = "FEDUQ_DATA_ROOT"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
#: Short split names (API) -> decathlon list keys (JSON).
SPLIT_KEYS = {"train": "training", "val": "validation", "test": "testing"}
DEFAULT_FRACTIONS = (0.7, 0.1, 0.2)
PACKAGE_SPLITS_DIR = Path(__file__).resolve().parent / "splits"


class DataError(ValueError):
    """Bad input data or configuration. The message names the site (center) and the offending file or folder."""


def _err(site: str | None, message: str) -> DataError:
    return DataError(f"site '{site if site else '?'}': {message}")


# --------------------------------------------------------------------------------------------------------------------
# Task registry
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TaskSpec:
    """Static description of a multi-center segmentation task.

    Attributes:
        name: task name (API, job parameter, ``feduq/splits/<name>/``), e.g. ``"polyp"``.
        centers: the federation's sites (folder names), in canonical order.
        in_channels: channels fed to the network (3 = RGB, 1 = gray).
        class_names: one name per class index, background first, e.g. ``("background", "polyp")``.
        group_column: center -> ``provenance.csv`` column whose value groups samples that must stay in one split
            (video sequence, patient/case id). Centers in neither this nor ``group_pattern`` are split per image.
        data_dir: folder of the task under the data root when it differs from ``name`` (``"skin"`` lives in
            ``<data root>/skin_lesion/``); ``None`` = ``name``. See :attr:`folder`.
        group_column_if_present: center -> ``provenance.csv`` column used like ``group_column``, but only when the
            site's ``provenance.csv`` has it (full downloads carry lesion/patient ids that the shared subsets lack:
            the HAM10000 ``lesion_id`` written by tools/convert_skin_breast.py); otherwise the center falls through
            to ``group_pattern`` or per-image splitting.
        group_pattern: center -> regular expression that derives the split group from the file stem, for centers
            whose ``provenance.csv`` has no group column. The pattern must match the whole stem (``re.fullmatch``);
            the group is its first capturing group that took part in the match (``r"(.+)_z?\\d+"``: ``Case07_z012`` ->
            ``Case07``, ``train_00_01`` -> ``train_00``). Precedence: ``group_column``, then
            ``group_column_if_present``, then ``group_pattern``.
        merge_foreground: binary task (2 classes) whose sites may label parts of the foreground with several ids:
            the smallest value declared in ``labels.json`` is class 0 and every other declared value is class 1
            (prostate: the RUNMC/BMC zone ids 1 and 2 both become "prostate", the whole gland = mask >= 1). When
            False, the ``i``-th smallest declared value is class ``i`` and a site must declare exactly
            ``num_classes`` values. See :func:`label_classes`.
        eval_regions: optional region name -> class indices whose union forms the region scored at test time, for
            nested structures (fundus: ``{"disc": (1, 2), "cup": (2,)}``: disc = class >= 1, cup = class 2). Empty:
            test scores are per foreground class. Training is multi-class either way.
    """

    name: str
    centers: tuple[str, ...]
    in_channels: int
    class_names: tuple[str, ...]
    group_column: dict[str, str]
    data_dir: str | None = None
    group_pattern: dict[str, str] = field(default_factory=dict)
    group_column_if_present: dict[str, str] = field(default_factory=dict)
    merge_foreground: bool = False
    eval_regions: dict[str, tuple[int, ...]] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    @property
    def folder(self) -> str:
        """Folder of the task under the data root: ``data_dir`` or, by default, ``name``."""
        return self.data_dir or self.name


#: Prostate slice stems: ``<case>_z<slice>`` (NCI-ISBI RUNMC/BMC, tools/convert_prostate.py) or
#: ``<split>_<case>_<slice>`` (UST-RUN/SAML subsets) -> the case id (``Case07``, ``train_00``).
PROSTATE_CASE_PATTERN = r"(.+)_z?\d+"
#: BUS-BRA stems ``bus_0001-l`` (download) or ``benign_0001-l`` (shared subset) -> the patient number ``0001``.
BUSBRA_PATIENT_PATTERN = r"\D*(\d+)-[A-Za-z]+"
#: The HAM10000 acquisition sources (metadata column ``dataset``) as site folders.
HAM10000_CENTERS = ("HAM10000-vidir_molemax", "HAM10000-vidir_modern", "HAM10000-rosendahl", "HAM10000-vienna_dias")

TASKS: dict[str, TaskSpec] = {
    "polyp": TaskSpec(
        name="polyp",
        centers=("Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"),
        in_channels=3,
        class_names=("background", "polyp"),
        group_column={"CVC-ColonDB": "sequence"},
    ),
    # FedEvi Table 2: 6-site prostate T2 MRI (2D axial slices), whole gland; split by case.
    "prostate": TaskSpec(
        name="prostate",
        centers=("BIDMC", "BMC", "HK", "I2CVB", "RUNMC", "UCL"),
        in_channels=1,
        class_names=("background", "prostate"),
        group_column={"BMC": "case", "RUNMC": "case"},
        group_pattern={c: PROSTATE_CASE_PATTERN for c in ("BIDMC", "HK", "I2CVB", "UCL")},
        merge_foreground=True,
    ),
    # FedEvi Table 3: optic disc / cup (FedDG/DoFE ROI domains); trained as bg / rim / cup, scored as disc / cup.
    "fundus": TaskSpec(
        name="fundus",
        centers=("Drishti-GS", "RIM-ONE-r3", "REFUGE-train", "REFUGE-val"),
        in_channels=3,
        class_names=("background", "disc_rim", "cup"),
        group_column={},
        eval_regions={"disc": (1, 2), "cup": (2,)},
    ),
    # FedA3I SKIN (there ISIC-2017): HAM10000 dermoscopy, one site per acquisition source. Images of one lesion stay
    # in one split when provenance.csv has HAM10000's lesion_id (converted full download; the shared subset has
    # one image per lesion and no such column).
    "skin": TaskSpec(
        name="skin",
        centers=HAM10000_CENTERS,
        in_channels=3,
        class_names=("background", "lesion"),
        group_column={},
        data_dir="skin_lesion",
        group_column_if_present={c: "lesion_id" for c in HAM10000_CENTERS},
    ),
    # FedA3I BREAST (there BUS/BUSIS/UDIAT): breast ultrasound lesions, one site per dataset. BUS-BRA images of one
    # patient (bus_0001-l, bus_0001-r) stay in one split; BUSI has no patient ids.
    "breast": TaskSpec(
        name="breast",
        centers=("BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"),
        in_channels=1,
        class_names=("background", "lesion"),
        group_column={},
        data_dir="breast_us",
        group_pattern={"BUS-BRA-INCa-Brazil": BUSBRA_PATIENT_PATTERN},
    ),
}


def get_task(name: str) -> TaskSpec:
    """Return the registered :class:`TaskSpec` of ``name``; raises :class:`DataError` listing the known tasks."""
    try:
        return TASKS[name]
    except KeyError:
        raise DataError(f"unknown task '{name}'; known tasks: {sorted(TASKS)}") from None


def task_folder(task: str) -> str:
    """Folder of ``task`` under the data root (:attr:`TaskSpec.folder`); an unregistered name is its own folder."""
    spec = TASKS.get(task)
    return spec.folder if spec is not None else task


def label_classes(spec: TaskSpec, label_values: Sequence[int], site: str | None = None) -> list[int]:
    """Class index of each mask value declared in a site's ``labels.json``, in the order of ``label_values``.

    Default: the ``i``-th smallest declared value is class ``i``, and the site must declare exactly
    ``spec.num_classes`` values. With ``spec.merge_foreground`` (binary tasks): the smallest value is class 0
    (background) and every other declared value is class 1 (prostate zone ids 1, 2 -> whole gland).

    Raises:
        DataError: the number of declared values does not fit the task (names the site and both counts), or
            ``merge_foreground`` on a task that does not have exactly 2 classes.
    """
    values = [int(v) for v in label_values]
    ranks = {v: i for i, v in enumerate(sorted(set(values)))}
    if spec.merge_foreground:
        if spec.num_classes != 2:
            raise _err(site, f"task '{spec.name}': merge_foreground needs exactly 2 classes, not {spec.num_classes}")
        return [0 if ranks[v] == 0 else 1 for v in values]
    if len(ranks) != spec.num_classes:
        raise _err(site, f"labels.json declares {len(ranks)} mask values {sorted(ranks)} but task '{spec.name}' has "
                         f"{spec.num_classes} classes {list(spec.class_names)}")
    return [ranks[v] for v in values]


# --------------------------------------------------------------------------------------------------------------------
# Locating and scanning a site
# --------------------------------------------------------------------------------------------------------------------


def resolve_data_root(data_root: str | os.PathLike | None = None, site: str | None = None) -> Path:
    """Return the data root folder: ``data_root`` if given, else the ``FEDUQ_DATA_ROOT`` environment variable.

    Raises:
        DataError: neither is set, or the folder does not exist (names the site, the env var and the path).
    """
    if data_root not in (None, ""):
        path, origin = Path(data_root), "data_root argument"
    elif os.environ.get(DATA_ROOT_ENV):
        path, origin = Path(os.environ[DATA_ROOT_ENV]), f"${DATA_ROOT_ENV}"
    else:
        raise _err(
            site,
            f"no data root: set \"data_root\" in the site's local/feduq_site.json "
            f"(python tools/prepare_site.py <site workspace> --data-root DIR) or the environment variable {DATA_ROOT_ENV}",
        )
    given = path
    path = path.expanduser().resolve()
    if not path.is_dir():
        hint = (
            f"; the relative path {str(given)!r} was resolved against this process's working directory {Path.cwd()}"
            " (a FLARE site runs in its own workspace): give an absolute path"
            if not given.expanduser().is_absolute() else ""
        )
        raise _err(site, f"data root {path} (from {origin}) does not exist or is not a folder{hint}")
    return path


def _center_dir(data_root: Path, task: str, center: str) -> Path:
    center_dir = Path(data_root) / task_folder(task) / center
    if not center_dir.is_dir():
        raise _err(center, f"center folder {center_dir} does not exist")
    return center_dir


def _rel(path: str | os.PathLike, center_dir: Path) -> str:
    """``path`` relative to the center folder (posix), or unchanged if it lies elsewhere."""
    try:
        return Path(path).resolve().relative_to(center_dir.resolve()).as_posix()
    except ValueError:
        return str(path)


def read_label_values(center_dir: str | os.PathLike) -> list[int]:
    """Sorted mask pixel values declared in ``<center_dir>/labels.json``; class index ``i`` = ``i``-th value.

    Raises:
        DataError: labels.json missing, not JSON, without a ``"labels"`` dict, or with non-integer keys.
    """
    center_dir = Path(center_dir)
    path = center_dir / "labels.json"
    site = center_dir.name
    try:
        labels = json.loads(path.read_text())["labels"]
        values = sorted(int(k) for k in labels)
    except FileNotFoundError:
        raise _err(site, f"labels file {path} is missing") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        expected = "{'labels': {'0': 'background', '255': ...}}"
        raise _err(site, f"labels file {path} is invalid (expected {expected}): {e}") from None
    if len(values) < 2:
        raise _err(site, f"labels file {path} lists {len(values)} value(s); need background + >= 1 class")
    return values


def read_groups(center_dir: str | os.PathLike, column: str) -> dict[str, str]:
    """Map file stem -> value of ``column`` in ``<center_dir>/provenance.csv``.

    Accepts the pass-2 format (file column ``image_file``, e.g. ``images/seq01_frame001.jpg``) and the pass-1 format
    (file column ``file``).

    Raises:
        DataError: provenance.csv missing, or without a file column or without ``column``.
    """
    center_dir = Path(center_dir)
    path, site = center_dir / "provenance.csv", center_dir.name
    if not path.is_file():
        raise _err(site, f"provenance file {path} is missing (needed for the '{column}' groups)")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        file_col = "image_file" if "image_file" in fields else "file" if "file" in fields else None
        if file_col is None or column not in fields:
            raise _err(site, f"provenance file {path} needs an 'image_file' (or 'file') and a '{column}' column")
        return {Path(row[file_col]).stem: row[column] for row in reader}


def stem_groups(stems: Sequence[str], pattern: str, site: str | None = None) -> dict[str, str]:
    """Map file stem -> split group derived by ``pattern`` (see :attr:`TaskSpec.group_pattern`).

    The pattern must match the whole stem; the group is its first capturing group that took part in the match.

    Raises:
        DataError: a stem that the pattern does not match, or a pattern without a capturing group (names the site,
            the stem and the pattern).
    """
    rx = re.compile(pattern)
    if rx.groups == 0:
        raise _err(site, f"group pattern {pattern!r} has no capturing group (the group is the first one that matches)")
    out = {}
    for stem in stems:
        m = rx.fullmatch(stem)
        group = next((g for g in m.groups() if g is not None), None) if m else None
        if group is None:
            raise _err(site, f"file stem '{stem}' does not match the group pattern {pattern!r}, so its split group "
                             f"is unknown")
        out[stem] = group
    return out


def _image_size(path: Path, site: str, center_dir: Path) -> tuple[tuple[int, int], str]:
    """(width, height) and PIL mode from the file header only (no full decode)."""
    try:
        with Image.open(path) as im:
            return im.size, im.mode
    except Exception as e:  # PIL raises OSError, SyntaxError, struct.error, ... on corrupt headers
        raise _err(site, f"cannot read image header of {_rel(path, center_dir)}: {e}") from None


def _check_pair(image: Path, label: Path, site: str, center_dir: Path) -> None:
    """Both files exist, are readable, the mask is single-channel and has the image's size."""
    for path, kind in ((image, "image"), (label, "mask")):
        if not path.is_file():
            raise _err(site, f"{kind} {_rel(path, center_dir)} does not exist")
    image_size, _ = _image_size(image, site, center_dir)
    mask_size, mask_mode = _image_size(label, site, center_dir)
    if mask_mode not in ("1", "L", "P", "I", "I;16"):
        raise _err(site, f"mask {_rel(label, center_dir)} has mode {mask_mode}; expected a single-channel mask")
    if mask_size != image_size:
        raise _err(
            site,
            f"mask {_rel(label, center_dir)} is {mask_size[0]}x{mask_size[1]} but image {_rel(image, center_dir)} "
            f"is {image_size[0]}x{image_size[1]}",
        )


def _files_by_stem(folder: Path, site: str, center_dir: Path) -> dict[str, Path]:
    if not folder.is_dir():
        raise _err(site, f"folder {folder} is missing")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        if path.stem in files:
            raise _err(site, f"two files share the stem '{path.stem}': {_rel(files[path.stem], center_dir)}, "
                             f"{_rel(path, center_dir)}")
        files[path.stem] = path
    return files


def scan_center(data_root: str | os.PathLike, task: str, center: str) -> list[dict[str, str]]:
    """List a site's image/mask pairs, sorted by stem: ``[{"id": stem, "image": abs path, "label": abs path}, ...]``.

    Only the file headers are read (size and mode), so a truncated pixel body is not detected here.

    Raises:
        DataError: center folder, ``images/`` or ``masks/`` missing; an image without a mask or a mask without an
            image; duplicate stems; an unreadable header; a mask that is not single-channel or whose size (W, H)
            differs from its image. The message names the site and the file.
    """
    center_dir = _center_dir(Path(data_root), task, center)
    images = _files_by_stem(center_dir / "images", center, center_dir)
    masks = _files_by_stem(center_dir / "masks", center, center_dir)
    no_mask, no_image = sorted(set(images) - set(masks)), sorted(set(masks) - set(images))
    more = lambda stems: f" ({len(stems) - 1} more)" if len(stems) > 1 else ""  # noqa: E731
    if no_mask:
        raise _err(center, f"image {_rel(images[no_mask[0]], center_dir)} has no mask masks/{no_mask[0]}.png"
                           f"{more(no_mask)}")
    if no_image:
        raise _err(center, f"mask {_rel(masks[no_image[0]], center_dir)} has no image "
                           f"(images/{no_image[0]}.<png|jpg>){more(no_image)}")
    if not images:
        raise _err(center, f"no images ({', '.join(IMAGE_SUFFIXES)}) in {center_dir / 'images'}")
    items = []
    for stem in sorted(images):
        _check_pair(images[stem], masks[stem], center, center_dir)
        items.append({"id": stem, "image": str(images[stem]), "label": str(masks[stem])})
    return items


# --------------------------------------------------------------------------------------------------------------------
# Splits
# --------------------------------------------------------------------------------------------------------------------


def _split_targets(n: int, fractions: Sequence[float]) -> tuple[int, int]:
    """(validation, testing) sample targets: floor(fraction * n), at least 1 when the fraction > 0 and n >= 3.

    With n == 2 (and nonzero training and validation fractions): (1, 0), since a site needs one training and one
    validation image before it can have a test image.
    """
    if n == 2 and fractions[0] > 0 and fractions[1] > 0:
        return 1, 0
    targets = []
    for frac in fractions[1:]:
        t = int(np.floor(frac * n + 1e-9))
        targets.append(max(t, 1) if frac > 0 and n >= 3 else t)
    return targets[0], targets[1]


def make_split(
    items: Sequence[Any],
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    seed: int = 0,
    groups: Sequence[Any] | None = None,
) -> dict[str, list[Any]]:
    """Seeded train/validation/test split that keeps every group in one split (pure function).

    Groups are shuffled with ``numpy.random.default_rng(seed)``; in that order each group goes to ``testing`` if it
    still fits under ``floor(fractions[2] * n)`` samples, else to ``validation`` if it fits under
    ``floor(fractions[1] * n)``, else to ``training``. Then testing and validation are each topped up with the one
    training group that brings their count closest to the target (only if that is closer). Without ``groups`` every
    item is its own group, so the counts hit the targets exactly. When ``n >= 3``, every split with a nonzero
    fraction gets at least one sample (provided there are at least as many groups as such splits).

    Fewer than 3 groups (all fractions nonzero, e.g. a prostate site with slices of 2 cases): whole groups cannot
    fill three splits, so

    * 2 groups, ``n >= 3``: ``testing`` gets the smaller group whole (tie: the first in seeded order), so no test
      image shares a group with a training or validation image; training and validation share the other group,
      split per item (validation ``max(1, floor(f_val / (f_train + f_val) * m))`` of its ``m >= 2`` items, drawn
      with the seed);
    * 1 group, or ``n <= 2``: the groups are ignored and the items are split one by one.

    ``n == 2`` gives one training and one validation item and an empty ``testing``; ``n == 1`` only ``training``.

    Args:
        items: the samples (any objects); each output list keeps their input order.
        fractions: (train, validation, test) fractions summing to 1; training gets the remainder.
        seed: RNG seed; the same seed gives the same split.
        groups: optional group key per item (same length as ``items``).

    Returns:
        ``{"training": [...], "validation": [...], "testing": [...]}`` (lists of the input items).

    Raises:
        ValueError: bad ``fractions`` or ``groups`` length.
    """
    fractions = tuple(float(f) for f in fractions)
    if len(fractions) != 3 or min(fractions) < 0 or abs(sum(fractions) - 1.0) > 1e-6:
        raise ValueError(f"fractions must be 3 non-negative numbers (train, val, test) summing to 1, got {fractions}")
    n = len(items)
    groups = list(range(n)) if groups is None else list(groups)
    if len(groups) != n:
        raise ValueError(f"groups has {len(groups)} entries for {n} items")

    grouped = len(set(groups)) < n
    members: dict[Any, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    keys = list(members)
    order = [keys[i] for i in np.random.default_rng(seed).permutation(len(keys))]

    if grouped and len(members) < 3 and min(fractions) > 0:  # too few groups for three whole-group splits
        if len(members) == 1 or n <= 2:
            return make_split(items, fractions=fractions, seed=seed)
        test_group = min(order, key=lambda g: len(members[g]))  # min() keeps the first (seeded) of equal sizes
        rest = [i for g in order if g != test_group for i in members[g]]
        n_val = max(1, int(np.floor(fractions[1] / (fractions[0] + fractions[1]) * len(rest) + 1e-9)))
        picked = np.random.default_rng(seed).permutation(len(rest))[:n_val]
        val_idx = {rest[j] for j in picked}
        idx = {"training": [i for i in rest if i not in val_idx], "validation": sorted(val_idx),
               "testing": members[test_group]}
        return {name: [items[i] for i in sorted(ix)] for name, ix in idx.items()}

    val_target, test_target = _split_targets(n, fractions)
    targets = {"testing": test_target, "validation": val_target}
    assigned: dict[str, list[Any]] = {"training": [], "validation": [], "testing": []}
    counts = dict.fromkeys(assigned, 0)
    for g in order:  # pass 1: fill testing, then validation, up to their targets without overshooting
        size = len(members[g])
        name = next((s for s in ("testing", "validation") if counts[s] + size <= targets[s]), "training")
        assigned[name].append(g)
        counts[name] += size

    def gap(name: str, extra: int = 0) -> int:
        return abs(counts[name] + extra - targets[name])

    for name in ("testing", "validation"):  # pass 2: top up with the training group that lands closest to the target
        best = min(assigned["training"], key=lambda g: gap(name, len(members[g])), default=None)
        if best is not None and gap(name, len(members[best])) < gap(name):
            assigned["training"].remove(best)
            assigned[name].append(best)
            counts[name] += len(members[best])

    # Guarantee: a split with a nonzero fraction is never empty (n >= 3); take the smallest group of the richest split.
    if n >= 3:
        for name, frac in zip(("training", "validation", "testing"), fractions):
            if frac > 0 and not assigned[name]:
                donor = max(assigned, key=lambda s: (len(assigned[s]), s == "training"))
                if len(assigned[donor]) > 1:
                    g = min(assigned[donor], key=lambda k: len(members[k]))
                    assigned[donor].remove(g)
                    assigned[name].append(g)

    return {name: [items[i] for i in sorted(i for g in gs for i in members[g])] for name, gs in assigned.items()}


def _provenance_columns(center_dir: Path) -> list[str]:
    """Header of ``<center_dir>/provenance.csv``, or ``[]`` when there is none."""
    path = center_dir / "provenance.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return next(csv.reader(f), [])


def _natural(value: str) -> tuple:
    return (0, int(value), "") if str(value).isdigit() else (1, 0, str(value))


def make_center_split(
    data_root: str | os.PathLike,
    task: str,
    center: str,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    seed: int = 0,
) -> dict[str, Any]:
    """Scan a site and split it with :func:`make_split`, grouping by a ``provenance.csv`` column
    (``TaskSpec.group_column[center]``, or ``group_column_if_present[center]`` when the file has it) or else a
    file-stem regex (``TaskSpec.group_pattern[center]``) if set. Fewer than 3 groups: see :func:`make_split`
    (recorded as ``group_note``).

    Returns:
        A decathlon dict ready for :func:`write_split_file`: metadata keys plus ``training``/``validation``/``testing``
        lists of ``{"image": "images/<stem>.jpg", "label": "masks/<stem>.png"}`` (paths relative to the center folder).

    Raises:
        DataError: anything :func:`scan_center` raises; an image missing from provenance.csv when grouping.
    """
    spec = get_task(task)
    center_dir = _center_dir(Path(data_root), task, center)
    items = scan_center(data_root, task, center)
    column = spec.group_column.get(center)
    optional = spec.group_column_if_present.get(center)
    if not column and optional and optional in _provenance_columns(center_dir):
        column = optional
    pattern = None if column else spec.group_pattern.get(center)
    groups = None
    if column:
        table = read_groups(center_dir, column)
        missing = [it for it in items if it["id"] not in table]
        if missing:
            raise _err(center, f"image {_rel(missing[0]['image'], center_dir)} (and {len(missing) - 1} more) is not "
                               f"listed in {center_dir / 'provenance.csv'}, so its '{column}' group is unknown")
        groups = [table[it["id"]] for it in items]
    elif pattern:
        table = stem_groups([it["id"] for it in items], pattern, site=center)
        groups = [table[it["id"]] for it in items]
    split = make_split(items, fractions=fractions, seed=seed, groups=groups)
    out: dict[str, Any] = {
        "name": f"{task}/{center}",
        "description": "FedUQ split; paths are relative to the center folder",
        "seed": seed,
        "fractions": list(fractions),
        "group_column": column,
        **({"group_pattern": pattern} if pattern else {}),
        "num_groups": len(set(groups)) if groups is not None else len(items),
    }
    if groups is not None and out["num_groups"] < 3 and min(fractions) > 0:
        out["group_note"] = (
            "fewer than 3 groups: testing holds one whole group, training and validation share the other"
            if out["num_groups"] == 2 and len(items) >= 3
            else "fewer than 3 groups: split per image"
        )
    if groups is not None:
        out["groups"] = {key: sorted({table[it["id"]] for it in split[key]}, key=_natural) for key in split}
    for key, split_items in split.items():
        out[key] = [{"image": _rel(it["image"], center_dir), "label": _rel(it["label"], center_dir)}
                    for it in split_items]
    return out


def write_split_file(split: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write a decathlon split dict as indented JSON (creating parent folders); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = []
    for key, value in split.items():  # one sample per line keeps the file short and diff-friendly
        if key in SPLIT_KEYS.values():
            body = ",\n".join(f"  {json.dumps(item)}" for item in value)
            lines.append(f' {json.dumps(key)}: [\n{body}\n ]' if value else f' {json.dumps(key)}: []')
        else:
            lines.append(f" {json.dumps(key)}: {json.dumps(value)}")
    path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    return path


def _find_split_file(task: str, center: str, center_dir: Path, split_file: str | os.PathLike | None) -> Path:
    if split_file:
        candidates = [Path(split_file)]
    else:
        candidates = [center_dir / "split.json", PACKAGE_SPLITS_DIR / task / f"{center}.json"]
    for path in candidates:
        if path.is_file():
            return path
    raise _err(center, "no split file; looked for " + ", ".join(str(p) for p in candidates))


def load_split(
    task: str,
    center: str,
    data_root: str | os.PathLike | None = None,
    split_file: str | os.PathLike | None = None,
    on_bad_file: str = "error",
) -> dict[str, list[dict[str, str]]]:
    """Load a site's split: ``{"training"|"validation"|"testing": [{"image": abs path, "label": abs path}, ...]}``.

    ``on_bad_file="skip"`` (a site setting) drops a pair whose file is missing, unreadable or whose
    mask/image sizes differ, with a warning naming the site and the file, instead of raising.

    Split file precedence: ``split_file`` > ``<data_root>/<task>/<center>/split.json`` > the packaged
    ``feduq/splits/<task>/<center>.json``. Paths in the file are relative to the center folder.

    Raises:
        DataError: unknown task; no data root / center folder / split file; invalid JSON or a missing key; a listed
            file that does not exist, has an unreadable header, or a mask/image size mismatch; a file listed twice.
    """
    from monai.data import load_decathlon_datalist

    get_task(task)
    center_dir = _center_dir(resolve_data_root(data_root, site=center), task, center)
    path = _find_split_file(task, center, center_dir, split_file)
    split: dict[str, list[dict[str, str]]] = {}
    for key in SPLIT_KEYS.values():
        try:
            split[key] = load_decathlon_datalist(path, is_segmentation=True, data_list_key=key, base_dir=center_dir)
        except (ValueError, TypeError, KeyError) as e:  # json.JSONDecodeError is a ValueError
            raise _err(center, f"split file {path} is invalid ({key}): {e}") from None
    seen: dict[str, str] = {}
    for key, items in split.items():
        for item in items:
            if "image" not in item or "label" not in item:
                raise _err(center, f"split file {path}: '{key}' entry {item} needs 'image' and 'label'")
            try:
                _check_pair(Path(item["image"]), Path(item["label"]), center, center_dir)
            except DataError as e:
                if on_bad_file != "skip":
                    raise
                _LOG.warning("%s; skipped (on_bad_file=skip)", e)
                item["skip"] = True
            if item["image"] in seen:
                raise _err(center, f"split file {path} lists {_rel(item['image'], center_dir)} in both "
                                   f"'{seen[item['image']]}' and '{key}'")
            seen[item["image"]] = key
    return {key: [i for i in items if not i.get("skip")] for key, items in split.items()}


def _check_decodes(items: list[dict], site: str, center_dir: Path, on_bad_file: str) -> list[dict]:
    """Fully decode every image and mask (catches truncated files a header read misses).

    Raises:
        DataError: naming the site and the file, unless ``on_bad_file == "skip"`` (then the pair is
            dropped with a warning).
    """
    good = []
    for item in items:
        try:
            for key in ("image", "label"):
                try:
                    with Image.open(item[key]) as img:
                        img.load()
                except (OSError, SyntaxError, ValueError) as e:
                    raise _err(site, f"cannot decode {_rel(item[key], center_dir)}: {e}") from None
        except DataError as e:
            if on_bad_file != "skip":
                raise
            _LOG.warning("%s; skipped (on_bad_file=skip)", e)
            continue
        good.append(item)
    return good


# --------------------------------------------------------------------------------------------------------------------
# Transforms and datasets
# --------------------------------------------------------------------------------------------------------------------


class _ToChannels:
    """PILReader converter: bring a PIL image to ``in_channels`` (gray/palette/RGBA -> RGB, or keep gray).

    A class rather than a lambda so the transform chain stays picklable (DataLoader workers).
    """

    def __init__(self, in_channels: int, site: str | None = None):
        self.in_channels, self.site = in_channels, site

    def __call__(self, img: Image.Image) -> Image.Image:
        name = getattr(img, "filename", "?")
        if self.in_channels == 3:
            return img if img.mode == "RGB" else img.convert("RGB")  # gray repeats, alpha dropped, palette expanded
        if img.mode in ("L", "I", "I;16", "F"):
            return img
        if img.mode in ("1", "LA", "La"):
            return img.convert("L")
        raise _err(self.site, f"image {name} has mode {img.mode} ({len(img.getbands())} bands); the task expects 1 "
                              f"(gray) channel and colour images are not converted silently")


class _CheckLabelValues:
    """``Lambdad`` function: raise :class:`DataError` if a mask holds pixel values that labels.json does not declare.

    Wrapped in ``Lambdad`` (a deterministic MONAI transform), so ``CacheDataset`` caches past it.
    """

    def __init__(self, label_values: Sequence[int], site: str | None = None):
        self.label_values, self.site = [int(v) for v in label_values], site

    def __call__(self, label):
        extra = sorted(set(np.unique(np.asarray(label)).tolist()) - set(self.label_values))
        if extra:
            name = getattr(label, "meta", {}).get("filename_or_obj", "?")
            raise _err(self.site, f"mask {'/'.join(Path(str(name)).parts[-2:])} holds pixel values {[int(v) for v in extra[:10]]} not "
                                  f"declared in labels.json {self.label_values}")
        return label


RESIZE_MODES = ("stretch", "letterbox")
ORIGINAL_SIZE_KEY = "orig_size"


class _Letterbox:
    """Letterbox ``keys`` of a sample dict into an ``image_size`` square (see :func:`letterbox_box`).

    The aspect ratio is the sample's ``orig_size`` (the size before the data provider stretched it to a square,
    from ``provenance.csv``; ``[0, 0]`` = unknown) or else the stored one. Wrapped in MONAI's deterministic
    ``Lambda`` so ``CacheDataset`` caches past it; a class, not a closure, so it pickles.
    """

    def __init__(self, keys: Sequence[str], modes: Sequence[str], image_size: int):
        self.keys, self.modes, self.image_size = tuple(keys), tuple(modes), int(image_size)

    def __call__(self, data: dict) -> dict:
        from monai.transforms import Resize, SpatialPad

        d = dict(data)
        for key, mode in zip(self.keys, self.modes):
            img = d[key]
            shape = aspect_shape(d.get(ORIGINAL_SIZE_KEY), tuple(img.shape[1:]))
            lengths = tuple(n for _, n in letterbox_box(shape, self.image_size))
            img = Resize(lengths, mode=mode, anti_aliasing=mode != "nearest")(img)
            d[key] = SpatialPad((self.image_size,) * len(lengths), method="symmetric")(img)
        return d


def aspect_shape(orig_size, stored_shape: Sequence[int]) -> tuple[int, ...]:
    """The spatial shape whose aspect ratio a letterbox keeps: ``orig_size`` when known (all sides > 0, same
    number of axes as ``stored_shape``), else ``stored_shape``."""
    if orig_size is not None:
        orig = tuple(int(v) for v in np.asarray(orig_size).reshape(-1))
        if len(orig) == len(stored_shape) and min(orig) > 0:
            return orig
    return tuple(int(v) for v in stored_shape)


def read_original_sizes(center_dir: str | os.PathLike) -> dict[str, tuple[int, int]]:
    """Map file stem -> ``(orig_width, orig_height)`` from ``provenance.csv`` (pass-2 sites record the size an
    image had before it was stretched to 384 x 384); ``{}`` when the file or those columns are absent.

    Raises:
        DataError: a recorded size that is not a positive integer (names the file and the stem).
    """
    center_dir = Path(center_dir)
    path = center_dir / "provenance.csv"
    if not path.is_file():
        return {}
    with path.open(newline="") as f:
        fields = csv.DictReader(f).fieldnames or []
    if not {"orig_width", "orig_height"} <= set(fields):
        return {}
    widths, heights = read_groups(center_dir, "orig_width"), read_groups(center_dir, "orig_height")
    out = {}
    for stem, w in widths.items():
        try:
            size = (int(w), int(heights[stem]))
        except (TypeError, ValueError):
            size = (0, 0)
        if min(size) <= 0:
            raise _err(center_dir.name, f"{path}: orig_width/orig_height of '{stem}' is not a positive integer "
                                        f"({w!r}, {heights.get(stem)!r})")
        out[stem] = size
    return out


def letterbox_box(shape: Sequence[int], image_size: int) -> tuple[tuple[int, int], ...]:
    """Where a stored image of spatial ``shape`` lands in its ``image_size``-square letterbox.

    Mirrors MONAI ``Resized(size_mode="longest")`` (each side scaled by ``image_size / max(shape)``,
    rounded half-to-even) followed by ``SpatialPadd(method="symmetric")`` (``(image_size - n) // 2``
    before), the ``resize="letterbox"`` path of :func:`make_transforms`.

    Args:
        shape: stored spatial shape, e.g. ``(W, H)`` as MONAI's PILReader gives it.
        image_size: side of the network input square.

    Returns:
        ``((start, length), ...)`` per spatial axis, in letterbox pixels.

    Raises:
        ValueError: a non-positive side or ``image_size``.
    """
    if image_size <= 0 or not shape or min(shape) <= 0:
        raise ValueError(f"letterbox_box: need positive sides, got shape={tuple(shape)}, image_size={image_size}")
    scale = image_size / max(shape)
    lengths = [int(round(n * scale)) for n in shape]
    return tuple(((image_size - n) // 2, n) for n in lengths)


def make_transforms(
    stage: str,
    image_size: int,
    in_channels: int,
    label_values: Sequence[int],
    site: str | None = None,
    label_classes: Sequence[int] | None = None,
    resize: str = "stretch",
):
    """MONAI dictionary transforms for ``{"image": path, "label": path}`` items.

    Pipeline: LoadImaged(PILReader, image converted to ``in_channels``) -> EnsureChannelFirstd -> label value check ->
    MapLabelValued(``label_values`` -> ``label_classes``) -> Resized(image bilinear with anti-aliasing; label nearest,
    except for ``stage == "test"``) -> ScaleIntensityd(image, min-max to [0, 1]) -> [train: flip along a random axis with
    p=0.5] -> EnsureTyped(float32).

    Output per sample:
        ``image``: float32 MetaTensor ``[in_channels, image_size, image_size]``, values in [0, 1].
        ``label``: float32 MetaTensor ``[1, image_size, image_size]`` of class indices 0..C-1 (for ``"test"`` the
        stored resolution ``[1, W, H]``, so HD95 is measured in stored pixels; upsample logits to it).
        Spatial axes follow MONAI's PILReader, i.e. (width, height) of the stored file, for image and label alike.

    Args:
        stage: ``"train"``, ``"val"`` or ``"test"``.
        image_size: network input side length.
        in_channels: 3 (gray/RGBA/palette converted to RGB) or 1 (gray kept; colour input raises DataError).
        label_values: mask pixel values declared by the site (see :func:`read_label_values`).
        site: only used in error messages.
        label_classes: class index of each value of ``label_values`` (same order; see :func:`label_classes`);
            default: the ``i``-th smallest value is class ``i``.
        resize: ``"stretch"`` (FedUQ default: each side resized to ``image_size``) or ``"letterbox"`` (official FedEvi
            code variant for polyp, methods.md §1.1: the long side resized to ``image_size``, the short side zero-padded
            symmetrically, at the aspect ratio of the sample's ``orig_size`` when it has one (see
            :func:`read_original_sizes`), else of the stored image; :func:`letterbox_box` gives where the image lands,
            for mapping predictions back).

    Raises:
        DataError: unsupported ``stage``, ``in_channels`` or ``resize`` (at build time); at load time, an image that
            cannot be brought to ``in_channels`` or a mask with undeclared values.
    """
    from monai.data import PILReader
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        Identityd,
        Lambdad,
        LoadImaged,
        MapLabelValued,
        OneOf,
        Lambda,
        RandFlipd,
        Resized,
        ScaleIntensityd,
    )

    if stage not in SPLIT_KEYS:
        raise _err(site, f"unknown stage '{stage}'; expected one of {sorted(SPLIT_KEYS)}")
    if in_channels not in (1, 3):
        raise _err(site, f"in_channels={in_channels} is not supported (1 = gray, 3 = RGB)")
    if resize not in RESIZE_MODES:
        raise _err(site, f"resize={resize!r} is not supported; expected one of {list(RESIZE_MODES)}")
    keys = ("image", "label")
    size = (int(image_size), int(image_size))
    values = [int(v) for v in label_values]
    classes = list(range(len(values))) if label_classes is None else [int(c) for c in label_classes]
    if len(classes) != len(values):
        raise _err(site, f"label_classes {classes} and label_values {values} differ in length")
    if label_classes is None:
        values = sorted(values)
    else:
        values, classes = (list(t) for t in zip(*sorted(zip(values, classes))))
    label_values = values
    chain = [
        LoadImaged("image", reader=PILReader(converter=_ToChannels(in_channels, site)), image_only=True),
        LoadImaged("label", reader=PILReader(), image_only=True),
        EnsureChannelFirstd(keys),
        Lambdad("label", func=_CheckLabelValues(label_values, site)),
        MapLabelValued("label", orig_labels=label_values, target_labels=classes),
    ]
    if resize == "letterbox":  # long side -> image_size at the original aspect ratio, then symmetric zero padding
        boxed = keys if stage != "test" else ("image",)
        chain += [
            ScaleIntensityd("image", minv=0.0, maxv=1.0),  # before the padding: the pad is black (0)
            Lambda(_Letterbox(boxed, ("bilinear", "nearest")[: len(boxed)], image_size)),  # label padding: background
        ]
    else:
        chain += [
            Resized("image", spatial_size=size, mode="bilinear", anti_aliasing=True),
            ScaleIntensityd("image", minv=0.0, maxv=1.0),  # after the resize: fewer pixels, still exactly [0, 1]
        ]
        if stage != "test":
            chain.append(Resized("label", spatial_size=size, mode="nearest"))
    if stage == "train":  # FedEvi: with p=0.5 flip along one random axis
        chain.append(
            OneOf(
                [RandFlipd(keys, prob=1.0, spatial_axis=0), RandFlipd(keys, prob=1.0, spatial_axis=1), Identityd(keys)],
                weights=[0.25, 0.25, 0.5],
            )
        )
    chain.append(EnsureTyped(keys, dtype=np.float32))
    return Compose(chain)


def get_dataset(
    task: str,
    center: str,
    split: str,
    data_root: str | os.PathLike | None = None,
    image_size: int = 384,
    max_items: int | None = None,
    cache: bool = True,
    split_file: str | os.PathLike | None = None,
    seed: int = 0,
    on_bad_file: str = "error",
    resize: str = "stretch",
):
    """MONAI dataset of one site's split, ready for ``monai.data.DataLoader``.

    Args:
        task: registered task name (see :data:`TASKS`).
        center: site folder name.
        split: ``"train"``, ``"val"`` or ``"test"`` (or the decathlon keys ``"training"``, ``"validation"``,
            ``"testing"``).
        data_root: data root; default ``$FEDUQ_DATA_ROOT``.
        image_size: network input side length.
        max_items: keep only the first N items of the split list (fast tests).
        cache: ``CacheDataset`` (deterministic transforms cached once, the random flip runs every epoch) or a plain
            ``Dataset``.
        split_file: explicit split JSON (highest precedence, see :func:`load_split`).
        seed: seeds the random flip of the training transforms.
        on_bad_file: ``"error"`` (default) raises on a missing, unreadable, truncated or size-mismatched
            file; ``"skip"`` drops that pair with a warning naming the site and file (a site setting).
        resize: ``"stretch"`` or ``"letterbox"`` (see :func:`make_transforms`).

    Returns:
        ``monai.data.CacheDataset`` or ``monai.data.Dataset`` of dicts ``{"image": [C,S,S] float32,
        "label": [1,S,S] float32 class indices}`` (see :func:`make_transforms`; test labels stay at stored size).

    Raises:
        DataError: see :func:`load_split`, :func:`read_label_values`, :func:`make_transforms` (with ``cache=True``
            load-time errors such as undeclared mask values surface here; with ``cache=False`` they surface, wrapped
            in MONAI's ``RuntimeError``, when a sample is read).
    """
    short, spec, center_dir, items = _split_items(task, center, split, data_root, max_items, split_file, on_bad_file)
    values = read_label_values(center_dir)
    classes = label_classes(spec, values, site=center)
    transform = make_transforms(
        short, image_size, spec.in_channels, values, site=center, label_classes=classes, resize=resize
    )
    if resize == "letterbox":  # the aspect ratio before the provider's stretch, where provenance.csv records it
        sizes = read_original_sizes(center_dir)
        items = [{**it, ORIGINAL_SIZE_KEY: np.asarray(sizes.get(Path(it["image"]).stem, (0, 0)))} for it in items]
    return _dataset(items, transform, cache, seed)


def _split_items(task, center, split, data_root, max_items, split_file, on_bad_file):
    """``(short split name, TaskSpec, center folder, decodable items)`` of one site's split."""
    short = {v: k for k, v in SPLIT_KEYS.items()}.get(split, split)
    if short not in SPLIT_KEYS:
        raise _err(center, f"unknown split '{split}'; expected one of {sorted(SPLIT_KEYS)}")
    spec = get_task(task)
    if on_bad_file not in ("error", "skip"):
        raise _err(center, f"on_bad_file must be 'error' or 'skip', got {on_bad_file!r}")
    items = load_split(task, center, data_root=data_root, split_file=split_file, on_bad_file=on_bad_file)
    items = items[SPLIT_KEYS[short]]
    if max_items is not None:
        items = items[: int(max_items)]
    center_dir = resolve_data_root(data_root, site=center) / spec.folder / center
    return short, spec, center_dir, _check_decodes(items, center, center_dir, on_bad_file)


def _dataset(items: list[dict], transform, cache: bool, seed: int):
    """A (Cache)Dataset of ``items``; transform errors surface as the DataError naming site and file."""
    from monai.data import CacheDataset, Dataset

    transform.set_random_state(seed=seed)
    if not cache:
        return Dataset(items, transform=transform)
    try:
        # One caching thread: with more, an exception in one thread leaves the others running into interpreter
        # shutdown, which aborts the process (torch, "terminate called without an active exception").
        return CacheDataset(items, transform=transform, num_workers=1, progress=False)
    except RuntimeError as e:  # MONAI wraps transform errors; surface our DataError (names site and file)
        cause: BaseException | None = e
        while cause is not None and not isinstance(cause, DataError):
            cause = cause.__cause__
        if cause is not None:
            raise cause from None
        raise


# --------------------------------------------------------------------------------------------------------------------
# Image-level classification (FedUAA's original form): same sites and committed splits, one class per image
# --------------------------------------------------------------------------------------------------------------------
#: Per-image class file of a site (``image,class`` columns; ``image`` is the file stem, e.g. ``10018``).
CLASSES_FILE = "classes.csv"
#: Image-level classes of the tasks that have them, in class-index order.
CLASSIFICATION_CLASSES: dict[str, tuple[str, ...]] = {"breast": ("benign", "malignant")}


def classification_classes(task: str) -> tuple[str, ...]:
    """Image-level class names of ``task`` (index = class); raises :class:`DataError` for a task without them."""
    get_task(task)
    if task not in CLASSIFICATION_CLASSES:
        raise DataError(f"task {task!r} has no image-level classes; classification tasks: {sorted(CLASSIFICATION_CLASSES)}")
    return CLASSIFICATION_CLASSES[task]


def read_image_classes(center_dir: str | os.PathLike, class_names: Sequence[str], site: str | None = None) -> dict[str, int]:
    """``<center_dir>/classes.csv`` (columns ``image``, ``class``) as file stem -> class index.

    Raises:
        DataError: the file is missing, lacks a column, lists a stem twice, or names a class not in ``class_names``
            (the message names the site and the file).
    """
    path = Path(center_dir) / CLASSES_FILE
    if not path.is_file():
        raise _err(site, f"no image-level labels: {path} does not exist")
    index = {name: i for i, name in enumerate(class_names)}
    out: dict[str, int] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"image", "class"} <= set(reader.fieldnames):
            raise _err(site, f"{path} needs the columns 'image' and 'class', has {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            stem, name = Path((row["image"] or "").strip()).stem, (row["class"] or "").strip()
            if name not in index:
                raise _err(site, f"{path} line {line}: class {name!r} of {stem!r} is not one of {list(class_names)}")
            if stem in out:
                raise _err(site, f"{path} lists {stem!r} twice")
            out[stem] = index[name]
    return out


def make_classification_transforms(stage: str, image_size: int, in_channels: int, site: str | None = None):
    """MONAI transforms for ``{"image": path, "label": int}`` items (FedUAA's augmentation).

    Pipeline: LoadImaged(PILReader, image converted to ``in_channels``) -> EnsureChannelFirstd -> Resized(bilinear,
    anti-aliased) -> ScaleIntensityd([0, 1]) -> [train: horizontal flip p=0.5 and a rotation by an angle drawn
    uniformly from ±30° (FedUAA: ``RandomHorizontalFlip`` + ``RandomRotation(30)``, zero padding)] -> EnsureTyped.
    With MONAI's PILReader the first spatial axis is the stored image's width, so the horizontal flip is
    ``spatial_axis=0``.

    Output per sample: ``image`` float32 ``[in_channels, image_size, image_size]`` in [0, 1] (the rotation's
    bilinear resampling keeps it there); ``label`` the int class index (collated to ``[B]`` int64).

    Raises:
        DataError: unsupported ``stage`` or ``in_channels``.
    """
    import math as _math

    from monai.data import PILReader
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        LoadImaged,
        RandFlipd,
        RandRotated,
        Resized,
        ScaleIntensityd,
    )

    if stage not in SPLIT_KEYS:
        raise _err(site, f"unknown stage '{stage}'; expected one of {sorted(SPLIT_KEYS)}")
    if in_channels not in (1, 3):
        raise _err(site, f"in_channels={in_channels} is not supported (1 = gray, 3 = RGB)")
    size = (int(image_size), int(image_size))
    chain = [
        LoadImaged("image", reader=PILReader(converter=_ToChannels(in_channels, site)), image_only=True),
        EnsureChannelFirstd("image"),
        Resized("image", spatial_size=size, mode="bilinear", anti_aliasing=True),
        ScaleIntensityd("image", minv=0.0, maxv=1.0),
    ]
    if stage == "train":
        chain += [
            RandFlipd("image", prob=0.5, spatial_axis=0),
            RandRotated("image", range_x=_math.radians(30), prob=1.0, mode="bilinear", padding_mode="zeros"),
        ]
    chain.append(EnsureTyped("image", dtype=np.float32, track_meta=False))
    return Compose(chain)


def get_classification_dataset(
    task: str,
    center: str,
    split: str,
    data_root: str | os.PathLike | None = None,
    image_size: int = 256,
    max_items: int | None = None,
    cache: bool = True,
    split_file: str | os.PathLike | None = None,
    seed: int = 0,
    on_bad_file: str = "error",
):
    """MONAI dataset of one site's split for image-level classification (FedUAA's original task form).

    Uses the same committed split as segmentation (:func:`load_split`; the masks are checked there but not loaded)
    and the image's class from ``<center>/classes.csv`` (:func:`read_image_classes`).

    Returns:
        ``CacheDataset`` / ``Dataset`` of ``{"image": [C,S,S] float32 in [0, 1], "label": int class index}``
        (see :func:`make_classification_transforms`).

    Raises:
        DataError: as :func:`get_dataset`; a task without image-level classes; an image of the split without a
            class in ``classes.csv`` (names the site, the image and the file).
    """
    names = classification_classes(task)
    short, spec, center_dir, items = _split_items(task, center, split, data_root, max_items, split_file, on_bad_file)
    classes = read_image_classes(center_dir, names, site=center)
    labelled = []
    for item in items:
        stem = Path(item["image"]).stem
        if stem not in classes:
            raise _err(center, f"image {_rel(item['image'], center_dir)} has no class in {center_dir / CLASSES_FILE}")
        labelled.append({"image": item["image"], "label": classes[stem]})
    transform = make_classification_transforms(short, image_size, spec.in_channels, site=center)
    return _dataset(labelled, transform, cache, seed)

__all__ += [
    "CLASSES_FILE",
    "CLASSIFICATION_CLASSES",
    "classification_classes",
    "read_image_classes",
    "make_classification_transforms",
    "get_classification_dataset",
]
