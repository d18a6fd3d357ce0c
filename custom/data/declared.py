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

nnU-Net's keys (``name``, ``channel_names``, ``labels``, ``regions_class_order``, ``file_ending``; ``numTraining`` and
the other informative keys are read and ignored):

* ``channel_names``: channel index (``"0"``, ``"1"``, ...) -> name, in the order the channels are stacked
  (``<case>_0000``, ``<case>_0001``, ...). Without a ``feduq.normalization`` entry, a channel is normalised as
  nnU-Net does by its name: ``"CT"`` -> the CT window, ``"noNorm"``, ``"rescale_to_0_1"``, ``"rgb_to_0_1"``, any other
  name -> z-score per image.
* ``labels``: structure name -> label value (``"background": 0`` required), or -> a list of values (nnU-Net's
  region syntax: the region is their union, e.g. ``"whole tumor": [1, 2, 3]``), then with ``regions_class_order``
  (one value per region, nnU-Net's order of painting regions back into a label map). FedUQ trains on the label
  values (softmax over background and every value) and scores the regions at test time, as the built-in fundus task
  scores its nested disc and cup.
* ``file_ending``: ``.png``, ``.bmp``, ``.tif``/``.tiff``, ``.jpg``/``.jpeg`` (2D files, scored per image) or ``.nii.gz``,
  ``.nii``, ``.nrrd``, ``.mha`` (3D volumes, trained slice by slice and split by case).

FedUQ's keys (all optional except ``sites``): ``sites`` (the federation's sites, any names: the folders under
``<data root>/<name>/``), ``held_out`` (sites that never train: tested only), ``group_pattern`` (a regular
expression on the case name whose first capturing group groups cases that must stay in one split, e.g. one patient's
studies; one pattern, or site -> pattern), ``normalization`` (channel index -> ``"zscore"``, ``"rescale_to_0_1"``,
``"rgb_to_0_1"``, ``"noNorm"`` or ``{"scheme": "CT", "window": [low, high], "mean": m, "std": s}`` in the stored
units, HU for CT; ``mean``/``std`` optional: without them the window is rescaled to [0, 1]; a ``"CT"`` channel without
a window gets nnU-Net's from the sites' intensity fingerprints, ``tools/intensity_fingerprint.py``), ``score`` (the label or
region names scored at test time; default every foreground label, or every region).

This module is the bottom of the data floor: it imports no FedUQ module but :mod:`feduq.common.errors`.
:mod:`feduq.data.tasks` turns a :class:`Declaration` into the :class:`~feduq.data.tasks.TaskSpec` every tool reads.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ..common.errors import DataError

__all__ = ["Declaration", "parse_declaration", "read_task_file", "FILE_ENDINGS_2D", "FILE_ENDINGS_3D",
           "NORMALIZATION_SCHEMES", "file_kind", "looks_like_task_file"]

FILE_ENDINGS_2D = (".png", ".bmp", ".tif", ".tiff", ".jpg", ".jpeg")
FILE_ENDINGS_3D = (".nii.gz", ".nii", ".nrrd", ".mha")
#: nnU-Net v2's normalisation schemes (``nnunetv2.preprocessing.normalization``), by the names its channel_names use
NORMALIZATION_SCHEMES = ("CT", "zscore", "rescale_to_0_1", "rgb_to_0_1", "noNorm")
_NNUNET_KEYS = {"name", "channel_names", "labels", "regions_class_order", "file_ending", "numTraining", "numTest",
                "description", "reference", "licence", "license", "release", "tensorImageSize", "modality",
                "overwrite_image_reader_writer", "dataset_name", "converted_by", "feduq"}
_FEDUQ_KEYS = {"sites", "held_out", "group_pattern", "normalization", "score"}


def file_kind(file_ending: str) -> str:
    """``"2d"`` or ``"3d"`` for a declared ``file_ending``; :class:`DataError` for one FedUQ does not read."""
    ending = str(file_ending).lower()
    if ending in FILE_ENDINGS_2D:
        return "2d"
    if ending in FILE_ENDINGS_3D:
        return "3d"
    raise DataError(f"file_ending {file_ending!r} is not one FedUQ reads: 2D {list(FILE_ENDINGS_2D)}, "
                    f"3D {list(FILE_ENDINGS_3D)}")


