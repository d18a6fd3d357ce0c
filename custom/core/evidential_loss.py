"""FedEvi's evidential losses (Chen et al., MICCAI 2024; official code ``JiayiChen815/FedEvi``): the evidential Dice
loss (paper Eq. 9 as the official code implements it, "mean", plus the Dirichlet second-moment variant) and FedEvi's
total loss with the KL regulariser to the uniform Dirichlet (Eq. 10-11, with the code's annealing factor). Pure
PyTorch, no FLARE; the evidence, Dirichlet and KL pieces are :mod:`feduq.core.evidential`'s.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from .evidential import (
    _check_alpha_target,
    _check_dice_variant,
    _check_evidence,
    dirichlet_from_logits,
    dirichlet_kl_to_uniform,
    kl_annealing_factor,
    target_to_one_hot,
)


class FedEviLossComponents(NamedTuple):
    """Detached components of the last ``FedEviLoss`` call (0-dim tensors, no graph)."""

    total: Tensor
    dice: Tensor
    kl: Tensor  #: mean KL over all positions, before weighting
    kl_coefficient: float  #: kl_weight * kl_annealing_factor(round_index)


def evidential_dice_loss(
    alpha: Tensor,
    target_onehot: Tensor,
    variant: str = "mean",
    include_background: bool = True,
    smooth: float = 1e-5,
    batch: bool = True,
) -> Tensor:
    """Soft multi-class Dice loss on the Dirichlet (paper Eq. 9 as in the official code).

    Per class c, summing jointly over batch and all spatial positions (one Dice per class per
    batch, not per image): ``I_c = sum rho_bar_c y_c``, ``U_c = sum D_c + sum y_c``,
    ``dice_c = (2 I_c + smooth) / (U_c + smooth)``; loss ``= 1 - mean_c dice_c``.

    * ``variant="mean"`` (official code): ``D_c = rho_bar_c^2`` (the expectation plugged in);
    * ``variant="second_moment"``: ``D_c = E[rho_c^2] = alpha_c(alpha_c+1)/(S(S+1))``, the Dirichlet
      second moment (adds the variance ``rho_bar(1-rho_bar)/(S+1)``; closer to Eq. 9's "Bayes risk").

    Args:
        alpha: ``[B, C, *spatial]`` Dirichlet parameters.
        target_onehot: one-hot ``[B, C, *spatial]``.
        variant: ``"mean"`` or ``"second_moment"``.
        include_background: keep class 0 in the mean (official code: True).
        smooth: additive smoothing in numerator and denominator.
        batch: sum over the batch before dividing (official code: True, one Dice per class per batch);
            False gives one Dice per image and class, averaged (MONAI ``DiceLoss(batch=False)``): the
            loss is then the mean of per-image losses, as DP-SGD's per-image clipping needs.

    Returns:
        0-dim tensor (dtype of ``alpha``).

    Raises:
        ValueError: unknown ``variant``; shape mismatch; ``include_background=False`` with C < 2.
    """
    _check_dice_variant(variant)
    y = _check_alpha_target(alpha, target_onehot)
    strength = alpha.sum(dim=1, keepdim=True)
    prob = alpha / strength
    if variant == "mean":
        sq = prob * prob
    else:
        sq = prob * ((alpha + 1.0) / (strength + 1.0))
    dims = [0, *range(2, alpha.ndim)] if batch else list(range(2, alpha.ndim))
    intersection = (prob * y).sum(dim=dims)
    denominator = sq.sum(dim=dims) + y.sum(dim=dims)
    dice = (2.0 * intersection + smooth) / (denominator + smooth)  # [C] (batch) or [B, C]
    if not include_background:
        if dice.shape[-1] < 2:
            raise ValueError("include_background=False needs at least 2 classes")
        dice = dice[..., 1:]
    return 1.0 - dice.mean()


class EvidentialDiceLoss(torch.nn.Module):
    """Dice loss on the expected Dirichlet probabilities of exp-evidence logits (paper Eq. 9 / official code).

    Args:
        variant: ``"mean"`` (official code: ``rho_bar^2`` in the denominator) or ``"second_moment"``
            (Dirichlet ``E[rho^2]`` in the denominator).
        include_background: include class 0 in the class mean (official code: True).
        smooth: Dice smoothing (official code: 1e-5).
        clamp_max: logit upper clamp before ``exp`` (official code: 80).
        evidence: ``"exp"`` (FedEvi, default) or ``"softplus"`` (FedUAA's segmentation baseline,
            ``EDL_Dice_Loss_softplus``); see :func:`dirichlet_from_logits`.

    ``forward(logits, target)``: logits ``[B, C, *spatial]`` (C >= 2); target as accepted by
    :func:`target_to_one_hot`. Returns a 0-dim tensor ``1 - mean_c dice_c``.

    Raises:
        ValueError: unknown ``variant`` or ``evidence`` (at construction); target shape mismatch
            (at forward).
    """

    def __init__(
        self,
        variant: str = "mean",
        include_background: bool = True,
        smooth: float = 1e-5,
        clamp_max: float = 80.0,
        evidence: str = "exp",
    ) -> None:
        super().__init__()
        _check_dice_variant(variant)
        _check_evidence(evidence)
        self.variant = variant
        self.include_background = bool(include_background)
        self.smooth = float(smooth)
        self.clamp_max = float(clamp_max)
        self.evidence = evidence

    def forward(self, logits: Tensor, target: Tensor) -> Tensor:
        onehot = target_to_one_hot(target, logits)
        alpha = dirichlet_from_logits(logits, self.clamp_max, self.evidence).alpha
        return evidential_dice_loss(alpha, onehot, self.variant, self.include_background, self.smooth)

    def extra_repr(self) -> str:
        return (
            f"variant={self.variant!r}, include_background={self.include_background}, "
            f"smooth={self.smooth}, clamp_max={self.clamp_max}, evidence={self.evidence!r}"
        )


class FedEviLoss(torch.nn.Module):
    """FedEvi client loss ``L = L_dice + kl_weight * a(r) * mean(KL)`` (paper Eq. 11 + code annealing).

    ``L_dice`` is :class:`EvidentialDiceLoss`; ``KL`` is :func:`dirichlet_kl_to_uniform`, averaged
    over all ``B * prod(spatial)`` positions; ``a(r)`` is :func:`kl_annealing_factor`.

    Args:
        kl_weight: lambda (official polyp/prostate: 0.01; paper fundus: 1e-5); >= 0.
        annealing_step: rounds until full KL weight (official: 10).
        dice_variant: ``"mean"`` (official code) or ``"second_moment"``.
        clamp_max: logit upper clamp (official: 80).
        include_background: Dice over the background class too (official: True).
        smooth: Dice smoothing (official: 1e-5).
        evidence: ``"exp"`` (FedEvi, default) or ``"softplus"`` (FedUAA's segmentation baseline in
            FedEvi: evidential Dice + KL with softplus evidence).
        batch_dice: one Dice per class over the batch (official code, default) or, False, per image
            (:func:`evidential_dice_loss` ``batch``; FedUQ's setting under DP-SGD).

    ``forward(logits, target, round_index)`` returns the 0-dim total loss; the detached parts of
    the last call are in :attr:`last_components` (:class:`FedEviLossComponents`, or None before the
    first call).

    Raises:
        ValueError: bad ``kl_weight``/``annealing_step``/``dice_variant``/``evidence`` at
            construction; bad target shape or ``round_index`` at forward.
    """

    def __init__(
        self,
        kl_weight: float = 0.01,
        annealing_step: int = 10,
        dice_variant: str = "mean",
        clamp_max: float = 80.0,
        include_background: bool = True,
        smooth: float = 1e-5,
        evidence: str = "exp",
        batch_dice: bool = True,
    ) -> None:
        super().__init__()
        if not math.isfinite(kl_weight) or kl_weight < 0:
            raise ValueError(f"kl_weight must be finite and >= 0, got {kl_weight!r}")
        kl_annealing_factor(1, annealing_step)  # validates annealing_step
        self.kl_weight = float(kl_weight)
        self.annealing_step = int(annealing_step)
        self.dice = EvidentialDiceLoss(dice_variant, include_background, smooth, clamp_max, evidence)
        self.batch_dice = bool(batch_dice)
        self.last_components: FedEviLossComponents | None = None

    @property
    def clamp_max(self) -> float:
        return self.dice.clamp_max

    def forward(self, logits: Tensor, target: Tensor, round_index: int) -> Tensor:
        coefficient = self.kl_weight * kl_annealing_factor(round_index, self.annealing_step)
        onehot = target_to_one_hot(target, logits)
        alpha = dirichlet_from_logits(logits, self.dice.clamp_max, self.dice.evidence).alpha
        dice = evidential_dice_loss(alpha, onehot, self.dice.variant, self.dice.include_background, self.dice.smooth,
                                    batch=self.batch_dice)
        kl = dirichlet_kl_to_uniform(alpha, onehot).mean()
        total = dice + coefficient * kl
        self.last_components = FedEviLossComponents(
            total=total.detach(), dice=dice.detach(), kl=kl.detach(), kl_coefficient=coefficient
        )
        return total

    def extra_repr(self) -> str:
        return f"kl_weight={self.kl_weight}, annealing_step={self.annealing_step}, evidence={self.dice.evidence!r}"
