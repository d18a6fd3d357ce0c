"""Reading the image files of public dataset releases, and writing a converted site folder all at once.

Used by the converters of ``feduq convert`` (:mod:`feduq.data.convert`). Two rules every converter follows:

* **Any file a public release ships can be read, or the conversion stops naming it.** TIFF files (``.tif``,
  ``.tiff``) are read with ``tifffile``, which handles what the releases contain and Pillow cannot open (CVC-ClinicDB's
  colour frames are tagged as 3-sample grayscale, ``PhotometricInterpretation = BlackIsZero`` with
  ``SamplesPerPixel = 3``; Pillow also refuses uncompressed separate colour planes); every other file with Pillow. A file
  that no reader can decode raises :class:`UnreadableImageError`, whose message names the file and the reader's reason.
* **Nothing half-written is left behind.** :func:`feduq.outputs.staged_folder` (re-exported here) builds the output in a hidden sibling folder and
  moves it into place only when the whole site was written; on any error the partial folder is removed and an
  existing output folder is untouched.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from ..outputs import staged_folder
from ..tasks.spec import DataError

TIFF_SUFFIXES = (".tif", ".tiff")

__all__ = ["TIFF_SUFFIXES", "SiteWriter", "UnreadableImageError", "read_image", "staged_folder"]


class UnreadableImageError(DataError):
    """An image or mask file that no reader can decode; the message is ``'<path>: cannot read ... (<reason>)'``."""


def _to_uint8(array: np.ndarray) -> np.ndarray:
    """Bool -> 0/255; integer arrays that fit 0..255 unchanged; anything else scaled linearly by its maximum."""
    if array.dtype == bool:
        return array.astype(np.uint8) * 255
    if np.issubdtype(array.dtype, np.integer) and array.min() >= 0 and array.max() <= 255:
        return array.astype(np.uint8)
    array = array.astype(np.float64)
    array -= min(0.0, float(array.min()))
    top = float(array.max())
    return np.zeros(array.shape, np.uint8) if top <= 0 else np.round(array * (255.0 / top)).astype(np.uint8)


def _read_tiff(path: Path, keep_16bit: bool = False) -> Image.Image:
    import tifffile

    with tifffile.TiffFile(path) as tif:
        if not tif.pages:
            raise ValueError("the file has no image page")
        array = tif.pages[0].asarray()  # first page only: the releases store one frame per file
    if array.ndim == 3 and array.shape[0] in (3, 4) and array.shape[-1] not in (3, 4):
        array = np.moveaxis(array, 0, -1)  # planes first (separate planar configuration without a shape tag)
    if array.ndim == 3 and array.shape[-1] == 1:
        array = array[..., 0]
    if array.ndim == 2 and keep_16bit and array.dtype == np.uint16:
        return Image.fromarray(array)  # mode "I;16", as Pillow (a site's reader) opens a 16-bit gray TIFF
    if array.ndim == 2:
        return Image.fromarray(_to_uint8(array), mode="L")
    if array.ndim == 3 and array.shape[-1] in (3, 4):
        return Image.fromarray(_to_uint8(array[..., :3]), mode="RGB")
    raise ValueError(f"unsupported pixel array shape {tuple(array.shape)}")


def read_image(path: str | os.PathLike, keep_16bit: bool = False) -> Image.Image:
    """Decode one image or mask file completely and return it as a Pillow image.

    Args:
        path: the file. ``.tif``/``.tiff`` are read with ``tifffile`` (first page; planes-first arrays are moved
            last; bool masks -> 0/255; 8-bit values kept; wider integer or float data scaled to 0..255 by its
            maximum) and returned in mode ``"L"`` (one channel; ``"I;16"`` with ``keep_16bit``) or ``"RGB"`` (3 or 4
            channels, alpha dropped). Every other file is read with Pillow in its own mode (call ``.convert("RGB")``
            or ``"L"`` as needed).
        keep_16bit: return a one-channel 16-bit TIFF unscaled, in mode ``"I;16"``, as Pillow opens it (the site's
            image reader, so :mod:`feduq.predict` scales it as training did); ``False`` (converters): scaled to 8
            bits by its maximum, as above.

    Returns:
        A loaded ``PIL.Image.Image`` (pixel data decoded, the file closed).

    Raises:
        UnreadableImageError: the file is missing, truncated, or in a format the reader cannot decode; the message
            names the file and the reader's reason.
    """
    path = Path(path)
    reader = "tifffile" if path.suffix.lower() in TIFF_SUFFIXES else "Pillow"
    try:
        if reader == "tifffile":
            return _read_tiff(path, keep_16bit)
        with Image.open(path) as im:
            im.load()
            return im.copy()
    except Exception as e:  # any decoder failure becomes one line naming the file
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UnreadableImageError(f"{path}: cannot read this image with {reader} ({reason})") from None


def resize_pair(image: Image.Image, mask: Image.Image, size: int, image_path, mask_path, dataset: str = ""):
    """Check that ``mask`` and ``image`` have one size, then resize both to ``size`` x ``size`` (Lanczos image,
    nearest mask; ``size`` 0 keeps them).

    Returns:
        ``(image, mask, (original width, original height))``.

    Raises:
        DataError: the sizes differ (names both files and sizes).
    """
    if mask.size != image.size:
        raise DataError(f"{dataset + ': ' if dataset else ''}mask {mask_path} is {mask.size[0]}x{mask.size[1]} but "
                        f"image {image_path} is {image.size[0]}x{image.size[1]}")
    orig = image.size
    if size:
        image = image.resize((size, size), Image.Resampling.LANCZOS)
        mask = mask.resize((size, size), Image.Resampling.NEAREST)
    return image, mask, orig


def write_provenance(path: str | os.PathLike, columns: list[str], rows: list[dict]) -> Path:
    """Write a site's ``provenance.csv`` (one row per image/mask pair, ``columns`` in order)."""
    import csv

    path = Path(path)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return path


