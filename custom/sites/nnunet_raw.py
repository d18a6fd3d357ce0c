"""A site in nnU-Net v2's raw dataset layout, read as it is (no conversion step).

A declared task's site (:mod:`feduq.tasks.declared`) is the folder ``<data root>/<task name>/<site>/``; when it holds a
``dataset.json`` and ``imagesTr/`` it is an nnU-Net raw dataset::

    <site>/dataset.json                  the site's own declaration (channel_names, labels, file_ending)
    <site>/imagesTr/<case>_0000<ending>  one file per channel, channel index in four digits
    <site>/imagesTr/<case>_0001<ending>
    <site>/labelsTr/<case><ending>       the label map of the case, in the image's geometry
    <site>/imagesTs/...                  optional: unlabelled cases (for feduq.predict; never trained or scored)
    <site>/split.json                    optional: {"training": [case, ...], "validation": [...], "testing": [...]}

The site's ``dataset.json`` must name the task's channels (same names, same order) and a subset of its labels (a
site may annotate fewer structures: partial labels; its label values are mapped to the task's classes by name). Its
file ending must be of the task's kind (2D images or 3D volumes).

2D files (PNG, BMP, JPEG with Pillow; TIFF with tifffile) are read as Pillow reads them, an RGB file giving three
channels as nnU-Net's natural-image reader does, into MONAI's axis order (width first), so a task file's 2D site gives
the very arrays FedUQ's own layout gives. 3D volumes (NIfTI with nibabel, NRRD/MHA with SimpleITK) are reoriented to
LPS (:mod:`feduq.io.volumes`) and cut into axial slices ``vol[:, :, z]``, each a sample ``<case>_z<zzz>``; a split
keeps every slice of a case together. Each channel is normalised over its whole image or volume by the task's scheme
(:func:`normalise_channel`) as it is read, once: the slices are kept in memory, not read again each epoch.

Every problem raises :class:`~feduq.tasks.spec.DataError` naming the site, the file and what is wrong.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..io import channel_io
from ..tasks.declared import file_kind
from .split_files import DEFAULT_FRACTIONS, make_split
from ..tasks.spec import SPLIT_KEYS, DataError, TaskSpec, get_task, resolve_data_root, site_error, stem_groups
from ..io.volume_checks import check_case_files
from ..io.volumes import VolumeError, read_volume

__all__ = ["SITE_DECLARATION", "is_nnunet_site", "half_nnunet_site", "SiteLabels", "read_site_labels", "annotated_classes",
           "check_site_declarations", "list_cases",
           "read_case", "make_case_split", "site_cases", "case_groups", "foreground_intensities",
           "normalise_channel", "nnunet_split", "nnunet_items"]

SITE_DECLARATION = "dataset.json"
IMAGES, LABELS, TEST_IMAGES = "imagesTr", "labelsTr", "imagesTs"
_CHANNEL = re.compile(r"(?P<case>.+)_(?P<channel>\d{4})")


def is_nnunet_site(center_dir: str | os.PathLike) -> bool:
    """True when a site folder is an nnU-Net raw dataset (``dataset.json`` and ``imagesTr/``). Readers outside this
    module ask :class:`feduq.sites.folder.SiteFolder`, which decides a site's layout once."""
    center_dir = Path(center_dir)
    return (center_dir / SITE_DECLARATION).is_file() and (center_dir / IMAGES).is_dir()


def half_nnunet_site(center_dir: str | os.PathLike, site: str) -> None:
    """A :class:`DataError` naming what is missing when a site folder is half an nnU-Net raw dataset (``imagesTr/``
    without ``dataset.json``, or the reverse), which would otherwise be read as FedUQ's layout and refused for a
    folder ``images/`` it never meant to have; nothing when it is neither or both."""
    center_dir = Path(center_dir)
    has_json, has_images = (center_dir / SITE_DECLARATION).is_file(), (center_dir / IMAGES).is_dir()
    if has_images and not has_json:
        raise site_error(site, f"{center_dir} has {IMAGES}/ but no {SITE_DECLARATION}: an nnU-Net raw dataset needs the "
                               "site's own dataset.json (channel_names, labels, file_ending)")
    if has_json and not has_images and not (center_dir / "images").is_dir():
        raise site_error(site, f"{center_dir} has a {SITE_DECLARATION} but no {IMAGES}/ folder of training cases")


