"""Test-time metrics and the paper-style per-client table.

Dice and HD95 come from MONAI (:func:`monai.metrics.compute_dice`,
:func:`monai.metrics.compute_hausdorff_distance`); calibration from
:class:`monai.metrics.CalibrationErrorMetric`. This module only fixes the conventions the papers
leave implicit, so every method is scored the same way:

* Scores are per image and per foreground class, then averaged over a site's test images. Tasks with
  nested structures score regions (unions of classes) instead, e.g. fundus disc = class >= 1 and
  cup = class 2 (:func:`region_scores`).
* HD95 is in **pixels of the stored mask** (384x384 for the polyp data): predictions made at a
  smaller training size are upsampled (bilinear on logits) to the mask size before argmax.
* Empty masks: GT and prediction both empty -> Dice 1, HD95 0. Exactly one of them empty ->
  Dice 0 and HD95 = the image diagonal (the largest distance possible in the image), instead of
  MONAI's NaN/inf, so a failed image counts as a failure and never disappears from the mean.
* Across clients the table reports the mean and the population std (ddof=0) of the per-client
  means, as FedEvi's Table 1 does.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import torch
from monai.metrics import CalibrationErrorMetric, compute_dice, compute_hausdorff_distance
from monai.networks.utils import one_hot
from monai.transforms import KeepLargestConnectedComponent


def dice_per_image(pred: torch.Tensor, target: torch.Tensor, num_classes: int) -> torch.Tensor:
    """Per-image, per-foreground-class Dice on the tensors' own device (no host transfer): MONAI's
    :func:`monai.metrics.compute_dice` with this module's empty-mask convention (both empty -> 1, one empty -> 0).

    Args:
        pred, target: class indices ``[B, 1, H, W]`` (int, or float holding ints), on the same device.
        num_classes: C including background.

    Returns:
        ``[B, C-1]`` float64 on the inputs' device.
    """
    p = one_hot(pred.long(), num_classes)
    t = one_hot(target.long(), num_classes)
    dice = compute_dice(p, t, include_background=False, ignore_empty=False).double()
    both_empty = ~p[:, 1:].flatten(2).any(-1) & ~t[:, 1:].flatten(2).any(-1)  # [B, C-1]
    return torch.where(both_empty, torch.ones_like(dice), dice)


def segmentation_scores(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, hd95: bool = True
) -> dict[str, np.ndarray]:
    """Per-image, per-foreground-class Dice and (optionally) HD95.

    Args:
        pred: predicted class indices ``[B, 1, H, W]`` (int or float holding ints).
        target: ground-truth class indices ``[B, 1, H, W]``.
        num_classes: C including background.
        hd95: also compute HD95 (skip it for fast validation Dice).

    Returns:
        ``{"dice": [B, C-1], "hd95": [B, C-1]}`` float64 arrays (``hd95`` only when requested);
        HD95 in pixels (see module doc).

    Raises:
        ValueError: ``pred`` and ``target`` shapes differ.
    """
    if pred.shape != target.shape:
        raise ValueError(f"segmentation_scores: pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    if not hd95:
        return {"dice": dice_per_image(pred, target, num_classes).cpu().numpy()}
    pred, target = pred.cpu(), target.cpu()
    p = one_hot(pred.long(), num_classes)
    t = one_hot(target.long(), num_classes)
    dice = dice_per_image(pred, target, num_classes).numpy()
    p_any = p[:, 1:].flatten(2).any(-1).numpy()  # [B, C-1]
    t_any = t[:, 1:].flatten(2).any(-1).numpy()
    both = p_any & t_any
    diagonal = math.hypot(*pred.shape[-2:])
    hd = np.where(p_any == t_any, 0.0, diagonal)  # both empty -> 0, exactly one empty -> diagonal
    if both.any():
        with np.errstate(all="ignore"):
            monai_hd = compute_hausdorff_distance(p, t, include_background=False, percentile=95).double().numpy()
        hd = np.where(both, monai_hd, hd)
    return {"dice": dice, "hd95": hd}


def region_scores(
    pred: torch.Tensor,
    target: torch.Tensor,
    regions: Mapping[str, Sequence[int]],
    hd95: bool = True,
    keep_largest_component: bool = False,
    connectivity: int = 8,
) -> dict[str, np.ndarray]:
    """Per-image Dice and (optionally) HD95 of regions that are unions of classes (nested structures).

    Fundus: ``{"disc": (1, 2), "cup": (2,)}`` scores the optic disc as class >= 1 and the cup as class 2, as FedEvi
    reports them. Each region binarises prediction and ground truth (1 where the class index is in the region) and
    is scored by :func:`segmentation_scores` with 2 classes, so all its conventions hold (empty masks, HD95 in
    pixels).

    Args:
        pred: predicted class indices ``[B, 1, H, W]``.
        target: ground-truth class indices ``[B, 1, H, W]``.
        regions: region name -> class indices forming it (at least one per region).
        hd95: also compute HD95.
        keep_largest_component: reduce each binarised predicted region to its largest connected component (MONAI
            ``KeepLargestConnectedComponent``) before scoring; ``connectivity`` 8 (full) or 4 (official FedEvi).

    Returns:
        ``{"dice": [B, R], "hd95": [B, R]}`` float64 (``hd95`` only when requested), columns in the order of
        ``regions``.

    Raises:
        ValueError: ``pred`` and ``target`` shapes differ, or ``regions`` is empty or has an empty region.
    """
    if not regions or any(len(c) == 0 for c in regions.values()):
        raise ValueError(f"region_scores: regions must be non-empty class lists, got {dict(regions)}")
    if pred.shape != target.shape:
        raise ValueError(f"region_scores: pred shape {tuple(pred.shape)} != target shape {tuple(target.shape)}")
    post = (KeepLargestConnectedComponent(applied_labels=[1], is_onehot=False, connectivity=1 if connectivity == 4 else 2)
            if keep_largest_component else None)
    columns: dict[str, list[np.ndarray]] = {}
    for classes in regions.values():
        members = torch.as_tensor(list(classes), dtype=torch.long, device=pred.device)
        p = torch.isin(pred.long(), members).long()
        t = torch.isin(target.long(), members).long()
        if post is not None:
            p = torch.stack([torch.as_tensor(post(x)).long() for x in p])
        for name, values in segmentation_scores(p, t, 2, hd95=hd95).items():
            columns.setdefault(name, []).append(values[:, 0])
    return {name: np.stack(cols, axis=1) for name, cols in columns.items()}


def calibration_error(probs: torch.Tensor, target: torch.Tensor, num_bins: int = 20) -> np.ndarray:
    """Expected calibration error per image over foreground classes (one-vs-rest, MONAI).

    Args:
        probs: class probabilities ``[B, C, H, W]`` (softmax, or the Dirichlet mean α/S).
        target: class indices ``[B, 1, H, W]``.
        num_bins: equal-width confidence bins.

    Returns:
        ``[B]`` float64, the mean ECE over foreground classes, in [0, 1].
    """
    metric = CalibrationErrorMetric(num_bins=num_bins, include_background=False, metric_reduction="none")
    ece = metric(probs.float(), one_hot(target.long(), probs.shape[1]).float())
    return torch.nan_to_num(ece, nan=0.0).double().mean(dim=1).cpu().numpy()


def summarize_sites(site_means: Mapping[str, Mapping[str, float]], metrics: Sequence[str]) -> dict[str, dict]:
    """Add ``Avg`` and ``Std`` rows (over clients, ddof=0) to a ``site -> metric -> value`` table. A metric some
    sites lack (a structure a site with partial labels does not annotate) is averaged over the sites that have it,
    and left out of ``Avg``/``Std`` when none has it."""
    table = {site: dict(vals) for site, vals in site_means.items()}
    if site_means:
        having = {m: [vals[m] for vals in site_means.values() if m in vals] for m in metrics}
        table["Avg"] = {m: float(np.mean(v)) for m, v in having.items() if v}
        table["Std"] = {m: float(np.std(v)) for m, v in having.items() if v}
    return table


def table_to_markdown(table: Mapping[str, Mapping[str, float]], columns: Sequence[tuple[str, str, float]]) -> str:
    """Render ``row -> metric -> value`` as a Markdown table.

    Args:
        columns: ``(metric_key, header, scale)`` triples, e.g. ``("dice", "Dice (%)", 100)``.
    """
    lines = ["| Client | " + " | ".join(h for _, h, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for row, vals in table.items():
        cells = [f"{vals[k] * s:.2f}" if k in vals else "" for k, _, s in columns]
        name = f"**{row}**" if row in ("Avg", "Std") else row
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def region_label_map(pred: torch.Tensor, regions: dict, keep_largest_component: bool, connectivity: int = 8
                     ) -> torch.Tensor:
    """A class map ``[B, 1, H, W]`` of a task scored by nested regions (fundus: disc = classes {1, 2}, cup = {2}),
    each region reduced to its largest component as :func:`feduq.scores.metrics.region_scores` scores it, then painted back
    from the widest region to the narrowest with the region's smallest class index."""
    if not keep_largest_component:
        return pred
    post = KeepLargestConnectedComponent(applied_labels=[1], is_onehot=False, connectivity=1 if connectivity == 4 else 2)
    out = torch.zeros_like(pred)
    for classes in sorted(regions.values(), key=len, reverse=True):
        binary = torch.isin(pred.long(), torch.as_tensor(list(classes))).long()
        kept = torch.stack([torch.as_tensor(post(b)).long() for b in binary])
        out[kept.bool()] = min(classes)
    return out