class SiteWriter:
    """One converted 2D site folder, written completely or not at all: every converter's writer.

    ``<out>/images/<stem>.<image_format>`` (JPEG at quality 90, or PNG), ``<out>/masks/<stem>.png``,
    ``<out>/provenance.csv`` (one row per pair: ``image_file``, ``mask_file`` and what the converter adds) and
    ``<out>/labels.json`` (``{"labels": {pixel value: name}, "note": how the site was made}``), built in a staging
    folder beside ``out`` (:func:`feduq.outputs.staged_folder`) and moved into place only when :meth:`finish` ran and
    the ``with`` block ended without an error::

        with SiteWriter(out, overwrite=False, what="CVC-ClinicDB", image_format="jpg") as site:
            for ...:
                site.add(stem, image, mask, original_image_path=..., orig_width=w, orig_height=h)
            site.finish(columns, labels={"0": "background", "255": "polyp"}, note="...")

    Raises:
        feduq.outputs.OutputFolderError: ``out`` exists and is not empty without ``overwrite`` (before anything is
            written); :meth:`finish` was not called (the site is incomplete, nothing is moved into place).
    """

    def __init__(self, out: str | os.PathLike, overwrite: bool = False, what: str = "output",
                 image_format: str = "png"):
        if image_format not in ("jpg", "png"):
            raise ValueError(f"image_format must be 'jpg' or 'png', got {image_format!r}")
        self.out, self.overwrite, self.what, self.image_format = Path(out), overwrite, what, image_format
        self.rows: list[dict] = []
        self.stage: Path | None = None
        self._finished = False

    def __enter__(self) -> "SiteWriter":
        self._staging = staged_folder(self.out, overwrite=self.overwrite, what=self.what)
        self.stage = self._staging.__enter__()
        (self.stage / "images").mkdir()
        (self.stage / "masks").mkdir()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None and not self._finished:  # an incomplete site is never moved into place
            from ..outputs import OutputFolderError

            error = OutputFolderError(f"{self.what}: the site was not finished (labels.json, provenance.csv)")
            self._staging.__exit__(OutputFolderError, error, None)  # removes the staging folder
            raise error
        return self._staging.__exit__(exc_type, exc, tb)

    def add(self, stem: str, image: Image.Image, mask: Image.Image, **provenance) -> dict:
        """Save one image/mask pair (the mask as PNG) and return its provenance row (``image_file``, ``mask_file``,
        then ``provenance`` in order); :attr:`rows` keeps every row."""
        image_file, mask_file = f"images/{stem}.{self.image_format}", f"masks/{stem}.png"
        image.save(self.stage / image_file, **({"quality": 90} if self.image_format == "jpg" else {}))
        mask.save(self.stage / mask_file)
        row = {"image_file": image_file, "mask_file": mask_file, **provenance}
        self.rows.append(row)
        return row

    def finish(self, columns: list[str], labels: dict[str, str], note: str) -> None:
        """Write ``provenance.csv`` (``columns`` in order) and ``labels.json``; the site is then complete."""
        import json

        write_provenance(self.stage / "provenance.csv", columns, self.rows)
        (self.stage / "labels.json").write_text(json.dumps({"labels": labels, "note": note}, indent=1) + "\n")
        self._finished = True
