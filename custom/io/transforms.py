"""MONAI transforms of the dataset API: segmentation (:func:`make_transforms`) and image-level classification
(:func:`make_classification_transforms`). How an image and its mask are resized (the letterbox geometry that maps
predictions back, PIL's bicubic, the mask's nearest neighbour) is :mod:`feduq.io.resize`.

Part of :mod:`feduq.data`, which re-exports every public name here and builds its datasets with these transforms
(import from there). Depends only on :mod:`feduq.tasks.spec` and :mod:`feduq.io.resize`.

Tensor conventions of a segmentation sample (see :func:`make_transforms`)::

    sample["image"]: float32 MetaTensor [in_channels, S, S], values in [0, 1]           (S = image_size)
    sample["label"]: float32 MetaTensor [1, S, S] holding class indices 0..C-1
                     (stage "test": [1, W0, H0], the stored resolution, not resized)

Like every MONAI 2D pipeline built on ``PILReader``, the two spatial axes are (width, height) of the stored PNG/JPEG,
i.e. transposed relative to ``numpy.asarray(PIL.Image.open(f))``. Image and label get identical treatment, and MONAI's
``PILWriter`` transposes back when saving, so predictions round-trip to correctly oriented files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
from PIL import Image

from .channel_io import gray_to_8bit  # noqa: F401  (re-exported: feduq.io.transforms.gray_to_8bit)
from .resize import LABEL_RESIZE_MODE, RESIZE_MODES, Letterbox, PILBicubic
from ..tasks.spec import SPLIT_KEYS, site_error

__all__ = [
    "INTENSITY_MODES",
    "make_transforms",
    "make_image_transforms",
    "make_classification_transforms",
    "gray_to_8bit",
]


class _ToChannels:
    """PILReader converter: bring a PIL image to ``in_channels`` (gray/palette/RGBA -> RGB, or keep gray).

    A class rather than a lambda so the transform chain stays picklable (DataLoader workers).
    """

    def __init__(self, in_channels: int, site: str | None = None):
        self.in_channels, self.site = in_channels, site

    def __call__(self, img: Image.Image) -> Image.Image:
        name = getattr(img, "filename", "?")
        if self.in_channels == 3:
            if img.mode.startswith("I") or img.mode == "F":  # 16/32-bit gray: Pillow's convert would clip at 255
                img = self._to_8bit(img, name)
            return img if img.mode == "RGB" else img.convert("RGB")  # gray repeats, alpha dropped, palette expanded
        if img.mode in ("L", "I", "I;16", "F"):
            return img
        if img.mode in ("1", "LA", "La"):
            return img.convert("L")
        raise site_error(self.site, f"image {name} has mode {img.mode} ({len(img.getbands())} bands); the task expects 1 "
                              f"(gray) channel and colour images are not converted silently")


    def _to_8bit(self, img: Image.Image, name: str) -> Image.Image:
        try:
            return gray_to_8bit(img, name)
        except ValueError as e:
            raise site_error(self.site, str(e)) from None


class _CheckLabelValues:
    """``Lambdad`` function: raise :class:`DataError` if a mask holds pixel values that labels.json does not declare.

    Wrapped in ``Lambdad`` (a deterministic MONAI transform), so ``CacheDataset`` caches past it.
    """

    def __init__(self, label_values: Sequence[int], site: str | None = None):
        self.label_values, self.site = [int(v) for v in label_values], site

    def __call__(self, label):
        extra = sorted(set(np.unique(np.asarray(label)).tolist()) - set(self.label_values))
        if extra:
            name = getattr(label, "meta", {}).get("filename_or_obj", "?")
            raise site_error(self.site, f"mask {'/'.join(Path(str(name)).parts[-2:])} holds pixel values {[int(v) for v in extra[:10]]} not "
                                  f"declared in labels.json {self.label_values}")
        return label


INTENSITY_MODES = ("max", "minmax", "raw")


class _DivideByMax:
    """``x / max(x)`` over the whole image (all channels): the official FedEvi code's per-image scaling."""

    def __call__(self, img):
        peak = img.max()
        return img / peak if float(peak) > 0 else img


class _Identity:
    """No intensity scaling (a picklable no-op for loader workers)."""

    def __call__(self, img):
        return img


