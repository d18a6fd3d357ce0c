"""Scores of a 3D case that was segmented slice by slice: Dice per case, HD95 in mm and structure volumes in mL.

A volume site of a declared task (:mod:`feduq.sites.nnunet_raw`) is trained and predicted per axial slice; what a
clinical reader compares is the case. Each case's slices are stacked back into ``[X, Y, Z]`` class maps and scored
in 3D with MONAI (:func:`monai.metrics.compute_dice`, :func:`monai.metrics.compute_hausdorff_distance` with the
voxel spacing), under the conventions of :mod:`feduq.scores.metrics`: prediction and reference both empty -> Dice 1,
HD95 0; exactly one empty -> Dice 0 and HD95 the volume's diagonal in mm (the largest distance possible), so a failed
case counts as a failure and never leaves the mean.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np
import torch

__all__ = ["case_scores_3d", "CaseCollector", "summarize_case_scores", "volume_site_results", "VolumeCaseLevel",
           "WholeCaseMaps"]


def case_scores_3d(pred: np.ndarray | torch.Tensor, label: np.ndarray | torch.Tensor, spacing: Sequence[float],
                   columns: Mapping[str, Sequence[int]]) -> dict[str, np.ndarray]:
    """Dice, HD95 (mm) and volumes (mL) of one case, per scored structure.

    Args:
        pred: predicted class indices ``[X, Y, Z]`` (int).
        label: reference class indices ``[X, Y, Z]``.
        spacing: voxel size ``(sx, sy, sz)`` in mm.
        columns: structure name -> the class indices whose union it is (a class, or a region of classes).

    Returns:
        ``{"dice": [K], "hd95_mm": [K], "volume_ml": [K] (predicted), "reference_ml": [K]}`` float64, K =
        ``len(columns)`` in its order.

    Raises:
        ValueError: shapes differ, or ``spacing`` is not three positive numbers.
    """
    from monai.metrics import compute_dice, compute_hausdorff_distance

    pred, label = torch.as_tensor(np.asarray(pred)).long(), torch.as_tensor(np.asarray(label)).long()
    if pred.shape != label.shape or pred.ndim != 3:
        raise ValueError(f"case_scores_3d: pred {tuple(pred.shape)} and label {tuple(label.shape)} must be one [X, Y, Z]")
    spacing = [float(s) for s in spacing]
    if len(spacing) != 3 or min(spacing) <= 0:
        raise ValueError(f"case_scores_3d: spacing must be three sizes > 0 in mm, got {spacing}")
    voxel_ml = float(np.prod(spacing)) / 1000.0
    diagonal = math.sqrt(sum((n * s) ** 2 for n, s in zip(pred.shape, spacing)))
    out: dict[str, list[float]] = {"dice": [], "hd95_mm": [], "volume_ml": [], "reference_ml": []}
    for classes in columns.values():
        members = torch.as_tensor(list(classes), dtype=torch.long)
        p, t = torch.isin(pred, members), torch.isin(label, members)
        p_any, t_any = bool(p.any()), bool(t.any())
        two = lambda m: torch.stack([~m, m])[None].float()  # noqa: E731 - [1, 2, X, Y, Z] one-hot
        if not (p_any or t_any):
            dice, hd = 1.0, 0.0
        elif not (p_any and t_any):
            dice, hd = 0.0, diagonal
        else:
            dice = float(compute_dice(two(p), two(t), include_background=False)[0, 0])
            hd = float(compute_hausdorff_distance(two(p), two(t), include_background=False, percentile=95,
                                                  spacing=spacing)[0, 0])
        out["dice"].append(dice)
        out["hd95_mm"].append(hd)
        out["volume_ml"].append(float(p.sum()) * voxel_ml)
        out["reference_ml"].append(float(t.sum()) * voxel_ml)
    return {k: np.asarray(v, dtype=np.float64) for k, v in out.items()}


class CaseCollector:
    """Collects a test loader's slices by case (``batch["case"]``, ``batch["slice"]``) as the ``observe`` hook of
    :func:`feduq.scores.scoring.evaluate_test`, then scores each case in 3D (:meth:`scores`).

    Args:
        regions: the task's scored regions (``evaluate_test`` hands tasks with regions its raw argmax): each slice's
            class map is then reduced per region as the test and ``predict`` reduce it
            (:func:`feduq.scores.metrics.region_label_map`).
        keep_largest_component / connectivity: that reduction's settings (the job's).
        letterbox: the slices were letterboxed; a label scored at the training size (``test_protocol.resolution =
            "training"``) is then the stored slice scaled by one factor, its longer side over the image size.
    """

    def __init__(self, regions=None, keep_largest_component: bool = False, connectivity: int = 8,
                 letterbox: bool = False):
        self.slices: dict[str, list[tuple[int, np.ndarray, np.ndarray]]] = {}
        self.spacing: dict[str, tuple[float, float, float]] = {}
        self.regions, self.keep, self.connectivity, self.letterbox = regions, keep_largest_component, connectivity, \
            letterbox

    def __call__(self, batch, logits, probs, scores, pred) -> None:
        if self.regions:
            from .metrics import region_label_map

            pred = region_label_map(pred, self.regions, self.keep, self.connectivity)
        for i, case in enumerate(batch["case"]):
            label = np.asarray(batch["label"][i, 0].cpu(), dtype=np.int64)
            z = int(np.asarray(batch["slice"][i]).ravel()[0])
            self.slices.setdefault(case, []).append((z, np.asarray(pred[i, 0], np.int64), label))
            sx, sy, sz = (float(s) for s in np.asarray(batch["spacing"][i]).ravel())
            gx, gy = (float(n) for n in np.asarray(batch["stored_shape"][i]).ravel())
            # the label's grid: the stored one, or the training size (test_protocol.resolution = "training")
            if self.letterbox and (label.shape[0], label.shape[1]) != (int(gx), int(gy)):
                scale = max(gx, gy) / max(label.shape[0], label.shape[1])  # one scale for both axes: the longer side's
                self.spacing[case] = (sx * scale, sy * scale, sz)
            else:
                self.spacing[case] = (sx * gx / label.shape[0], sy * gy / label.shape[1], sz)

    def scores(self, columns: Mapping[str, Sequence[int]]) -> tuple[list[str], dict[str, np.ndarray]]:
        """``(cases in test order, {"dice": [N, K], "hd95_mm": [N, K], "volume_ml": [N, K], "reference_ml": [N,
        K]})``, one row per case."""
        names, rows = list(self.slices), {}
        for case in names:
            ordered = sorted(self.slices[case], key=lambda s: s[0])
            pred = np.stack([s[1] for s in ordered], axis=-1)
            label = np.stack([s[2] for s in ordered], axis=-1)
            for key, value in case_scores_3d(pred, label, self.spacing[case], columns).items():
                rows.setdefault(key, []).append(value)
        return names, {k: np.stack(v) for k, v in rows.items()}


def summarize_case_scores(cases: dict[str, np.ndarray], slice_ece: np.ndarray, columns: Sequence[str]) -> dict:
    """A volume site's test metrics from :meth:`CaseCollector.scores`: ``dice`` and ``hd95_mm`` (mean over cases of
    the mean over structures), ``ece`` (mean over the slices), ``num_cases``, ``num_images`` (slices) and, with more
    than one structure, ``dice_<name>`` / ``hd95_mm_<name>`` per structure."""
    metrics = {"dice": float(cases["dice"].mean()), "hd95_mm": float(cases["hd95_mm"].mean()),
               "ece": float(np.mean(slice_ece)), "num_cases": int(cases["dice"].shape[0]),
               "num_images": int(len(slice_ece))}
    if len(columns) > 1:
        for c, name in enumerate(columns):
            metrics[f"dice_{name}"] = float(cases["dice"][:, c].mean())
            metrics[f"hd95_mm_{name}"] = float(cases["hd95_mm"][:, c].mean())
    return metrics


def volume_site_results(cases: CaseCollector, slice_ece: np.ndarray, class_names: Sequence[str],
                        regions: Mapping[str, Sequence[int]] | None, site: str,
                        annotated: Sequence | None = None) -> tuple[dict, list[dict], list[dict]]:
    """A volume site's test results from its collected slices: ``(metrics, per-case rows, paired-test rows)``.

    The structures scored are the task's regions, else its foreground classes; on a site with partial labels
    (``annotated``: its groups of classes, :func:`feduq.core.partial_labels.as_groups`) only those it annotates. ``metrics``: :func:`summarize_case_scores`;
    per-case rows: :func:`feduq.scores.tables.per_case_rows` (``per_case_test.csv``); paired-test rows ``{"site",
    "image": case, "dice", "hd95_mm"}`` and, with several structures, ``dice_<s>`` each (``per_image_test.csv``: a
    volume's unit is the case, its slices are not independent)."""
    from ..core.partial_labels import scored_columns
    from .tables import per_case_rows

    columns, keep = scored_columns(class_names, regions, annotated)  # partial labels: what this site annotates
    columns = {name: columns[name] for i, name in enumerate(columns) if i in keep}
    names, per_case = cases.scores(columns)
    rows = per_case_rows(site, names, per_case, list(columns))
    units = [{"site": r["site"], "image": r["case"], "dice": r["dice"], "hd95_mm": r["hd95_mm"],
              **({f"dice_{n}": r[f"dice_{n}"] for n in columns} if len(columns) > 1 else {})} for r in rows]
    return summarize_case_scores(per_case, slice_ece, list(columns)), rows, units


class VolumeCaseLevel:
    """A volume site's case-level numbers for the review rule, one row per case (the volume is what ``predict``
    accepts or flags): each slice's predicted class map, primary uncertainty map and reference mask kept by case, then
    stacked ``[X, Y, Z]`` and scored as ``predict`` scores a volume (:func:`feduq.scores.case_scores.case_scores` on
    the stack: the image mean, the mean inside the predicted foreground, the 3D boundary band; the predicted and
    reference foreground fractions), its features the mean of its slices' pooled bottleneck features (as
    ``predict``'s), its Dice and HD95 (mm) the 3D ones of :class:`CaseCollector`."""

    def __init__(self):
        self.slices: dict[str, list[tuple[int, int, np.ndarray, np.ndarray, np.ndarray]]] = {}

    def add(self, batch, row_index: int, shown: torch.Tensor, uncertainty: torch.Tensor, label: torch.Tensor) -> None:
        """Keep one slice (batch of 1): its row's index, class map, uncertainty and reference ``[H, W]``."""
        case = batch["case"][0]
        z = int(np.asarray(batch["slice"][0]).ravel()[0])
        self.slices.setdefault(case, []).append((z, row_index, np.asarray(shown, np.int64),
                                                 np.asarray(uncertainty, np.float32), np.asarray(label) > 0))

    def rows(self, site: str, per_case: Sequence[Mapping], features: np.ndarray | None) -> tuple[list[dict],
                                                                                                np.ndarray | None]:
        """``(rows, features [cases, C] or None)``: per case ``site, image`` (the case), ``dice``, ``hd95_mm``,
        ``hd95_px`` (NaN: a volume's distance is in mm), ``slices``, the case scores and ``mask_fraction``;
        ``per_case``: :func:`volume_site_results`'s paired-test rows (``image`` = case, ``dice``, ``hd95_mm``)."""
        from .case_scores import case_scores

        scored = {r["image"]: r for r in per_case}
        out, feats = [], []
        for case, items in self.slices.items():
            items = sorted(items, key=lambda s: s[0])
            shown = torch.from_numpy(np.stack([s[2] for s in items], axis=-1))
            u = torch.from_numpy(np.stack([s[3] for s in items], axis=-1))
            mask = np.stack([s[4] for s in items], axis=-1)
            row = {"site": site, "image": case, "dice": float(scored[case]["dice"]),
                   "hd95_mm": float(scored[case]["hd95_mm"]), "hd95_px": float("nan"), "slices": len(items),
                   **{k: float(v) for k, v in case_scores(shown, u).items()}, "mask_fraction": float(mask.mean())}
            out.append(row)
            if features is not None:
                feats.append(features[[s[1] for s in items]].mean(axis=0))
        return out, (np.stack(feats) if feats else None)


class WholeCaseMaps:
    """Cases predicted whole (a 3D network's volumes): each case's class map and reference on its file's grid,
    scored per structure when asked, as :class:`CaseCollector` scores slices stacked back (its ``scores``, for
    :func:`volume_site_results`)."""

    def __init__(self):
        self.items: list[tuple[str, np.ndarray, np.ndarray, tuple]] = []

    def add(self, case: str, pred: np.ndarray, label: np.ndarray, spacing) -> None:
        """One case: ``pred`` and ``label`` class indices ``[*file shape]``, ``spacing`` in mm per axis."""
        self.items.append((case, pred, label, tuple(float(s) for s in spacing)))

    def scores(self, columns: Mapping[str, Sequence[int]]) -> tuple[list[str], dict[str, np.ndarray]]:
        """``(cases, {"dice": [cases, structures], "hd95": ...})`` (:func:`case_scores_3d`)."""
        per = [case_scores_3d(pred, label, spacing, columns) for _, pred, label, spacing in self.items]
        return [c for c, *_ in self.items], {k: np.stack([p[k] for p in per]) for k in per[0]}
