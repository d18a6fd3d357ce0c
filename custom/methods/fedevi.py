"""FedEvi's server side: the aggregation-weight math (paper Eq. 6-8, official code) and :class:`FedEviServer`.

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
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ..core.aggregation import normalise_weights, weighted_average
from ..common.wire import FedUQMetaKey, FedUQTask
from ..parts.server import ServerPart, num_samples
from ..parts.site import SitePart

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

from ..common.checks import non_negative as _check_non_negative
from ..common.checks import positive as _check_positive
from ..common.checks import same_length as _check_same_length
from ..common.checks import scalar as _scalar
from ..common.checks import vector as _as_vector

INITIAL_MODES = ("samples", "uniform")
RELIABILITY_MODES = ("code", "paper")


def initial_weights(num_samples: Sequence[float], mode: str = "samples") -> np.ndarray:
    """Initial aggregation weights ``beta^0`` (paper §2.3 and Tab. 5; official code uses "samples").

    * ``"samples"`` ("#Sample-Aware", paper default and official code): ``beta_k = N_k / sum_j N_j``;
    * ``"uniform"`` ("#Client-Aware", paper ablation): ``beta_k = 1 / K``.

    Args:
        num_samples: K training-set sizes ``N_k`` (finite, >= 0, not all 0); validated in both modes.
        mode: ``"samples"`` or ``"uniform"``.

    Returns:
        ``np.ndarray`` float64 ``[K]`` summing to 1.

    Raises:
        ValueError: unknown ``mode``; ``num_samples`` empty, not 1-D, non-finite, negative (names
            the index and value) or all zero.
    """
    if mode not in INITIAL_MODES:
        raise ValueError(f"mode must be one of {INITIAL_MODES}, got {mode!r}")
    counts = _as_vector(num_samples, "num_samples")
    _check_non_negative(counts, "num_samples")
    total = counts.sum()
    if total <= 0:
        raise ValueError(f"num_samples must not be all zero, got {counts.tolist()}")
    if mode == "uniform":
        return np.full(counts.shape, 1.0 / counts.size)
    return counts / total


def client_scores(
    epistemic: Sequence[float],
    mean_aleatoric: Sequence[float] | None = None,
    mean_inv_aleatoric: Sequence[float] | None = None,
    delta: float = 1.0,
    reliability: str = "code",
    negative_tolerance: float = 1e-6,
) -> np.ndarray:
    """Per-client weight increments ``x_k`` (paper Eq. 6-8 / official code).

    * ``reliability="code"`` (default, official code): ``x_k = delta * G_k / A_k`` with
      ``A_k`` = mean over val images of U_ale (ratio of means);
    * ``reliability="paper"`` (paper Eq. 7-8): ``x_k = delta * G_k * R_k`` with
      ``R_k`` = mean over val images of 1/U_ale. By Jensen ``R_k >= 1/A_k``, so the two differ.

    ``G_k`` (Eq. 6) is the mean over client k's val images of U_epi under the surrogate model. Being
    a mutual information it is >= 0; values in ``[-negative_tolerance, 0)`` (floating-point rounding
    of ``total - aleatoric``) are set to 0, more negative values are an error.

    Args:
        epistemic: ``G_k``, length K.
        mean_aleatoric: ``A_k``, length K, each > 0; required for ``reliability="code"``.
        mean_inv_aleatoric: ``R_k``, length K, each > 0; required for ``reliability="paper"``.
        delta: adjustment magnitude (paper: 1.0 for all datasets); finite, >= 0.
        reliability: ``"code"`` or ``"paper"``.
        negative_tolerance: see above; >= 0.

    Returns:
        ``np.ndarray`` float64 ``[K]``, all >= 0.

    Raises:
        ValueError: unknown ``reliability``; the statistic it needs missing; lengths differ;
            non-finite entries; ``A_k``/``R_k`` <= 0; ``G_k < -negative_tolerance``; bad ``delta``.
            Messages name the parameter and the offending index/value.
    """
    if reliability not in RELIABILITY_MODES:
        raise ValueError(f"reliability must be one of {RELIABILITY_MODES}, got {reliability!r}")
    delta = _scalar(delta, "delta", minimum=0.0)
    tol = _scalar(negative_tolerance, "negative_tolerance", minimum=0.0)
    g = _as_vector(epistemic, "epistemic")
    bad = np.flatnonzero(g < -tol)
    if bad.size:
        raise ValueError(f"epistemic[{bad[0]}] must be >= 0 (mutual information), got {float(g[bad[0]])!r}")
    g = np.maximum(g, 0.0)
    if reliability == "code":
        if mean_aleatoric is None:
            raise ValueError('mean_aleatoric (A_k) is required for reliability="code"')
        a = _as_vector(mean_aleatoric, "mean_aleatoric")
        _check_same_length(g, "epistemic", a, "mean_aleatoric")
        _check_positive(a, "mean_aleatoric")
        return delta * g / a
    if mean_inv_aleatoric is None:
        raise ValueError('mean_inv_aleatoric (R_k) is required for reliability="paper"')
    r = _as_vector(mean_inv_aleatoric, "mean_inv_aleatoric")
    _check_same_length(g, "epistemic", r, "mean_inv_aleatoric")
    _check_positive(r, "mean_inv_aleatoric")
    return delta * g * r


def update_weights(
    beta_prev: Sequence[float],
    scores: Sequence[float],
    clip_min: float = 1e-3,
    renormalize_after_clip: bool = False,
) -> np.ndarray:
    """One FedEvi weight update (paper Eq. 8 + normalisation; clip is an official-code addition).

    ``beta = (beta_prev + x) / sum(beta_prev + x)``, then ``beta = max(beta, clip_min)``.
    The official code does **not** renormalise after the clip (default), so the result can sum to
    slightly more than 1 when a weight was clipped; ``renormalize_after_clip=True`` divides by the
    sum again (a renormalised weight can then end slightly below ``clip_min``).

    Args:
        beta_prev: previous weights ``beta^{r-1}``, length K, finite, >= 0 (need not sum to 1).
        scores: increments ``x_k`` from :func:`client_scores`, length K, finite, >= 0.
        clip_min: lower clip, finite, ``0 <= clip_min < 1`` (official code: 1e-3; 0 disables).
        renormalize_after_clip: see above (official code: False).

    Returns:
        ``np.ndarray`` float64 ``[K]``.

    Raises:
        ValueError: lengths differ; empty; non-finite or negative entries (names the parameter,
            index and value); ``sum(beta_prev + scores) == 0``; bad ``clip_min``.
    """
    beta = _as_vector(beta_prev, "beta_prev")
    x = _as_vector(scores, "scores")
    _check_same_length(beta, "beta_prev", x, "scores")
    _check_non_negative(beta, "beta_prev")
    _check_non_negative(x, "scores")
    clip = _scalar(clip_min, "clip_min", minimum=0.0, below=1.0)
    raw = beta + x
    total = raw.sum()
    if total <= 0:
        raise ValueError(f"sum of beta_prev + scores must be > 0, got beta_prev={beta.tolist()}, scores={x.tolist()}")
    new = np.maximum(raw / total, clip)
    if renormalize_after_clip:
        new = new / new.sum()
    return new


@dataclass
class FedEviConfig:
    """Server-side FedEvi switches. Defaults reproduce the official code (polyp run).

    Attributes:
        delta: adjustment magnitude delta of Eq. 8 (paper and code: 1.0); finite, >= 0.
        reliability: ``"code"`` (default): ``x_k = delta * G_k / mean(U_ale)`` (ratio of means,
            official code); ``"paper"``: ``x_k = delta * G_k * mean(1/U_ale)`` (paper Eq. 7-8).
        clip_min: lower clip of the normalised weights (official code: 1e-3; not in the paper;
            0 disables); ``0 <= clip_min < 1``.
        renormalize_after_clip: False (default, official code): weights may sum to > 1 after the
            clip; True: divide by the sum again after clipping.
        initial: ``beta^0``: ``"samples"`` (default; paper "#Sample-Aware" and code, N_k / sum N)
            or ``"uniform"`` (paper ablation "#Client-Aware", 1/K).
    """

    delta: float = 1.0
    reliability: str = "code"
    clip_min: float = 1e-3
    renormalize_after_clip: bool = False
    initial: str = "samples"

    def validate(self) -> "FedEviConfig":
        """Raise ValueError naming the first invalid field; return ``self`` when valid."""
        _scalar(self.delta, "delta", minimum=0.0)
        if self.reliability not in RELIABILITY_MODES:
            raise ValueError(f"reliability must be one of {RELIABILITY_MODES}, got {self.reliability!r}")
        _scalar(self.clip_min, "clip_min", minimum=0.0, below=1.0)
        if not isinstance(self.renormalize_after_clip, (bool, np.bool_)):
            raise ValueError(f"renormalize_after_clip must be a bool, got {self.renormalize_after_clip!r}")
        if self.initial not in INITIAL_MODES:
            raise ValueError(f"initial must be one of {INITIAL_MODES}, got {self.initial!r}")
        return self


def fedevi_update(
    beta_prev: Sequence[float],
    epistemic: Sequence[float],
    mean_aleatoric: Sequence[float] | None = None,
    mean_inv_aleatoric: Sequence[float] | None = None,
    config: FedEviConfig | None = None,
) -> np.ndarray:
    """:func:`client_scores` then :func:`update_weights` with the switches of ``config``.

    Args:
        beta_prev: ``beta^{r-1}``, length K.
        epistemic: ``G_k``, length K.
        mean_aleatoric: ``A_k`` (needed when ``config.reliability == "code"``).
        mean_inv_aleatoric: ``R_k`` (needed when ``config.reliability == "paper"``).
        config: :class:`FedEviConfig` (validated); None uses the defaults.

    Returns:
        ``beta^r`` as ``np.ndarray`` float64 ``[K]``.

    Raises:
        ValueError: as :meth:`FedEviConfig.validate`, :func:`client_scores`, :func:`update_weights`.
    """
    cfg = (config or FedEviConfig()).validate()
    x = client_scores(
        epistemic,
        mean_aleatoric=mean_aleatoric,
        mean_inv_aleatoric=mean_inv_aleatoric,
        delta=cfg.delta,
        reliability=cfg.reliability,
    )
    return update_weights(beta_prev, x, clip_min=cfg.clip_min, renormalize_after_clip=cfg.renormalize_after_clip)


def round_weights(
    beta: Mapping[str, float],
    epistemic: Mapping[str, float],
    mean_aleatoric: Mapping[str, float] | None = None,
    mean_inv_aleatoric: Mapping[str, float] | None = None,
    config: FedEviConfig | None = None,
) -> dict[str, float]:
    """One round's weights by site name, with the sites that were scored this round (the keys of ``epistemic``).

    Every site of ``beta`` scored: exactly :func:`fedevi_update` (Eq. 8, official code). Some sites not scored (they
    failed or timed out this round): the scored sites share the mass they held before, updated by Eq. 8 among
    themselves, and every other site keeps its weight, so one round's absence neither rewards nor erases a site
    (a FedUQ rule for partial participation; the paper assumes every site answers).

    Args:
        beta: ``beta^{r-1}`` by site, every scored site included.
        epistemic: ``G_k`` of the scored sites.
        mean_aleatoric, mean_inv_aleatoric: ``A_k`` / ``R_k`` by site, as the reliability mode needs.
        config: :class:`FedEviConfig`; None uses the defaults.

    Returns:
        ``beta^r`` by site (every site of ``beta``), float.

    Raises:
        ValueError: a scored site missing from ``beta`` or from the statistic the mode needs; as :func:`fedevi_update`.
    """
    scored = list(epistemic)
    missing = [s for s in scored if s not in beta]
    if missing:
        raise ValueError(f"scored site(s) {missing} have no previous weight in beta (sites: {sorted(beta)})")

    def column(stat: Mapping[str, float] | None, name: str):
        if stat is None:
            return None
        absent = [s for s in scored if s not in stat]
        if absent:
            raise ValueError(f"{name} lacks the scored site(s) {absent}")
        return [stat[s] for s in scored]

    updated = fedevi_update([beta[s] for s in scored], [epistemic[s] for s in scored],
                            mean_aleatoric=column(mean_aleatoric, "mean_aleatoric"),
                            mean_inv_aleatoric=column(mean_inv_aleatoric, "mean_inv_aleatoric"), config=config)
    mass = 1.0 if set(scored) == set(beta) else sum(beta[s] for s in scored)
    return {**{s: float(w) for s, w in beta.items()}, **{s: float(w) * mass for s, w in zip(scored, updated)}}


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
        from ..core.evidential_loss import FedEviLoss

        return FedEviLoss(kl_weight=self.kl_weight, annealing_step=self.annealing_step, dice_variant=self.dice_variant,
                          clamp_max=self.clamp_max, batch_dice=batch_dice)

    def loss(self, site):
        return self._loss(batch_dice=site.dp is None)  # DP-SGD: per-image Dice, a mean of per-image losses

    def probabilities(self, logits):
        from ..core.evidential import dirichlet_from_logits

        return dirichlet_from_logits(logits, clamp_max=self.clamp_max).prob

    def uncertainty(self):
        from ..core.maps import dirichlet_uncertainty

        return dirichlet_uncertainty("exp", self.clamp_max)

    def image_uncertainty(self, model, site) -> dict[str, np.ndarray]:
        """Per validation image, the mean aleatoric and epistemic uncertainty of ``model`` (``[N]`` float64 each)."""
        from ..core.engine import per_image_statistics
        from ..core.evidential import image_uncertainty_means

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
