"""The task registry and a site's folder: which tasks exist, where a site's files live, and the checks on them.

Part of the dataset API :mod:`feduq.data`, which re-exports every public name here (import from there). This is
the bottom layer: :mod:`feduq.io.transforms` and :mod:`feduq.data` import from it, it imports neither.

* Registry: :class:`TaskSpec`, :data:`TASKS`, :func:`get_task`, :func:`task_folder`, :func:`label_classes`
  (mask value -> class index).
* A site's folder (layout in :mod:`feduq.data`): :func:`resolve_data_root`, :func:`read_label_values`
  (``labels.json``), :func:`read_groups` (``provenance.csv``), :func:`stem_groups`, :func:`scan_center` (lists the
  image/mask pairs and checks their headers).
* :class:`DataError`: every problem with the input data; its message names the site and the offending file or folder.
"""

from __future__ import annotations

import csv
import json
import os
import re
from pathlib import Path
from typing import Sequence

from PIL import Image

from ..common.errors import DataError  # feduq.data.DataError
from .declared import looks_like_task_file, parse_declaration, read_task_file
from .task import TaskSpec
from ..common.wire import SITE_CONFIG_FILE

__all__ = [
    "DATA_ROOT_ENV",
    "IMAGE_SUFFIXES",
    "SPLIT_KEYS",
    "DataError",
    "TaskSpec",
    "TASKS",
    "BUILT_IN",
    "PACKAGE_TASKS_DIR",
    "PROSTATE_CASE_PATTERN",
    "BUSBRA_PATIENT_PATTERN",
    "HAM10000_CENTERS",
    "CT_ORGANS",
    "CT_TRAINING_CENTERS",
    "CT_HELD_OUT",
    "get_task",
    "job_task",
    "task_name",
    "task_reference",
    "declared_task",
    "task_folder",
    "label_classes",
    "resolve_data_root",
    "read_label_values",
    "read_groups",
    "stem_groups",
    "scan_center",
]

DATA_ROOT_ENV = "FEDUQ_DATA_ROOT"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
#: Short split names (API) -> decathlon list keys (JSON).
SPLIT_KEYS = {"train": "training", "val": "validation", "test": "testing"}


def site_error(site: str | None, message: str) -> DataError:
    """The :class:`DataError` every data check raises: ``"site '<site>': <message>"`` (``'?'`` when unknown)."""
    return DataError(f"site '{site if site else '?'}': {message}")


# --------------------------------------------------------------------------------------------------------------------
# Task registry
# --------------------------------------------------------------------------------------------------------------------


#: Prostate slice stems: ``<case>_z<slice>`` (NCI-ISBI RUNMC/BMC, feduq convert prostate) or
#: ``<split>_<case>_<slice>`` (UST-RUN/SAML subsets) -> the case id (``Case07``, ``train_00``); the prostate task file's
#: group pattern.
PROSTATE_CASE_PATTERN = r"(.+)_z?\d+"
#: BUS-BRA stems ``bus_0001-l`` (download) or ``benign_0001-l`` (shared subset) -> the patient number ``0001``.
BUSBRA_PATIENT_PATTERN = r"\D*(\d+)-[A-Za-z]+"
#: The HAM10000 acquisition sources (metadata column ``dataset``) as site folders.
HAM10000_CENTERS = ("HAM10000-vidir_molemax", "HAM10000-vidir_modern", "HAM10000-rosendahl", "HAM10000-vienna_dias")
#: Abdominal CT (FIVA/FUNAvg, partial labels; loaders and per-site label sets in :mod:`feduq.data.ct`): the global label
#: space (fixed order), the training sites, and the held-out test site (never trains; every slice is test).
CT_ORGANS = ("background", "liver", "kidney", "spleen", "pancreas")
CT_TRAINING_CENTERS = ("NIH-Pancreas-CT", "KiTS19", "MSD-Task09-Spleen", "3D-IRCADb-01", "CHAOS-CT")
CT_HELD_OUT = ("CURVAS-Erlangen",)