@dataclass(frozen=True)
class SiteLabels:
    """What a site's ``dataset.json`` says, checked against the task.

    Attributes:
        file_ending: the site's files' ending (of the task's kind).
        value_to_class: the site's label value -> the task's class index it is read as: the smallest class of the
            value's group (below), so a structure that is a union of the site's groups reads right from it.
        annotated: the site's annotation as groups of the task's classes (:mod:`feduq.core.partial_labels`): the
            background group (class 0 and every class the site never marks) first, then one group per site value
            (the disc-only site of a disc/cup region task: ``((0,), (1, 2))``). One singleton group per class: the
            site annotates everything.
        names: the site's structure name of each foreground group, in :attr:`annotated`'s order.
    """

    file_ending: str
    value_to_class: dict[int, int]
    annotated: tuple[tuple[int, ...], ...]
    names: tuple[str, ...] = ()

    @property
    def partial(self) -> bool:
        """True when the site annotates fewer structures than the task's classes (the marginal loss applies)."""
        return any(len(g) > 1 for g in self.annotated)


def _site_structures(own: dict, path: Path, site: str) -> tuple[dict[str, tuple[int, ...]], list[int]]:
    """``(structure name -> the site's label values, the site's values)`` of its ``labels`` (plain or nnU-Net's
    region syntax, whose ``regions_class_order`` gives the values its maps hold)."""
    labels = dict(own["labels"])
    structures: dict[str, tuple[int, ...]] = {}
    for name, value in labels.items():
        vals = value if isinstance(value, list) else [value]
        if not vals or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
            raise site_error(site, f"{path}: labels.{name} must be a label value >= 0 or a list of them, got {value!r}")
        structures[name] = tuple(vals)
    if structures.get("background") != (0,):
        raise site_error(site, f"{path}: labels.background must be 0")
    regions = any(isinstance(v, list) for k, v in labels.items() if k != "background")
    if regions:
        order = own.get("regions_class_order")
        fg = [k for k in structures if k != "background"]
        if not (isinstance(order, list) and len(order) == len(fg)):
            raise site_error(site, f"{path}: labels use nnU-Net's region syntax but regions_class_order {order!r} does "
                                   f"not give one value per region ({len(fg)})")
        values = sorted({0, *(v for k in fg for v in structures[k])})
    else:
        seen: dict[int, str] = {}
        for name, (v,) in structures.items():
            if v in seen:
                raise site_error(site, f"{path}: labels.{name} declares the label value {v} a second time")
            seen[v] = name
        values = sorted(seen)
    if len(values) < 2:
        raise site_error(site, f"{path}: labels declare no structure besides the background")
    return structures, values