def _intensity(mode: str):
    from monai.transforms import Lambdad, ScaleIntensityd

    if mode == "max":
        return Lambdad("image", func=_DivideByMax())
    if mode == "raw":  # the stored 0-255 values as floats (FedA3I official code: no normalisation)
        return Lambdad("image", func=_Identity())
    return ScaleIntensityd("image", minv=0.0, maxv=1.0)


def _check_stage_and_channels(stage: str, in_channels: int, site: str | None, load: bool = True) -> None:
    if stage not in SPLIT_KEYS:
        raise site_error(site, f"unknown stage '{stage}'; expected one of {sorted(SPLIT_KEYS)}")
    if load and in_channels not in (1, 3):
        raise site_error(site, f"in_channels={in_channels} is not supported (1 = gray, 3 = RGB)")


def _load_image(in_channels: int, site: str | None) -> list:
    """The image's loading steps: PILReader (converted to ``in_channels``), channel first (a list, not a ``Compose``:
    ``CacheDataset`` caches up to the first randomizable step, and a ``Compose`` counts as one)."""
    from monai.transforms import EnsureChannelFirstd

    return [_pil_load(in_channels, site), EnsureChannelFirstd("image")]


def _pil_load(in_channels: int, site: str | None):
    """Load ``"image"`` with Pillow through :class:`_ToChannels` and nothing else (:class:`_PILLoad`)."""
    from monai.transforms import Lambdad

    return Lambdad("image", _PILLoad(in_channels, site))


class _PILLoad:
    """MONAI's ``LoadImage`` with its reader given per call, so only that reader runs: a ``LoadImage(reader=...)``
    also registers MONAI's default readers and, when the given reader raises, retries with them silently (a refused
    float TIFF or colour image would load unconverted, and the site's DataError would be lost). A class, so the
    transform chain pickles for DataLoader workers."""

    def __init__(self, in_channels: int, site: str | None):
        from monai.data import PILReader
        from monai.transforms import LoadImage

        self.reader = PILReader(converter=_ToChannels(in_channels, site))
        self.loader = LoadImage(image_only=True)

    def __call__(self, path):
        return self.loader(path, reader=self.reader)


#: the sample key :class:`_Mark8Bit` sets and :class:`_Compact` removes: the stored image holds 8-bit values
EIGHT_BIT_KEY = "image_8bit"


class _Mark8Bit:
    """``Lambda`` function right after loading: records whether the stored image holds 8-bit values (whole numbers in
    0..255: every RGB image after :class:`_ToChannels`, an 8-bit gray one), i.e. whether :class:`_Compact` may keep
    its resized image in 8 bits without losing more than the stored file had."""

    def __call__(self, sample: dict) -> dict:
        image = sample["image"]
        lo, hi = float(image.min()), float(image.max())
        whole = 0 <= lo and hi <= 255 and bool((image == image.round()).all())
        return {**sample, EIGHT_BIT_KEY: whole}