#: the task files shipped in the package: the built-in tasks, read by the same code as a user's task file
PACKAGE_TASKS_DIR = Path(__file__).resolve().parent / "task_files"
BUILT_IN = ("polyp", "prostate", "fundus", "skin", "breast", "ct")


#: the built-in tasks, by name, from their shipped task files
TASKS: dict[str, TaskSpec] = {name: read_task_file(PACKAGE_TASKS_DIR / f"{name}.json") for name in BUILT_IN}

#: tasks declared in a file or a job's configuration, by name (:func:`declared_task`); built-in names are refused
DECLARED: dict[str, TaskSpec] = {}


def declared_task(task: TaskSpec) -> TaskSpec:
    """A declared task, registered under its name so that every tool and site that is handed the name finds it
    (:func:`get_task`). Declaring the same task again returns the one registered first.

    Raises:
        DataError: the name is a built-in task's, or another declaration already holds it (names both sources).
    """
    if task.name in TASKS:
        raise DataError(f"{task.source}: name: {task.name!r} is a built-in task's name; give the declared task "
                        "its own (nnU-Net's DatasetNNN_Name)")
    known = DECLARED.get(task.name)
    if known is not None:
        if known.raw != task.raw:
            raise DataError(f"{task.source}: name: {task.name!r} is already declared differently (by "
                            f"{known.source}); one name, one declaration")
        return known
    DECLARED[task.name] = task
    return task


def get_task(name) -> TaskSpec:
    """The :class:`TaskSpec` of a task: a built-in name (:data:`TASKS`), the name of a task declared earlier in this
    process, or a path to a task file (nnU-Net's ``dataset.json`` with FedUQ's ``"feduq"`` keys,
    :mod:`feduq.tasks.declared`); a :class:`TaskSpec` is returned as it is. A job's task value, which may be the
    declaration itself, is read by :func:`job_task`.

    Raises:
        DataError: an unknown name (listing the built-in tasks), or a task file that does not check (one line naming
            the file and the key).
    """
    if isinstance(name, TaskSpec):
        return name
    if not isinstance(name, (str, os.PathLike)):
        raise DataError(f"a task is named by a built-in name or a task file's path, got {type(name).__name__} "
                        f"{name!r:.80}")
    if name in TASKS:
        return TASKS[name]
    if name in DECLARED:
        return DECLARED[name]
    if looks_like_task_file(name):
        return declared_task(read_task_file(name))
    raise DataError(f"unknown task {name!r}; known tasks: {sorted(TASKS)} (built in), or give a task file "
                    "(--task path/to/dataset.json: nnU-Net's dataset.json with a \"feduq\" object)")


def job_task(value) -> TaskSpec:
    """The task a job names (:func:`task_reference` writes it): a built-in task's name, or a declared task's JSON
    object, which is checked (:func:`~feduq.tasks.declared.parse_declaration`) and registered under its name, so that
    the rest of the site finds it by name. Anything else is read as :func:`get_task` reads it.

    Raises:
        DataError: a declaration that does not check (one line naming the key), or what :func:`get_task` raises.
    """
    if isinstance(value, dict):
        return declared_task(parse_declaration(value))
    return get_task(value)


def task_reference(spec: TaskSpec) -> str | dict:
    """How a job names its task: a built-in task by its name (every site's package ships its task file), any other by
    its declaration itself (the JSON object), so the job is self-contained and the sites need no task file."""
    return spec.name if TASKS.get(spec.name) == spec else spec.raw


def task_name(task) -> str:
    """The name of a task given as :func:`job_task` takes it (a declared task is registered on the way)."""
    return job_task(task).name


