"""Evidential (Dirichlet) math used by FedEvi: evidence and uncertainties; the losses are :mod:`feduq.core.evidential_loss`.

Pure PyTorch, no FLARE. Every function is differentiable and works for logits of shape
``[B, C, *spatial]`` with any number of spatial dimensions, including none (``[B, C]``,
classification).

Sources (the FedEvi paper, Chen et al., MICCAI 2024, and its official code ``JiayiChen815/FedEvi``):

* evidence / Dirichlet: paper Eq. 1-2, official code (exp activation, upper clamp at 80); the
  ``evidence="softplus"`` option gives FedUAA's activation (Wang et al., MICCAI 2023, and the
  ``EDL_Dice_Loss_softplus`` that FedEvi's FedUAA segmentation baseline trains with);
* uncertainties: paper Eq. 3-5 (with the sign typo of Eq. 4 fixed), official code;
* Dice loss: paper Eq. 9 as implemented in the official code ("mean" variant), plus the Dirichlet
  second-moment variant;
* KL regulariser: paper Eq. 10; KL annealing: official code variant (the paper omits it);
* total loss: paper Eq. 11 with the code's annealing factor.

Numerical notes
---------------
* Logits are clamped from above only (default 80, so ``exp`` stays finite in float32); there is
  no lower clamp, as in the official code. Evidence of a logit of -200 is exactly 0.
* ``dirichlet_kl_to_uniform`` uses an asymptotically rearranged closed form. It is the same
  quantity as the textbook formula, but it avoids the catastrophic cancellation between
  ``lnGamma`` and ``digamma`` terms that makes the textbook formula meaningless in float32 once an
  alpha exceeds about 1e4 (at alpha = e^80 the textbook terms are ~4e36 and cancel to ~80).
* ``evidential_uncertainty`` is the direct formula, computed in the input dtype. In float32 the
  absolute error is about 1e-5 for very confident pixels; ``image_uncertainty_means`` therefore
  computes in float64 by default.
"""

from __future__ import annotations

import math
from numbers import Integral
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "Dirichlet",
    "Uncertainty",
    "FedEviLossComponents",
    "DICE_VARIANTS",
    "EVIDENCE_FUNCTIONS",
    "dirichlet_from_logits",
    "evidential_uncertainty",
    "dirichlet_second_moment",
    "dirichlet_kl_to_uniform",
    "kl_annealing_factor",
    "to_one_hot",
    "target_to_one_hot",
    "evidential_dice_loss",  # the losses: feduq.core.evidential_loss, re-exported here
    "EvidentialDiceLoss",
    "FedEviLoss",
    "image_uncertainty_means",
]

DICE_VARIANTS = ("mean", "second_moment")
EVIDENCE_FUNCTIONS = ("exp", "softplus")  # exp: FedEvi (default); softplus: FedUAA

# Below this argument lnGamma / digamma are evaluated directly, above it by their asymptotic series.
_SERIES_THRESHOLD = 10.0
_HALF_LOG_2PI = 0.5 * math.log(2.0 * math.pi)


class Dirichlet(NamedTuple):
    """Dirichlet parameters of an evidential output.

    All tensors share the dtype and device of the logits. ``evidence``, ``alpha`` and ``prob`` have
    the logits' shape ``[B, C, *spatial]``; ``strength`` is ``[B, 1, *spatial]``.
    """

    evidence: Tensor  #: e = exp(min(z, clamp_max)) (FedEvi) or softplus(z) (FedUAA), >= 0
    alpha: Tensor  #: alpha = e + 1 >= 1
    strength: Tensor  #: S = sum_c alpha_c (channel kept, size 1)
    prob: Tensor  #: expected probability rho_bar = alpha / S


class Uncertainty(NamedTuple):
    """Per-position uncertainties, each ``[B, *spatial]`` (channel reduced), in nats."""

    total: Tensor  #: entropy of the expected probability H[rho_bar]
    aleatoric: Tensor  #: expected entropy E_{Dir}[H[rho]]
    epistemic: Tensor  #: mutual information I[y, rho] = total - aleatoric



# --------------------------------------------------------------------------------------------------
# Validation helpers
# --------------------------------------------------------------------------------------------------
def _check_logits(logits: Tensor, name: str = "logits") -> None:
    if not isinstance(logits, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(logits).__name__}")
    if logits.ndim < 2:
        raise ValueError(f"{name} must have shape [B, C, *spatial] (ndim >= 2), got shape {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {logits.dtype}")