def read_site_labels(center_dir: Path, spec: TaskSpec, site: str) -> SiteLabels:
    """Read and check a site's ``dataset.json`` against the declared task ``spec``.

    A site's structures are matched by name to the task's labels or regions (a site's ``"optic_disc": 1`` is the
    task's region optic_disc); each value the site's maps hold then stands for the task's classes that lie in every
    site structure holding the value and in none without it (the value's group). A site structure must be exactly
    the union of its values' groups: else its maps cannot say which of the task's classes a pixel is in.

    Raises:
        DataError: naming the site and the file: not JSON; other channel names than the task's; a label name the task
            lacks; a site structure that is not a union of the task's classes its values can stand for (e.g. a
            nested cup given as a plain label beside the disc: use nnU-Net's region syntax); a file ending of the
            other kind (3D volumes where the task declares 2D files, or the reverse); no ``dataset.json`` (naming
            what the folder lacks).
    """
    d = spec
    path = center_dir / SITE_DECLARATION
    if not path.is_file():  # the folder is not a site of this task's layout: say what a site of it holds
        half_nnunet_site(center_dir, site)
        raise site_error(site, f"{center_dir} is not an nnU-Net raw site of task {spec.name!r}: no {SITE_DECLARATION} "
                               f"(the site's own, with channel_names, labels and file_ending) and no {IMAGES}/ "
                               f"folder of cases")
    try:
        own = json.loads(path.read_text())
        channels = {int(k): v for k, v in own["channel_names"].items()}
        dict(own["labels"])
        ending = str(own.get("file_ending", d.file_ending))
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError, AttributeError) as e:
        raise site_error(site, f"{path}: not an nnU-Net dataset.json with channel_names and labels ({e})") from None
    if [channels.get(i) for i in range(len(channels))] != list(d.channel_names):
        raise site_error(site, f"{path}: channel_names {[channels.get(i) for i in range(len(channels))]} differ from "
                               f"the task's {list(d.channel_names)} (same names, same order)")
    try:
        kind = file_kind(ending)
    except Exception as e:
        raise site_error(site, f"{path}: {e}") from None
    if kind != d.kind:
        raise site_error(site, f"{path}: file_ending {ending!r} is {'3D volumes' if kind == '3d' else '2D images'} but "
                               f"task {d.name!r} declares {'3D volumes' if d.kind == '3d' else '2D images'} "
                               f"({d.file_ending!r})")
    structures, values = _site_structures(own, path, site)
    extra = [name for name in structures if name not in d.labels]
    if extra:
        raise site_error(site, f"{path}: label {extra[0]!r} is not a label or region of task {d.name!r} "
                               f"({list(d.labels)}); a site's structures are the task's, by name, or a subset of them")
    classes = {name: {d.label_values.index(v) for v in d.labels[name]} for name in structures if name != "background"}
    everything = set(range(spec.num_classes))
    groups: dict[int, tuple[int, ...]] = {}
    for v in values:
        inside = [classes[k] for k, vals in structures.items() if k != "background" and v in vals]
        outside = [classes[k] for k, vals in structures.items() if k != "background" and v not in vals]
        group = set.intersection(*inside) if inside else set(everything)
        group -= set().union(*outside)
        if not group:
            holders = [k for k, vals in structures.items() if v in vals]
            raise site_error(site, f"{path}: label value {v} ({', '.join(holders)}) stands for none of task "
                                   f"{d.name!r}'s classes: its labels {dict(own['labels'])} are not unions of the "
                                   f"task's values {d.raw['labels']} (nested structures are declared in nnU-Net's "
                                   "region syntax, as the task does)")
        groups[v] = tuple(sorted(group))
    for name, vals in structures.items():
        union = set().union(*(groups[v] for v in vals))
        want = {0} if name == "background" else classes[name]
        if name != "background" and union != want:
            raise site_error(site, f"{path}: labels.{name} {list(vals)} cannot be read as the task's {name} (its "
                                   f"values {[d.label_values[c] for c in sorted(want)]}): the site's labels "
                                   f"{dict(own['labels'])} are not unions of the task's values {d.raw['labels']}")
    mapping = {v: min(groups[v]) for v in values}
    annotated = (groups[0], *(groups[v] for v in values if v != 0))
    names = tuple(next((k for k, vals in structures.items() if k != "background" and vals == (v,)),
                       "+".join(spec.class_names[c] for c in groups[v])) for v in values if v != 0)
    return SiteLabels(ending, mapping, annotated, names)


def annotated_classes(task, data_root, center: str, site: str | None = None) -> tuple[tuple[int, ...], ...] | None:
    """The site's annotation as groups of the task's classes (:attr:`SiteLabels.annotated`) when it annotates fewer
    structures than the task declares (partial labels, from its ``dataset.json``); None when it annotates all, or is
    not an nnU-Net site.

    Raises:
        DataError: as :func:`read_site_labels`.
    """
    spec = get_task(task)
    center_dir = resolve_data_root(data_root, site=site or center) / spec.folder / center
    if not is_nnunet_site(center_dir):
        return None
    labels = read_site_labels(center_dir, spec, site or center)
    return labels.annotated if labels.partial else None