def task_folder(task: str) -> str:
    """Folder of ``task`` under the data root (:attr:`TaskSpec.folder`); an unregistered name is its own folder."""
    spec = TASKS.get(task) or DECLARED.get(task)
    if spec is None and looks_like_task_file(task):
        spec = get_task(task)
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
            raise site_error(site, f"task '{spec.name}': merge_foreground needs exactly 2 classes, not {spec.num_classes}")
        return [0 if ranks[v] == 0 else 1 for v in values]
    if len(ranks) != spec.num_classes:
        raise site_error(site, f"labels.json declares {len(ranks)} mask values {sorted(ranks)} but task '{spec.name}' has "
                         f"{spec.num_classes} classes {list(spec.class_names)}")
    return [ranks[v] for v in values]


# --------------------------------------------------------------------------------------------------------------------
# Locating and scanning a site
# --------------------------------------------------------------------------------------------------------------------


def resolve_data_root(data_root: str | os.PathLike | None = None, site: str | None = None) -> Path:
    """Return the data root folder: ``data_root`` if given, else the ``FEDUQ_DATA_ROOT`` environment variable.

    A relative ``FEDUQ_DATA_ROOT`` is taken against this process's working directory, else against the folder the
    command was started from (the shell's ``$PWD``, which FLARE's simulator hands on to each site process it starts in
    its own workspace), so ``export FEDUQ_DATA_ROOT=/data/feduq; nvflare simulator JOB -w WS`` finds the data.

    Raises:
        DataError: neither is set, or the folder does not exist (names the site, the env var and the path).
    """
    if data_root not in (None, ""):
        path, origin = Path(data_root), "data_root argument"
    elif os.environ.get(DATA_ROOT_ENV):
        path, origin = Path(os.environ[DATA_ROOT_ENV]), f"${DATA_ROOT_ENV}"
    else:
        raise site_error(
            site,
            f"no data root: set \"data_root\" in the site's local/{SITE_CONFIG_FILE} "
            f"(feduq prepare-site <site workspace> --data-root DIR) or the environment variable {DATA_ROOT_ENV}",
        )
    given = path
    path = path.expanduser().resolve()
    launched = os.environ.get("PWD")  # the shell's folder at launch, inherited by FLARE's site processes
    if (not path.is_dir() and origin.startswith("$") and not given.expanduser().is_absolute() and launched
            and (Path(launched) / given.expanduser()).is_dir()):
        # a relative $FEDUQ_DATA_ROOT means the folder the command was started from, also in a site that FLARE's
        # simulator started in its own workspace (nvflare simulator JOB after export FEDUQ_DATA_ROOT=/data/feduq)
        path = (Path(launched) / given.expanduser()).resolve()
    if not path.is_dir():
        hint = (
            f"; the relative path {str(given)!r} was resolved against this process's working directory {Path.cwd()}"
            + (f" and the folder it was started from ({launched})" if origin.startswith("$") and launched else "")
            + " (a FLARE site runs in its own workspace): give an absolute path"
            + (f", e.g. export {DATA_ROOT_ENV}=\"$(cd {given} && pwd)\" from the folder it is relative to, before "
               f"nvflare poc start" if origin.startswith("$") else "")
            if not given.expanduser().is_absolute() else ""
        )
        raise site_error(site, f"data root {path} (from {origin}) does not exist or is not a folder{hint}")
    return path


def center_folder(data_root: Path, task: str, center: str) -> Path:
    """``<data_root>/<task folder>/<center>``; :class:`DataError` naming the center when it is not a folder."""
    center_dir = Path(data_root) / task_folder(task) / center
    if not center_dir.is_dir():
        raise site_error(center, f"center folder {center_dir} does not exist")
    return center_dir


