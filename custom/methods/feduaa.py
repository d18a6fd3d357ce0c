"""FedUAA math (Wang et al., MICCAI 2023): TWEU head, its loss, Youden threshold, aggregation weights.

Pure PyTorch / NumPy / scikit-learn, no FLARE. Paper: M. Wang, L. Wang, X. Xu et al., "Federated
uncertainty-aware aggregation for fundus diabetic retinopathy staging" (FedUAA, MICCAI 2023,
arXiv:2303.13033) (official code
``LooKing9218/FedUAA`` @2e45d2c, read, not run).

Per client and round (paper §2.1-2.2, Alg. 1):

1. the local TWEU head maps features to logits z; evidence ``e = softplus(z)``, ``alpha = e + 1``,
   ``S = sum_k alpha_k``, belief ``b_k = e_k / S``, uncertainty ``u = K / S``
   (:func:`evidential_output`; ``sum_k b_k + u = 1``);
2. loss ``L = mean[L_Ice + a(r) * L_KL] + L_Tce`` (Eq. 4-8; :class:`FedUAALoss`);
3. the Youden-optimal uncertainty threshold theta of ``u`` against the error indicator
   ``1 - [argmax b = y]`` (Eq. 2-3; :func:`youden_threshold`), sent to the server;
4. the server aggregates the shared part with ``w = softmax(theta_1..theta_N)``
   (Alg. 1 line 14; :func:`aggregation_weights`); heads stay local.

Segmentation (FedEvi's FedUAA baseline, **inferred** from the bytecode FedEvi released): FedEvi trains FedUAA
with its evidential Dice + KL on softplus evidence (:class:`FedUAASegLoss`) and, per pixel,
``u = C / S``. How the ROC is formed for segmentation is not released; the choice is a switch of
:class:`YoudenCollector` (``level="pixel"``: a seeded random subsample of pixels per image against
the pixel error; ``level="image"``: the image-mean ``u`` against "image Dice < cut-off").

The Dirichlet pieces are :mod:`feduq.evidential`'s (``dirichlet_from_logits(evidence="softplus")``,
``dirichlet_kl_to_uniform``, ``kl_annealing_factor``, ``target_to_one_hot``), not copies.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ..evidential import (
    FedEviLoss,
    dirichlet_from_logits,
    dirichlet_kl_to_uniform,
    kl_annealing_factor,
    target_to_one_hot,
)
from ..constants import FedUQMetaKey
from ._checks import vector as _vector
from .server import LocalEntriesServer

__all__ = [
    "ROC_LEVELS",
    "THRESHOLD_SOURCES",
    "DEFAULT_THRESHOLD",
    "EvidentialOutput",
    "FedUAALossComponents",
    "YoudenPoint",
    "evidential_output",
    "edl_cross_entropy",
    "temperature_cross_entropy",
    "FedUAALoss",
    "FedUAASegLoss",
    "youden_point",
    "youden_threshold",
    "aggregation_weights",
    "resolve_threshold",
    "pixel_samples",
    "image_samples",
    "YoudenCollector",
    "FedUAAServer",
]

ROC_LEVELS = ("pixel", "image")
THRESHOLD_SOURCES = ("train", "val")
#: threshold of a site that has never reported a usable one: the official code's fallback value
#: when its Youden computation throws (official code).
DEFAULT_THRESHOLD = 0.5


# --------------------------------------------------------------------------------------------------
# TWEU head outputs and losses
# --------------------------------------------------------------------------------------------------
class EvidentialOutput(NamedTuple):
    """Subjective-logic view of softplus-evidence logits (paper §2.1).

    For logits ``[B, K, *spatial]``: ``evidence``, ``alpha``, ``belief`` are ``[B, K, *spatial]``,
    ``strength`` is ``[B, 1, *spatial]`` and ``uncertainty`` is ``[B, *spatial]``; all share the
    logits' dtype and device. ``belief.sum(1) + uncertainty == 1``.
    """

    evidence: Tensor  #: e = softplus(z) >= 0
    alpha: Tensor  #: alpha = e + 1
    strength: Tensor  #: S = sum_k alpha_k (channel kept)
    belief: Tensor  #: b_k = e_k / S, in [0, 1)
    uncertainty: Tensor  #: u = K / S, in (0, 1]


class FedUAALossComponents(NamedTuple):
    """Detached parts of the last :class:`FedUAALoss` / :class:`FedUAASegLoss` call (0-dim tensors)."""

    total: Tensor
    main: Tensor  #: mean L_Ice (classification) or the evidential Dice (segmentation)
    kl: Tensor  #: mean KL over samples / positions, before weighting
    tce: Tensor  #: mean temperature cross-entropy (0 when disabled)
    kl_coefficient: float  #: kl_weight * a(r)


def evidential_output(logits: Tensor) -> EvidentialOutput:
    """Evidence, Dirichlet, belief and uncertainty of the TWEU head (paper §2.1).

    ``e = softplus(z)``, ``alpha = e + 1``, ``S = sum_k alpha_k``, ``b_k = e_k / S``, ``u = K / S``.

    Args:
        logits: float tensor ``[B, K]`` (classification) or ``[B, K, *spatial]`` (segmentation,
            per pixel), K >= 2.

    Returns:
        :class:`EvidentialOutput`; ``uncertainty`` is ``[B]`` or ``[B, *spatial]``.

    Raises:
        TypeError / ValueError: not a floating tensor, or fewer than 2 dimensions.
    """
    d = dirichlet_from_logits(logits, evidence="softplus")
    num_classes = logits.shape[1]
    return EvidentialOutput(
        evidence=d.evidence,
        alpha=d.alpha,
        strength=d.strength,
        belief=d.evidence / d.strength,
        uncertainty=(num_classes / d.strength).squeeze(1),
    )


def edl_cross_entropy(alpha: Tensor, target_onehot: Tensor) -> Tensor:
    """L_Ice, the expected cross-entropy under ``Dir(alpha)`` (paper Eq. 5, digamma form).

    ``L_Ice = sum_k y_k (psi(S) - psi(alpha_k))`` per sample / position.

    Args:
        alpha: ``[B, K, *spatial]`` Dirichlet parameters (>= 1).
        target_onehot: one-hot of the same shape (cast to ``alpha``'s dtype).

    Returns:
        ``[B, *spatial]`` tensor (dtype of ``alpha``), >= 0.

    Raises:
        ValueError: shapes differ.
    """
    if tuple(target_onehot.shape) != tuple(alpha.shape):
        raise ValueError(
            f"target_onehot must have the shape of alpha: expected {tuple(alpha.shape)}, "
            f"got {tuple(target_onehot.shape)}"
        )
    y = target_onehot.to(alpha.dtype)
    strength = alpha.sum(dim=1, keepdim=True)
    return (y * (torch.digamma(strength) - torch.digamma(alpha))).sum(dim=1)


def temperature_cross_entropy(belief: Tensor, target_onehot: Tensor, temperature: float = 0.05) -> Tensor:
    """L_Tce, cross-entropy of the temperature-warmed belief ``softmax(b / tau)`` (paper Eq. 8).

    ``L_Tce = -sum_k y_k log softmax(b / tau)_k`` per sample / position (official code: standard
    cross-entropy with ``b / tau`` as logits; ``b in [0, 1)`` so the logits lie in ``[0, 1/tau)``).

    Args:
        belief: ``[B, K, *spatial]`` belief masses.
        target_onehot: one-hot of the same shape.
        temperature: tau > 0 (paper: 0.05).

    Returns:
        ``[B, *spatial]`` tensor (dtype of ``belief``), >= 0.

    Raises:
        ValueError: shapes differ, or ``temperature`` not finite and > 0.
    """
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature!r}")
    if tuple(target_onehot.shape) != tuple(belief.shape):
        raise ValueError(
            f"target_onehot must have the shape of belief: expected {tuple(belief.shape)}, "
            f"got {tuple(target_onehot.shape)}"
        )
    log_p = F.log_softmax(belief / float(temperature), dim=1)
    return -(target_onehot.to(belief.dtype) * log_p).sum(dim=1)


def _check_kl_weight(kl_weight: float) -> float:
    if not (isinstance(kl_weight, (int, float)) and math.isfinite(kl_weight) and kl_weight >= 0):
        raise ValueError(f"kl_weight must be finite and >= 0, got {kl_weight!r}")
    return float(kl_weight)


class FedUAALoss(torch.nn.Module):
    """TWEU loss ``L = mean[L_Ice + kl_weight * a(r) * L_KL] + mean[L_Tce]`` (paper Eq. 4-8).

    * ``L_Ice``: :func:`edl_cross_entropy` (Eq. 5);
    * ``L_KL``: ``KL(Dir(alpha~) || Dir(1))`` with ``alpha~ = y + (1 - y) * alpha`` (Eq. 6, read with
      a product of Gammas; :func:`feduq.evidential.dirichlet_kl_to_uniform`), not averaged over
      classes;
    * ``a(r) = min(1, r / annealing_step)`` (:func:`feduq.evidential.kl_annealing_factor`). The
      paper ramps lambda from 0 to 1; the official code uses ``annealing_step = 101`` (its
      ``iters`` counter after a 100-round run starting at 1), the default here;
    * ``L_Tce``: :func:`temperature_cross_entropy` with ``tau = 0.05`` (Eq. 8);
    * the means run over the batch and, for ``[B, K, *spatial]`` logits, over all positions.

    Args:
        annealing_step: rounds until the KL has full weight (official code: 101).
        temperature: tau of L_Tce (paper: 0.05); None drops the term.
        kl_weight: extra factor on the annealed KL (paper and code: 1).

    ``forward(logits, target, round_index)``: logits ``[B, K, *spatial]``; target class indices
    ``[B]``/``[B, *spatial]``/``[B, 1, *spatial]`` or one-hot (see
    :func:`feduq.evidential.target_to_one_hot`; for ``[B, K]`` logits pass ``[B]`` or one-hot);
    ``round_index`` 1-based. Returns the 0-dim total; :attr:`last_components` holds its parts.

    Raises:
        ValueError: bad arguments at construction; bad target or round at forward.
    """

    def __init__(self, annealing_step: int = 101, temperature: float | None = 0.05, kl_weight: float = 1.0) -> None:
        super().__init__()
        kl_annealing_factor(1, annealing_step)  # validates annealing_step
        if temperature is not None:
            temperature_cross_entropy(torch.zeros(1, 2), torch.zeros(1, 2), temperature)  # validates tau
        self.annealing_step = int(annealing_step)
        self.temperature = None if temperature is None else float(temperature)
        self.kl_weight = _check_kl_weight(kl_weight)
        self.last_components: FedUAALossComponents | None = None

    def forward(self, logits: Tensor, target: Tensor, round_index: int) -> Tensor:
        coefficient = self.kl_weight * kl_annealing_factor(round_index, self.annealing_step)
        if logits.ndim == 2 and target.ndim == 1:
            target = target.unsqueeze(1)  # [B] class indices of a [B, K] output
        onehot = target_to_one_hot(target, logits)
        out = evidential_output(logits)
        ice = edl_cross_entropy(out.alpha, onehot).mean()
        kl = dirichlet_kl_to_uniform(out.alpha, onehot).mean()
        if self.temperature is None:
            tce = torch.zeros((), dtype=logits.dtype, device=logits.device)
        else:
            tce = temperature_cross_entropy(out.belief, onehot, self.temperature).mean()
        total = ice + coefficient * kl + tce
        self.last_components = FedUAALossComponents(
            total.detach(), ice.detach(), kl.detach(), tce.detach(), coefficient
        )
        return total

    def extra_repr(self) -> str:
        return f"annealing_step={self.annealing_step}, temperature={self.temperature}, kl_weight={self.kl_weight}"


class FedUAASegLoss(torch.nn.Module):
    """FedUAA's segmentation loss as FedEvi trains it (**inferred** from the bytecode FedEvi released).

    ``L = Dice_evidential + kl_weight * a(r) * mean KL (+ mean L_Tce)``: FedEvi's evidential Dice
    and KL (:class:`feduq.evidential.FedEviLoss`) with **softplus** evidence, i.e. FedEvi's
    ``EDL_Dice_Loss_softplus``. No temperature constant is visible in FedEvi's FedUAA code, so the
    temperature term is off by default; ``temperature=0.05`` adds the paper's per-pixel L_Tce.

    Args:
        kl_weight: lambda (default 0.01, FedEvi's polyp value; the FedUAA baseline's is not released).
        annealing_step: a(r) = min(1, r / annealing_step) (default 10, FedEvi's).
        dice_variant: ``"mean"`` (FedEvi code) or ``"second_moment"``.
        temperature: tau of an optional per-pixel L_Tce; None (default) leaves it out.
        batch_dice: see :class:`feduq.evidential.FedEviLoss` (False under DP-SGD).

    ``forward(logits [B, C, *spatial], target, round_index)`` -> 0-dim total;
    :attr:`last_components` as :class:`FedUAALoss` (``main`` = Dice).
    """

    def __init__(
        self,
        kl_weight: float = 0.01,
        annealing_step: int = 10,
        dice_variant: str = "mean",
        temperature: float | None = None,
        batch_dice: bool = True,
    ) -> None:
        super().__init__()
        self.base = FedEviLoss(
            kl_weight=kl_weight, annealing_step=annealing_step, dice_variant=dice_variant, evidence="softplus",
            batch_dice=batch_dice,
        )
        if temperature is not None:
            temperature_cross_entropy(torch.zeros(1, 2), torch.zeros(1, 2), temperature)
        self.temperature = None if temperature is None else float(temperature)
        self.last_components: FedUAALossComponents | None = None

    def forward(self, logits: Tensor, target: Tensor, round_index: int) -> Tensor:
        total = self.base(logits, target, round_index)
        parts = self.base.last_components
        tce = torch.zeros((), dtype=logits.dtype, device=logits.device)
        if self.temperature is not None:
            out = evidential_output(logits)
            tce = temperature_cross_entropy(out.belief, target_to_one_hot(target, logits), self.temperature).mean()
            total = total + tce
        self.last_components = FedUAALossComponents(
            total.detach(), parts.dice, parts.kl, tce.detach(), parts.kl_coefficient
        )
        return total

    def extra_repr(self) -> str:
        return f"{self.base.extra_repr()}, temperature={self.temperature}"


# --------------------------------------------------------------------------------------------------
# Youden threshold and aggregation weights
# --------------------------------------------------------------------------------------------------
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


class FedUAAServer(LocalEntriesServer):
    """FedUAA's server part (Wang et al., MICCAI 2023, Alg. 1 lines 13-15): softmax(θ) over the sites' thresholds.

    Each site sends the shared part of its model (its head stays local) and its Youden uncertainty threshold θ_k
    (``feduaa_youden_threshold``). The server fuses the accepted sites with ``w = softmax(θ)``
    (:func:`aggregation_weights`), the paper's softmax renormalised over the sites that answered. A threshold that
    is None (the site's ROC was undefined this round), NaN/Inf, outside [0, 1] or missing does not reject the update:
    the site's previous threshold is used, or ``default_threshold`` for a site that never sent a usable one
    (:func:`resolve_threshold`), with a warning. Logged per round: ``FEDUAA_WEIGHTS {json}`` (θ used, where each
    came from, weights); the thresholds are checkpointed (``feduaa_thresholds``), so a resumed job continues them.

    Args:
        default_threshold: θ of a site without a usable history (0.5, the official code's fallback).

    Raises:
        ValueError: ``default_threshold`` not finite in [0, 1].
    """

    label = "FedUAA"
    state_key = FedUQMetaKey.FEDUAA_THRESHOLDS

    def __init__(self, default_threshold: float = DEFAULT_THRESHOLD):
        resolve_threshold(None, default=default_threshold)  # validates the default
        self.default_threshold = float(default_threshold)
        self.thresholds: dict[str, float] = {}  # site -> the threshold used for it in the last fused round

    def start(self, fed, global_params, sites, state) -> None:
        """Restore the thresholds the sites reported before the checkpoint (not the fallbacks)."""
        self.thresholds = {}
        for site, value in (state or {}).items():
            theta, source = resolve_threshold(value, None, self.default_threshold)
            if source == "reported":
                self.thresholds[str(site)] = theta
        if self.thresholds:
            fed.log(f"restored FedUAA thresholds from the global model: {self.thresholds}")

    def state(self) -> dict[str, float] | None:
        return dict(self.thresholds) or None

    def weights(self, fed, answers):
        sites = list(answers)
        theta, source = {}, {}
        for s in sites:
            value = answers[s].meta.get(FedUQMetaKey.FEDUAA_THRESHOLD)
            theta[s], source[s] = resolve_threshold(value, self.thresholds.get(s), self.default_threshold)
            if source[s] != "reported":
                fed.warn(f"site {s!r} sent no usable FedUAA threshold ({FedUQMetaKey.FEDUAA_THRESHOLD}={value!r}); "
                         f"using its {source[s]} threshold {theta[s]:.6f}")
        w = dict(zip(sites, map(float, aggregation_weights([theta[s] for s in sites]))))
        self.thresholds.update(theta)
        fed.log("FEDUAA_WEIGHTS " + json.dumps({"round": fed.round, "threshold": {s: round(t, 6) for s, t in theta.items()},
                                                "source": source, "weight": {s: round(v, 6) for s, v in w.items()}}))
        return w