def check_site_declarations(task, data_root, centers: Sequence[str]) -> list[str]:
    """The data check a job runs before FLARE starts, on every site folder of ``centers`` in nnU-Net's raw layout:
    its ``dataset.json`` read against the task (:func:`read_site_labels`), and its ``numTraining`` against the cases
    in ``imagesTr/`` (nnU-Net's dataset check asserts they are equal; FedUQ reads the files that are there and warns).

    Returns:
        The warnings, one line each (``"site 'X': dataset.json numTraining 30, imagesTr/ holds 29 cases ..."``).

    Raises:
        DataError: as :func:`read_site_labels`, naming the site and its labels.
    """
    spec = get_task(task)
    root = resolve_data_root(data_root)
    notes = []
    for center in centers:
        center_dir = root / spec.folder / center
        half_nnunet_site(center_dir, center)
        if not is_nnunet_site(center_dir):
            continue
        labels = read_site_labels(center_dir, spec, center)
        declared = json.loads((center_dir / SITE_DECLARATION).read_text()).get("numTraining")
        found = len({m["case"] for p in (center_dir / IMAGES).iterdir() if p.name.endswith(labels.file_ending)
                     and (m := _CHANNEL.fullmatch(p.name[: -len(labels.file_ending)]))})
        if declared is not None and declared != found:
            notes.append(f"site {center!r}: {center_dir / SITE_DECLARATION} says numTraining {declared!r}, "
                         f"{IMAGES}/ holds {found} cases; FedUQ reads the {found} that are there (nnU-Net's "
                         "dataset check would stop here)")
    return notes


def list_cases(center_dir: Path, spec: TaskSpec, site: str, labels: SiteLabels, folder: str = IMAGES,
               skip=frozenset()) -> dict[str, dict]:
    """The cases of ``<site>/<folder>/``: ``case -> {"channels": [path per file, channel order], "label": path or
    None}`` (a label only for ``imagesTr``), sorted by case; entries named in ``skip`` are not looked at. A volume
    task's headers are read (:func:`feduq.io.volume_checks.check_case_files`, no voxel): every path that reads
    cases refuses a volume without a spacing before any work.

    Raises:
        DataError: naming the site and the file: an empty folder; a file of another ending (mixed endings); a name
            without the four-digit channel index; a case missing a channel file another case has; a case without its
            label file, or a label file without a case; a volume whose header gives no spacing.
    """
    ending = labels.file_ending
    images = center_dir / folder
    files = sorted(p for p in images.iterdir() if not p.name.startswith(".") and p.name not in skip
                   ) if images.is_dir() else []
    if not files:
        raise site_error(site, f"{images} holds no images")
    cases: dict[str, dict[int, Path]] = {}
    for path in files:
        if not path.name.endswith(ending):
            whose = (f"the site's file_ending {ending!r} ({center_dir / SITE_DECLARATION})"
                     if (center_dir / SITE_DECLARATION).is_file() else f"the task's file_ending {ending!r}")
            raise site_error(site, f"{folder}/{path.name} does not end in {whose}; one file ending per dataset")
        m = _CHANNEL.fullmatch(path.name[: -len(ending)])
        if not m:
            raise site_error(site, f"{folder}/{path.name} is not named <case>_<XXXX>{ending} (four-digit channel "
                                   "index, nnU-Net's naming)")
        cases.setdefault(m["case"], {})[int(m["channel"])] = path
    indices = sorted({i for chans in cases.values() for i in chans})
    expected = list(range(len(spec.channel_names) if spec.kind == "3d" else max(indices) + 1))
    out = {}
    for case, chans in sorted(cases.items()):
        missing = [i for i in expected if i not in chans]
        if missing or sorted(chans) != expected:
            what = f"has no channel file {case}_{missing[0]:04d}{ending}" if missing else (
                f"has channel files {sorted(chans)}, expected {expected} (channel_names {list(spec.channel_names)})")
            raise site_error(site, f"{folder}/: case {case!r} {what}")
        out[case] = {"channels": [chans[i] for i in expected], "label": None}
    if folder == IMAGES:
        label_dir = center_dir / LABELS
        for case in out:
            path = label_dir / f"{case}{ending}"
            if not path.is_file():
                raise site_error(site, f"case {case!r} has no label file {LABELS}/{case}{ending}")
            out[case]["label"] = path
        strays = sorted(p.name for p in label_dir.iterdir()
                        if not p.name.startswith(".") and p.name.endswith(ending) and p.name[: -len(ending)] not in out)
        if strays:
            raise site_error(site, f"{LABELS}/{strays[0]} has no images in {IMAGES}/")
    for files in out.values() if spec.kind == "3d" else ():
        check_case_files(files, site, voxels=False)
    return out


