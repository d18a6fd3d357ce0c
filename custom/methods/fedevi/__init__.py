"""FedEvi (Chen et al., MICCAI 2024): the aggregation-weight math (:mod:`.equations`, paper Eq. 6-8 and the official
code), its server part :class:`FedEviServer` and its site part :class:`FedEviSite`.

Per round r (FedEvi paper Algorithm 1, official code ``main_seg_al.py``):

1. the server forms the surrogate model from the previous weights ``beta^{r-1}``;
2. clients report ``G_k`` (mean over val images of U_epi under the surrogate, Eq. 6) and their
   reliability statistic under their local model: ``A_k`` = mean of U_ale (official code) or
   ``R_k`` = mean of 1/U_ale (paper Eq. 7);
3. :func:`client_scores` gives ``x_k``, :func:`update_weights` gives ``beta^r`` (Eq. 8 + code clip).

:class:`FedEviConfig` collects the paper-vs-code switches; :func:`fedevi_update` runs steps 3 with it.
All arrays are 1-D ``float64`` of length K (number of clients), in a fixed client order.
"""

from __future__ import annotations

import json
import math

import numpy as np

from ...common.wire import FedUQMetaKey, FedUQTask
from ...core.aggregation import normalise_weights, weighted_average
from ...parts.server import ServerPart, num_samples
from ...parts.site import SitePart
from .equations import (
    INITIAL_MODES,
    RELIABILITY_MODES,
    FedEviConfig,
    client_scores,
    fedevi_update,
    initial_weights,
    round_weights,
    update_weights,
)

__all__ = [
    "INITIAL_MODES",
    "RELIABILITY_MODES",
    "FedEviConfig",
    "initial_weights",
    "client_scores",
    "update_weights",
    "fedevi_update",
    "round_weights",
    "FedEviServer",
    "FedEviSite",
]


class FedEviServer(ServerPart):
    """FedEvi's server part (§2.3, Eq. 6-8): the surrogate exchange and β, for :mod:`feduq.flare.controller`.

    Per round r, after the sites' updates θ_k (with N_k, A_k = mean U_ale and R_k = mean 1/U_ale) were accepted:

    1. β⁰ from N_k (or uniform, ``config.initial``) the first time; a site joining later starts at the mean β.
    2. The surrogate θ̂ = Σ_k β_k^{r-1} θ_k (β renormalised over the accepted sites) goes out as
       ``validate_surrogate`` (timeout ``surrogate_timeout``); each site returns G_k, the mean U_epi of θ̂ on its
       validation images. An invalid G_k (not finite, < 0) is rejected with its reason; fewer valid G_k than the
       quorum stops the job.
    3. β^r = :func:`round_weights` over the scored sites (Eq. 8; a site not scored keeps its β), logged as
       ``FEDEVI_BETA {json}`` and checkpointed (``fedevi_beta``), so a resumed job continues with it.
    4. θ^r = Σ_k β_k^r θ_k over the accepted sites.

    Args:
        config: the switches of :class:`FedEviConfig` (validated here).
    """

    label = "FedEvi"
    state_key = FedUQMetaKey.FEDEVI_BETA
    timeout_args = ("train_timeout", "surrogate_timeout")

    def __init__(self, config: FedEviConfig | None = None):
        self.config = (config or FedEviConfig()).validate()
        self.beta: dict[str, float] = {}

    @classmethod
    def from_job(cls, delta: float = 1.0, reliability: str = "code", clip_min: float = 1e-3,
                 renormalize_after_clip: bool = False, initial_weights: str = "samples") -> "FedEviServer":
        """From the job's workflow arguments (:class:`FedEviConfig`'s switches; ``initial_weights`` is its ``initial``)."""
        return cls(FedEviConfig(delta=delta, reliability=reliability, clip_min=clip_min,
                                renormalize_after_clip=renormalize_after_clip, initial=initial_weights))

    def start(self, fed, global_params, sites, state) -> None:
        self.beta = {k: float(v) for k, v in (state or {}).items()}

    def state(self) -> dict[str, float] | None:
        return dict(self.beta) or None

    def check(self, site, answer, global_params) -> None:
        """The shared checks, then A_k (the reliability statistic) must be a finite number > 0."""
        super().check(site, answer, global_params)
        a = answer.meta.get(FedUQMetaKey.MEAN_ALEATORIC)
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not math.isfinite(a) or a <= 0:
            raise ValueError(f"site {site!r}: A_k = {a!r} (expected a finite number > 0)")

    def fuse(self, fed, answers, global_params):
        sites = sorted(answers)
        meta = {s: answers[s].meta for s in sites}
        if not self.beta:
            beta0 = initial_weights([num_samples(s, meta[s]) for s in sites], mode=self.config.initial)
            self.beta = dict(zip(sites, map(float, beta0)))
            fed.log("FEDEVI_BETA " + json.dumps({"round": "initial", "beta": self.beta}))
        for s in sites:  # a site joining late starts from the mean weight
            self.beta.setdefault(s, float(np.mean(list(self.beta.values()))))
        params = {s: answers[s].params for s in sites}
        surrogate = weighted_average(params, {s: self.beta[s] for s in sites})
        replies = fed.send(FedUQTask.VALIDATE_SURROGATE, surrogate, sites, timeout="surrogate_timeout")
        epistemic, invalid = {}, {}
        for site, reply in replies.items():
            g = reply.meta.get(FedUQMetaKey.MEAN_EPISTEMIC)
            if isinstance(g, (int, float)) and math.isfinite(g) and g >= 0:
                epistemic[site] = float(g)
            else:
                invalid[site] = f"sent an invalid G_k {g!r}"
                fed.warn(f"round {fed.round}: site {site!r} sent an invalid G_k {g!r}")
        scored = [s for s in sites if s in epistemic]
        fed.require(FedUQTask.VALIDATE_SURROGATE, sites, scored, invalid)
        missing = sorted(set(sites) - set(scored))
        if missing:
            fed.warn(f"round {fed.round} task 'validate_surrogate': no valid answer from {missing}; continuing")
        self.beta = round_weights(
            self.beta, {s: epistemic[s] for s in scored},
            mean_aleatoric={s: meta[s][FedUQMetaKey.MEAN_ALEATORIC] for s in scored},
            mean_inv_aleatoric={s: meta[s].get(FedUQMetaKey.MEAN_INV_ALEATORIC, np.nan) for s in scored},
            config=self.config)
        fed.log("FEDEVI_BETA " + json.dumps({
            "round": fed.round, "beta": {s: round(w, 6) for s, w in self.beta.items()},
            "G": {s: round(v, 6) for s, v in epistemic.items()},
            "A": {s: round(meta[s][FedUQMetaKey.MEAN_ALEATORIC], 6) for s in sites}}))
        beta_round = {s: self.beta[s] for s in sites}
        return weighted_average(params, beta_round), normalise_weights(beta_round)