def _check_alpha_target(alpha: Tensor, target_onehot: Tensor) -> Tensor:
    """Check α and the one-hot target share a shape (ValueError giving both); the target in α's dtype."""
    _check_logits(alpha, "alpha")
    if tuple(target_onehot.shape) != tuple(alpha.shape):
        raise ValueError(
            f"target_onehot must have the shape of alpha: expected {tuple(alpha.shape)}, "
            f"got {tuple(target_onehot.shape)}"
        )
    return target_onehot.to(dtype=alpha.dtype)


def _check_dice_variant(variant: str) -> None:
    if variant not in DICE_VARIANTS:
        raise ValueError(f"variant must be one of {DICE_VARIANTS}, got {variant!r}")


def _check_evidence(evidence: str) -> None:
    if evidence not in EVIDENCE_FUNCTIONS:
        raise ValueError(f"evidence must be one of {EVIDENCE_FUNCTIONS}, got {evidence!r}")


# --------------------------------------------------------------------------------------------------
# Evidence -> Dirichlet, uncertainties
# --------------------------------------------------------------------------------------------------
def dirichlet_from_logits(logits: Tensor, clamp_max: float = 80.0, evidence: str = "exp") -> Dirichlet:
    """Map logits to the Dirichlet of an evidential model (paper Eq. 1-2, official code).

    ``evidence = exp(clamp(logits, max=clamp_max))`` (upper clamp only, as the official code),
    ``alpha = evidence + 1``, ``strength = sum_c alpha_c`` and ``prob = alpha / strength``
    (the expected class probability, paper Eq. 2).

    Args:
        logits: float tensor ``[B, C, *spatial]`` (any number of spatial dims, also ``[B, C]``).
        clamp_max: upper clamp applied to the logits before ``exp``. 80 keeps float32 finite
            (exp(80) ~ 5.5e34); the gradient is 0 for logits above it. Not used for softplus.
        evidence: ``"exp"`` (FedEvi, default) or ``"softplus"`` (FedUAA:
            ``evidence = softplus(logits) = ln(1 + e^z)``, finite for every finite logit, so no
            clamp; torch evaluates it as ``z`` above 20).

    Returns:
        :class:`Dirichlet` with ``evidence``, ``alpha``, ``prob`` shaped like ``logits`` and
        ``strength`` shaped ``[B, 1, *spatial]``; same dtype/device as ``logits``.

    Raises:
        TypeError: ``logits`` is not a floating-point tensor.
        ValueError: ``logits`` has fewer than 2 dimensions, or an unknown ``evidence``.
    """
    _check_logits(logits)
    _check_evidence(evidence)
    if evidence == "exp":
        ev = torch.exp(torch.clamp(logits, max=clamp_max))
    else:
        ev = F.softplus(logits)
    alpha = ev + 1.0
    strength = alpha.sum(dim=1, keepdim=True)
    prob = alpha / strength
    return Dirichlet(evidence=ev, alpha=alpha, strength=strength, prob=prob)


def evidential_uncertainty(alpha: Tensor) -> Uncertainty:
    """Total / aleatoric / epistemic uncertainty of ``Dir(alpha)`` per position (paper Eq. 3-5).

    With ``S = sum_c alpha_c`` and ``rho_bar = alpha / S``:

    * total ``H[rho_bar] = -sum_c rho_bar_c ln rho_bar_c`` (Eq. 3, left-hand side);
    * aleatoric ``U_ale = sum_c rho_bar_c (psi(S + 1) - psi(alpha_c + 1))`` (Eq. 5), the expected
      entropy of the categorical under the Dirichlet;
    * epistemic ``U_epi = H[rho_bar] - U_ale`` (mutual information, Eq. 3), computed by subtraction
      as in the official code.

    Paper typo: Eq. 4 as printed reads ``sum rho_bar (psi(alpha+1) - psi(S+1)) + sum rho_bar ln rho_bar``;
    the second sign is wrong (it would make U_epi negative). The correct mutual information is
    ``sum rho_bar (psi(alpha+1) - psi(S+1)) - sum rho_bar ln rho_bar``, which is what is computed here.

    Natural logarithms; no epsilon (``rho_bar_c >= 1/S > 0``). Computed in ``alpha``'s dtype; in
    float32 expect absolute errors up to ~1e-5 for very confident positions (and so possibly tiny
    negative ``epistemic`` values); pass float64 for exact statistics.

    Args:
        alpha: float tensor ``[B, C, *spatial]`` with all entries >= 1 (typically ``Dirichlet.alpha``).

    Returns:
        :class:`Uncertainty` of three tensors ``[B, *spatial]``, dtype of ``alpha``.

    Raises:
        TypeError / ValueError: as :func:`dirichlet_from_logits` for a bad ``alpha``.
    """
    _check_logits(alpha, "alpha")
    strength = alpha.sum(dim=1, keepdim=True)
    prob = alpha / strength
    total = -(prob * torch.log(prob)).sum(dim=1)
    aleatoric = (prob * (torch.digamma(strength + 1.0) - torch.digamma(alpha + 1.0))).sum(dim=1)
    epistemic = total - aleatoric
    return Uncertainty(total=total, aleatoric=aleatoric, epistemic=epistemic)


