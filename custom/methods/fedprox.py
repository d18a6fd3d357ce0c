"""FedProx's site part (Li et al., MLSys 2020): FedAvg's local loss plus the proximal term μ/2·‖θ − θ_g‖².

FedProx changes only the site (its server is FedAvg's). The term's value is NVFlare's torch loss
:class:`nvflare.app_opt.pt.fedproxloss.PTFedProxLoss` (a plain ``torch.nn`` module, no FLARE runtime).
"""

from __future__ import annotations

import copy

import numpy as np
import torch
from nvflare.app_opt.pt.fedproxloss import PTFedProxLoss

from ..parts.site import SitePart


class ProximalTerm:
    """FedProx's proximal term μ/2·‖θ − θ_g‖² against a frozen copy of this round's global model.

    The value is NVFlare's :class:`nvflare.app_opt.pt.fedproxloss.PTFedProxLoss` (NVFlare 2.9:
    ``forward(input, target)`` sums ``(mu / 2) * torch.sum((p - p_g) ** 2)`` over
    ``zip(input.named_parameters(), target.named_parameters())``, i.e. over trainable parameters
    only: buffers such as BatchNorm running statistics are not penalised; ``mu < 0`` raises
    ``ValueError``). The global copy is a deep copy with ``requires_grad=False`` taken when the
    round starts, so it neither aliases the parameters being trained (which would make the term
    silently 0) nor collects gradients. Every evaluated value is recorded for the round's mean.

    Args:
        global_model: a model holding this round's received global parameters (copied here).
        mu: proximal weight μ >= 0.
    """

    def __init__(self, global_model: torch.nn.Module, mu: float):
        self.loss = PTFedProxLoss(mu=mu)
        self.global_model = copy.deepcopy(global_model).requires_grad_(False)
        self.values: list[float] = []

    def __call__(self, model: torch.nn.Module) -> torch.Tensor:
        term = self.loss(model, self.global_model)
        self.values.append(float(term.detach()) if torch.is_tensor(term) else float(term))
        return term

    def mean(self) -> float:
        """Mean of the recorded values (0.0 before the first step)."""
        return float(np.mean(self.values)) if self.values else 0.0


class FedProxSite(SitePart):
    """FedProx's site part: FedAvg's Dice + CE loss plus μ/2·‖θ − θ_g‖² (Li et al., MLSys 2020, Eq. 2).

    θ_g is the global model received this round, frozen when the round starts (:class:`ProximalTerm`). The term is
    added to every local step's loss; it is 0 at the first step of a round (θ = θ_g) and grows as the local model
    drifts. The round's mean over its steps is logged as ``prox_term`` (with ``mu``) in the site's ``FEDUQ_TRAIN``
    line and stays on the site: like FedAvg, only θ_k and N_k are sent.

    Args:
        mu: proximal weight μ >= 0 (default 0.01, NVFlare's ``PTFedProxLoss`` default); 0 is FedAvg.
        loss: FedAvg's local loss (:class:`feduq.parts.site.SitePart`).

    Raises:
        ValueError: ``mu`` < 0 or not a number.
    """

    def __init__(self, mu: float = 0.01, loss: str = "dice_ce"):
        super().__init__(loss)
        if not mu >= 0:
            raise ValueError(f"FedProx: mu must be >= 0, got {mu!r}")
        self.mu = float(mu)
        self.term: ProximalTerm | None = None  # this round's term

    def regularizer(self, site) -> ProximalTerm:
        self.term = ProximalTerm(site.model, self.mu)
        return self.term

    def record(self, round_index: int) -> dict:
        return {"mu": self.mu, "prox_term": self.term.mean() if self.term is not None else None}