class _Compact:
    """``Lambda`` function, the last step a ``CacheDataset`` caches, so a site's cached samples take a quarter of their
    float32 bytes: the label's class indices as uint8 (lossless; a label that is not whole numbers in 0..255 stays
    float32), and an image whose stored file held 8-bit values (:class:`_Mark8Bit`) as uint8 ``round(x * scale)``.

    ``scale``: 255 for an image already scaled to [0, 1] (``intensity="max"`` / ``"minmax"``), 1 for one in 0..255
    (``"raw"``; PIL's bicubic output, whose intensity scaling runs after the cache). PIL's bicubic output is whole
    numbers, so it comes back exactly; a bilinear resample (``stretch``, ``letterbox``) comes back to within half
    an 8-bit step (0.5 / 255 of [0, 1]), as any 8-bit image library keeps a resized 8-bit image. A stored image with
    more than 8 bits stays float32."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def __call__(self, sample: dict) -> dict:
        import torch

        out = dict(sample)
        eight_bit = out.pop(EIGHT_BIT_KEY, False)
        label = out.get("label")
        whole_bytes = label is not None and 0 <= float(label.min()) and float(label.max()) <= 255
        if whole_bytes and bool((label == label.round()).all()):
            out["label"] = out["label"].to(torch.uint8)
        if eight_bit:
            out["image"] = (torch.as_tensor(out["image"]) * self.scale).round().clamp(0, 255).to(torch.uint8)
        return out


class _Expand:
    """The cached uint8 entries back to float32 (the image divided by :class:`_Compact`'s ``scale``), every time a
    sample is read. A plain callable, not a MONAI ``Transform``: ``CacheDataset`` caches up to the first such step,
    so the cache keeps :class:`_Compact`'s uint8."""

    def __init__(self, scale: float):
        self.scale = float(scale)

    def __call__(self, sample: dict) -> dict:
        import torch

        out = {}
        for k, v in sample.items():
            if isinstance(v, torch.Tensor) and v.dtype == torch.uint8:
                v = v.to(torch.float32)
                if k == "image" and self.scale != 1.0:
                    v = v / self.scale
            out[k] = v
        return out


class _PlainTensors:
    """The sample's MONAI ``MetaTensor`` entries as plain tensors (the same data, no metadata), every time a sample is
    read. A plain callable: ``CacheDataset`` caches up to the first such step."""

    def __call__(self, sample: dict) -> dict:
        import torch

        return {k: v.as_subclass(torch.Tensor) if isinstance(v, torch.Tensor) else v for k, v in sample.items()}


def _eight_bit_steps(resize: str, intensity: str) -> list:
    """:class:`_Compact` and :class:`_Expand` with the scale of the image they see: 0..255 after PIL's bicubic (its
    intensity scaling follows) or with ``intensity="raw"``, else [0, 1]."""
    from monai.transforms import Lambda

    scale = 1.0 if resize == "stretch_bicubic" or intensity == "raw" else 255.0
    return [Lambda(_Compact(scale)), _Expand(scale)]


def _image_steps(image_size: int, resize: str, intensity: str) -> list:
    """The image's resize and intensity steps of the test stage (the image alone): letterbox = intensity, then the
    long side to ``image_size`` and symmetric zero padding; stretch = bilinear anti-aliased resize, then intensity;
    stretch_bicubic = PIL's bicubic resize of the 8-bit image (the official FedEvi code's), then intensity."""
    from monai.transforms import Lambda, Resized

    if resize == "letterbox":
        return [_intensity(intensity), Lambda(Letterbox(("image",), ("bilinear",), image_size))]
    if resize == "stretch_bicubic":
        return [Lambda(PILBicubic(image_size)), _intensity(intensity)]
    return [Resized("image", spatial_size=(int(image_size),) * 2, mode="bilinear", anti_aliasing=True),
            _intensity(intensity)]


def make_image_transforms(image_size: int, in_channels: int, resize: str = "stretch", intensity: str = "minmax",
                          site: str | None = None, load: bool = True):
    """The test stage's image transforms without a label: what :func:`make_transforms` does to ``"image"`` at
    ``stage="test"`` (the one pipeline by which FedUQ scores and predicts; :mod:`feduq.predict`), the image kept
    in 8 bits as a site's cache keeps it (:class:`_Compact`), so a prediction sees the values a site's test saw.

    Args:
        load: items are ``{"image": path}`` (loaded with PILReader as for training) when true; else ``{"image":
            array}``, a float32 ``[in_channels, W, H]`` array of 0..255 values in PILReader's axis order (width first).

    Returns:
        A MONAI ``Compose`` giving ``{"image": float32 MetaTensor [in_channels, S, S]}``.

    Raises:
        DataError: unsupported ``in_channels``, ``resize`` or ``intensity``.
    """
    from monai.transforms import Compose, EnsureTyped, Lambda

    _check_stage_and_channels("test", in_channels, site, load)
    _check_modes(resize, intensity, site)
    chain = (_load_image(in_channels, site) if load else []) + [Lambda(_Mark8Bit())]
    after = [Lambda(PILBicubic(image_size))] if resize == "stretch_bicubic" else _image_steps(image_size, resize, intensity)
    after += _eight_bit_steps(resize, intensity) + ([_intensity(intensity)] if resize == "stretch_bicubic" else [])
    return Compose(chain + after + [EnsureTyped("image", dtype=np.float32)])


def _check_modes(resize: str, intensity: str, site: str | None) -> None:
    if intensity not in INTENSITY_MODES:
        raise site_error(site, f"intensity={intensity!r} is not supported; expected one of {list(INTENSITY_MODES)}")
    if resize not in RESIZE_MODES:
        raise site_error(site, f"resize={resize!r} is not supported; expected one of {list(RESIZE_MODES)}")


def make_transforms(
    stage: str,
    image_size: int,
    in_channels: int,
    label_values: Sequence[int],
    site: str | None = None,
    label_classes: Sequence[int] | None = None,
    resize: str = "stretch",
    intensity: str = "minmax",
    load: bool = True,
):
    """MONAI dictionary transforms for ``{"image": path, "label": path}`` items (``load=False``: arrays already read).

    Pipeline: LoadImaged(PILReader, image converted to ``in_channels``) -> EnsureChannelFirstd -> label value check ->
    MapLabelValued(``label_values`` -> ``label_classes``) -> Resized(image bilinear with anti-aliasing; label nearest on
    pixel centres, :data:`LABEL_RESIZE_MODE`, except for ``stage == "test"``) -> intensity scaling (``intensity``) ->
    label and image as uint8, the end of what a ``CacheDataset`` caches -> [train: without metadata, flip along a
    random axis with p=0.5] -> back to float32 -> EnsureTyped(float32). The uint8 step (:class:`_Compact`) is lossless for the label and
    for PIL's bicubic output (whose intensity scaling runs after it, on every read); a bilinear-resampled image of an
    8-bit file comes back to within half an 8-bit step (0.5 / 255 of [0, 1]); an image with more bits stays float32.
    It runs with or without a cache, so a cached and an uncached dataset give the same samples.

    Output per sample:
        ``image``: float32 MetaTensor ``[in_channels, image_size, image_size]``, values in [0, 1].
        ``label``: float32 MetaTensor ``[1, image_size, image_size]`` of class indices 0..C-1 (for ``"test"`` the
        stored resolution ``[1, W, H]``, so HD95 is measured in stored pixels; upsample logits to it).
        Spatial axes follow MONAI's PILReader, i.e. (width, height) of the stored file, for image and label alike.

    Args:
        stage: ``"train"``, ``"val"`` or ``"test"``.
        image_size: network input side length.
        in_channels: 3 (gray/RGBA/palette converted to RGB) or 1 (gray kept; colour input raises DataError).
        label_values: mask pixel values declared by the site (see :func:`read_label_values`).
        site: only used in error messages.
        label_classes: class index of each value of ``label_values`` (same order; see :func:`label_classes`);
            default: the ``i``-th smallest value is class ``i``.
        resize: ``"stretch"`` (FedUQ default: each side resized to ``image_size``, bilinear with anti-aliasing),
            ``"stretch_bicubic"`` (each side by PIL's bicubic filter on the 8-bit image, as the official FedEvi code
            resizes: the candidate cause of jobs/fedevi/README.md's CVC-ColonDB difference) or ``"letterbox"`` (official FedEvi
            code variant for polyp: the long side resized to ``image_size``, the short side zero-padded
            symmetrically, at the aspect ratio of the sample's ``orig_size`` when it has one (see
            :func:`read_original_sizes`), else of the stored image; :func:`letterbox_box` gives where the image lands,
            for mapping predictions back).
        intensity: ``"raw"`` (the stored 0-255 values, FedA3I's code), ``"minmax"`` (MONAI ``ScaleIntensityd``: (x - min) / (max - min), exactly [0, 1]) or ``"max"``
            (official FedEvi code: x / max over the whole image, so a dark image keeps its offset; values in [0, 1]).
        load: False for items read already (:mod:`feduq.sites.nnunet_raw`): ``"image"`` a float32 ``[C, W, H]`` array
            (any number of channels) and ``"label"`` a ``[1, W, H]`` array of values ``label_values``; the steps
            after loading are the same.

    Raises:
        DataError: unsupported ``stage``, ``in_channels``, ``resize`` or ``intensity`` (at build time); at load time, an image that
            cannot be brought to ``in_channels`` or a mask with undeclared values.
    """
    from monai.data import PILReader
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        Identityd,
        Lambdad,
        LoadImaged,
        MapLabelValued,
        OneOf,
        Lambda,
        RandFlipd,
        Resized,
    )

    _check_stage_and_channels(stage, in_channels, site, load)
    _check_modes(resize, intensity, site)
    keys = ("image", "label")
    size = (int(image_size), int(image_size))
    values = [int(v) for v in label_values]
    classes = list(range(len(values))) if label_classes is None else [int(c) for c in label_classes]
    if len(classes) != len(values):
        raise site_error(site, f"label_classes {classes} and label_values {values} differ in length")
    if label_classes is None:
        values = sorted(values)
    else:
        values, classes = (list(t) for t in zip(*sorted(zip(values, classes))))
    label_values = values
    loaded = [LoadImaged("label", reader=PILReader(), image_only=True), EnsureChannelFirstd("label")]
    chain = (_load_image(in_channels, site) if load else [EnsureTyped(keys, dtype=np.float32, track_meta=True)]) + [
        Lambda(_Mark8Bit()),
        *(loaded if load else []),
        Lambdad("label", func=_CheckLabelValues(label_values, site)),
        MapLabelValued("label", orig_labels=label_values, target_labels=classes),
    ]
    after_cache = []  # deterministic steps that run on every read, after the uint8 cache
    if resize == "stretch_bicubic":  # 8-bit values after PIL's bicubic: cached as uint8, scaled on every read
        chain.append(Lambda(PILBicubic(image_size)))
        after_cache.append(_intensity(intensity))
    elif stage == "test" or resize != "letterbox":
        chain += _image_steps(image_size, resize, intensity)
    else:  # letterbox: long side -> image_size at the original aspect ratio, then symmetric zero padding
        chain += [
            _intensity(intensity),  # before the padding: the pad is black (0)
            Lambda(Letterbox(keys, ("bilinear", LABEL_RESIZE_MODE), image_size)),  # label padding: background
        ]
    if stage != "test" and resize != "letterbox":  # a test label stays on the stored grid
        chain.append(Resized("label", spatial_size=size, mode=LABEL_RESIZE_MODE))
    compact, expand = _eight_bit_steps(resize, intensity)
    chain.append(compact)
    if stage == "train":  # FedEvi: with p=0.5 flip along one random axis
        # on the cached uint8 entries without the loaded file's metadata (a flip commutes with the elementwise steps
        # after it, so the sample is the same): MONAI copies a MetaTensor's metadata at every step, which cost more
        # than the flip itself (2 ms of host work per 384 px training image)
        chain += [
            _PlainTensors(),
            OneOf(
                [RandFlipd(keys, prob=1.0, spatial_axis=0), RandFlipd(keys, prob=1.0, spatial_axis=1), Identityd(keys)],
                weights=[0.25, 0.25, 0.5],
            ),
        ]
    chain += [expand, *after_cache]
    chain.append(EnsureTyped(keys, dtype=np.float32))
    return Compose(chain)


