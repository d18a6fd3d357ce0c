"""Splits of a site's images into training, validation and test: made (grouped by patient, lesion or video
sequence), written and loaded (MONAI decathlon JSON, paths relative to the center folder). Part of the one dataset API
of :mod:`feduq.data` (import from there); the layout and the lookup order of split files are described there.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
from PIL import Image

from .centers import parse_site, relative_split, site_center, site_split_file, virtual_split
from ..tasks.spec import (
    SPLIT_KEYS,
    DataError,
    center_folder,
    check_pair,
    site_error,
    relative_to_site,
    get_task,
    read_groups,
    resolve_data_root,
    scan_center,
    stem_groups,
)

_LOG = logging.getLogger("feduq.data")
DEFAULT_FRACTIONS = (0.7, 0.1, 0.2)
PACKAGE_SPLITS_DIR = Path(__file__).resolve().parents[1] / "splits"


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


def provenance_columns(center_dir: Path) -> list[str]:
    """Header of ``<center_dir>/provenance.csv``, or ``[]`` when there is none."""
    path = center_dir / "provenance.csv"
    if not path.is_file():
        return []
    with path.open(newline="") as f:
        return next(csv.reader(f), [])


def natural_key(value: str) -> tuple:
    """Sort key putting digit strings first in numeric order (``"2" < "10"``), then the others alphabetically."""
    return (0, int(value), "") if str(value).isdigit() else (1, 0, str(value))


def center_groups(data_root: str | os.PathLike, task: str, center: str, items: Sequence[Mapping] | None = None
                  ) -> tuple[str | None, str | None, dict[str, str] | None]:
    """What groups a center's images: ``(column, pattern, {stem: group})``, the ``provenance.csv`` column
    (``TaskSpec.group_column[center]``, or ``group_column_if_present[center]`` when the file has it) or else the
    file-stem regex (``TaskSpec.group_pattern[center]``); ``(None, None, None)`` when the center's images are
    independent (split, and tested, image by image). The groups are the units that must stay in one split (video
    sequence, patient, lesion) and the independent units of a paired test (:mod:`feduq.results.paired`).

    Args:
        items: the center's samples (``{"id": stem, "image": path, ...}``), each of which a provenance column must
            list; None: the column's table as it is (the stems a pattern groups are then scanned here).

    Raises:
        DataError: the provenance file or column is missing, or an image is not listed in it (named).
    """
    spec = get_task(task)
    center_dir = center_folder(Path(data_root), task, center)
    column = spec.group_column.get(center)
    optional = spec.group_column_if_present.get(center)
    if not column and optional and optional in provenance_columns(center_dir):
        column = optional
    pattern = None if column else spec.case_pattern(center)
    if column:
        try:
            table = read_groups(center_dir, column)
        except DataError as e:
            raise DataError(f"{e}; the site's converter (feduq convert <dataset>) writes it, or split per image "
                            f"with feduq split --per-image") from None
        missing = [it for it in items or () if it["id"] not in table]
        if missing:
            raise site_error(center, f"image {relative_to_site(missing[0]['image'], center_dir)} (and {len(missing) - 1} "
                                     f"more) is not listed in {center_dir / 'provenance.csv'}, so its '{column}' group "
                                     "is unknown")
        return column, None, table
    if pattern:
        items = scan_center(data_root, task, center) if items is None else items
        return None, pattern, stem_groups([it["id"] for it in items], pattern, site=center)
    return None, None, None


def make_center_split(
    data_root: str | os.PathLike,
    task: str,
    center: str,
    fractions: Sequence[float] = DEFAULT_FRACTIONS,
    seed: int = 0,
    per_image: bool = False,
) -> dict[str, Any]:
    """Scan a site and split it with :func:`make_split`, grouping by a ``provenance.csv`` column
    (``TaskSpec.group_column[center]``, or ``group_column_if_present[center]`` when the file has it) or else a
    file-stem regex (``TaskSpec.group_pattern[center]``) if set. Fewer than 3 groups: see :func:`make_split`
    (recorded as ``group_note``). ``per_image=True`` ignores every grouping and splits image by image, as the
    official FedEvi code splits its polyp sites (neighbouring video frames may then straddle the splits).

    Returns:
        A decathlon dict ready for :func:`write_split_file`: metadata keys plus ``training``/``validation``/``testing``
        lists of ``{"image": "images/<stem>.jpg", "label": "masks/<stem>.png"}`` (paths relative to the center folder).

    Raises:
        DataError: anything :func:`scan_center` raises; an image missing from provenance.csv when grouping.
    """
    center_dir = center_folder(Path(data_root), task, center)
    items = scan_center(data_root, task, center)
    column, pattern, table = (None, None, None) if per_image else center_groups(data_root, task, center, items)
    groups = [table[it["id"]] for it in items] if table is not None else None
    split = make_split(items, fractions=fractions, seed=seed, groups=groups)
    out: dict[str, Any] = {
        "name": f"{task}/{center}",
        "description": "FedUQ split; paths are relative to the center folder",
        "seed": seed,
        "fractions": list(fractions),
        "group_column": column,
        **({"group_pattern": pattern} if pattern else {}),
        **({"per_image": True} if per_image else {}),
        "num_groups": len(set(groups)) if groups is not None else len(items),
    }
    if groups is not None and out["num_groups"] < 3 and min(fractions) > 0:
        out["group_note"] = (
            "fewer than 3 groups: testing holds one whole group, training and validation share the other"
            if out["num_groups"] == 2 and len(items) >= 3
            else "fewer than 3 groups: split per image"
        )
    if groups is not None:
        out["groups"] = {key: sorted({table[it["id"]] for it in split[key]}, key=natural_key) for key in split}
    for key, split_items in split.items():
        out[key] = [{"image": relative_to_site(it["image"], center_dir), "label": relative_to_site(it["label"], center_dir)}
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


def find_split_file(task: str, center: str, center_dir: Path, split_file: str | os.PathLike | None) -> Path:
    """The split file a site reads: ``split_file`` when given, else the site's own ``split.json``, else the packaged
    ``splits/<task>/<center>.json``. Raises :class:`DataError` naming the center when none exists."""
    if split_file:
        candidates = [Path(split_file)]
    else:
        candidates = [center_dir / "split.json", PACKAGE_SPLITS_DIR / task / f"{center}.json"]
    for path in candidates:
        if path.is_file():
            return path
    raise site_error(center, "no split file; looked for " + ", ".join(str(p) for p in candidates))


def load_split(
    task: str,
    center: str,
    data_root: str | os.PathLike | None = None,
    split_file: str | os.PathLike | None = None,
    on_bad_file: str = "error",
    site: str | None = None,
    checked: tuple[str, ...] | None = None,
) -> dict[str, list[dict[str, str]]]:
    """Load a site's split: ``{"training"|"validation"|"testing": [{"image": abs path, "label": abs path}, ...]}``.

    ``site`` (default: ``center``) names the site reading ``center``'s folder: a virtual site
    ``<center>-p<k>of<K>`` takes its part of the committed partition, and any site's own
    ``<center>/splits/<site>.json`` (a derived, e.g. noisy, dataset) comes before the center's splits
    (:mod:`feduq.sites.centers`).

    ``on_bad_file="skip"`` (a site setting) drops a pair whose file is missing, unreadable or whose
    mask/image sizes differ, with a warning naming the site and the file, instead of raising.

    ``checked``: the split keys whose files are opened and checked (default: every key). A site reading one split
    checks that split's files only, once; a file listed under two keys is refused whichever keys are checked.

    Split file precedence: ``split_file`` > ``<center>/splits/<site>.json`` > (virtual site: its part of
    ``feduq/splits/<task>/<center>.iid<K>.json``) > ``<data_root>/<task>/<center>/split.json`` > the packaged
    ``feduq/splits/<task>/<center>.json``. Paths in the file are relative to the center folder.

    Raises:
        DataError: unknown task; no data root / center folder / split file; invalid JSON or a missing key; a listed
            file that does not exist, has an unreadable header, or a mask/image size mismatch; a file listed twice.
    """
    from monai.data import load_decathlon_datalist

    get_task(task)
    site = site or center
    center_dir = center_folder(resolve_data_root(data_root, site=site), task, center)
    own = None if split_file else site_split_file(task, site, center_dir)
    split: dict[str, list[dict[str, str]]] = {}
    if own is None and not split_file and parse_site(site)[1] is not None:  # a virtual site's committed part
        path = f"{site}'s part of the committed partition"
        split = {key: [{k: os.path.normpath(center_dir / v) for k, v in item.items()} for item in items]
                 for key, items in virtual_split(task, site, center_dir).items()}
    else:
        path = own or find_split_file(task, center, center_dir, split_file)
    for key in SPLIT_KEYS.values():
        if key in split:
            continue
        try:
            split[key] = load_decathlon_datalist(path, is_segmentation=True, data_list_key=key, base_dir=center_dir)
        except (ValueError, TypeError, KeyError) as e:  # json.JSONDecodeError is a ValueError
            raise site_error(center, f"split file {path} is invalid ({key}): {e}") from None
    seen: dict[str, str] = {}
    for key, items in split.items():
        for item in items:
            if "image" not in item or "label" not in item:
                raise site_error(center, f"split file {path}: '{key}' entry {item} needs 'image' and 'label'")
            for role in ("image", "label"):  # a split names files of its own site only (never ../other or /abs)
                if not _inside(item[role], center_dir):
                    raise site_error(center, f"split file {path}: '{key}' {role} {item[role]} lies outside the site folder "
                                       f"{center_dir}; a split names files of its own site only")
            try:
                if checked is None or key in checked:
                    check_pair(Path(item["image"]), Path(item["label"]), center, center_dir)
            except DataError as e:
                if on_bad_file != "skip":
                    raise
                _LOG.warning("%s; skipped (on_bad_file=skip)", e)
                item["skip"] = True
            if item["image"] in seen:
                raise site_error(center, f"split file {path} lists {relative_to_site(item['image'], center_dir)} in both "
                                   f"'{seen[item['image']]}' and '{key}'")
            seen[item["image"]] = key
    return {key: [i for i in items if not i.get("skip")] for key, items in split.items()}


def split_size(task: str, center: str, key: str, data_root: str | os.PathLike | None = None,
               site: str | None = None) -> int:
    """How many items ``key`` (``"testing"``, ...) of a site's split lists, by :func:`load_split`'s precedence but
    without checking the files (a quick look before a run: FedUQ's data check before FLARE starts).

    Raises:
        DataError: as :func:`load_split` for a missing or invalid split file.
    """
    site = site or center
    center_dir = center_folder(resolve_data_root(data_root, site=site), task, center)
    own = site_split_file(task, site, center_dir)
    if own is None and parse_site(site)[1] is not None:
        return len(virtual_split(task, site, center_dir).get(key, []))
    path = own or find_split_file(task, center, center_dir, None)
    try:
        return len(json.loads(Path(path).read_text()).get(key, []))
    except (OSError, ValueError, AttributeError) as e:
        raise site_error(center, f"split file {path} is invalid: {e}") from None


def _inside(path, folder: Path) -> bool:
    """``path`` lies lexically under ``folder`` (after normalising ``..``; symlinked data inside the folder is kept)."""
    base = os.path.normpath(str(folder))
    return os.path.normpath(str(path)).startswith(base + os.sep)


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
                    raise site_error(site, f"cannot decode {relative_to_site(item[key], center_dir)}: {e}") from None
        except DataError as e:
            if on_bad_file != "skip":
                raise
            _LOG.warning("%s; skipped (on_bad_file=skip)", e)
            continue
        good.append(item)
    return good


def site_split(task: str, site: str, data_root: str | os.PathLike | None = None) -> dict:
    """A site's center and split with paths relative to the center folder (for tools that derive datasets).

    Returns:
        ``{"center": str, "training": [{"image": rel, "label": rel}, ...], "validation": [...], "testing": [...]}``.

    Raises:
        DataError: as :func:`load_split`; a site that is neither a center nor a virtual site of one.
    """
    center = site_center(task, site)
    center_dir = resolve_data_root(data_root, site=site) / get_task(task).folder / center
    return {"center": center, **relative_split(load_split(task, center, data_root, site=site), center_dir)}
