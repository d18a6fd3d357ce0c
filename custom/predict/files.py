"""What :mod:`feduq.predict` reads and writes: the cases of an input path, a 2D image as the network's pipeline
sees it, and the per-case files (label map, probability, uncertainty maps, overlay) in the input's own geometry.

Axis convention: a 2D plane is ``[C, W, H]`` / ``[W, H]`` (width first), as MONAI's ``PILReader`` gives an image and
as FedUQ's transforms and networks see it; files are written transposed back to ``[H, W]`` rows. A volume plane is
``lps[:, :, z]`` of :class:`feduq.io.volumes.Volume`, the orientation FedUQ's 2D MRI sites were made in.

16-bit PNG maps: ``value = png / 65535 * scale`` with ``scale`` given in the output's ``scales.json`` (probability:
1; uncertainty in nats: ln C, its largest possible value; vacuity: 1).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import numpy as np
from PIL import Image

from ..io.image_files import TIFF_SUFFIXES, read_image
from ..tasks.spec import IMAGE_SUFFIXES, DataError
from ..io.volumes import is_dicom_series, is_nifti

__all__ = ["PredictError", "Case", "find_cases", "read_plane", "write_case", "map_scale", "PNG16_MAX", "OUTPUTS",
           "DEFAULT_OUTPUTS", "parse_outputs"]

PNG16_MAX = 65535
#: zlib level of every PNG written (1: 8x faster than PIL's default 6 on a 384 px 16-bit map, its file 8 % larger)
PNG_COMPRESSION = 1
IMAGE_FILE_SUFFIXES = IMAGE_SUFFIXES + TIFF_SUFFIXES + (".bmp",)
#: outline colours of foreground classes 1, 2, ... in the overlay
CLASS_COLOURS = ((0, 255, 0), (255, 200, 0), (0, 160, 255), (255, 0, 255), (255, 80, 80), (120, 255, 255))


class PredictError(DataError):
    """An input, output or option :mod:`feduq.predict` cannot use; one line naming the file or parameter."""


#: what can be written per case: the label map, the method's own uncertainty map, every uncertainty map of the
#: method, the foreground probability, the overlay picture for a person
OUTPUTS = ("label", "uncertainty", "uncertainty_maps", "probability", "overlay", "dicom_seg")
#: what a reader needs: the label map and the method's own uncertainty map (and the CSV, always written); a DICOM
#: series' label map also as a DICOM Segmentation for the hospital's viewer (:mod:`feduq.predict.dicom_seg`)
DEFAULT_OUTPUTS = ("label", "uncertainty", "dicom_seg")


def parse_outputs(value: str | Iterable[str] | None) -> tuple[str, ...]:
    """``"label,uncertainty"`` (or a sequence of names, or ``"all"``) -> the names of :data:`OUTPUTS` in their order.

    Raises:
        PredictError: an unknown name, or none (the message names ``--outputs`` and the choices), or ``dicom_seg``
            without ``label``.
    """
    if value is None:
        return DEFAULT_OUTPUTS
    names = [v.strip() for v in (value.split(",") if isinstance(value, str) else value) if v.strip()]
    if names == ["all"]:
        return OUTPUTS
    unknown = [n for n in names if n not in OUTPUTS]
    if unknown or not names:
        raise PredictError(f"--outputs {','.join(names) or repr(value)}: expected a comma-separated list of "
                         f"{', '.join(OUTPUTS)} (or all); unknown {unknown}" if unknown else
                         f"--outputs: name at least one of {', '.join(OUTPUTS)} (or all)")
    if "dicom_seg" in names and "label" not in names:
        raise PredictError("--outputs dicom_seg needs label too (the DICOM Segmentation is the label map's copy)")
    return tuple(n for n in OUTPUTS if n in names)


@dataclass(frozen=True)
class Case:
    """One input case: a 2D image file (``kind="image"``) or a volume (``"volume"``: NIfTI file, DICOM folder)."""

    name: str
    path: Path
    kind: str


def _case_name(path: Path) -> str:
    name = path.name
    for suffix in (".nii.gz", ".nii"):
        if name.lower().endswith(suffix):
            return name[: -len(suffix)]
    return path.stem if path.is_file() else name


def find_cases(path: str | os.PathLike) -> list[Case]:
    """The cases of ``path``: an image file, a NIfTI file, a DICOM series folder, or a folder of these (not
    recursive; sub-folders holding ``.dcm`` files are series). Sorted by name.

    Raises:
        PredictError: ``path`` does not exist, is a file of another type, holds no case, or two cases share a name.
    """
    path = Path(path)
    if not path.exists():
        raise PredictError(f"input {path} does not exist")

    def case(p: Path) -> Case | None:
        if p.is_file() and p.suffix.lower() in IMAGE_FILE_SUFFIXES:
            return Case(_case_name(p), p, "image")
        if p.is_file() and is_nifti(p):
            return Case(_case_name(p), p, "volume")
        if p.is_dir() and is_dicom_series(p):
            return Case(p.name, p, "volume")
        return None

    if path.is_file() or is_dicom_series(path):
        found = case(path)
        if found is None:
            raise PredictError(f"input {path}: not an image ({', '.join(IMAGE_FILE_SUFFIXES)}), NIfTI volume or DICOM "
                               f"series folder")
        return [found]
    cases = [c for c in (case(p) for p in sorted(path.iterdir()) if not p.name.startswith(".")) if c is not None]
    if not cases:
        raise PredictError(f"input folder {path} holds no image ({', '.join(IMAGE_FILE_SUFFIXES)}), NIfTI volume or "
                           f"DICOM series folder")
    names: dict[str, Path] = {}
    for c in cases:
        if c.name in names:
            raise PredictError(f"input folder {path}: {names[c.name].name} and {c.path.name} are both case {c.name!r}")
        names[c.name] = c.path
    return cases


def read_plane(path: Path, in_channels: int) -> tuple[np.ndarray, Image.Image]:
    """Decode a 2D image as the network's pipeline loads it: ``(float32 [in_channels, W, H] of its stored values,
    the decoded image)``. Gray, palette or RGBA images become RGB for a 3-channel network as in training (a 16-bit gray
    image scaled to 8 bits first: :func:`feduq.io.transforms.gray_to_8bit`); a colour image is refused by a
    1-channel network.

    Raises:
        PredictError: the file cannot be decoded, its channels do not fit, or a 3-channel network is given a float
            or out-of-range gray image (names the file).
    """
    image = None
    if path.suffix.lower() in TIFF_SUFFIXES:  # a site reads every image with Pillow (MONAI's PILReader): so does predict
        try:
            with Image.open(path) as im:
                im.load()
                image = im.copy()
        except Exception:  # noqa: BLE001  what Pillow cannot open (e.g. 3-sample "gray" frames): tifffile below
            image = None
    try:
        if image is None:
            image = read_image(path, keep_16bit=True)  # a 16-bit gray TIFF unscaled, as Pillow would give it
    except DataError as e:
        raise PredictError(str(e)) from None
    if in_channels == 3:
        if image.mode.startswith("I") or image.mode == "F":  # 16/32-bit gray: scaled to 8 bits as a site does
            from ..io.transforms import gray_to_8bit

            try:
                image = gray_to_8bit(image, str(path))
            except ValueError as e:
                raise PredictError(str(e)) from None
        image = image if image.mode == "RGB" else image.convert("RGB")
    elif image.mode in ("1", "LA", "La"):
        image = image.convert("L")
    elif image.mode not in ("L", "I", "I;16", "F"):
        raise PredictError(f"{path}: image mode {image.mode} ({len(image.getbands())} channels); the model takes 1 "
                           f"(gray) channel and colour images are not converted silently")
    array = np.asarray(image, dtype=np.float32)
    array = array.transpose(2, 1, 0) if array.ndim == 3 else array.T[None]
    return np.ascontiguousarray(array), image


def map_scale(name: str, num_classes: int) -> float:
    """Largest possible value of an uncertainty map: 1 for vacuity (C/S), ln C nats for entropy-type maps."""
    return 1.0 if name == "vacuity" else float(np.log(num_classes))


def _png16(array_wh: np.ndarray, scale: float, path: Path) -> None:
    values = np.clip(np.nan_to_num(array_wh.T / scale), 0.0, 1.0)
    Image.fromarray(np.rint(values * PNG16_MAX).astype(np.uint16)).save(path, compress_level=PNG_COMPRESSION)


def overlay(image_hw: np.ndarray, label_hw: np.ndarray, uncertainty_hw: np.ndarray, scale: float) -> Image.Image:
    """A picture for a person: the image with each predicted class outlined, beside the uncertainty as a heat map
    (magma, 0 to ``scale``) over the gray image. Inputs are ``[H, W]`` rows (image ``[H, W]`` or ``[H, W, 3]``)."""
    from matplotlib import colormaps
    from scipy import ndimage

    img = image_hw.astype(np.float64)
    img = (img - img.min()) / max(float(np.ptp(img)), 1e-12) * 255.0
    rgb = np.repeat(img[..., None], 3, axis=2) if img.ndim == 2 else img[..., :3]
    left = rgb.copy()
    for c in [int(v) for v in np.unique(label_hw) if v > 0]:
        region = label_hw == c
        edge = region & ~ndimage.binary_erosion(region, iterations=max(1, min(label_hw.shape) // 200))
        left[edge] = CLASS_COLOURS[(c - 1) % len(CLASS_COLOURS)]
    heat = colormaps["magma"](np.clip(np.nan_to_num(uncertainty_hw / scale), 0, 1))[..., :3] * 255.0
    gray = np.repeat(rgb.mean(axis=2, keepdims=True), 3, axis=2)
    right = 0.35 * gray + 0.65 * heat
    gap = np.full((rgb.shape[0], 4, 3), 255.0)
    return Image.fromarray(np.rint(np.concatenate([left, gap, right], axis=1)).clip(0, 255).astype(np.uint8))


def write_case(out: Path, case: Case, label: np.ndarray | None, probability: np.ndarray | None,
               maps: dict[str, np.ndarray], primary: str, num_classes: int, picture: Image.Image | None,
               volume=None, seg_identity=None, probabilities: dict[str, np.ndarray] | None = None,
               seg_label: np.ndarray | None = None) -> Path:
    """Write one case's files into ``out/<case name>/``, all at once (a hidden folder renamed into place): those
    given, a None is not written (``predict --outputs``).

    2D (``volume`` None; arrays ``[W, H]``): ``label.png`` (uint8 class indices), ``probability.png`` (16-bit
    foreground probability), ``uncertainty_<map>.png`` (16-bit, scale :func:`map_scale`), ``overlay.png``.
    Volume (arrays ``[X, Y, Z]`` on the LPS grid of ``volume``): ``label.nii.gz`` (uint8), ``probability.nii.gz`` and
    ``uncertainty_<map>.nii.gz`` (float32, the map's own unit) in the input's shape and affine, ``overlay.png``;
    with ``seg_identity`` (:class:`feduq.predict.dicom_seg.SegIdentity`) and a DICOM series as the volume, the label
    map (``seg_label`` where ``label`` is not written) also as a DICOM Segmentation referencing the series
    (``segmentation.dcm``; a series resampled onto an even grid: each instance's frame is the grid slice it lies on).
    ``probabilities``: structure -> its probability map, written as ``probability_<structure>.png`` (16-bit) or
    ``.nii.gz`` (float32) beside the foreground's, one per class or nested region (nnU-Net's ``--save_probabilities``
    gives one per region).

    Returns:
        The case folder.
    """
    final = out / case.name
    from ..outputs import usual_permissions

    stage = usual_permissions(Path(tempfile.mkdtemp(prefix=f".{case.name}.partial-", dir=out)))  # not 0700
    try:
        if volume is None:
            if label is not None:
                Image.fromarray(np.ascontiguousarray(label.T).astype(np.uint8)).save(stage / "label.png",
                                                                                 compress_level=PNG_COMPRESSION)
            if probability is not None:
                _png16(probability, 1.0, stage / "probability.png")
            for name, m in (probabilities or {}).items():
                _png16(m, 1.0, stage / f"probability_{name}.png")
            for name, m in maps.items():
                _png16(m, map_scale(name, num_classes), stage / f"uncertainty_{name}.png")
        else:
            if label is not None:
                volume.save_nifti(label, stage / "label.nii.gz", np.uint8)
            if seg_identity is not None and volume.source_files:
                from .dicom_seg import SEG_FILE, write_dicom_seg

                seg_label = label if seg_label is None else seg_label
                write_dicom_seg(stage / SEG_FILE, volume.source_files, volume.instance_frames(seg_label), seg_identity)
            if probability is not None:
                volume.save_nifti(probability, stage / "probability.nii.gz", np.float32)
            for name, m in (probabilities or {}).items():
                volume.save_nifti(m, stage / f"probability_{name}.nii.gz", np.float32)
            for name, m in maps.items():
                volume.save_nifti(m, stage / f"uncertainty_{name}.nii.gz", np.float32)
        if picture is not None:
            picture.save(stage / "overlay.png", compress_level=PNG_COMPRESSION)
        if final.exists():
            shutil.rmtree(final)
        os.replace(stage, final)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    return final