class FedEviSite(SitePart):
    """FedEvi's site part (Chen et al., MICCAI 2024; official code): evidential training and the statistics A_k, G_k.

    Local loss: the evidential Dice loss on α/S plus λ·a(r)·KL to the uniform Dirichlet (:class:`feduq.core.evidential_loss.FedEviLoss`;
    per-image Dice under DP-SGD, so the loss is a mean of per-image losses). After local training the site sends
    A_k = mean over its validation images of U_ale under θ_k and R_k = mean of 1/U_ale (the paper's form of the
    reliability term); it answers ``validate_surrogate`` with G_k = mean U_epi of the surrogate θ̂ on its validation
    images (Eq. 5-8; each image's mean over its pixels, then the mean over images, as the official code).

    Args:
        kl_weight: λ of the KL regulariser (0.01 for polyp and prostate; 1e-5 for fundus).
        annealing_step: a(r) = min(1, r / annealing_step) with 1-based round r (official code).
        dice_variant: ``"mean"`` (official code) or ``"second_moment"`` (Dirichlet E[ρ²]).
        clamp_max: upper clamp of the logits before exp (official code: 80).

    Raises:
        ValueError: an argument out of range, named ("FedEvi: ...").
    """

    def __init__(self, kl_weight: float = 0.01, annealing_step: int = 10, dice_variant: str = "mean",
                 clamp_max: float = 80.0):
        super().__init__()
        self.kl_weight, self.annealing_step, self.dice_variant, self.clamp_max = kl_weight, annealing_step, dice_variant, clamp_max
        try:
            self._loss(batch_dice=True)  # validates kl_weight, annealing_step, dice_variant, clamp_max now, not at round 0
        except (TypeError, ValueError) as e:
            raise ValueError(f"FedEvi: {e}") from None

    def _loss(self, batch_dice: bool):
        from ...core.evidential_loss import FedEviLoss

        return FedEviLoss(kl_weight=self.kl_weight, annealing_step=self.annealing_step, dice_variant=self.dice_variant,
                          clamp_max=self.clamp_max, batch_dice=batch_dice)

    def loss(self, site):
        return self._loss(batch_dice=site.dp is None)  # DP-SGD: per-image Dice, a mean of per-image losses

    def probabilities(self, logits):
        from ...core.evidential import dirichlet_from_logits

        return dirichlet_from_logits(logits, clamp_max=self.clamp_max).prob

    def uncertainty(self):
        from ...scores.maps import dirichlet_uncertainty

        return dirichlet_uncertainty("exp", self.clamp_max)

    def image_uncertainty(self, model, site) -> dict[str, np.ndarray]:
        """Per validation image, the mean aleatoric and epistemic uncertainty of ``model`` (``[N]`` float64 each)."""
        from ...scores.scoring import per_image_statistics
        from ...core.evidential import image_uncertainty_means

        return per_image_statistics(model, site.val_loader, site.device,
                                    lambda lo: image_uncertainty_means(lo, clamp_max=self.clamp_max))

    def statistics(self, site, round_index):
        u_ale = self.image_uncertainty(site.model, site)["aleatoric"]
        return {FedUQMetaKey.MEAN_ALEATORIC: float(u_ale.mean()),
                FedUQMetaKey.MEAN_INV_ALEATORIC: float((1.0 / u_ale).mean())}

    def tasks(self):
        return {FedUQTask.VALIDATE_SURROGATE: self.validate_surrogate}

    def validate_surrogate(self, site, params, round_index):
        """G_k of the surrogate ``params`` on the site's validation images; logged ``FEDEVI_SURROGATE {json}``."""
        import time

        start = time.perf_counter()
        g = float(self.image_uncertainty(site.load_eval(params), site)["epistemic"].mean())
        site.log("FEDEVI_SURROGATE " + json.dumps({"site": site.site, "round": round_index, "u_epi": g,
                                                  "seconds": round(time.perf_counter() - start, 3)}))
        return {FedUQMetaKey.MEAN_EPISTEMIC: g}, {"u_epi": g}