def relative_to_site(path: str | os.PathLike, center_dir: Path) -> str:
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
        raise site_error(site, f"labels file {path} is missing") from None
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        expected = "{'labels': {'0': 'background', '255': ...}}"
        raise site_error(site, f"labels file {path} is invalid (expected {expected}): {e}") from None
    if len(values) < 2:
        raise site_error(site, f"labels file {path} lists {len(values)} value(s); need background + >= 1 class")
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
        raise site_error(site, f"provenance file {path} is missing (needed for the '{column}' groups)")
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        fields = reader.fieldnames or []
        file_col = "image_file" if "image_file" in fields else "file" if "file" in fields else None
        if file_col is None or column not in fields:
            raise site_error(site, f"provenance file {path} needs an 'image_file' (or 'file') and a '{column}' column")
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
        raise site_error(site, f"group pattern {pattern!r} has no capturing group (the group is the first one that matches)")
    out = {}
    for stem in stems:
        m = rx.fullmatch(stem)
        group = next((g for g in m.groups() if g is not None), None) if m else None
        if group is None:
            raise site_error(site, f"file stem '{stem}' does not match the group pattern {pattern!r}, so its split group "
                             f"is unknown")
        out[stem] = group
    return out


def _image_size(path: Path, site: str, center_dir: Path) -> tuple[tuple[int, int], str]:
    """(width, height) and PIL mode from the file header only (no full decode)."""
    try:
        with Image.open(path) as im:
            return im.size, im.mode
    except Exception as e:  # PIL raises OSError, SyntaxError, struct.error, ... on corrupt headers
        raise site_error(site, f"cannot read image header of {relative_to_site(path, center_dir)}: {e}") from None


def check_pair(image: Path, label: Path, site: str, center_dir: Path) -> None:
    """Both files exist, are readable, the mask is single-channel and has the image's size."""
    for path, kind in ((image, "image"), (label, "mask")):
        if not path.is_file():
            raise site_error(site, f"{kind} {relative_to_site(path, center_dir)} does not exist")
    image_size, _ = _image_size(image, site, center_dir)
    mask_size, mask_mode = _image_size(label, site, center_dir)
    if mask_mode not in ("1", "L", "P", "I", "I;16"):
        raise site_error(site, f"mask {relative_to_site(label, center_dir)} has mode {mask_mode}; expected a single-channel mask")
    if mask_size != image_size:
        raise site_error(
            site,
            f"mask {relative_to_site(label, center_dir)} is {mask_size[0]}x{mask_size[1]} but image {relative_to_site(image, center_dir)} "
            f"is {image_size[0]}x{image_size[1]}",
        )


def _files_by_stem(folder: Path, site: str, center_dir: Path) -> dict[str, Path]:
    if not folder.is_dir():
        raise site_error(site, f"folder {folder} is missing")
    files: dict[str, Path] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or path.suffix.lower() not in IMAGE_SUFFIXES:
            continue
        if path.stem in files:
            raise site_error(site, f"two files share the stem '{path.stem}': {relative_to_site(files[path.stem], center_dir)}, "
                             f"{relative_to_site(path, center_dir)}")
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
    center_dir = center_folder(Path(data_root), task, center)
    images = _files_by_stem(center_dir / "images", center, center_dir)
    masks = _files_by_stem(center_dir / "masks", center, center_dir)
    no_mask, no_image = sorted(set(images) - set(masks)), sorted(set(masks) - set(images))
    more = lambda stems: f" ({len(stems) - 1} more)" if len(stems) > 1 else ""  # noqa: E731
    if no_mask:
        raise site_error(center, f"image {relative_to_site(images[no_mask[0]], center_dir)} has no mask masks/{no_mask[0]}.png"
                           f"{more(no_mask)}")
    if no_image:
        raise site_error(center, f"mask {relative_to_site(masks[no_image[0]], center_dir)} has no image "
                           f"(images/{no_image[0]}.<png|jpg>){more(no_image)}")
    if not images:
        raise site_error(center, f"no images ({', '.join(IMAGE_SUFFIXES)}) in {center_dir / 'images'}")
    items = []
    for stem in sorted(images):
        check_pair(images[stem], masks[stem], center, center_dir)
        items.append({"id": stem, "image": str(images[stem]), "label": str(masks[stem])})
    return items
