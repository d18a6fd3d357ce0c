"""FedEvi's aggregation-weight math, FLARE-free (paper Eq. 6-8 and the official code's variant).

Per round r (FedEvi paper Algorithm 1, official code ``main_seg_al.py``): clients report ``G_k`` (mean over validation
images of U_epi under the surrogate, Eq. 6) and their reliability statistic (``A_k`` = mean U_ale, official code, or
``R_k`` = mean 1/U_ale, Eq. 7); :func:`client_scores` gives ``x_k`` and :func:`update_weights` gives ``beta^r``
(Eq. 8 + the code's clip). :class:`FedEviConfig` collects the paper-vs-code switches; :func:`fedevi_update` runs
them. All arrays are 1-D ``float64`` of length K (number of clients), in a fixed client order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ...common.checks import non_negative as _check_non_negative
from ...common.checks import positive as _check_positive
from ...common.checks import same_length as _check_same_length
from ...common.checks import scalar as _scalar
from ...common.checks import vector as _as_vector
from ...core.aggregation import normalise_weights

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
