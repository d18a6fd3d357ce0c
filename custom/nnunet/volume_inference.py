"""A planned 3D network on one preprocessed volume, and its outputs mapped back onto the file's grid (FLARE-free).

nnU-Net predicts a case by Gaussian-weighted sliding windows of the plan's patch over the preprocessed volume, then
resamples the probabilities back to the cropped shape at the file's spacing, puts them into the crop's bounding box
and reverts the transpose (``nnunetv2.inference.export_prediction``). FedUQ does the same with MONAI's sliding window
(overlap 0.5, Gaussian) and carries the method's uncertainty maps through the same steps, so the label volume, the
probabilities and every uncertainty volume lie on the input's grid: :func:`predict_volume`. Test-time mirroring
(nnU-Net predicts with it by default) is optional here (``mirror_axes``, :class:`Mirrored`: the logits averaged over
every flip of the plan's mirror axes, as ``nnUNetPredictor._internal_maybe_mirror_and_predict`` averages them); the
sites' test task and the exported bundle do not mirror.
"""

from __future__ import annotations

import itertools
from typing import Callable, Mapping

import numpy as np
import torch

__all__ = ["Mirrored", "sliding_window_logits", "to_file_grid", "predict_volume", "window_starts", "volume_features"]


class Mirrored(torch.nn.Module):
    """``model`` with nnU-Net's test-time mirroring: the mean of its logits on the input and on every flip of it
    along a non-empty subset of ``axes`` (spatial axes, 0 = the first after the channel), each flipped back
    (``nnunetv2.inference.predict_from_raw_data.nnUNetPredictor._internal_maybe_mirror_and_predict``; 2^k passes for
    k axes). Input ``[B, C, *spatial]``, output ``model``'s logits ``[B, K, *spatial]``; with ``axes`` empty,
    ``model`` unchanged. The output is then equivariant to each flip: flipping the input flips the output."""

    def __init__(self, model: torch.nn.Module, axes=()):
        super().__init__()
        self.model, self.axes = model, tuple(int(a) for a in axes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, n = self.model(x), 1
        for k in range(1, len(self.axes) + 1):
            for combo in itertools.combinations(self.axes, k):
                dims = [a + 2 for a in combo]
                out = out + torch.flip(self.model(torch.flip(x, dims)), dims)
                n += 1
        return out / n


@torch.no_grad()
def sliding_window_logits(model: torch.nn.Module, data: np.ndarray, patch_size, device: torch.device,
                          overlap: float = 0.5, mirror_axes=()) -> torch.Tensor:
    """Logits ``[1, C, *shape]`` float32 of a preprocessed volume ``data [C_in, *shape]`` by MONAI's Gaussian
    sliding window of ``patch_size`` (volumes smaller than the patch are padded by MONAI and cropped back); with
    ``mirror_axes`` each window is predicted with test-time mirroring (:class:`Mirrored`)."""
    from monai.inferers import sliding_window_inference

    model.eval()
    model = Mirrored(model, mirror_axes) if mirror_axes else model
    image = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))[None].to(device)
    return sliding_window_inference(image, list(patch_size), 1, model, overlap=overlap, mode="gaussian").float()


def window_starts(size: int, patch: int, overlap: float = 0.5) -> list[int]:
    """Start indices of the sliding windows along one axis of ``size`` voxels (at least ``patch``): nnU-Net's
    ``compute_steps_for_sliding_window``, ``ceil((size - patch) / (patch * (1 - overlap))) + 1`` windows spread evenly
    from 0 to ``size - patch``."""
    if size <= patch:
        return [0]
    n = int(np.ceil((size - patch) / (patch * (1.0 - overlap)))) + 1
    return [int(np.round((size - patch) / (n - 1) * i)) for i in range(n)]


