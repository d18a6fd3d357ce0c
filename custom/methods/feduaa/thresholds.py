"""FedUAA's Youden uncertainty threshold (MICCAI 2023, Eq. 2-3), the aggregation weights softmax(θ) (Alg. 1 line
14), and what enters the ROC for segmentation. NumPy / scikit-learn / torch, no FLARE."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from ...common.checks import vector as _vector
from .losses import evidential_output

ROC_LEVELS = ("pixel", "image")
THRESHOLD_SOURCES = ("train", "val")
#: threshold of a site that has never reported a usable one: the official code's fallback value
#: when its Youden computation throws (official code).
DEFAULT_THRESHOLD = 0.5


class YoudenPoint(NamedTuple):
    """Result of :func:`youden_point`. ``threshold`` is None when the ROC gives none (see there)."""

    threshold: float | None
    youden_j: float  #: max TPR - FPR (NaN when the ROC is undefined)
    tpr: float
    fpr: float
    num_samples: int
    num_wrong: int
    reason: str  #: "ok", "empty", "no_errors", "no_correct", "uninformative"


def _as_flat(values, name: str, dtype) -> np.ndarray:
    if isinstance(values, Tensor):
        values = values.detach().cpu().numpy()
    try:
        arr = np.asarray(values, dtype=dtype).reshape(-1)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be array-like of numbers: {exc}") from exc
    return arr


def youden_point(uncertainty, wrong) -> YoudenPoint:
    """Youden-optimal uncertainty threshold of a client (paper Eq. 2-3, official code).

    ROC of ``uncertainty`` as a score for ``wrong`` (sklearn ``roc_curve(wrong, u)``, default
    ``drop_intermediate=True`` as the code; a sample counts as flagged when ``u >= threshold``),
    ``J = TPR - FPR``, threshold at the **first** maximum of J (``np.argmax``, as the code).

    Guards (pitfalls of the official code):

    * sklearn's first ROC point has threshold ``+inf`` (TPR = FPR = 0, J = 0). It is the first
      maximum exactly when no finite threshold has J > 0 (u does not rank errors above correct
      samples at all); the code would then send ``inf`` and the server's softmax would return NaN.
      Here: threshold None, ``reason="uninformative"``.
    * no wrong or no correct sample: TPR or FPR is undefined (sklearn warns and returns NaN, which
      the code's try/except does not catch). Here: None, ``reason="no_errors"`` / ``"no_correct"``.
    * no sample: None, ``reason="empty"``.
    * a finite threshold is clamped to ``[0, 1]`` (``u = K / S`` lies in ``(0, 1]`` anyway).

    None means "no threshold this round": the caller keeps the previous one (:func:`resolve_threshold`).

    Args:
        uncertainty: array-like (numpy, torch, list) of N finite scores, any shape (flattened).
        wrong: array-like of N entries in {0, 1} (bool or numbers); 1 = mis-prediction (Eq. 2).

    Returns:
        :class:`YoudenPoint`.

    Raises:
        ValueError: lengths differ, a non-finite uncertainty, or a ``wrong`` entry not 0/1.
    """
    from sklearn.metrics import roc_curve

    u = _as_flat(uncertainty, "uncertainty", np.float64)
    w = _as_flat(wrong, "wrong", np.float64)
    if u.shape != w.shape:
        raise ValueError(f"uncertainty and wrong must have the same number of entries, got {u.size} and {w.size}")
    bad = np.flatnonzero(~np.isfinite(u))
    if bad.size:
        raise ValueError(f"uncertainty[{bad[0]}] must be finite, got {u[bad[0]]!r}")
    bad = np.flatnonzero((w != 0) & (w != 1))
    if bad.size:
        raise ValueError(f"wrong[{bad[0]}] must be 0 or 1, got {w[bad[0]]!r}")
    n, n_wrong = int(u.size), int(w.sum())
    if n == 0:
        return YoudenPoint(None, math.nan, math.nan, math.nan, 0, 0, "empty")
    if n_wrong == 0:
        return YoudenPoint(None, math.nan, math.nan, math.nan, n, 0, "no_errors")
    if n_wrong == n:
        return YoudenPoint(None, math.nan, math.nan, math.nan, n, n, "no_correct")
    fpr, tpr, thresholds = roc_curve(w.astype(np.int8), u)
    j = tpr - fpr
    best = int(np.argmax(j))
    if best == 0 or not np.isfinite(thresholds[best]):
        return YoudenPoint(None, float(j[best]), float(tpr[best]), float(fpr[best]), n, n_wrong, "uninformative")
    theta = float(min(1.0, max(0.0, thresholds[best])))
    return YoudenPoint(theta, float(j[best]), float(tpr[best]), float(fpr[best]), n, n_wrong, "ok")


def youden_threshold(uncertainty, wrong) -> float | None:
    """The threshold of :func:`youden_point` (a float in ``[0, 1]``, or None when undefined).

    Args / Raises: as :func:`youden_point`.
    """
    return youden_point(uncertainty, wrong).threshold


def aggregation_weights(thresholds: Sequence[float] | np.ndarray) -> np.ndarray:
    """Aggregation weights ``w_i = exp(theta_i) / sum_j exp(theta_j)`` (paper §2.2, Alg. 1 line 14).

    A plain softmax, no temperature (paper and code). With thresholds in ``[0, 1]`` the largest
    weight ratio is ``e`` (~2.7). Computed as ``softmax(theta - max theta)`` in float64. Over a subset
    of clients (the ones that answered) this equals the full softmax renormalised over that subset.

    Args:
        thresholds: N finite thresholds (1-D, N >= 1). Resolve missing ones first
            (:func:`resolve_threshold`); NaN/inf are rejected, never propagated.

    Returns:
        ``np.ndarray`` float64 ``[N]``, positive, summing to 1.

    Raises:
        ValueError: empty, not 1-D, or a non-finite entry (names the index and value).
    """
    theta = _vector(thresholds, "thresholds")
    z = np.exp(theta - theta.max())
    return z / z.sum()


def resolve_threshold(
    value, previous: float | None = None, default: float = DEFAULT_THRESHOLD
) -> tuple[float, str]:
    """The threshold the server uses for a site this round.

    ``value`` is used when it is a real number (not a bool), finite and in ``[0, 1]``; otherwise
    (None: the site's ROC was undefined this round; NaN/inf/out of range/not a number: a faulty
    site) the site's ``previous`` threshold is kept, and a site that never had one gets ``default``
    (0.5, the official code's fallback).

    Args:
        value: what the site reported (anything).
        previous: the site's last used threshold, or None.
        default: threshold for a site without any history, in ``[0, 1]``.

    Returns:
        ``(threshold, source)`` with source ``"reported"``, ``"previous"`` or ``"default"``.

    Raises:
        ValueError: ``default`` not finite in ``[0, 1]``.
    """
    if not (isinstance(default, (int, float)) and math.isfinite(default) and 0.0 <= default <= 1.0):
        raise ValueError(f"default threshold must be finite in [0, 1], got {default!r}")
    if isinstance(value, (int, float, np.floating, np.integer)) and not isinstance(value, (bool, np.bool_)):
        v = float(value)
        if math.isfinite(v) and 0.0 <= v <= 1.0:
            return v, "reported"
    if previous is not None:
        return float(previous), "previous"
    return float(default), "default"


# --------------------------------------------------------------------------------------------------
# Segmentation: what enters the ROC
# --------------------------------------------------------------------------------------------------
def pixel_samples(
    uncertainty: Tensor, wrong: Tensor, per_image: int | None, generator: torch.Generator | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Pixel-level ROC samples: a random subsample of pixels of every image (segmentation, [inferred]).

    Args:
        uncertainty: ``[B, *spatial]`` per-pixel ``u = C / S``.
        wrong: ``[B, *spatial]`` bool (or 0/1) pixel error indicator ``argmax b != y``.
        per_image: pixels drawn per image, uniformly without replacement (all pixels when None,
            0, or >= the image's pixel count).
        generator: torch CPU generator for the draw (seed it for reproducible thresholds).

    Returns:
        ``(u, wrong)``: float32 and bool numpy arrays of ``B * min(per_image, pixels)`` entries.

    Raises:
        ValueError: shapes differ or ``per_image < 0``.
    """
    if tuple(uncertainty.shape) != tuple(wrong.shape):
        raise ValueError(f"uncertainty {tuple(uncertainty.shape)} and wrong {tuple(wrong.shape)} shapes differ")
    if per_image is not None and per_image < 0:
        raise ValueError(f"per_image must be >= 0 or None, got {per_image!r}")
    u = uncertainty.detach().reshape(uncertainty.shape[0], -1).float().cpu()
    w = wrong.detach().reshape(wrong.shape[0], -1).bool().cpu()
    pixels = u.shape[1]
    if per_image and per_image < pixels:
        index = torch.stack([torch.randperm(pixels, generator=generator)[:per_image] for _ in range(u.shape[0])])
        u, w = torch.gather(u, 1, index), torch.gather(w, 1, index)
    return u.reshape(-1).numpy(), w.reshape(-1).numpy()


def image_samples(
    uncertainty: Tensor, pred: Tensor, label: Tensor, num_classes: int, dice_cutoff: float = 0.5
) -> tuple[np.ndarray, np.ndarray]:
    """Image-level ROC samples: mean ``u`` per image against "image Dice < cut-off" ([inferred]).

    The image Dice is the mean over foreground classes of ``2|P∩G| / (|P| + |G|)`` of the argmax
    prediction, a class absent from both prediction and ground truth counting as Dice 1 (FedUQ's
    evaluation convention).

    Args:
        uncertainty: ``[B, *spatial]`` per-pixel ``u``.
        pred: ``[B, *spatial]`` or ``[B, 1, *spatial]`` predicted class indices.
        label: class indices of the same shape as ``pred``.
        num_classes: C >= 2 (class 0 is background).
        dice_cutoff: an image is "wrong" when its Dice is below this value, in ``(0, 1]``.

    Returns:
        ``(mean_u, wrong)``: float32 ``[B]`` and bool ``[B]`` numpy arrays.

    Raises:
        ValueError: shapes differ, ``num_classes < 2`` or a bad ``dice_cutoff``.
    """
    if num_classes < 2:
        raise ValueError(f"num_classes must be >= 2, got {num_classes}")
    if not (0.0 < dice_cutoff <= 1.0):
        raise ValueError(f"dice_cutoff must be in (0, 1], got {dice_cutoff!r}")
    batch = uncertainty.shape[0]
    p = pred.detach().reshape(batch, -1).cpu()
    g = label.detach().reshape(batch, -1).cpu().to(p.dtype)
    if p.shape != g.shape or p.shape[1] != uncertainty[0].numel():
        raise ValueError(
            f"pred {tuple(pred.shape)}, label {tuple(label.shape)} and uncertainty {tuple(uncertainty.shape)} "
            "must cover the same pixels"
        )
    dice = torch.zeros(batch, dtype=torch.float64)
    for c in range(1, num_classes):
        pc, gc = (p == c), (g == c)
        inter = (pc & gc).sum(1).double()
        size = pc.sum(1).double() + gc.sum(1).double()
        dice += torch.where(size > 0, 2.0 * inter / size.clamp_min(1.0), torch.ones_like(size))
    dice /= num_classes - 1
    mean_u = uncertainty.detach().reshape(batch, -1).double().mean(1).float().cpu()
    return mean_u.numpy(), (dice < dice_cutoff).numpy()


@dataclass
class YoudenCollector:
    """Accumulates (uncertainty, wrong) pairs over a round and returns the Youden threshold.

    Segmentation switches (the papers leave them open):

    Attributes:
        level: ``"pixel"`` (default): per-pixel ``u = C/S`` against the pixel error
            ``argmax b != y`` on ``pixels_per_image`` randomly drawn pixels of every image (seeded);
            ``"image"``: image-mean ``u`` against "image Dice < ``dice_cutoff``".
            For ``[B, K]`` (classification) logits both reduce to the paper's per-sample ROC.
        pixels_per_image: pixels drawn per image at ``level="pixel"`` (default 1024; 0 = all).
        dice_cutoff: image-level error cut-off (default 0.5).
        seed: base seed; :meth:`reset` seeds the pixel draw with ``(seed, round)``.
    """

    level: str = "pixel"
    pixels_per_image: int = 1024
    dice_cutoff: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if self.level not in ROC_LEVELS:
            raise ValueError(f"level must be one of {ROC_LEVELS}, got {self.level!r}")
        n = self.pixels_per_image
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise ValueError(f"pixels_per_image must be an int >= 0, got {self.pixels_per_image!r}")
        if not (isinstance(self.dice_cutoff, (int, float)) and 0.0 < self.dice_cutoff <= 1.0):
            raise ValueError(f"dice_cutoff must be in (0, 1], got {self.dice_cutoff!r}")
        self.reset(0)

    def reset(self, round_index: int = 0) -> None:
        """Forget everything collected; reseed the pixel draw with ``(seed, round_index)``."""
        self._u: list[np.ndarray] = []
        self._w: list[np.ndarray] = []
        self._generator = torch.Generator().manual_seed(int(self.seed) * 1_000_003 + int(round_index))

    @torch.no_grad()
    def add(self, logits: Tensor, label: Tensor) -> None:
        """Add one batch (detached; no effect on gradients).

        Args:
            logits: ``[B, C, *spatial]`` (or ``[B, C]``) softplus-evidence logits.
            label: class indices ``[B, 1, *spatial]`` / ``[B, *spatial]`` (``[B]`` for ``[B, C]``).
        """
        logits = logits.detach()
        out = evidential_output(logits.float())
        pred = out.belief.argmax(dim=1)
        target = label.detach().reshape(pred.shape).to(pred.device).long()
        if self.level == "pixel" or logits.ndim == 2:
            u, w = pixel_samples(out.uncertainty, pred != target, self.pixels_per_image or None, self._generator)
        else:
            u, w = image_samples(out.uncertainty, pred, target, logits.shape[1], self.dice_cutoff)
        self._u.append(u.astype(np.float32))
        self._w.append(w.astype(bool))

    @property
    def num_samples(self) -> int:
        return int(sum(a.size for a in self._u))

    def result(self) -> YoudenPoint:
        """:func:`youden_point` of everything added since the last :meth:`reset`."""
        if not self._u:
            return youden_point(np.zeros(0), np.zeros(0))
        return youden_point(np.concatenate(self._u), np.concatenate(self._w))
