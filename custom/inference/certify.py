"""A review threshold certified on a site's own labelled cases: selective risk control by Learn then Test.

A site labels k of its cases. For a threshold λ on the case-level uncertainty, the rule accepts the cases whose score
is at most λ; what the site wants is that the accepted cases' mean Dice reaches a target t. Learn then Test
(Angelopoulos, Bates, Candès, Jordan & Lei, *Learn then Test: Calibrating Predictive Algorithms to Achieve Risk
Control*, 2021) turns this into multiple testing: for each λ of a grid fixed before the data are seen, the null
hypothesis H_λ says the selective risk ``E[1 - Dice | accepted by λ] > α`` (α = 1 - t); a valid p-value of each
H_λ comes from the n(λ) accepted cases, which given n(λ) are an i.i.d. sample of the accepted distribution (LTT §5,
selective classification); the Hoeffding–Bentkus p-value of a loss in [0, 1] (LTT Prop. 3; Bates, Angelopoulos, Lei,
Malik & Jordan, *Distribution-free, risk-controlling prediction sets*, JACM 2021, eq. 13-14); and fixed-sequence
testing over the grid ordered from the most conservative λ (LTT §4) rejects H_λ while p ≤ δ and stops at the first
that is not. Every rejected λ then holds, with probability at least 1 - δ over the k cases drawn, jointly: the
accepted cases' mean Dice at that site is at least t. The rule takes the most permissive rejected λ (the highest
coverage); no rejection means the k cases cannot certify t at any coverage.

Pure functions (NumPy, SciPy), no FedUQ import: ``predict --calibrate`` and the exported bundle can share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["hb_p_value", "risk_upper_bound", "Certificate", "certify_threshold", "cases_needed"]


def _h1(a: float, b: float) -> float:
    """Bernoulli relative entropy ``a log(a/b) + (1-a) log((1-a)/(1-b))`` (0 log 0 = 0)."""
    out = 0.0
    if a > 0:
        out += a * math.log(a / b)
    if a < 1:
        out += (1 - a) * math.log((1 - a) / (1 - b))
    return out


def hb_p_value(risk_hat: float, n: int, alpha: float) -> float:
    """Hoeffding–Bentkus p-value of ``H: E[loss] > alpha`` from the mean ``risk_hat`` of ``n`` i.i.d. losses in
    [0, 1] (LTT Prop. 3): ``min(exp(-n h1(min(r, α), α)), e P(Binomial(n, α) <= ceil(n r)))``; 1 when ``n == 0``.

    Raises:
        ValueError: ``alpha`` not in (0, 1) or ``risk_hat`` not in [0, 1].
    """
    from scipy.stats import binom

    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha}")
    if not 0 <= risk_hat <= 1:
        raise ValueError(f"risk_hat must lie in [0, 1], got {risk_hat}")
    if n <= 0:
        return 1.0
    hoeffding = math.exp(-n * _h1(min(risk_hat, alpha), alpha))
    bentkus = math.e * float(binom.cdf(math.ceil(n * risk_hat - 1e-12), n, alpha))
    return min(1.0, hoeffding, bentkus)


def risk_upper_bound(losses: Sequence[float], delta: float) -> float:
    """The smallest α whose Hoeffding–Bentkus test rejects ``E[loss] > α`` at level ``delta`` (bisection to 1e-6): an
    upper confidence bound of the mean loss; 1 for no losses."""
    x = np.asarray(losses, dtype=np.float64)
    if x.size == 0:
        return 1.0
    r = float(x.mean())
    lo, hi = r, 1.0 - 1e-9
    if hb_p_value(r, x.size, hi) > delta:
        return 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if mid <= 0 or hb_p_value(r, x.size, mid) > delta:
            lo = mid
        else:
            hi = mid
    return hi


@dataclass(frozen=True)
class Certificate:
    """The certified rule of one site's k labelled cases.

    Attributes:
        threshold: accept a case when its score is at most this (None: no threshold certified).
        target / delta: the mean Dice certified, with probability at least 1 - delta.
        k: labelled cases; accepted: those the threshold accepts; coverage: accepted / k.
        accepted_dice: their empirical mean Dice; lower_bound: a (1 - delta) lower confidence bound of it (1 - the
            Hoeffding–Bentkus upper bound of the risk, :func:`risk_upper_bound`).
        best_target: the highest target these cases certify at some coverage: the lower bound at the first threshold
            tested (every later one is tested only after it is rejected).
    """

    threshold: float | None
    target: float
    delta: float
    k: int
    accepted: int
    coverage: float
    accepted_dice: float
    lower_bound: float
    best_target: float


def certify_threshold(scores: Sequence[float], dice: Sequence[float], target: float, delta: float = 0.1,
                      grid: Sequence[float] | None = None, start: float | None = None) -> Certificate:
    """Learn then Test on k labelled cases (see the module docstring).

    Args:
        scores: each case's review score (higher = less certain), ``[k]``.
        dice: each case's Dice in [0, 1], ``[k]``.
        target: the mean Dice the accepted cases must reach, in (0, 1).
        delta: the error level, in (0, 1).
        grid: the thresholds tested, fixed before the data (e.g. evenly spaced over the score's range, 0 to ln C
            nats); tested from the smallest (most conservative) up. Default: 200 evenly spaced in [0, max score]
            (a convenience for tests: a grid from the data weakens the guarantee).
        start: the first threshold tested (the grid's values below it are not): the fixed sequence must start where
            the accepted cases are many enough to reject (a threshold accepting one case never certifies a target
            above 1 - delta), and be chosen without these cases, e.g. the threshold the training sites chose.

    Raises:
        ValueError: mismatched lengths, no cases, a Dice outside [0, 1], target or delta outside (0, 1).
    """
    s, d = np.asarray(scores, np.float64), np.asarray(dice, np.float64)
    if s.shape != d.shape or s.ndim != 1 or s.size == 0:
        raise ValueError(f"scores and dice must be two equal-length non-empty lists, got {s.shape} and {d.shape}")
    if not (np.all(d >= 0) and np.all(d <= 1)):
        raise ValueError("dice values must lie in [0, 1]")
    if not 0 < target < 1 or not 0 < delta < 1:
        raise ValueError(f"target and delta must lie in (0, 1), got {target} and {delta}")
    lambdas = np.sort(np.asarray(grid if grid is not None else np.linspace(0.0, float(s.max()), 200), np.float64))
    if start is not None:
        lambdas = lambdas[lambdas >= start]
    alpha, chosen, first_bound = 1.0 - target, None, None
    for lam in lambdas:
        accepted = s <= lam
        n = int(accepted.sum())
        loss = 1.0 - d[accepted]
        if first_bound is None:
            first_bound = 1.0 - risk_upper_bound(loss, delta)
        if n == 0 or hb_p_value(float(loss.mean()), n, alpha) > delta:
            break  # fixed sequence: the first hypothesis not rejected ends the testing
        chosen = float(lam)
    best = float(first_bound) if first_bound is not None else 0.0
    if chosen is None:
        return Certificate(None, target, delta, int(s.size), 0, 0.0, float("nan"), float("nan"), best)
    accepted = s <= chosen
    loss = 1.0 - d[accepted]
    return Certificate(chosen, target, delta, int(s.size), int(accepted.sum()), float(accepted.mean()),
                       float(d[accepted].mean()), 1.0 - risk_upper_bound(loss, delta), best)


def cases_needed(target: float, delta: float, mean_dice: float) -> int | None:
    """Roughly how many accepted cases with mean Dice ``mean_dice`` certify ``target`` at level ``delta``: the smallest
    n whose Hoeffding–Bentkus p-value at the empirical risk 1 - mean_dice is at most delta (None when mean_dice <=
    target: no number of such cases does)."""
    if mean_dice <= target:
        return None
    n = 1
    while hb_p_value(1.0 - mean_dice, n, 1.0 - target) > delta:
        n *= 2
        if n > 1 << 20:
            return None
    lo, hi = n // 2, n
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if hb_p_value(1.0 - mean_dice, mid, 1.0 - target) <= delta else (mid, hi)
    return hi
