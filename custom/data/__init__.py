"""Datasets: one API for every 2D multi-center segmentation task, ``(task, center, split) -> samples``, over the rooms
below it (tasks, io, sites), and the CT data (:mod:`feduq.data.ct`).

Import everything from here. The API spans four modules (each imports only the ones before it):

* :mod:`feduq.tasks.spec` -- the task registry (:class:`TaskSpec`, :data:`TASKS`, :func:`get_task`), a site's folder
  (:func:`resolve_data_root`, :func:`read_label_values`, :func:`read_groups`, :func:`scan_center`) and
  :class:`DataError`;
* :mod:`feduq.io.transforms` -- the MONAI transforms (:func:`make_transforms`, :func:`make_classification_transforms`);
* :mod:`feduq.io.resize` -- the resize modes and the letterbox geometry (:func:`letterbox_box`, :func:`aspect_shape`,
  :data:`ORIGINAL_SIZE_KEY`);
* :mod:`feduq.sites.split_files` -- splits (:func:`make_split`, :func:`make_center_split`, :func:`load_split`,
  :func:`site_split`);
* :mod:`feduq.data` (this module) -- the datasets (:func:`get_dataset`, :func:`get_classification_dataset`) and a
  re-export of the three above.

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

Tensor conventions of :func:`get_dataset` samples (see :func:`make_transforms`; the spatial axes are (width, height)
of the stored file, as MONAI's ``PILReader`` gives them: see :mod:`feduq.io.transforms`)::

    sample["image"]: float32 MetaTensor [in_channels, S, S], values in [0, 1]           (S = image_size)
    sample["label"]: float32 MetaTensor [1, S, S] holding class indices 0..C-1
                     (stage "test": [1, W0, H0], the stored resolution, not resized)
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Sequence

import numpy as np

# Re-exported: the registry, a site's folder and the transforms are part of this dataset API (feduq.data.X).
from ..tasks.spec import (
    BUILT_IN,
    PACKAGE_TASKS_DIR,
    BUSBRA_PATIENT_PATTERN,
    DATA_ROOT_ENV,
    HAM10000_CENTERS,
    IMAGE_SUFFIXES,
    PROSTATE_CASE_PATTERN,
    SPLIT_KEYS,
    TASKS,
    DataError,
    TaskSpec,
    site_error,
    relative_to_site,
    get_task,
    task_name,
    task_reference,
    job_task,
    declared_task,
    label_classes,
    read_groups,
    read_label_values,
    resolve_data_root,
    scan_center,
    stem_groups,
    task_folder,
)
from ..sites.split_files import (
    DEFAULT_FRACTIONS,
    PACKAGE_SPLITS_DIR,
    _check_decodes,
    load_split,
    center_groups,
    make_center_split,
    make_split,
    site_split,
    write_split_file,
)
from ..io.resize import ORIGINAL_SIZE_KEY, RESIZE_MODES, aspect_shape, letterbox_box, read_original_sizes
from ..io.transforms import make_classification_transforms, make_transforms
from ..sites.folder import SiteFolder
from ..sites.nnunet_raw import annotated_classes, nnunet_items

__all__ = [
    "DATA_ROOT_ENV",
    "IMAGE_SUFFIXES",
    "SPLIT_KEYS",
    "DataError",
    "data_error_in",
    "TaskSpec",
    "TASKS",
    "get_task",
    "task_name",
    "task_reference",
    "BUILT_IN",
    "PACKAGE_TASKS_DIR",
    "job_task",
    "declared_task",
    "annotated_classes",
    "task_folder",
    "label_classes",
    "resolve_data_root",
    "read_label_values",
    "read_groups",
    "stem_groups",
    "scan_center",
    "make_split",
    "center_groups",
    "make_center_split",
    "write_split_file",
    "load_split",
    "make_transforms",
    "get_dataset",
    # re-exported from feduq.tasks.spec and feduq.io.resize (see the module docstring)
    "PROSTATE_CASE_PATTERN",
    "BUSBRA_PATIENT_PATTERN",
    "HAM10000_CENTERS",
    "RESIZE_MODES",
    "ORIGINAL_SIZE_KEY",
    "aspect_shape",
    "read_original_sizes",
    "letterbox_box",
]

# --------------------------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------------------------


def get_dataset(
    task: str,
    center: str,
    split: str,
    data_root: str | os.PathLike | None = None,
    image_size: int = 384,
    max_items: int | None = None,
    cache: bool | str = True,
    split_file: str | os.PathLike | None = None,
    seed: int = 0,
    on_bad_file: str = "error",
    resize: str = "stretch",
    intensity: str = "minmax",
    site: str | None = None,
    stage: str | None = None,
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
        cache: ``True``: a ``CacheDataset`` (deterministic transforms cached once, the random flip runs every
            epoch); ``False``: a plain ``Dataset``; ``"check"``: a plain ``Dataset`` whose every sample was read once
            here, so a bad file raises now, as with a cache, but nothing is kept (a split read once, at the end).
        split_file: explicit split JSON (highest precedence, see :func:`load_split`).
        seed: seeds the random flip of the training transforms.
        on_bad_file: ``"error"`` (default) raises on a missing, unreadable, truncated or size-mismatched
            file; ``"skip"`` drops that pair with a warning naming the site and file (a site setting).
        resize: ``"stretch"`` or ``"letterbox"`` (see :func:`make_transforms`).
        intensity: ``"minmax"``, ``"max"`` or ``"raw"`` (see :func:`make_transforms`).
        site: the site reading ``center`` (a virtual site, or one with its own split; :func:`load_split`).
        stage: the transforms of another split (``"val"``: the training images without random flips, e.g. for
            FedA3I's noise estimation); default the split's own.

    Returns:
        ``monai.data.CacheDataset`` or ``monai.data.Dataset`` of dicts ``{"image": [C,S,S] float32,
        "label": [1,S,S] float32 class indices}`` (see :func:`make_transforms`; test labels stay at stored size).

    Raises:
        DataError: see :func:`load_split`, :func:`read_label_values`, :func:`make_transforms` (with ``cache=True``
            or ``"check"`` load-time errors such as undeclared mask values surface here; with ``cache=False`` they
            surface, wrapped in MONAI's ``RuntimeError``, when a sample is read).
    """
    folder = SiteFolder.of(task, center, data_root, site=center)  # half an nnU-Net dataset: named as that
    spec, center_dir = folder.task, folder.path
    if folder.nnunet:
        return _nnunet_dataset(spec, center, split, data_root, image_size, max_items, cache, split_file, seed,
                               resize, intensity, site, stage)
    if spec.kind == "3d" or spec.normalised_at_read:
        raise site_error(center, f"{center_dir} is not an nnU-Net raw dataset (dataset.json and imagesTr/); task "
                                 f"{spec.name!r} declares {'3D volumes' if spec.kind == '3d' else 'normalised channels'}, "
                                 "which FedUQ reads from nnU-Net's layout only (its own layout serves a 2D task whose "
                                 "channels are all noNorm)")
    short, spec, center_dir, items = _split_items(task, center, split, data_root, max_items, split_file, on_bad_file,
                                                  site)
    values = read_label_values(center_dir)
    classes = label_classes(spec, values, site=center)
    transform = make_transforms(
        stage or short, image_size, spec.in_channels, values, site=center, label_classes=classes, resize=resize,
        intensity=intensity,
    )
    if resize == "letterbox":  # the aspect ratio before the provider's stretch, where provenance.csv records it
        sizes = read_original_sizes(center_dir)
        items = [{**it, ORIGINAL_SIZE_KEY: np.asarray(sizes.get(Path(it["image"]).stem, (0, 0)))} for it in items]
    # the steps after the cache (feduq.io.transforms) make new tensors and dicts and never write into a cached
    # sample, so it is read without MONAI's deep copy (which copied each image's metadata on every read)
    return _dataset(items, transform, cache, seed, copy_cache=False)


