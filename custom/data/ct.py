"""Abdominal CT with a different organ subset per site (FIVA / FUNAvg, FIVA §4 data): labels, splits, reading.

Task ``"ct"`` of the registry (:mod:`feduq.tasks.spec`), folder ``<data_root>/abdominal_ct/<center>/``. The site layout is
the usual one (:mod:`feduq.data`) plus 3D volumes::

    images/<stem>.png       8-bit gray axial slice, windowed by the source (no HU)   masks/<stem>.png  uint8 label ids
    images/<case>.nii.gz    CT volume (.nii or .nii.gz; HU kept)                     masks/<case>.nii.gz
    labels.json             {"labels": {"0": "background", "1": "liver"}, "note": ...}   (mask value -> label NAME)

**Label spaces.** The global space is :data:`ORGANS` = (background, liver, kidney, spleen, pancreas), in this fixed
order. Each label name of a site's ``labels.json`` maps to a global organ: itself, an alias (:data:`LABEL_ALIASES`),
or background when listed in :data:`IGNORED_LABELS`; any other name raises :class:`DataError`. A site's organs
(:func:`site_organs`) are numbered 1..n in GLOBAL order (site-local ids); every other mask value becomes 0 =
"background or not labelled" (:func:`site_label_lut`). :func:`local_to_global` maps site-local ids back to global ids.
Lesions are merged into their organ: KiTS19 "kidney tumor" (value 2) is part of "kidney", i.e. kidney = the KiTS
"kidney and tumour" region (the whole kidney including the tumour), as the organ labels of the other sites include
lesions (3D-IRCADb liver with tumours). "right_kidney"/"left_kidney" (AMOS, BTCV style) both become "kidney".

**Sites.** Training: NIH-Pancreas-CT (pancreas), KiTS19 (kidney), MSD-Task09-Spleen (spleen), 3D-IRCADb-01 (liver),
CHAOS-CT (liver). Held out (:data:`HELD_OUT`, never trains, every item in ``testing``): CURVAS-Erlangen (liver, kidney,
pancreas). :func:`training_centers` is the federation.

**Splits** by case (patient), committed as ``feduq/splits/ct/<center>.json`` (decathlon JSON, paths relative to the
center folder, as for the other tasks; ``<center>/split.json`` at a site overrides it): :func:`make_ct_split` runs
:func:`feduq.data.make_split` (seed 0, 0.7/0.1/0.2 of the images, whole cases) over :func:`scan_ct_center`, which pairs
PNG slices and NIfTI volumes by stem. Case of a PNG slice: ``provenance.csv`` column ``case`` (NIH ``PANCREAS_0001``,
3D-IRCADb ``10001``, CHAOS ``101``) or the registry's stem pattern (KiTS19 ``10036_103`` -> ``10036``; MSD
``10003_spleen_26`` -> ``spleen_26``, the MSD case, 10003 being the slice; CURVAS ``r1_10001_458`` -> ``10001``, the
patient, ``rK_`` = radiologist K, so one case holds several radiologists' slices). Case of a volume: its stem.
Regenerate with ``feduq split --data-root <root> --task ct``.

**Orientation.** :func:`read_case` returns every site in radiological orientation (anterior up, patient right on
image left). The data pass already fixed NIH-Pancreas-CT (``flip_vertical``) and 3D-IRCADb-01 (``rotate_180``),
recorded in provenance column ``orientation_fix``; KiTS19, CHAOS-CT and CURVAS are radiological as stored. The
MSD-Task09-Spleen slices are stored left-right mirrored (spleen on image left; checked on overlays, SOURCES.md section
6 says so too, and its provenance.csv has no ``orientation_fix`` column), so :func:`ct_items` marks them
``"orientation_fix": "flip_lr"`` and :func:`read_case` flips image and mask; :data:`ORIENTATION_FIXES` applies only
while the site's provenance.csv has no ``orientation_fix`` column (a later data pass that fixes the files turns it
off). NIfTI volumes are reoriented to LPS voxel order and returned as ``[Z, H, W]`` = (S, P, L): row 0 anterior,
column 0 patient right (z index 0 = most inferior), the same view as the PNG slices.

The generic 2D datasets (:func:`feduq.data.get_dataset`) do not serve this task (a site declares fewer classes than
the global space, so :func:`feduq.data.label_classes` raises): use :func:`ct_items` and :func:`read_case`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from PIL import Image

from ..sites.split_files import DEFAULT_FRACTIONS, find_split_file, natural_key, provenance_columns, make_split
from ..tasks.spec import (
    CT_HELD_OUT,
    CT_ORGANS,
    IMAGE_SUFFIXES,
    SPLIT_KEYS,
    DataError,
    center_folder,
    check_pair,
    site_error,
    relative_to_site,
    get_task,
    read_groups,
    resolve_data_root,
    stem_groups,
)

__all__ = [
    "TASK",
    "ORGANS",
    "HELD_OUT",
    "LABEL_ALIASES",
    "IGNORED_LABELS",
    "ORIENTATION_FIXES",
    "VOLUME_SUFFIXES",
    "training_centers",
    "read_site_labels",
    "site_organs",
    "site_label_lut",
    "local_to_global",
    "scan_ct_center",
    "make_ct_split",
    "ct_items",
    "read_case",
]

TASK = "ct"
#: Global label space, background first, fixed order (global id = index).
ORGANS: tuple[str, ...] = CT_ORGANS
#: The held-out test site(s): never in a federation, every item in "testing". Defined once in feduq.tasks.spec.
HELD_OUT: tuple[str, ...] = CT_HELD_OUT
VOLUME_SUFFIXES = (".nii.gz", ".nii")
#: Normalised label name (lower case, runs of non-alphanumerics -> one space) -> global organ. Lesions are merged into
#: their organ (KiTS "kidney tumor" -> kidney = the KiTS kidney+tumour region).
LABEL_ALIASES: dict[str, str] = {
    "background unlabeled": "background", "background unlabelled": "background", "unlabeled": "background",
    "kidney tumor": "kidney", "kidney tumour": "kidney", "kidney cyst": "kidney",
    "right kidney": "kidney", "left kidney": "kidney", "kidney right": "kidney", "kidney left": "kidney",
    "liver tumor": "liver", "liver tumour": "liver", "pancreas tumor": "pancreas", "pancreas tumour": "pancreas",
}  # fmt: skip
#: Structures outside the global space that a site may declare; they become background (0), as in FIVA's partial-label setting.
IGNORED_LABELS = frozenset({
    "gallbladder", "gall bladder", "esophagus", "stomach", "aorta", "inferior vena cava",
    "portal vein and splenic vein", "duodenum", "bladder", "urinary bladder", "prostate uterus", "colon",
    "small bowel", "right adrenal gland", "left adrenal gland", "adrenal gland right", "adrenal gland left",
})  # fmt: skip
#: Center -> fix that :func:`read_case` applies to its PNG slices while its provenance.csv has no orientation_fix.
ORIENTATION_FIXES = {"MSD-Task09-Spleen": "flip_lr"}


def training_centers() -> tuple[str, ...]:
    """The federation's sites: the task's centers minus :data:`HELD_OUT`, in registry order."""
    return tuple(c for c in get_task(TASK).centers if c not in HELD_OUT)


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", " ", str(name).lower()).strip()


def _site_dir(data_root, center: str) -> Path:
    return center_folder(resolve_data_root(data_root, site=center), TASK, center)


def read_site_labels(data_root: str | os.PathLike | None, center: str) -> dict[int, str]:
    """Raw mask value -> global organ name (``"background"`` for background and ignored labels), from labels.json.

    Raises:
        DataError: labels.json missing or invalid (names the file); a label that is neither a global organ, an alias
            nor ignored (names the site, the label and the global space); no organ of the global space declared.
    """
    path = _site_dir(data_root, center) / "labels.json"
    try:
        labels = json.loads(path.read_text())["labels"]
        raw = {int(k): v for k, v in labels.items()}
        if any(k < 0 or not isinstance(v, str) for k, v in raw.items()):
            raise ValueError("values must be integers >= 0 and names strings")
    except FileNotFoundError:
        raise site_error(center, f"labels file {path} is missing") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise site_error(center, f"labels file {path} is invalid (expected {{'labels': {{'0': 'background', "
                           f"'1': 'liver'}}}}): {e}") from None
    out = {}
    for value, name in sorted(raw.items()):
        key = _norm(name)
        organ = key if key in ORGANS else LABEL_ALIASES.get(key, "background" if key in IGNORED_LABELS else None)
        if organ is None:
            raise site_error(center, f"labels file {path} declares label {value} {name!r}, which is not in the global label "
                               f"space {list(ORGANS)} (nor an alias in feduq.data.ct.LABEL_ALIASES or an ignored label "
                               f"in feduq.data.ct.IGNORED_LABELS)")
        out[value] = organ
    if not set(out.values()) - {"background"}:
        raise site_error(center, f"labels file {path} declares no organ of the global label space {list(ORGANS)}")
    return out


def site_organs(data_root: str | os.PathLike | None, center: str) -> tuple[str, ...]:
    """The site's labelled organs in GLOBAL order, without background (KiTS19: ``("kidney",)``); site-local id =
    position + 1."""
    declared = set(read_site_labels(data_root, center).values())
    return tuple(o for o in ORGANS[1:] if o in declared)


def site_label_lut(data_root: str | os.PathLike | None, center: str) -> dict[int, int]:
    """Raw mask value -> site-local id for every value declared in labels.json: organs 1..n in global order (merged
    labels share an id: KiTS19 {0: 0, 1: 1, 2: 1}), background and ignored labels 0. A mask value that is not
    declared makes :func:`read_case` raise."""
    labels = read_site_labels(data_root, center)
    organs = tuple(o for o in ORGANS[1:] if o in set(labels.values()))
    return {v: (organs.index(o) + 1 if o in organs else 0) for v, o in labels.items()}


def local_to_global(site_organs: Sequence[str]) -> list[int]:
    """Site-local id -> global id (index = local id; entry 0 is background 0), e.g. ("liver", "kidney", "pancreas")
    -> [0, 1, 2, 4]. Raises :class:`DataError` for a name outside :data:`ORGANS` or out of global order."""
    ids = [0]
    for organ in site_organs:
        if organ not in ORGANS[1:]:
            raise DataError(f"organ {organ!r} is not in the global label space {list(ORGANS)}")
        ids.append(ORGANS.index(organ))
    if ids != sorted(set(ids)):
        raise DataError(f"site organs {list(site_organs)} must be distinct and in global order {list(ORGANS[1:])}")
    return ids


# --------------------------------------------------------------------------------------------------------------------
# Listing a site, cases, splits
# --------------------------------------------------------------------------------------------------------------------


def _stem_kind(path: Path) -> tuple[str, str] | None:
    """(stem, "volume" | "slice") of an image/mask file name, None for anything else."""
    name = path.name.lower()
    for suffix in VOLUME_SUFFIXES:
        if name.endswith(suffix):
            return path.name[: -len(suffix)], "volume"
    return (path.stem, "slice") if path.suffix.lower() in IMAGE_SUFFIXES else None


def _files(folder: Path, center: str, center_dir: Path) -> dict[str, tuple[Path, str]]:
    if not folder.is_dir():
        raise site_error(center, f"folder {folder} is missing")
    files: dict[str, tuple[Path, str]] = {}
    for path in sorted(folder.iterdir()):
        sk = None if path.name.startswith(".") else _stem_kind(path)
        if sk is None:
            continue
        if sk[0] in files:
            raise site_error(center, f"two files share the stem '{sk[0]}': {relative_to_site(files[sk[0]][0], center_dir)}, "
                               f"{relative_to_site(path, center_dir)}")
        files[sk[0]] = (path, sk[1])
    return files


def _nifti(path: Path, center: str, center_dir: Path):
    import nibabel as nib

    try:
        return nib.load(str(path))
    except Exception as e:  # nibabel raises ImageFileError, OSError, EOFError, zlib.error, ... on bad files
        raise site_error(center, f"cannot read NIfTI file {relative_to_site(path, center_dir)}: {e}") from None


def _check_volume_pair(image: Path, label: Path, center: str, center_dir: Path) -> None:
    shapes = [tuple(_nifti(p, center, center_dir).shape) for p in (image, label)]
    if shapes[0] != shapes[1]:
        raise site_error(center, f"mask {relative_to_site(label, center_dir)} has shape {shapes[1]} but image {relative_to_site(image, center_dir)} "
                           f"has shape {shapes[0]}")


def _case_map(center: str, center_dir: Path, slices: Sequence[str]) -> tuple[dict[str, str], dict[str, Any]]:
    """Case of each PNG slice stem and how it was derived (``{"group_column": ..., "group_pattern": ...}``)."""
    spec = get_task(TASK)
    column = spec.group_column.get(center) or ("case" if "case" in provenance_columns(center_dir) else None)
    pattern = None if column else spec.case_pattern(center)
    if not slices:
        return {}, {"group_column": column, **({"group_pattern": pattern} if pattern else {})}
    if column:
        table = read_groups(center_dir, column)
        missing = [s for s in slices if s not in table]
        if missing:
            raise site_error(center, f"slice {missing[0]} (and {len(missing) - 1} more) is not listed in "
                               f"{center_dir / 'provenance.csv'}, so its '{column}' (case) is unknown")
        cases = {s: table[s] for s in slices}
    elif pattern:
        cases = stem_groups(slices, pattern, site=center)
    else:  # an unregistered site without case ids: every slice is its own case
        cases = {s: s for s in slices}
    return cases, {"group_column": column, **({"group_pattern": pattern} if pattern else {})}


def scan_ct_center(data_root: str | os.PathLike | None, center: str, check: bool = True) -> list[dict[str, Any]]:
    """List a site's image/mask pairs (PNG slices and NIfTI volumes), sorted by stem: ``{"image", "label": abs path,
    "name": stem, "case", "kind": "slice" | "volume"}``. ``check`` reads the headers (sizes, shapes).

    Raises:
        DataError: missing folders, an unpaired file, a slice paired with a volume, duplicate stems, an unreadable
            header, a size/shape mismatch, a slice whose case is unknown (each names the site and the file).
    """
    center_dir = _site_dir(data_root, center)
    images = _files(center_dir / "images", center, center_dir)
    masks = _files(center_dir / "masks", center, center_dir)
    for a, b, what in ((images, masks, "has no mask in masks/"), (masks, images, "has no image in images/")):
        lone = sorted(set(a) - set(b))
        if lone:
            raise site_error(center, f"{relative_to_site(a[lone[0]][0], center_dir)} {what} (same stem '{lone[0]}')"
                               + (f" ({len(lone) - 1} more)" if len(lone) > 1 else ""))
    if not images:
        raise site_error(center, f"no images (PNG slices or NIfTI volumes) in {center_dir / 'images'}")
    cases, _ = _case_map(center, center_dir, [s for s in images if images[s][1] == "slice"])
    items = []
    for stem in sorted(images):
        (image, kind), (label, mask_kind) = images[stem], masks[stem]
        if kind != mask_kind:
            raise site_error(center, f"image {relative_to_site(image, center_dir)} is a {kind} but its mask {relative_to_site(label, center_dir)} "
                               f"is a {mask_kind}")
        if check:
            (check_pair if kind == "slice" else _check_volume_pair)(image, label, center, center_dir)
        items.append({"image": str(image), "label": str(label), "name": stem, "case": cases.get(stem, stem),
                      "kind": kind})
    return items


def make_ct_split(data_root: str | os.PathLike | None, center: str, fractions: Sequence[float] = DEFAULT_FRACTIONS,
                  seed: int = 0) -> dict[str, Any]:
    """Split a site by case with :func:`feduq.data.make_split` (a held-out site: everything in ``testing``); returns a
    decathlon dict for :func:`feduq.data.write_split_file`, in the format of :func:`feduq.data.make_center_split`."""
    items = scan_ct_center(data_root, center)
    fractions = (0.0, 0.0, 1.0) if center in HELD_OUT else tuple(float(f) for f in fractions)
    center_dir = _site_dir(data_root, center)
    _, how = _case_map(center, center_dir, [])
    groups = [it["case"] for it in items]
    split = make_split(items, fractions=fractions, seed=seed, groups=groups)
    out: dict[str, Any] = {
        "name": f"{TASK}/{center}",
        "description": "FedUQ split by case; paths are relative to the center folder"
                       + ("; held-out test site: every item is test" if center in HELD_OUT else ""),
        "seed": seed,
        "fractions": list(fractions),
        **how,
        "num_groups": len(set(groups)),
        "groups": {k: sorted({it["case"] for it in v}, key=natural_key) for k, v in split.items()},
    }
    for key, split_items in split.items():
        out[key] = [{"image": relative_to_site(it["image"], center_dir), "label": relative_to_site(it["label"], center_dir)}
                    for it in split_items]
    return out


def ct_items(data_root: str | os.PathLike | None, center: str, split: str,
             split_file: str | os.PathLike | None = None) -> list[dict[str, str]]:
    """Items of one split (``"train"|"val"|"test"`` or ``"training"|...``) in file order: ``{"image", "label": abs
    path, "case", "name": stem, "orientation_fix": "" | "flip_lr"}``. Split file precedence as
    :func:`feduq.data.load_split`: ``split_file`` > ``<center>/split.json`` > ``feduq/splits/ct/<center>.json``.

    Raises:
        DataError: unknown split; no/invalid split file; a listed file that is not on disk (or fails the header
            checks of :func:`scan_ct_center`), listed twice, or a held-out site with training/validation items.
    """
    key = SPLIT_KEYS.get(split, split)
    if key not in SPLIT_KEYS.values():
        raise DataError(f"site '{center}': unknown split {split!r}; use one of {list(SPLIT_KEYS)}")
    center_dir = _site_dir(data_root, center)
    path = find_split_file(TASK, center, center_dir, split_file)
    try:
        table = json.loads(Path(path).read_text())
        lists = {k: [(e["image"], e["label"]) for e in table[k]] for k in SPLIT_KEYS.values()}
    except (ValueError, KeyError, TypeError) as e:
        raise site_error(center, f"split file {path} is invalid (needs training/validation/testing lists of "
                           f"{{'image', 'label'}}): {e}") from None
    if center in HELD_OUT and (lists["training"] or lists["validation"]):
        raise site_error(center, f"split file {path}: the held-out site {center} must have every item in 'testing'")
    seen: dict[str, str] = {}
    for k, pairs in lists.items():
        for image, _ in pairs:
            if image in seen:
                raise site_error(center, f"split file {path} lists {image} in both '{seen[image]}' and '{k}'")
            seen[image] = k
    on_disk = {Path(it["image"]).resolve(): it for it in scan_ct_center(data_root, center, check=False)}
    fix = ORIENTATION_FIXES.get(center, "") if "orientation_fix" not in provenance_columns(center_dir) else ""
    out = []
    for image, label in lists[key]:
        it = on_disk.get((center_dir / image).resolve())
        if it is None or Path(it["label"]).resolve() != (center_dir / label).resolve():
            raise site_error(center, f"split file {path} lists {image} / {label}, which is not an image/mask pair of "
                               f"{center_dir}")
        (check_pair if it["kind"] == "slice" else _check_volume_pair)(Path(it["image"]), Path(it["label"]), center,
                                                                       center_dir)
        out.append({"image": it["image"], "label": it["label"], "case": it["case"], "name": it["name"],
                    "orientation_fix": fix if it["kind"] == "slice" else ""})
    return out


# --------------------------------------------------------------------------------------------------------------------
# Reading one item
# --------------------------------------------------------------------------------------------------------------------


def _read_png(path: Path, site: str, center_dir: Path, mask: bool) -> np.ndarray:
    try:
        with Image.open(path) as im:
            if mask and im.mode not in ("1", "L", "P", "I", "I;16"):
                raise site_error(site, f"mask {relative_to_site(path, center_dir)} has mode {im.mode}; expected a single-channel mask")
            arr = np.asarray(im if mask or im.mode in ("L", "I", "I;16", "F") else im.convert("L"))
    except DataError:
        raise
    except Exception as e:  # PIL: OSError, SyntaxError, ValueError on bad files
        raise site_error(site, f"cannot read {relative_to_site(path, center_dir)}: {e}") from None
    return arr


def _read_volume(path: Path, site: str, center_dir: Path, mask: bool) -> tuple[np.ndarray, tuple, tuple[float, ...]]:
    """(array in LPS voxel order, raw shape, spacing per LPS axis) of a NIfTI file."""
    from nibabel.orientations import apply_orientation, axcodes2ornt, io_orientation, ornt_transform

    img = _nifti(path, site, center_dir)
    raw_shape = tuple(img.shape)
    try:
        arr = np.asanyarray(img.dataobj) if mask else img.get_fdata(dtype=np.float32)
    except Exception as e:
        raise site_error(site, f"cannot read NIfTI file {relative_to_site(path, center_dir)}: {e}") from None
    while arr.ndim > 3 and arr.shape[-1] == 1:
        arr = arr[..., 0]
    if arr.ndim != 3:
        raise site_error(site, f"NIfTI file {relative_to_site(path, center_dir)} has shape {raw_shape}; expected a 3D volume")
    transform = ornt_transform(io_orientation(img.affine), axcodes2ornt(("L", "P", "S")))
    zooms = [float(z) for z in img.header.get_zooms()[:3]]
    spacing = [0.0] * 3
    for axis, (new_axis, _) in enumerate(transform):
        spacing[int(new_axis)] = zooms[axis]
    return apply_orientation(arr, transform), raw_shape, tuple(spacing)


def read_case(item: dict[str, Any], lut: dict[int, int], site: str | None = None
              ) -> tuple[np.ndarray, np.ndarray, tuple[float, ...] | None]:
    """Read one item of :func:`ct_items`: ``(image, mask, spacing)``.

    * PNG slice: image float32 ``[H, W]`` (8-bit windowed gray 0..255 as stored, no HU), spacing ``None``.
    * NIfTI volume: image float32 ``[Z, H, W]`` in HU (scl_slope/inter applied), voxel order (S, P, L) after
      reorientation (row 0 anterior, column 0 patient right, like the slices), spacing ``(z, y, x)`` in mm from the
      header zooms, in the array's axis order.
    * mask int16, same shape, remapped with ``lut`` (:func:`site_label_lut`) to site-local ids.
    * ``item["orientation_fix"] == "flip_lr"`` (see :data:`ORIENTATION_FIXES`): image and mask flipped left-right.

    Raises:
        DataError: unreadable file (names it), mask shape different from its image's (names both files and shapes),
            a non-integer mask value or one not declared in labels.json (names the mask and the values).
    """
    image_path, label_path = Path(item["image"]), Path(item["label"])
    center_dir = image_path.parent.parent
    site = site or center_dir.name
    if (_stem_kind(image_path) or ("", ""))[1] == "volume":
        image, image_shape, spacing = _read_volume(image_path, site, center_dir, mask=False)
        mask, mask_shape, _ = _read_volume(label_path, site, center_dir, mask=True)
        image, mask = image.transpose(2, 1, 0), mask.transpose(2, 1, 0)
        spacing = spacing[::-1]
    else:
        image = _read_png(image_path, site, center_dir, mask=False).astype(np.float32)
        mask = _read_png(label_path, site, center_dir, mask=True)
        image_shape, mask_shape, spacing = image.shape, mask.shape, None
    if image_shape != mask_shape:
        raise site_error(site, f"mask {relative_to_site(label_path, center_dir)} has shape {tuple(mask_shape)} but image "
                         f"{relative_to_site(image_path, center_dir)} has shape {tuple(image_shape)}")
    values, inverse = np.unique(mask, return_inverse=True)
    bad = [v for v in values.tolist() if v != int(v) or int(v) not in lut]
    if bad:
        raise site_error(site, f"mask {relative_to_site(label_path, center_dir)} holds values {bad[:10]} not declared in labels.json "
                         f"(declared: {sorted(lut)})")
    mask = np.asarray([lut[int(v)] for v in values.tolist()], dtype=np.int16)[inverse.reshape(-1)].reshape(mask.shape)
    if item.get("orientation_fix") == "flip_lr":
        image, mask = image[..., ::-1], mask[..., ::-1]
    elif item.get("orientation_fix"):
        raise site_error(site, f"unknown orientation_fix {item['orientation_fix']!r} for {relative_to_site(image_path, center_dir)}")
    return np.ascontiguousarray(image, dtype=np.float32), np.ascontiguousarray(mask), spacing