def normalise_channel(x: np.ndarray, scheme: tuple) -> np.ndarray:
    """:func:`feduq.io.channel_io.normalise_channel` (nnU-Net v2's schemes), its error as a :class:`DataError`."""
    try:
        return channel_io.normalise_channel(x, scheme)
    except ValueError as e:
        raise DataError(str(e)) from None


def read_case(case: str, files: dict, spec: TaskSpec, labels: SiteLabels, site: str, normalise: bool = True) -> dict:
    """Read one case: its channels stacked in the declared order and normalised, its label map as task classes.

    Returns:
        ``{"image": float32 [C, X, Y] (2D, width first) or [C, X, Y, Z] (3D, LPS), "label": uint8 [1, X, Y(, Z)]
        class indices or None, "spacing": (sx, sy[, sz]) mm or None (2D), "volume": the first channel's
        :class:`~feduq.io.volumes.Volume` (3D; its geometry writes results back) or None}``.

    Raises:
        DataError: naming the site and the file: unreadable; a channel or label whose shape (or, 3D, affine) differs
            from the first channel's; a label value the site's ``dataset.json`` does not declare; a total channel
            count other than the task's.
    """
    d = spec
    volume = None
    if d.kind == "3d":
        chans, vols = [], []
        for path in files["channels"]:
            try:
                vol = read_volume(path)
            except VolumeError as e:
                raise site_error(site, str(e)) from None
            if vols and (vol.shape != vols[0].shape or not np.allclose(vol.affine, vols[0].affine, atol=1e-4)):
                raise site_error(site, f"{IMAGES}/{path.name}: shape {vol.shape} / affine differ from "
                                       f"{vols[0].path.name}'s {vols[0].shape} (channels of a case share one grid)")
            vols.append(vol)
            chans.append(vol.lps[None])
        image, volume, spacing = np.concatenate(chans).astype(np.float32), vols[0], vols[0].spacing
    else:
        try:  # the channel files stacked (channel_io, the exported bundle's own reader)
            image = channel_io.read_case_2d(files["channels"], d.normalization, normalise=False)
        except ValueError as e:
            raise site_error(site, str(e)) from None
        spacing = None
    if not np.isfinite(image).all():
        raise site_error(site, f"case {case!r}: its image holds NaN or infinite values ({files['channels'][0].name})")
    if image.shape[0] != len(d.channel_names):
        raise site_error(site, f"case {case!r}: its files hold {image.shape[0]} channel(s), the task declares "
                               f"{len(d.channel_names)} {list(d.channel_names)}")
    if normalise:  # else the stored values (the intensity fingerprint)
        image = np.stack([normalise_channel(image[c], d.normalization[c]) for c in range(image.shape[0])])
    label = None
    if files.get("label") is not None:
        label = _read_label(files["label"], case, spec, labels, site, volume, image.shape[1:])
    return {"image": image, "label": label, "spacing": spacing, "volume": volume}


def _read_label(path: Path, case, spec, labels: SiteLabels, site, volume, shape) -> np.ndarray:
    if volume is not None:
        try:
            vol = read_volume(path)
        except VolumeError as e:
            raise site_error(site, str(e)) from None
        if vol.shape != volume.shape or not np.allclose(vol.affine, volume.affine, atol=1e-4):
            raise site_error(site, f"{LABELS}/{path.name}: shape {vol.shape} or affine differs from its image "
                                   f"{volume.path.name} ({volume.shape}); a label map lies on its image's grid")
        raw = np.asarray(vol.lps)
    else:
        try:
            raw = channel_io.read_plane(path, label=True)[0]
        except ValueError as e:
            raise site_error(site, str(e)) from None
        if raw.shape != tuple(shape):
            raise site_error(site, f"{LABELS}/{path.name} is {raw.shape[0]}x{raw.shape[1]} but its image is "
                                   f"{shape[0]}x{shape[1]}")
    if not np.isfinite(raw).all():
        raise site_error(site, f"{LABELS}/{path.name} holds NaN or infinite values")
    values = np.unique(raw)
    bad = [v for v in values.tolist() if v != int(v) or int(v) not in labels.value_to_class]
    if bad:
        raise site_error(site, f"{LABELS}/{path.name} holds label value(s) {bad[:5]} not declared in the site's "
                               f"{SITE_DECLARATION} {sorted(labels.value_to_class)}")
    lut = np.zeros(int(values.max()) + 1, np.uint8)
    for v, c in labels.value_to_class.items():
        if v < lut.size:
            lut[v] = c
    return lut[raw.astype(np.int64)][None]


