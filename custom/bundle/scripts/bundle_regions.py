"""The exported MONAI Bundle's post-processing of a task scored by nested regions (nnU-Net's region syntax, or the
built-in fundus task's disc = rim + cup), with PyTorch and MONAI only (no FedUQ import): the bundle carries this very
file as ``scripts/bundle_regions.py`` (:mod:`feduq.bundle.export`).

:func:`paint_regions` is :func:`feduq.scores.metrics.region_label_map` for one channel-first class map: each region (the
union of its classes) reduced to its largest connected component, then painted back from the widest region to the
narrowest with the region's smallest class index (nnU-Net's painting under ``regions_class_order``), as ``predict``
writes it. Reducing each *class* instead (MONAI's ``KeepLargestConnectedComponentd`` over the class labels, the
bundle's step for per-class tasks) would drop an arc of a disc rim that the cup cuts in two, where ``predict`` keeps
both arcs as parts of one disc.
"""

from __future__ import annotations

import torch

__all__ = ["paint_regions"]


def paint_regions(label, regions, connectivity: int = 8):
    """A class map ``[1, *spatial]`` (argmax class indices, any integer or float dtype) -> the same shape and dtype,
    region by region.

    Args:
        label: the argmax of the method's probabilities, channel first (2D ``[1, W, H]`` or one slice).
        regions: the regions' class indices, e.g. fundus ``[[1, 2], [2]]``; painted widest first (a stable sort by
            size, so regions of one size keep the given order, as ``region_label_map`` sorts the task's regions).
        connectivity: 8 (full) or 4 neighbours, as the job's test.

    Returns:
        the painted class map (a MetaTensor keeps its meta): 0 outside every region's kept component, else the smallest class index of the
        narrowest region whose kept component covers the pixel.
    """
    from monai.transforms import KeepLargestConnectedComponent

    post = KeepLargestConnectedComponent(applied_labels=[1], is_onehot=False,
                                         connectivity=1 if int(connectivity) == 4 else 2)
    label = torch.as_tensor(label)
    out = torch.zeros_like(label)  # a MetaTensor stays one, with its meta (the file name the bundle's writer uses)
    plain = label.as_subclass(torch.Tensor)
    for classes in sorted((list(c) for c in regions), key=len, reverse=True):
        binary = torch.isin(plain.long(), torch.as_tensor(classes)).long()
        kept = torch.as_tensor(post(binary)).as_subclass(torch.Tensor).bool()
        out[kept] = min(classes)
    return out
