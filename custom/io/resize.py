"""How a 2D image and its mask are brought to the network's square: the resize modes of the dataset API.

``resize="stretch"`` (FedUQ's default; MONAI ``Resized``, bilinear with anti-aliasing) lives in
:mod:`feduq.io.transforms`; this module holds the two official FedEvi variants and the mask's rule:

* ``"letterbox"`` (the official FedEvi code's polyp variant): :func:`letterbox_box` says where a stored image lands in
  the square, :func:`aspect_shape` which aspect ratio it keeps (the sample's ``orig_size``, :data:`ORIGINAL_SIZE_KEY`,
  read by :func:`read_original_sizes` from ``provenance.csv``); :class:`Letterbox` applies it.
* ``"stretch_bicubic"``: :class:`PILBicubic`, PIL's bicubic filter on the 8-bit image, as the official code resizes.
* a mask is resized by nearest neighbour on pixel centres (:data:`LABEL_RESIZE_MODE`).

Part of :mod:`feduq.data` (which re-exports the public names); depends only on :mod:`feduq.tasks.spec`.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ..tasks.spec import read_groups, site_error

__all__ = [
    "RESIZE_MODES",
    "ORIGINAL_SIZE_KEY",
    "LABEL_RESIZE_MODE",
    "Letterbox",
    "PILBicubic",
    "aspect_shape",
    "read_original_sizes",
    "letterbox_box",
]

RESIZE_MODES = ("stretch", "letterbox", "stretch_bicubic")
ORIGINAL_SIZE_KEY = "orig_size"
#: How a mask is resized: nearest neighbour on the pixel centres (torch's ``nearest-exact``, what PIL's NEAREST and
#: scikit-image do), so the mask stays aligned with the image, whose resize is centre-aligned too. MONAI's
#: ``"nearest"`` (torch's legacy mode) takes each output pixel's top-left source pixel instead: at 384 -> 96 that
#: moves the mask 1.5 stored pixels up and left of its image (FedUQ before this fix).
LABEL_RESIZE_MODE = "nearest-exact"


class Letterbox:
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
            img = Resize(lengths, mode=mode, anti_aliasing=not mode.startswith("nearest"))(img)
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
            raise site_error(center_dir.name, f"{path}: orig_width/orig_height of '{stem}' is not a positive integer "
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



class PILBicubic:
    """Each side of ``"image"`` resized to ``image_size`` by PIL's bicubic filter on the stored 8-bit values, as the
    official FedEvi code resizes its polyp images (``Image.resize(..., Image.BICUBIC)``); the meta is kept.
    The array is ``[C, W, H]`` (MONAI's PILReader axes), values 0-255."""

    def __init__(self, image_size: int):
        self.size = int(image_size)

    def __call__(self, sample):
        from monai.data import MetaTensor
        from PIL import Image

        image = sample["image"]
        arr = np.asarray(image.detach().cpu() if hasattr(image, "detach") else image)
        hwc = np.clip(np.rint(arr), 0, 255).astype(np.uint8).transpose(2, 1, 0)  # [H, W, C]
        channels = [np.asarray(Image.fromarray(hwc[..., c]).resize((self.size, self.size), Image.BICUBIC))
                    for c in range(hwc.shape[-1])]
        out = np.stack(channels, axis=-1).transpose(2, 1, 0).astype(np.float32)  # back to [C, W, H]
        meta = getattr(image, "meta", None)
        return {**sample, "image": MetaTensor(out, meta=dict(meta)) if meta is not None else out}