def dirichlet_second_moment(alpha: Tensor) -> Tensor:
    """Second moment ``E[rho_c^2] = alpha_c (alpha_c + 1) / (S (S + 1))`` of ``rho ~ Dir(alpha)``.

    Closed form derived here (not in the paper); equals ``rho_bar_c^2 + rho_bar_c (1 - rho_bar_c) / (S + 1)``.
    Evaluated as ``(alpha/S) * ((alpha+1)/(S+1))`` so that alpha ~ e^80 does not overflow float32.

    Args:
        alpha: float tensor ``[B, C, *spatial]``, entries > 0.

    Returns:
        Tensor shaped like ``alpha`` (same dtype).
    """
    _check_logits(alpha, "alpha")
    strength = alpha.sum(dim=1, keepdim=True)
    return (alpha / strength) * ((alpha + 1.0) / (strength + 1.0))


# --------------------------------------------------------------------------------------------------
# KL(Dir(alpha_tilde) || Dir(1))
# --------------------------------------------------------------------------------------------------
def _stirling_remainder_minus_one(x: Tensor) -> Tensor:
    """``lnGamma(x) - (x - 1/2) ln x + x - 1`` for ``x >= 1``, exactly 0 at ``x = 1``."""
    big = x >= _SERIES_THRESHOLD
    x_small = torch.where(big, torch.ones_like(x), x)
    x_big = torch.where(big, x, torch.full_like(x, _SERIES_THRESHOLD))
    direct = torch.lgamma(x_small) - (x_small - 0.5) * torch.log(x_small) + (x_small - 1.0)
    inv = 1.0 / x_big
    inv2 = inv * inv
    series = (_HALF_LOG_2PI - 1.0) + inv * (1.0 / 12.0 - inv2 * (1.0 / 360.0 - inv2 * (1.0 / 1260.0)))
    return torch.where(big, series, direct)


def _digamma_minus_log(x: Tensor) -> Tensor:
    """``psi(x) - ln x`` for ``x >= 1``, accurate in relative terms also for huge ``x``."""
    big = x >= _SERIES_THRESHOLD
    x_small = torch.where(big, torch.ones_like(x), x)
    x_big = torch.where(big, x, torch.full_like(x, _SERIES_THRESHOLD))
    direct = torch.digamma(x_small) - torch.log(x_small)
    inv = 1.0 / x_big
    inv2 = inv * inv
    series = -0.5 * inv - inv2 * (1.0 / 12.0 - inv2 * (1.0 / 120.0 - inv2 * (1.0 / 252.0 - inv2 * (1.0 / 240.0))))
    return torch.where(big, series, direct)


