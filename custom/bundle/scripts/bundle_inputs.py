"""The exported MONAI Bundle's input check (copied into the bundle as ``scripts/bundle_inputs.py``; Python's standard
library and Pillow only, no FedUQ import): run by MONAI's own bundle runner before the first image is read, it stops
the run in one line on stderr with exit code 2 when ``--dataset_dir`` is missing or holds no input, or when an image
cannot be decoded, naming the folder or the file (MONAI would otherwise report an empty data loader with exit 0, or
a long traceback that does not name the file)."""

from __future__ import annotations

import os
import sys

__all__ = ["checked"]


def _stop(message: str) -> None:
    print(f"bundle: error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def checked(files: list, dataset_dir: str, what: str = "images (PNG, JPEG, BMP)", decode: bool = True) -> list:
    """Return ``files`` (the datalist: paths, or lists of a case's channel files) once checked.

    Args:
        files: what the config's datalist found in ``dataset_dir``.
        dataset_dir: the ``--dataset_dir`` given to the runner.
        what: how the message names the expected inputs.
        decode: open every image with Pillow (2D inputs; volumes are read by their own reader).

    Raises:
        SystemExit(2): after one line on stderr naming the folder (missing, not a folder, no input) or the file.
    """
    if not os.path.isdir(dataset_dir):
        _stop(f"--dataset_dir {dataset_dir} is not a folder; give the folder of the {what} to segment")
    if not files:
        _stop(f"--dataset_dir {dataset_dir} holds no {what}; nothing to segment")
    if decode:
        from PIL import Image

        for f in files:
            for path in f if isinstance(f, (list, tuple)) else [f]:
                try:
                    with Image.open(path) as im:
                        im.load()
                except Exception as e:  # any decoder error: the file is named, not the decoder's stack
                    _stop(f"{path}: cannot read this image ({type(e).__name__}: {e}); replace or remove it")
    return files
