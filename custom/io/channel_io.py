"""The channels of a declared task's 2D case read and normalised as nnU-Net v2 does, with NumPy, Pillow and tifffile
only (no FedUQ import), so the MONAI Bundle FedUQ exports carries this very file (``scripts/channel_io.py``) and reads
and normalises an image exactly as the sites did (:mod:`feduq.sites.nnunet_raw` uses it; :mod:`feduq.bundle.export`
copies it). Problems raise ``ValueError`` with one line naming the file; the sites turn it into their ``DataError``.
"""

from __future__ import annotations

import os
from typing import Sequence

import numpy as np

__all__ = ["gray_to_8bit", "read_plane", "normalise_channel", "read_case_2d", "case_of"]


def gray_to_8bit(img, name: str = "?"):
    """A gray image as 8 bits, as a 3-channel network's pipeline reads it before repeating it to RGB (Pillow's own
    ``convert("RGB")`` would clip a 16-bit image at 255): a 16-bit image (``I;16*``, or ``I`` holding values > 255)
    scaled by 255 / 65535 and rounded; an ``I`` image holding values <= 255 kept as they are. Used by the sites and by
    ``predict``; the exported MONAI Bundle writes the same scaling as a config expression.

    Args:
        img: a PIL image of mode ``I``, ``I;16*`` or ``F``.
        name: the file's name, for the error.

    Returns:
        a mode ``L`` image of the same size.

    Raises:
        ValueError: a float image (mode ``F``), or values outside 0..65535, naming ``name``.
    """
    from PIL import Image

    arr = np.asarray(img)
    if img.mode == "F" or arr.dtype.kind == "f":
        raise ValueError(f"image {name} is a 32-bit float image (mode {img.mode}); save it as an 8- or 16-bit image: "
                         "FedUQ does not guess its intensity range")
    wide = img.mode.startswith("I;16") or int(arr.max(initial=0)) > 255
    if int(arr.min(initial=0)) < 0 or int(arr.max(initial=0)) > 65535:
        raise ValueError(f"image {name} holds values outside 0..65535 (mode {img.mode}); expected an 8- or 16-bit image")
    scaled = np.rint(arr.astype(np.float64) * (255.0 / 65535.0)) if wide else arr
    return Image.fromarray(scaled.astype(np.uint8), "L")


def read_plane(path: str | os.PathLike, rgb: bool = False, label: bool = False) -> np.ndarray:
    """A 2D file as ``[C, W, H]`` float32 (MONAI's PILReader order, width first): RGB(A), palette and other colour
    files give 3 channels, gray files 1 (``rgb``: a gray file made RGB, as a 3-channel task reads its one file); a
    label map (``label``) its stored values (a palette file's indices), one channel. TIFF with tifffile.

    Raises:
        ValueError: unreadable, not 2D, or (``label``) not a one-channel mode; the message names the file.
    """
    name = "/".join(str(path).replace(os.sep, "/").split("/")[-2:])
    try:
        if str(path).lower().endswith((".tif", ".tiff")):
            import tifffile

            arr = np.asarray(tifffile.imread(str(path)))
        else:
            from PIL import Image

            with Image.open(path) as img:
                img.load()
                if label:
                    if img.mode not in ("1", "L", "P", "I", "I;16"):
                        raise ValueError(f"{name} has mode {img.mode}; a label map is one channel of label values "
                                         "(mode 1, L, P, I or I;16)")
                elif img.mode in ("RGBA", "P", "LA", "CMYK", "YCbCr") or (rgb and img.mode == "L"):
                    img = img.convert("RGB")
                elif rgb and (img.mode.startswith("I") or img.mode == "F"):
                    img = gray_to_8bit(img, name).convert("RGB")
                arr = np.asarray(img)
    except (OSError, SyntaxError) as e:
        raise ValueError(f"cannot read {name}: {e}") from None
    if arr.ndim == 2:
        return arr.T[None].astype(np.float32)
    if arr.ndim == 3 and arr.shape[2] in (3, 4) and not label:
        return arr[..., :3].transpose(2, 1, 0).astype(np.float32)
    raise ValueError(f"{name} has shape {arr.shape}; expected a 2D {'label map' if label else 'image (gray or RGB)'}")


def normalise_channel(x: np.ndarray, scheme: Sequence) -> np.ndarray:
    """One channel of one image or volume normalised as nnU-Net v2's schemes do, over the whole array (float32).

    Args:
        x: the channel, any shape, stored units.
        scheme: ``(name, low, high, mean, std)`` (:attr:`feduq.tasks.task.TaskSpec.normalization`):
            ``zscore`` (x - mean) / std of this array (nnU-Net's ZScoreNormalization without a mask); ``rescale_to_0_1``
            (x - min) / (max - min); ``rgb_to_0_1`` x / 255; ``CT`` clipped to [low, high], then (x - mean) / std with
            the declared (fingerprint) numbers, or without them (x - low) / (high - low); ``noNorm`` unchanged.

    Raises:
        ValueError: a ``CT`` scheme without its window.
    """
    name, low, high, mean, std = scheme
    if name == "CT" and low is None:
        raise ValueError("a CT channel has no window yet: declare it in the task file or compute it from the sites' "
                         "intensity fingerprints (feduq fingerprint)")
    x = x.astype(np.float32, copy=False)
    if name == "zscore":
        return ((x - x.mean(dtype=np.float64)) / max(float(x.std(dtype=np.float64)), 1e-8)).astype(np.float32)
    if name == "rescale_to_0_1":
        lo, hi = float(x.min()), float(x.max())
        return ((x - lo) / max(hi - lo, 1e-8)).astype(np.float32)
    if name == "rgb_to_0_1":
        if x.size and (float(x.min()) < 0 or float(x.max()) > 255):
            raise ValueError(f"rgb_to_0_1 needs values in 0..255 (nnU-Net's RGBTo01Normalization), got "
                             f"{float(x.min()):g}..{float(x.max()):g}")
        return x / np.float32(255.0)
    if name == "CT":
        x = np.clip(x, low, high)
        return ((x - mean) / std if std is not None else (x - low) / (high - low)).astype(np.float32)
    return x


def read_case_2d(files: Sequence, normalization: Sequence[Sequence], normalise: bool = True) -> np.ndarray:
    """A 2D case's channel files (``<case>_0000``, ``<case>_0001``, ... in order) as one float32 ``[C, W, H]``, each
    channel normalised by its scheme (``normalization``: one per declared channel).

    Raises:
        ValueError: a file cannot be read, the files differ in size, or they hold another number of channels than
            declared (the message names the first file).
    """
    rgb = len(normalization) == 3 and len(files) == 1  # one file for a 3-channel task: read as RGB
    planes = [read_plane(f, rgb=rgb) for f in files]
    first = "/".join(str(files[0]).replace(os.sep, "/").split("/")[-2:])
    if any(p.shape[1:] != planes[0].shape[1:] for p in planes):
        raise ValueError(f"{first}: the channel files of its case differ in size "
                         f"{[list(p.shape[1:]) for p in planes]} (a case's channels share one grid)")
    image = np.concatenate(planes)
    if image.shape[0] != len(normalization):
        raise ValueError(f"{first}: its case's files hold {image.shape[0]} channel(s), the task declares "
                         f"{len(normalization)}")
    if not normalise:
        return image
    return np.stack([normalise_channel(image[c], normalization[c]) for c in range(image.shape[0])])


def case_of(channel_file: str | os.PathLike, file_ending: str) -> str:
    """``.../<case>_0000<ending>`` -> ``<case>``."""
    base = os.path.basename(str(channel_file))
    return base[: -len(file_ending)][:-5]