def nnunet_split(center_dir: Path, spec: TaskSpec, site: str, cases: Sequence[str],
                 split_file: str | os.PathLike | None = None, seed: int = 0) -> dict[str, list[str]]:
    """The site's split by case: ``split_file``, else ``<site>/split.json``, else made here with
    :func:`~feduq.sites.split_files.make_split` (70/10/20, ``seed``; cases grouped by the task's group pattern).

    Raises:
        DataError: a split file that is not JSON, lacks a split key, or lists a case twice or one the site lacks.
    """
    path = Path(split_file) if split_file else center_dir / "split.json"
    if split_file and not path.is_file():
        raise site_error(site, f"split file {path} does not exist")
    if path.is_file():
        try:
            split = {key: [str(c) for c in json.loads(path.read_text())[key]] for key in SPLIT_KEYS.values()}
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise site_error(site, f"split file {path} is invalid (expected lists of case names under "
                                   f"{list(SPLIT_KEYS.values())}): {e}") from None
        seen: dict[str, str] = {}
        for key, names in split.items():
            for name in names:
                if name not in cases:
                    raise site_error(site, f"split file {path}: '{key}' lists case {name!r}, which {IMAGES}/ lacks")
                if name in seen:
                    raise site_error(site, f"split file {path} lists case {name!r} in '{seen[name]}' and '{key}'")
                seen[name] = key
        return split
    made = make_case_split(center_dir, spec, site, cases, seed=seed)
    return {key: made[key] for key in SPLIT_KEYS.values()}


def make_case_split(center_dir: Path, spec: TaskSpec, site: str, cases: Sequence[str],
                    fractions: Sequence[float] = DEFAULT_FRACTIONS, seed: int = 0) -> dict:
    """A seeded split of a site's cases (:func:`~feduq.sites.split_files.make_split`, grouped by the task's group
    pattern): ``{"name", "seed", "fractions", "group_column": None, "group_pattern", "num_groups", "training": [case,
    ...], "validation": [...], "testing": [...]}``, the site's ``split.json`` as ``feduq split`` writes it.

    Raises:
        DataError: a case name the group pattern does not match.
    """
    pattern = spec.group_pattern.get(site) or spec.case_pattern(center_dir.name)
    groups = stem_groups(list(cases), pattern, site=site) if pattern else None
    out = make_split(list(cases), fractions=fractions, seed=seed, groups=[groups[c] for c in cases] if groups else None)
    return {"name": f"{spec.name}/{center_dir.name}", "description": "FedUQ split of an nnU-Net raw site, by case",
            "seed": seed, "fractions": list(fractions), "group_column": None,
            **({"group_pattern": pattern} if pattern else {}),
            "num_groups": len(set(groups.values())) if groups else len(cases),
            **{key: list(out[key]) for key in SPLIT_KEYS.values()}}


def case_groups(task, data_root, center: str, site: str | None = None) -> dict[str, str] | None:
    """``case -> group`` of an nnU-Net site by the task's group pattern (the independent units of a paired test);
    None when its cases are independent."""
    spec = get_task(task)
    pattern = spec.group_pattern.get(site or center) or spec.case_pattern(center)
    return stem_groups(site_cases(task, data_root, center, site), pattern, site=site or center) if pattern else None


def site_cases(task, data_root, center: str, site: str | None = None) -> list[str]:
    """The case names of a declared task's nnU-Net site (its ``imagesTr/``), checked as at start-up."""
    spec = get_task(task)
    center_dir = resolve_data_root(data_root, site=site or center) / spec.folder / center
    return list(list_cases(center_dir, spec, site or center, read_site_labels(center_dir, spec, site or center)))