@torch.no_grad()
def volume_features(features_net: Callable[[torch.Tensor], torch.Tensor], data: np.ndarray, patch_size,
                    device: torch.device, overlap: float = 0.5) -> np.ndarray:
    """The pooled bottleneck features ``[F]`` float64 of a preprocessed volume ``data [C_in, *shape]``: the mean, with
    equal weight per window, of ``features_net``'s output ``[1, F]`` (the spatial mean of the encoder's last stage,
    :meth:`feduq.nnunet.planned.PlannedNetwork.bottleneck`) over every window of ``patch_size`` of the sliding window
    (:func:`window_starts` per axis; a volume smaller than the patch is zero-padded evenly on both sides, as MONAI's
    sliding window pads it). Each window counts once, the Gaussian weighting of the logits not applied: a feature of
    the input's content, not of how the windows' logits are blended. No mirroring."""
    image = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))[None]
    patch = [int(p) for p in patch_size]
    pad = []
    for size, p in zip(reversed(image.shape[2:]), reversed(patch)):
        extra = max(0, p - int(size))
        pad += [extra // 2, extra - extra // 2]
    image = torch.nn.functional.pad(image, pad).to(device)
    starts = [window_starts(int(s), p, overlap) for s, p in zip(image.shape[2:], patch)]
    total, n = None, 0
    for corner in itertools.product(*starts):
        window = image[(slice(None), slice(None), *(slice(c, c + p) for c, p in zip(corner, patch)))]
        f = features_net(window).double()[0]
        total, n = (f if total is None else total + f), n + 1
    return (total / n).cpu().numpy()


def keep_largest_components(seg: np.ndarray, num_classes: int, regions: Mapping | None = None,
                            full: bool = True) -> np.ndarray:
    """A class map reduced as FedUQ's 2D sites reduce theirs (the job's ``keep_largest_component``): each
    foreground class's largest connected component (MONAI's ``KeepLargestConnectedComponent``), or, for a task
    scored by nested regions (nnU-Net's ``"gland": [1, 2], "TZ": 2``), each region's largest component painted back
    from the widest region to the narrowest with the region's smallest class index (FedUQ's 2D region path).

    Args:
        seg: class indices ``[*shape]`` (2D or 3D), integer.
        num_classes: classes, background included.
        regions: region name -> class indices, or None.
        full: full connectivity (8 in 2D, 26 in 3D; the job's ``connectivity: 8``), else face neighbours only (4, 6).

    Returns:
        The reduced class map, ``seg``'s shape and dtype.
    """
    from monai.transforms import KeepLargestConnectedComponent

    hops = None if full else 1
    if not regions:
        post = KeepLargestConnectedComponent(applied_labels=list(range(1, num_classes)), is_onehot=False,
                                             connectivity=hops)
        return np.asarray(post(torch.from_numpy(seg.astype(np.int64))[None]))[0].astype(seg.dtype)
    post = KeepLargestConnectedComponent(applied_labels=[1], is_onehot=False, connectivity=hops)
    out = np.zeros_like(seg)
    for classes in sorted(regions.values(), key=len, reverse=True):
        binary = torch.from_numpy(np.isin(seg, list(classes)).astype(np.int64))[None]
        out[np.asarray(post(binary))[0].astype(bool)] = min(int(c) for c in classes)
    return out


def to_file_grid(pipeline, probabilities: torch.Tensor, props: Mapping,
                 maps: Mapping[str, torch.Tensor] | None = None, largest: Mapping | None = None
                 ) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Probabilities and maps of the preprocessed grid on the file's grid, as nnU-Net maps its predictions back; with
    ``largest`` (:func:`keep_largest_components`' keyword arguments), the class map reduced to its largest components.

    Args:
        pipeline: the :class:`feduq.nnunet.pipeline.SitePipeline` the case was preprocessed with.
        probabilities: ``[C, *shape]`` on the preprocessed grid (softmax, or the Dirichlet mean alpha / S).
        props: nnU-Net's properties of the case (``DefaultPreprocessor.run_case``).
        maps: name -> ``[*shape]`` uncertainty maps on the preprocessed grid.

    Returns:
        ``(class map [*file shape] uint8, probabilities [C, *file shape] float32, maps {name: [*file shape]
        float32})``, in the reader's axis order; outside the non-zero crop the class is background (probability 1)
        and every map 0.
    """
    from nnunetv2.inference.export_prediction import convert_predicted_logits_to_segmentation_with_correct_shape
    from acvl_utils.cropping_and_padding.bounding_boxes import insert_crop_into_image

    pm, cm = pipeline.pm, pipeline.cm
    threads = torch.get_num_threads()
    seg, probs = convert_predicted_logits_to_segmentation_with_correct_shape(
        torch.log(probabilities.float().clamp_min(1e-8)).cpu(), pm, cm, pipeline.label_manager, dict(props),
        return_probabilities=True, num_threads_torch=threads)
    if largest:
        seg = keep_largest_components(np.asarray(seg), **largest)
    out_maps = {}
    if maps:
        spacing_t = [props["spacing"][i] for i in pm.transpose_forward]
        current = cm.spacing if len(cm.spacing) == len(props["shape_after_cropping_and_before_resampling"]) else \
            [spacing_t[0], *cm.spacing]
        stacked = torch.stack([m.float().cpu() for m in maps.values()])
        resampled = cm.resampling_fn_probabilities(stacked, props["shape_after_cropping_and_before_resampling"],
                                                   current, spacing_t)
        resampled = torch.as_tensor(np.asarray(resampled), dtype=torch.float32)
        for i, name in enumerate(maps):
            full = torch.zeros(tuple(props["shape_before_cropping"]), dtype=torch.float32)
            full = insert_crop_into_image(full, resampled[i], props["bbox_used_for_cropping"])
            out_maps[name] = np.asarray(full).transpose(pm.transpose_backward).astype(np.float32)
    torch.set_num_threads(threads)
    return np.asarray(seg), np.asarray(probs, dtype=np.float32), out_maps


def predict_volume(model: torch.nn.Module, pipeline, data: np.ndarray, props: Mapping, device: torch.device,
                   prob_fn: Callable[[torch.Tensor], torch.Tensor],
                   uncertainty_fn: Callable[[torch.Tensor], Mapping[str, torch.Tensor]] | None = None,
                   mirror_axes=(), largest: Mapping | None = None) -> dict:
    """One preprocessed volume through ``model``: ``{"label": [*file shape] uint8 class indices, "probabilities":
    [C, *file shape] float32, "maps": {name: [*file shape] float32} (the method's uncertainty maps, when
    ``uncertainty_fn``), "probabilities_preprocessed": [C, *shape] float32}`` (:func:`to_file_grid`); with
    ``mirror_axes`` (the plan's: ``pipeline.augmentation()[3]``) the logits are mirrored (:class:`Mirrored`) before
    the method's probabilities and uncertainty are computed from them; ``largest``: the class map's reduction to its
    largest components (:func:`keep_largest_components`; probabilities and maps are left as they are)."""
    logits = sliding_window_logits(model, data, pipeline.patch_size, device, mirror_axes=mirror_axes)
    probs = prob_fn(logits)[0]
    maps = {k: v[0] for k, v in uncertainty_fn(logits).items()} if uncertainty_fn is not None else None
    seg, probs_file, maps_file = to_file_grid(pipeline, probs, props, maps, largest)
    return {"label": seg, "probabilities": probs_file, "maps": maps_file,
            "probabilities_preprocessed": probs.cpu().numpy()}