def _nnunet_dataset(spec, center, split, data_root, image_size, max_items, cache, split_file, seed, resize, intensity,
                    site, stage):
    """:func:`get_dataset` of a declared task's site in nnU-Net's raw layout (:mod:`feduq.sites.nnunet_raw`): the
    cases read and normalised once, then the same transforms as a file-based site (the job's ``intensity`` applies
    only when every channel is ``noNorm``)."""
    short = {v: k for k, v in SPLIT_KEYS.items()}.get(split, split)
    if short not in SPLIT_KEYS:
        raise site_error(center, f"unknown split '{split}'; expected one of {sorted(SPLIT_KEYS)}")
    items = nnunet_items(spec.name, center, short, data_root, max_items, split_file, site)
    if resize == "letterbox" and spec.kind == "2d":  # a 2D site may keep FedUQ's provenance.csv beside:
        # the size each case had before it was stretched (orig_width, orig_height), the letterbox's aspect ratio
        sizes = read_original_sizes(resolve_data_root(data_root, site=center) / spec.folder / center)
        if sizes:
            items = [{**it, ORIGINAL_SIZE_KEY: np.asarray(sizes.get(it["case"], (0, 0)))} for it in items]
    transform = make_transforms(
        stage or short, image_size, spec.in_channels, list(range(spec.num_classes)), site=center, resize=resize,
        intensity="raw" if spec.normalised_at_read else intensity, load=False,
    )
    return _dataset(items, transform, cache, seed, copy_cache=False)