def training_case_files(task, data_root, center: str, site: str | None = None) -> list[tuple[list[Path], Path]]:
    """The files of a site's training split (``<site>/split.json``, else FedUQ's seeded split by case): per case
    ``(channel files in channel order, label file)``, in case order; what a site fingerprints for the federation's
    plan (its validation and test cases never enter it).

    Raises:
        DataError: as :func:`list_cases` and :func:`nnunet_split`; a site with no training case.
    """
    spec = get_task(task)
    site = site or center
    center_dir = resolve_data_root(data_root, site=site) / spec.folder / center
    if not is_nnunet_site(center_dir):
        raise site_error(site, f"{center_dir} is not an nnU-Net raw dataset (no {SITE_DECLARATION} and {IMAGES}/)")
    cases = list_cases(center_dir, spec, site, read_site_labels(center_dir, spec, site))
    names = nnunet_split(center_dir, spec, site, list(cases))[SPLIT_KEYS["train"]]
    if not names:
        raise site_error(site, "its split has no training case")
    return [(list(cases[c]["channels"]), cases[c]["label"]) for c in names]


def nnunet_items(task, center: str, split: str, data_root=None, max_items: int | None = None,
                 split_file: str | os.PathLike | None = None, site: str | None = None) -> list[dict]:
    """The samples of one split of a site in nnU-Net's layout, read and normalised once.

    Returns:
        A list of ``{"image": float32 [C, X, Y], "label": uint8 [1, X, Y] class indices, "id": str, "case": str}``:
        one per 2D file, or one per axial slice of a volume (``id`` ``<case>_z<zzz>``, with the case's voxel
        ``spacing`` [3] mm and the slice's ``stored_shape`` [2], for scoring the case in 3D); ``max_items`` keeps the
        first N cases of the split.

    Raises:
        DataError: anything :func:`read_site_labels`, :func:`list_cases`, :func:`read_case` or :func:`nnunet_split`
            raises; a task that is not declared (a built-in task's sites use FedUQ's layout).
    """
    spec = get_task(task)
    site = site or center
    key = SPLIT_KEYS.get(split, split)
    center_dir = resolve_data_root(data_root, site=site) / spec.folder / center
    if not is_nnunet_site(center_dir):
        raise site_error(site, f"{center_dir} is not an nnU-Net raw dataset (no {SITE_DECLARATION} and {IMAGES}/)")
    labels = read_site_labels(center_dir, spec, site)
    cases = list_cases(center_dir, spec, site, labels)
    names = nnunet_split(center_dir, spec, site, list(cases), split_file)[key]
    if max_items is not None:
        names = names[: int(max_items)]
    items = []
    for case in names:
        data = read_case(case, cases[case], spec, labels, site)
        image, label = data["image"], data["label"]
        if image.ndim == 3:
            items.append({"image": image, "label": label, "id": case, "case": case})
            continue
        spacing = np.asarray(data["spacing"], np.float32)
        shape = np.asarray(image.shape[1:3], np.float32)
        for z in range(image.shape[-1]):
            items.append({"image": np.ascontiguousarray(image[..., z]), "label": np.ascontiguousarray(label[..., z]),
                          "id": f"{case}_z{z:03d}", "case": case, "slice": z, "spacing": spacing,
                          "stored_shape": shape})
    return items


def foreground_intensities(task, data_root, center: str, site: str | None = None, voxels_per_case: int = 10000,
                           seed: int = 0) -> dict[int, np.ndarray]:
    """A site's intensity fingerprint samples, as nnU-Net's dataset fingerprint takes them: per channel, the stored
    values of up to ``voxels_per_case`` foreground voxels (label > 0) of each labelled case, drawn with ``seed``.

    Returns:
        channel index -> float64 ``[N]`` (stored units, e.g. HU), over every case of the site's ``imagesTr/``.

    Raises:
        DataError: as :func:`read_case`.
    """
    spec = get_task(task)
    site = site or center
    center_dir = resolve_data_root(data_root, site=site) / spec.folder / center
    labels = read_site_labels(center_dir, spec, site)
    rng = np.random.default_rng(seed)
    out: dict[int, list[np.ndarray]] = {c: [] for c in range(len(spec.channel_names))}
    for case, files in list_cases(center_dir, spec, site, labels).items():
        data = read_case(case, files, spec, labels, site, normalise=False)
        fg = np.flatnonzero(data["label"][0] > 0)
        pick = fg if fg.size <= voxels_per_case else rng.choice(fg, voxels_per_case, replace=False)
        for c in out:
            out[c].append(data["image"][c].ravel()[pick].astype(np.float64))
    return {c: np.concatenate(v) if v else np.zeros(0) for c, v in out.items()}