def looks_like_task_file(value: Any) -> bool:
    """True for a ``--task`` value that names a file rather than a built-in task (ends in ``.json`` or holds a path
    separator)."""
    return isinstance(value, (str, os.PathLike)) and (str(value).endswith(".json") or os.sep in str(value))


@dataclass(frozen=True)
class Declaration:
    """A validated task declaration.

    Attributes:
        name: the task's name (``dataset.json``'s ``name``): its folder under the data root and its name in tables.
        channel_names: one name per input channel, in stacking order (``<case>_0000`` first).
        label_values: the label values files hold, sorted, background (0) first; class index ``i`` is the ``i``-th.
        class_names: one name per class index (a region's name for the value that ``regions_class_order`` paints it
            with; ``label_<v>`` for a value no name has).
        labels: structure name -> its label values (one value for a plain label, several for a region).
        regions: True when the labels use nnU-Net's region syntax.
        file_ending: e.g. ``".nii.gz"``; :attr:`kind` says whether the files are 2D images or 3D volumes.
        sites: the federation's sites; ``held_out``: those of them that never train.
        group_pattern: site -> regular expression on the case name (key ``"*"``: every site).
        normalization: per channel, ``(scheme, window low, window high, mean, std)`` (unused numbers None).
        score: structure name -> class indices whose union is scored at test time.
        source: where the declaration came from (``"task file <path>"``, or ``"the job's task declaration"``), for
            messages.
        raw: the declaration as given (a JSON object), carried in a job's configuration.
    """

    name: str
    channel_names: tuple[str, ...]
    label_values: tuple[int, ...]
    class_names: tuple[str, ...]
    labels: dict[str, tuple[int, ...]]
    regions: bool
    file_ending: str
    sites: tuple[str, ...]
    held_out: tuple[str, ...] = ()
    group_pattern: dict[str, str] = field(default_factory=dict)
    normalization: tuple[tuple, ...] = ()
    score: dict[str, tuple[int, ...]] = field(default_factory=dict)
    source: str = "?"
    raw: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """``"2d"`` (images, scored per image) or ``"3d"`` (volumes, trained per slice, scored per case)."""
        return file_kind(self.file_ending)

    @property
    def normalised_at_read(self) -> bool:
        """True when some channel is normalised as it is read (the job's ``intensity`` setting then leaves the
        values as they are); False when every channel is ``noNorm`` (the job's ``intensity`` applies, as for a
        built-in task)."""
        return any(n[0] != "noNorm" for n in self.normalization)

    @property
    def label_ending(self) -> str:
        """The ending predicted label files are written with: the task's, but PNG for JPEG (lossy) and BMP (8 bits)."""
        return ".png" if self.file_ending.lower() in (".jpg", ".jpeg", ".bmp") else self.file_ending

    @property
    def missing_windows(self) -> tuple[int, ...]:
        """The ``CT`` channels whose window is still to be computed from the sites' intensity fingerprints
        (``tools/intensity_fingerprint.py``); a job does not run until there are none."""
        return tuple(i for i, n in enumerate(self.normalization) if n[0] == "CT" and n[1] is None)

    def class_of(self, label_name: str) -> int:
        """The class index of a plain label's name."""
        return self.label_values.index(self.labels[label_name][0])


def _fail(source: str, key: str, message: str) -> DataError:
    return DataError(f"{source}: {key}: {message}")


def read_task_file(path: str | os.PathLike) -> Declaration:
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


def parse_declaration(raw: Mapping, source: str = "the job's task declaration") -> Declaration:
    """Check a task declaration (a JSON object) and return it as a :class:`Declaration`.

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
    return Declaration(
        name=name, channel_names=channels, label_values=values, class_names=class_names, labels=labels,
        regions=regions, file_ending=str(raw["file_ending"]), sites=tuple(sites), held_out=tuple(held_out),
        group_pattern=_group_pattern(feduq.get("group_pattern"), sites, source),
        normalization=_normalization(feduq.get("normalization", {}), channels, source),
        score=_score(feduq.get("score"), labels, values, regions, source), source=source,
        raw=json.loads(json.dumps(raw)),
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
                        "leave it out and compute it with tools/intensity_fingerprint.py)")
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