def _split_items(task, center, split, data_root, max_items, split_file, on_bad_file, site=None):
    """``(short split name, TaskSpec, center folder, decodable items)`` of one site's split."""
    short = {v: k for k, v in SPLIT_KEYS.items()}.get(split, split)
    if short not in SPLIT_KEYS:
        raise site_error(center, f"unknown split '{split}'; expected one of {sorted(SPLIT_KEYS)}")
    spec = get_task(task)
    if on_bad_file not in ("error", "skip"):
        raise site_error(center, f"on_bad_file must be 'error' or 'skip', got {on_bad_file!r}")
    items = load_split(task, center, data_root=data_root, split_file=split_file, on_bad_file=on_bad_file, site=site,
                       checked=(SPLIT_KEYS[short],))[SPLIT_KEYS[short]]
    if max_items is not None:
        items = items[: int(max_items)]
    center_dir = resolve_data_root(data_root, site=center) / spec.folder / center
    return short, spec, center_dir, _check_decodes(items, center, center_dir, on_bad_file)


def _dataset(items: list[dict], transform, cache: bool | str, seed: int, copy_cache: bool = True):
    """A (Cache)Dataset of ``items`` (``cache``: see :func:`get_dataset`; ``copy_cache``: MONAI's deep copy of a
    cached sample before the steps after the cache, needed when one of them writes into its input); transform errors
    surface as the DataError naming site and file."""
    from monai.data import CacheDataset, Dataset

    transform.set_random_state(seed=seed)
    if not cache:
        return Dataset(items, transform=transform)
    try:  # MONAI wraps transform errors; surface our DataError (names site and file)
        if cache == "check":  # every sample read once, nothing kept
            dataset = Dataset(items, transform=transform)
            for i in range(len(dataset)):
                dataset[i]
            transform.set_random_state(seed=seed)
            return dataset
        # One caching thread: with more, an exception in one thread leaves the others running into interpreter
        # shutdown, which aborts the process (torch, "terminate called without an active exception").
        return CacheDataset(items, transform=transform, num_workers=1, progress=False, copy_cache=copy_cache)
    except RuntimeError as e:
        cause = data_error_in(e)
        if cause is not None:
            raise cause from None
        raise


def data_error_in(error: BaseException) -> DataError | None:
    """The :class:`DataError` a MONAI ``RuntimeError("applying transform ...")`` wraps (its ``__cause__`` chain), or
    None. MONAI wraps every exception a transform raises, so a dataset's clear message has to be unwrapped."""
    cause: BaseException | None = error
    while cause is not None and not isinstance(cause, DataError):
        cause = cause.__cause__
    return cause


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
        raise site_error(site, f"no image-level labels: {path} does not exist")
    index = {name: i for i, name in enumerate(class_names)}
    out: dict[str, int] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if not reader.fieldnames or not {"image", "class"} <= set(reader.fieldnames):
            raise site_error(site, f"{path} needs the columns 'image' and 'class', has {reader.fieldnames}")
        for line, row in enumerate(reader, start=2):
            stem, name = Path((row["image"] or "").strip()).stem, (row["class"] or "").strip()
            if name not in index:
                raise site_error(site, f"{path} line {line}: class {name!r} of {stem!r} is not one of {list(class_names)}")
            if stem in out:
                raise site_error(site, f"{path} lists {stem!r} twice")
            out[stem] = index[name]
    return out

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
    site: str | None = None,
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
    short, spec, center_dir, items = _split_items(task, center, split, data_root, max_items, split_file, on_bad_file,
                                                  site)
    classes = read_image_classes(center_dir, names, site=center)
    labelled = []
    for item in items:
        stem = Path(item["image"]).stem
        if stem not in classes:
            raise site_error(center, f"image {relative_to_site(item['image'], center_dir)} has no class in {center_dir / CLASSES_FILE}")
        labelled.append({"image": item["image"], "label": classes[stem]})
    transform = make_classification_transforms(short, image_size, spec.in_channels, site=center)
    return _dataset(labelled, transform, cache, seed)


__all__ += [
    "site_split",
    "CLASSES_FILE",
    "CLASSIFICATION_CLASSES",
    "classification_classes",
    "read_image_classes",
    "make_classification_transforms",
    "get_classification_dataset",
]