def dirichlet_kl_to_uniform(alpha: Tensor, target_onehot: Tensor) -> Tensor:
    """Per-position ``KL(Dir(alpha_tilde) || Dir(1))`` with ``alpha_tilde = y + (1 - y) * alpha`` (paper Eq. 10).

    The ground-truth class is reset to 1 and the wrong classes keep their alpha, so the KL
    penalises evidence on wrong classes only. Closed form (official code, ``utils/loss_func.py`` ``kl_divergence``)::

        lnGamma(S~) - lnGamma(C) - sum_c lnGamma(a~_c) + sum_c (a~_c - 1)(psi(a~_c) - psi(S~)),  S~ = sum_c a~_c

    Implementation: algebraically identical rearrangement via Stirling's series,
    ``KL = K(S~) - 1/2 sum_c ln a~_c - sum_c F(a~_c) + sum_c (a~_c - 1)(g(a~_c) - g(S~))`` with
    ``F(x) = lnGamma(x) - (x - 1/2) ln x + x - 1``, ``g(x) = psi(x) - ln x`` and
    ``K(S) = (C - 1/2) ln S + F(S) - lnGamma(C) - C + 1``, each evaluated directly for small
    arguments and by its asymptotic series for large ones. This removes the cancellation of the
    O(alpha ln alpha) terms, so the result is accurate in float32 up to alpha ~ e^80 and exactly 0
    when every ``a~_c`` is 1.

    Args:
        alpha: float tensor ``[B, C, *spatial]``, entries >= 1.
        target_onehot: one-hot (0/1) tensor with the same shape as ``alpha`` (any dtype; cast to
            ``alpha``'s dtype).

    For C = 2 with a one-hot target the closed form ``ln w - 1 + 1/w`` (w = the wrong class's
    alpha) is used instead; it is the same quantity.

    Returns:
        Tensor ``[B, *spatial]`` (dtype of ``alpha``), >= 0.

    Raises:
        ValueError: ``target_onehot.shape != alpha.shape`` (message gives both shapes).
    """
    y = _check_alpha_target(alpha, target_onehot)
    a = y + (1.0 - y) * alpha
    num_classes = a.shape[1]
    s = a.sum(dim=1)
    if num_classes == 2 and bool(((y == 0) | (y == 1)).all()) and bool((y.sum(dim=1) == 1).all()):
        # Binary fast path [derived]: with a~ = (1, w), lnGamma(1+w) - lnGamma(w) = ln w and
        # psi(w) - psi(1+w) = -1/w, so KL = ln w - 1 + 1/w; exact, stable up to w ~ e^80, 0 at w = 1,
        # and ~10x cheaper than the special functions below.
        w = s - 1.0
        return torch.log(w) - 1.0 + 1.0 / w

    # K(S): direct (exactly 0 at S == C) below C + threshold, series above.
    c = float(num_classes)
    lgamma_c = math.lgamma(c)
    big = s >= c + _SERIES_THRESHOLD
    s_small = torch.where(big, torch.full_like(s, c), s)
    s_big = torch.where(big, s, torch.full_like(s, c + _SERIES_THRESHOLD))
    # lgamma(C) through torch (not math) so that k_direct is exactly 0 at S == C
    lgamma_c_t = torch.lgamma(torch.full_like(s_small, c))
    k_direct = (torch.lgamma(s_small) - lgamma_c_t) + (c - s_small) * torch.log(s_small) + (s_small - c)
    k_series = (c - 0.5) * torch.log(s_big) + _stirling_remainder_minus_one(s_big) - (lgamma_c + c - 1.0)
    k_term = torch.where(big, k_series, k_direct)

    per_class = (
        -0.5 * torch.log(a)
        - _stirling_remainder_minus_one(a)
        + (a - 1.0) * (_digamma_minus_log(a) - _digamma_minus_log(s).unsqueeze(1))
    )
    return k_term + per_class.sum(dim=1)


def kl_annealing_factor(round_index: int, annealing_step: int = 10) -> float:
    """KL annealing factor ``a(r) = min(1, r / annealing_step)`` (official code variant; the paper omits it).

    Args:
        round_index: 1-based federated round index ``r`` (the code passes the round as "epoch";
            constant within a round). Must be an int >= 1.
        annealing_step: number of rounds to reach full weight; int > 0 (official polyp run: 10).

    Returns:
        Python float in (0, 1].

    Raises:
        ValueError: ``annealing_step <= 0`` or ``round_index < 1`` (or either is not an int).
    """
    if isinstance(annealing_step, bool) or not isinstance(annealing_step, Integral) or annealing_step <= 0:
        raise ValueError(f"annealing_step must be a positive int, got {annealing_step!r}")
    if isinstance(round_index, bool) or not isinstance(round_index, Integral) or round_index < 1:
        raise ValueError(f"round_index must be a 1-based int >= 1, got {round_index!r}")
    return min(1.0, int(round_index) / int(annealing_step))