def make_classification_transforms(stage: str, image_size: int, in_channels: int, site: str | None = None):
    """MONAI transforms for ``{"image": path, "label": int}`` items (FedUAA's augmentation).

    Pipeline: LoadImaged(PILReader, image converted to ``in_channels``) -> EnsureChannelFirstd -> Resized(bilinear,
    anti-aliased) -> ScaleIntensityd([0, 1]) -> [train: horizontal flip p=0.5 and a rotation by an angle drawn
    uniformly from ±30° (FedUAA: ``RandomHorizontalFlip`` + ``RandomRotation(30)``, zero padding)] -> EnsureTyped.
    With MONAI's PILReader the first spatial axis is the stored image's width, so the horizontal flip is
    ``spatial_axis=0``.

    Output per sample: ``image`` float32 ``[in_channels, image_size, image_size]`` in [0, 1] (the rotation's
    bilinear resampling keeps it there); ``label`` the int class index (collated to ``[B]`` int64).

    Raises:
        DataError: unsupported ``stage`` or ``in_channels``.
    """
    import math as _math

    from monai.data import PILReader
    from monai.transforms import (
        Compose,
        EnsureChannelFirstd,
        EnsureTyped,
        LoadImaged,
        RandFlipd,
        RandRotated,
        Resized,
        ScaleIntensityd,
    )

    _check_stage_and_channels(stage, in_channels, site)
    size = (int(image_size), int(image_size))
    chain = [
        _pil_load(in_channels, site),
        EnsureChannelFirstd("image"),
        Resized("image", spatial_size=size, mode="bilinear", anti_aliasing=True),
        ScaleIntensityd("image", minv=0.0, maxv=1.0),
    ]
    if stage == "train":
        chain += [
            RandFlipd("image", prob=0.5, spatial_axis=0),
            RandRotated("image", range_x=_math.radians(30), prob=1.0, mode="bilinear", padding_mode="zeros"),
        ]
    chain.append(EnsureTyped("image", dtype=np.float32, track_meta=False))
    return Compose(chain)
