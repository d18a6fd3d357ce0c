"""A task declared in a file: nnU-Net v2's ``dataset.json`` plus FedUQ's own keys in one ``"feduq"`` object.

A consortium describes its task the way every nnU-Net user already does, and FedUQ reads it as it is::

    {
      "name": "Dataset731_ProstateMR",
      "channel_names": {"0": "T2", "1": "ADC"},
      "labels": {"background": 0, "PZ": 1, "TZ": 2},
      "file_ending": ".nii.gz",
      "feduq": {
        "sites": ["Hospital-A", "Hospital-B", "Hospital-C"],
        "held_out": ["Hospital-C"],
        "group_pattern": "(.+)_\\\\d+",
        "normalization": {"0": "zscore", "1": "zscore"},
        "score": ["PZ", "TZ"]
      }
    }

nnU-Net's keys (``name``, ``channel_names``, ``labels``, ``regions_class_order``, ``file_ending``,
``overwrite_image_reader_writer``; ``numTraining`` and the other informative keys are read and ignored: a site's own
``dataset.json`` counts its cases):

* ``channel_names``: channel index (``"0"``, ``"1"``, ...) -> name, in the order the channels are stacked
  (``<case>_0000``, ``<case>_0001``, ...). Without a ``feduq.normalization`` entry, a channel is normalised as
  nnU-Net does by its name: ``"CT"`` -> the CT window, ``"noNorm"``, ``"rescale_to_0_1"``, ``"rgb_to_0_1"``, any other
  name -> z-score per image.
* ``labels``: structure name -> label value (``"background": 0`` required), or -> a list of values (nnU-Net's
  region syntax: the region is their union, e.g. ``"whole tumor": [1, 2, 3]``), then with ``regions_class_order``
  (one value per region, nnU-Net's order of painting regions back into a label map). FedUQ trains on the label
  values (softmax over background and every value) and scores the regions at test time, as the built-in fundus task
  scores its nested disc and cup.
* ``file_ending``: ``.png``, ``.bmp``, ``.tif``/``.tiff`` (2D files, scored per image) or ``.nii.gz``,
  ``.nii``, ``.nrrd``, ``.mha`` (3D volumes, trained slice by slice and split by case). JPEG is refused, as nnU-Net v2
  refuses it: its 2D reader (``nnunetv2/imageio/natural_image_reader_writer.py``, ``NaturalImage2DIO``) takes PNG,
  BMP and TIFF only, "because we cannot allow lossy compression" of label maps (a JPEG mask gains values at edges).
* ``overwrite_image_reader_writer``: honoured when it names the reader FedUQ reads the ending with
  (:data:`READERS`: ``NaturalImage2DIO`` for 2D files; ``SimpleITKIO``, ``NibabelIO`` or ``NibabelIOWithReorient``
  for NIfTI, ``SimpleITKIO`` for NRRD and MHA; ``"None"``: nnU-Net's "no override"), refused otherwise (nnU-Net's
  ``reader_writer_registry.determine_reader_writer_from_dataset_json``).

FedUQ's keys (all optional except ``sites``): ``sites`` (the federation's sites, any names: the folders under
``<data root>/<name>/``), ``held_out`` (sites that never train: tested only), ``group_pattern`` (a regular
expression on the case name whose first capturing group groups cases that must stay in one split, e.g. one patient's
studies; one pattern, or site -> pattern), ``normalization`` (channel index -> ``"zscore"``, ``"rescale_to_0_1"``,
``"rgb_to_0_1"``, ``"noNorm"`` (the job's ``intensity`` setting then applies) or ``{"scheme": "CT", "window": [low,
high], "mean": m, "std": s}`` in the stored
units, HU for CT; ``mean``/``std`` optional: without them the window is rescaled to [0, 1]; a ``"CT"`` channel without
a window gets nnU-Net's from the sites' intensity fingerprints, ``feduq fingerprint``), ``score`` (the label or
region names scored at test time; default every foreground label, or every region), ``hyperparameters`` (method ->
executor argument -> value, e.g. ``{"fedevi": {"kl_weight": 1e-5}}``: applied when a job of that method is configured
for the task, after the method's defaults and before ``--set``; the method and argument names are checked there,
:func:`feduq.recipes.settings.task_method_settings`).

The keys a task in FedUQ's own layout adds (the built-in tasks' files, ``feduq/tasks/task_files/``, are written with
them and read by this same code): ``layout`` (``"feduq"``: sites hold ``images/``, ``masks/``, ``labels.json`` and
``provenance.csv``), ``folder`` (the task's folder under the data root, default its name), ``group_column`` (site ->
``provenance.csv`` column grouping the images one split keeps together, e.g. ``"sequence"``),
``group_column_if_present`` (the same, used where the column exists), ``merge_foreground`` (true: a binary task whose
sites' ``labels.json`` may give the foreground several values) and ``partition_sites`` (sites run as IID virtual
partitions ``<site>-p<k>of<K>``).

This module reads and checks a task file into the one task type, :class:`~feduq.tasks.task.TaskSpec`, which every
tool reads (a built-in task's shipped file and a user's alike); :mod:`feduq.tasks.spec` keeps the registry.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any, Mapping

from ..common.errors import DataError
from .task import FILE_ENDINGS_2D, FILE_ENDINGS_3D, TaskSpec, file_kind

__all__ = ["TaskSpec", "parse_declaration", "read_task_file", "FILE_ENDINGS_2D", "FILE_ENDINGS_3D",
           "NORMALIZATION_SCHEMES", "file_kind", "looks_like_task_file"]

#: nnU-Net v2's normalisation schemes (``nnunetv2.preprocessing.normalization``), by the names its channel_names use
NORMALIZATION_SCHEMES = ("CT", "zscore", "rescale_to_0_1", "rgb_to_0_1", "noNorm")
_NNUNET_KEYS = {"name", "channel_names", "labels", "regions_class_order", "file_ending", "numTraining", "numTest",
                "description", "reference", "licence", "license", "release", "tensorImageSize", "modality",
                "overwrite_image_reader_writer", "dataset_name", "converted_by", "feduq"}
_FEDUQ_KEYS = {"sites", "held_out", "group_pattern", "normalization", "score", "hyperparameters", "layout", "folder",
               "group_column", "group_column_if_present", "merge_foreground", "partition_sites", "configuration"}
#: how a task's sites train, by nnU-Net's configuration names: ``2d`` (images, or a volume's axial slices, on FedUQ's
#: 2D site) or ``3d_fullres`` (volumes on nnU-Net's 3D network of the federation's plan, :mod:`feduq.site.site3d`)
CONFIGURATIONS = ("2d", "3d_fullres")
#: where a task's sites keep their files: nnU-Net's raw layout (``dataset.json``, ``imagesTr/``, ``labelsTr/``; inputs
#: to predict named ``<case>_0000<ending>``) or FedUQ's own (``images/``, ``masks/``, ``labels.json``,
#: ``provenance.csv``; inputs to predict are image files of any name), :mod:`feduq.data`
LAYOUTS = ("nnunet", "feduq")
#: the nnU-Net v2 readers (``nnunetv2.imageio``) whose reading of an ending is FedUQ's: ``overwrite_image_reader_writer``
#: may name one of them (FedUQ reads 2D files as ``NaturalImage2DIO`` does, volumes with nibabel or SimpleITK,
#: :func:`feduq.io.volumes.read_volume`)
READERS = {**{e: ("NaturalImage2DIO",) for e in (".png", ".bmp", ".tif", ".tiff")},
           **{e: ("SimpleITKIO", "NibabelIO", "NibabelIOWithReorient") for e in (".nii.gz", ".nii")},
           ".nrrd": ("SimpleITKIO",), ".mha": ("SimpleITKIO",)}


def looks_like_task_file(value: Any) -> bool:
    """True for a ``--task`` value that names a file rather than a built-in task (ends in ``.json`` or holds a path
    separator)."""
    return isinstance(value, (str, os.PathLike)) and (str(value).endswith(".json") or os.sep in str(value))


def _fail(source: str, key: str, message: str) -> DataError:
    return DataError(f"{source}: {key}: {message}")


def read_task_file(path: str | os.PathLike) -> TaskSpec:
    """Read and check a task file (see the module docstring).

    Raises:
        DataError: the file is missing, not JSON, not an object, or fails :func:`parse_declaration` (one line naming
            the file and the key).
    """
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise DataError(f"task file {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(f"task file {path} is not JSON: {e}") from None
    return parse_declaration(raw, source=f"task file {path}")


def parse_declaration(raw: Mapping, source: str = "the job's task declaration") -> TaskSpec:
    """Check a task declaration (a JSON object) and return it as the task's :class:`~feduq.tasks.task.TaskSpec`.

    Raises:
        DataError: one line naming ``source`` and the key: not an object; ``name``, ``channel_names``, ``labels`` or
            ``file_ending`` missing or malformed; channel indices not 0..n-1; ``background`` not 0; a label value
            declared twice; regions without a fitting ``regions_class_order``; an unknown key in ``feduq``; no
            ``feduq.sites``; a held-out site, group pattern, normalisation or scored structure that does not fit.
    """
    if not isinstance(raw, Mapping):
        raise DataError(f"{source}: expected a JSON object (nnU-Net's dataset.json), got {type(raw).__name__}")
    unknown = sorted(set(raw) - _NNUNET_KEYS)
    if unknown:
        raise _fail(source, unknown[0], "is not a key of nnU-Net's dataset.json nor 'feduq' (FedUQ's keys go in "
                    "the 'feduq' object)")
    for key in ("name", "channel_names", "labels", "file_ending"):
        if key not in raw:
            raise _fail(source, key, "is missing (nnU-Net's dataset.json needs name, channel_names, labels and "
                        "file_ending)")
    name = raw["name"]
    if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", name):
        raise _fail(source, "name", f"{name!r} is not a folder name (letters, digits, '_', '.', '-')")
    channels = _channels(raw["channel_names"], source)
    values, class_names, labels, regions = _labels(raw["labels"], raw.get("regions_class_order"), source)
    try:
        file_kind(raw["file_ending"])
    except DataError as e:
        raise _fail(source, "file_ending", str(e)) from None
    reader = raw.get("overwrite_image_reader_writer")
    accepted = READERS[str(raw["file_ending"]).lower()]
    if reader not in (None, "None", *accepted):
        raise _fail(source, "overwrite_image_reader_writer", f"{reader!r} is not how FedUQ reads "
                    f"{raw['file_ending']} files ({' or '.join(accepted)} is): remove the key or name that reader")
    feduq = raw.get("feduq", {})
    if not isinstance(feduq, Mapping):
        raise _fail(source, "feduq", "must be a JSON object")
    unknown = sorted(set(feduq) - _FEDUQ_KEYS)
    if unknown:
        raise _fail(source, f"feduq.{unknown[0]}", f"is not a FedUQ key (known: {sorted(_FEDUQ_KEYS)})")
    sites = feduq.get("sites")
    if not (isinstance(sites, list) and sites and all(isinstance(s, str) and s and "/" not in s for s in sites)):
        raise _fail(source, "feduq.sites", "must list the federation's sites (folder names under "
                    f"<data root>/{name}/), got {sites!r}")
    if len(set(sites)) != len(sites):
        raise _fail(source, "feduq.sites", f"lists a site twice: {sites}")
    held_out = feduq.get("held_out", [])
    if not isinstance(held_out, list) or any(s not in sites for s in held_out):
        raise _fail(source, "feduq.held_out", f"{held_out!r} must be a list of sites from feduq.sites")
    if len(held_out) >= len(sites):
        raise _fail(source, "feduq.held_out", "holds every site: at least one site must train")
    configuration = feduq.get("configuration", "2d")
    if configuration not in CONFIGURATIONS:
        raise _fail(source, "feduq.configuration", f"must be one of {list(CONFIGURATIONS)}, got {configuration!r}")
    if configuration != "2d" and file_kind(raw["file_ending"]) != "3d":
        raise _fail(source, "feduq.configuration", f"{configuration!r} trains volumes, but file_ending "
                    f"{raw['file_ending']!r} holds 2D images")
    return TaskSpec(
        name=name, channel_names=channels, label_values=values, class_names=class_names, labels=labels,
        regions=regions, file_ending=str(raw["file_ending"]), sites=tuple(sites), held_out=tuple(held_out),
        group_pattern=_group_pattern(feduq.get("group_pattern"), sites, source),
        normalization=_normalization(feduq.get("normalization", {}), channels, source),
        score=_score(feduq.get("score"), labels, values, regions, source),
        hyperparameters=_hyperparameters(feduq.get("hyperparameters", {}), source), source=source,
        raw=json.loads(json.dumps(raw)), **_layout(feduq, sites, len(values), source), configuration=configuration,
    )


def _channels(channel_names, source: str) -> tuple[str, ...]:
    if not isinstance(channel_names, Mapping) or not channel_names:
        raise _fail(source, "channel_names", f"must map channel indices to names, e.g. {{\"0\": \"T2\"}}, got "
                    f"{channel_names!r}")
    try:
        index = {int(k): v for k, v in channel_names.items()}
    except (TypeError, ValueError):
        raise _fail(source, "channel_names", f"keys must be channel indices \"0\", \"1\", ..., got "
                    f"{sorted(channel_names)}") from None
    if sorted(index) != list(range(len(index))):
        raise _fail(source, "channel_names", f"indices must be 0..{len(index) - 1}, got {sorted(index)}")
    if not all(isinstance(v, str) and v for v in index.values()):
        raise _fail(source, "channel_names", "every channel needs a name (a string)")
    return tuple(index[i] for i in range(len(index)))


def _labels(labels, order, source: str):
    """``(label values, class names, name -> values, regions?)`` of nnU-Net's ``labels`` (+ ``regions_class_order``)."""
    if not isinstance(labels, Mapping) or not labels:
        raise _fail(source, "labels", f"must map structure names to label values, got {labels!r}")
    if "ignore" in labels:
        raise _fail(source, "labels.ignore", "nnU-Net's ignore label (sparse annotation) is not supported; declare "
                    "the structures a site annotates in its own dataset.json instead (partial labels)")
    if labels.get("background") != 0:
        raise _fail(source, "labels.background", f"must be 0 (nnU-Net's convention), got {labels.get('background')!r}")
    out: dict[str, tuple[int, ...]] = {}
    for key, value in labels.items():
        vals = value if isinstance(value, list) else [value]
        if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
            raise _fail(source, f"labels.{key}", f"must be a label value >= 0 or a list of them, got {value!r}")
        out[key] = tuple(int(v) for v in vals)
    regions = any(isinstance(v, list) for k, v in labels.items() if k != "background")
    if not regions:
        seen: dict[int, str] = {}
        for key, (v,) in out.items():
            if v in seen:
                raise _fail(source, f"labels.{key}", f"declares the label value {v} that '{seen[v]}' already has")
            seen[v] = key
        values = tuple(sorted(seen))
        return values, tuple(seen[v] for v in values), out, False
    if order is None:
        raise _fail(source, "regions_class_order", "is missing: labels use nnU-Net's region syntax (lists of values)")
    foreground = [k for k in out if k != "background"]
    if not (isinstance(order, list) and len(order) == len(foreground) and len(set(order)) == len(order)
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in order)):
        raise _fail(source, "regions_class_order", f"needs one distinct label value > 0 per region ({len(foreground)}), "
                    f"got {order!r}")
    for key in foreground:
        if 0 in out[key]:
            raise _fail(source, f"labels.{key}", "a region cannot contain the background value 0")
        if len(set(out[key])) != len(out[key]):
            raise _fail(source, f"labels.{key}", f"declares a label value twice: {list(out[key])}")
    same: dict[frozenset, str] = {}
    for key in foreground:  # two names for one set of values: one structure declared twice
        values_of = frozenset(out[key])
        if values_of in same:
            raise _fail(source, f"labels.{key}", f"covers the same label values {sorted(values_of)} as "
                        f"'{same[values_of]}': one structure declared twice")
        same[values_of] = key
    values = tuple(sorted({0, *(v for k in foreground for v in out[k])}))
    missing = [v for v in order if v not in values]
    if missing:
        raise _fail(source, "regions_class_order", f"value {missing[0]} is in no region")
    painted = {v: k for k, v in zip(foreground, order)}
    return values, tuple("background" if v == 0 else painted.get(v, f"label_{v}") for v in values), out, True