# --------------------------------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------------------------------
def to_one_hot(target: Tensor, num_classes: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """Class indices -> one-hot.

    Args:
        target: class indices ``[B, 1, *spatial]`` or ``[B, *spatial]``; integer dtype, or floating
            dtype holding integral values.
        num_classes: C >= 1.
        dtype: dtype of the result.

    Returns:
        One-hot tensor ``[B, C, *spatial]`` of ``dtype``. Any target with ``ndim >= 2`` and
        ``shape[1] == 1`` is treated as ``[B, 1, *spatial]`` (channel dim squeezed; so ``[B, 1]`` ->
        ``[B, C]``); use :func:`target_to_one_hot` when the logits' shape can disambiguate.

    Raises:
        ValueError: non-integral values, or indices outside ``[0, num_classes)`` (names the value).
    """
    if isinstance(num_classes, bool) or not isinstance(num_classes, Integral) or num_classes < 1:
        raise ValueError(f"num_classes must be an int >= 1, got {num_classes!r}")
    if target.ndim >= 2 and target.shape[1] == 1:
        target = target.squeeze(1)
    if target.is_floating_point():
        if target.numel() and not bool(torch.all(target == torch.round(target))):
            raise ValueError("target holds class indices but contains non-integral values")
    elif target.dtype == torch.bool or target.is_complex():
        raise ValueError(f"target must hold integer class indices, got dtype {target.dtype}")
    index = target.long()
    if index.numel():
        lo, hi = int(index.min()), int(index.max())
        if lo < 0 or hi >= num_classes:
            bad = lo if lo < 0 else hi
            raise ValueError(f"target class index {bad} outside [0, {num_classes}) (num_classes={num_classes})")
    return F.one_hot(index, num_classes).movedim(-1, 1).to(dtype)


def target_to_one_hot(target: Tensor, logits: Tensor) -> Tensor:
    """Bring a segmentation target to one-hot ``[B, C, *spatial]`` matching ``logits``.

    Accepted ``target`` forms for logits ``[B, C, *spatial]`` (C >= 2):

    * class indices ``[B, 1, *spatial]`` or ``[B, *spatial]`` (int, or float holding ints);
    * one-hot ``[B, C, *spatial]`` (cast to the logits' dtype, values not checked).

    Returns:
        Float tensor of ``logits``' shape, dtype and device.

    Raises:
        ValueError: C < 2, or a target shape matching none of the forms (expected vs actual shape),
            or invalid class indices.
    """
    _check_logits(logits)
    shape = tuple(logits.shape)
    batch, num_classes, spatial = shape[0], shape[1], shape[2:]
    if num_classes < 2:
        raise ValueError(f"evidential losses need C >= 2 classes, got logits of shape {shape}")
    tshape = tuple(target.shape)
    if tshape == shape:
        return target.to(device=logits.device, dtype=logits.dtype)
    if tshape == (batch, *spatial):  # add the channel dim so to_one_hot cannot squeeze a spatial dim of size 1
        target = target.unsqueeze(1)
        tshape = tuple(target.shape)
    if tshape == (batch, 1, *spatial):
        return to_one_hot(target.to(logits.device), num_classes, dtype=logits.dtype)
    raise ValueError(
        f"target shape mismatch: expected {(batch, 1, *spatial)} or {(batch, *spatial)} (class indices) "
        f"or {shape} (one-hot) for logits of shape {shape}, got {tshape}"
    )


# --------------------------------------------------------------------------------------------------
# Client statistics
# --------------------------------------------------------------------------------------------------
def image_uncertainty_means(
    logits: Tensor, clamp_max: float = 80.0, dtype: torch.dtype | None = torch.float64, evidence: str = "exp"
) -> dict[str, Tensor]:
    """Per-image mean uncertainties (official code reduction: mean over all spatial positions).

    A client averages these over its validation images to get its FedEvi statistics: ``G_k`` from
    ``"epistemic"`` under the surrogate model, ``A_k`` from ``"aleatoric"`` under its local model
    (and the paper's ``R_k`` as the mean of ``1 / aleatoric``).

    Args:
        logits: ``[B, C, *spatial]`` float logits (``[B, C]`` gives per-sample values).
        clamp_max: logit upper clamp (official: 80).
        dtype: computation dtype (default float64, for statistics free of float32 rounding);
            None computes in the logits' dtype.
        evidence: ``"exp"`` (default) or ``"softplus"``; see :func:`dirichlet_from_logits`.

    Returns:
        ``{"aleatoric", "epistemic", "total"}`` -> tensors ``[B]`` of the computation dtype.
    """
    _check_logits(logits)
    if dtype is not None:
        logits = logits.to(dtype)
    unc = evidential_uncertainty(dirichlet_from_logits(logits, clamp_max, evidence).alpha)
    batch = logits.shape[0]
    return {
        "aleatoric": unc.aleatoric.reshape(batch, -1).mean(dim=1),
        "epistemic": unc.epistemic.reshape(batch, -1).mean(dim=1),
        "total": unc.total.reshape(batch, -1).mean(dim=1),
    }
