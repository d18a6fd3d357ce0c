"""FedUAA on the site (MICCAI 2023, §2.1, Eq. 4-8): the TWEU head's evidential outputs and the losses, in the
classification form and FedEvi's segmentation form. Pure PyTorch, no FLARE."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ...core.evidential import dirichlet_from_logits, dirichlet_kl_to_uniform, kl_annealing_factor, target_to_one_hot
from ...core.evidential_loss import FedEviLoss


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
      a product of Gammas; :func:`feduq.core.evidential.dirichlet_kl_to_uniform`), not averaged over
      classes;
    * ``a(r) = min(1, r / annealing_step)`` (:func:`feduq.core.evidential.kl_annealing_factor`). The
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
    :func:`feduq.core.evidential.target_to_one_hot`; for ``[B, K]`` logits pass ``[B]`` or one-hot);
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
    and KL (:class:`feduq.core.evidential_loss.FedEviLoss`) with **softplus** evidence, i.e. FedEvi's
    ``EDL_Dice_Loss_softplus``. No temperature constant is visible in FedEvi's FedUAA code, so the
    temperature term is off by default; ``temperature=0.05`` adds the paper's per-pixel L_Tce.

    Args:
        kl_weight: lambda (default 0.01, FedEvi's polyp value; the FedUAA baseline's is not released).
        annealing_step: a(r) = min(1, r / annealing_step) (default 10, FedEvi's).
        dice_variant: ``"mean"`` (FedEvi code) or ``"second_moment"``.
        temperature: tau of an optional per-pixel L_Tce; None (default) leaves it out.
        batch_dice: see :class:`feduq.core.evidential_loss.FedEviLoss` (False under DP-SGD).

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