def _group_pattern(pattern, sites, source: str) -> dict[str, str]:
    if pattern is None:
        return {}
    patterns = {"*": pattern} if isinstance(pattern, str) else pattern
    if not isinstance(patterns, Mapping):
        raise _fail(source, "feduq.group_pattern", "must be a regular expression or site -> regular expression")
    for site, rx in patterns.items():
        if site != "*" and site not in sites:
            raise _fail(source, f"feduq.group_pattern.{site}", "is not a site of feduq.sites")
        try:
            groups = re.compile(rx).groups
        except (re.error, TypeError) as e:
            raise _fail(source, f"feduq.group_pattern.{site}", f"{rx!r} is not a regular expression: {e}") from None
        if groups == 0:
            raise _fail(source, f"feduq.group_pattern.{site}", f"{rx!r} has no capturing group (the group is the "
                        "first one that matches)")
    return dict(patterns)


def _normalization(given, channels, source: str) -> tuple[tuple, ...]:
    """Per channel ``(scheme, low, high, mean, std)``: the ``feduq.normalization`` entry or nnU-Net's default for the
    channel's name."""
    if not isinstance(given, Mapping):
        raise _fail(source, "feduq.normalization", "must map channel indices to schemes")
    extra = [k for k in given if not (str(k).isdigit() and str(int(k)) == str(k) and int(k) < len(channels))]
    if extra:
        raise _fail(source, f"feduq.normalization.{extra[0]}", f"is not a channel index 0..{len(channels) - 1}")
    by_name = {s.lower(): s for s in NORMALIZATION_SCHEMES}
    out = []
    for i, channel in enumerate(channels):
        entry = given.get(str(i), by_name.get(channel.lower(), "zscore"))
        key = f"feduq.normalization.{i}" if str(i) in given else f"channel_names.{i}"
        spec = dict(entry) if isinstance(entry, Mapping) else {"scheme": entry}
        scheme = by_name.get(str(spec.get("scheme", "")).lower())
        if scheme is None:
            raise _fail(source, key, f"scheme {spec.get('scheme')!r} is not one of {list(NORMALIZATION_SCHEMES)}")
        if scheme != "CT":
            if set(spec) - {"scheme"}:
                raise _fail(source, key, f"{scheme} takes no numbers, got {sorted(set(spec) - {'scheme'})}")
            out.append((scheme, None, None, None, None))
            continue
        unknown = sorted(set(spec) - {"scheme", "window", "mean", "std"})
        if unknown:
            raise _fail(source, key, f"CT takes \"window\", \"mean\" and \"std\", not {unknown}")
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # noqa: E731
        window = spec.get("window")
        if window is None and set(spec) == {"scheme"}:  # to be computed from the sites' intensity fingerprints
            out.append(("CT", None, None, None, None))
            continue
        if not (isinstance(window, list) and len(window) == 2 and all(number(v) for v in window)
                and window[0] < window[1]):
            raise _fail(source, key, f"CT needs \"window\": [low, high] with low < high in the stored units (HU), "
                        f"got {window!r} (declare it, e.g. {{\"scheme\": \"CT\", \"window\": [-160, 240]}}, or "
                        "leave it out and compute it with feduq fingerprint)")
        mean, std = spec.get("mean"), spec.get("std")
        if (mean is None) != (std is None) or (std is not None and not (number(mean) and number(std) and std > 0)):
            raise _fail(source, key, f"CT takes both \"mean\" and \"std\" (> 0) or neither, got {mean!r}, {std!r}")
        out.append(("CT", float(window[0]), float(window[1]), None if mean is None else float(mean),
                    None if std is None else float(std)))
    return tuple(out)


def _score(score, labels, values, regions: bool, source: str) -> dict[str, tuple[int, ...]]:
    names = [k for k in labels if k != "background"] if score is None else score
    if not (isinstance(names, list) and names and all(isinstance(n, str) for n in names)):
        raise _fail(source, "feduq.score", f"must list label or region names, got {score!r}")
    if len(set(names)) != len(names):
        raise _fail(source, "feduq.score", f"names a structure twice: {names}")
    out = {}
    for name in names:
        if name not in labels or name == "background":
            raise _fail(source, "feduq.score", f"{name!r} is not a foreground label of 'labels' "
                        f"({[k for k in labels if k != 'background']})")
        out[name] = tuple(values.index(v) for v in labels[name])
    return out


def _hyperparameters(given, source: str) -> dict[str, dict]:
    """``feduq.hyperparameters`` checked for its shape (method -> argument -> value); whether the methods are registered
    and take those arguments is checked where a job is configured (this module knows no methods)."""
    if not isinstance(given, Mapping):
        raise _fail(source, "feduq.hyperparameters", f"must map method names to objects of executor arguments, e.g. "
                    f'{{"fedevi": {{"kl_weight": 1e-05}}}}, got {given!r}')
    for method, args in given.items():
        if not isinstance(args, Mapping) or not args:
            raise _fail(source, f"feduq.hyperparameters.{method}", f"must be a non-empty object of executor "
                        f"arguments, e.g. {{\"kl_weight\": 1e-05}}, got {args!r}")
    return {method: dict(args) for method, args in given.items()}


def _layout(feduq: Mapping, sites, num_values: int, source: str) -> dict:
    """The layout keys of ``feduq`` (module docstring), checked: one line naming the key."""
    layout = feduq.get("layout", "nnunet")
    if layout not in LAYOUTS:
        raise _fail(source, "feduq.layout", f"must be one of {list(LAYOUTS)}, got {layout!r}")
    folder = feduq.get("folder")
    if folder is not None and not (isinstance(folder, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", folder)):
        raise _fail(source, "feduq.folder", f"{folder!r} is not a folder name (letters, digits, '_', '.', '-')")
    columns = {}
    for key in ("group_column", "group_column_if_present"):
        given = feduq.get(key, {})
        if not (isinstance(given, Mapping) and all(isinstance(v, str) and v for v in given.values())):
            raise _fail(source, f"feduq.{key}", f"must map sites to provenance.csv column names, got {given!r}")
        extra = [site for site in given if site not in sites]
        if extra:
            raise _fail(source, f"feduq.{key}.{extra[0]}", "is not a site of feduq.sites")
        columns[key] = dict(given)
    merge = feduq.get("merge_foreground", False)
    if not isinstance(merge, bool) or (merge and num_values != 2):
        raise _fail(source, "feduq.merge_foreground", f"must be true or false, and true only for a binary task "
                    f"(background and one structure), got {merge!r} with {num_values} label values")
    partitions = feduq.get("partition_sites", [])
    if not (isinstance(partitions, list) and all(isinstance(p, str) and p and "/" not in p for p in partitions)):
        raise _fail(source, "feduq.partition_sites", f"must list site folder names, got {partitions!r}")
    return {"layout": layout, "data_dir": folder, **columns, "merge_foreground": merge,
            "partition_sites": tuple(partitions)}
