"""A review threshold certified on a site's own labelled cases: selective risk control by Learn then Test.

A site labels k of its cases. For a threshold λ on the case-level uncertainty, the rule accepts the cases whose score
is at most λ; what the site wants is that the accepted cases' mean Dice reaches a target t. Learn then Test
(Angelopoulos, Bates, Candès, Jordan & Lei, *Learn then Test: Calibrating Predictive Algorithms to Achieve Risk
Control*, 2021) turns this into multiple testing: for each λ of a grid fixed before the data are seen, the null
hypothesis H_λ says the selective risk ``E[1 - Dice | accepted by λ] > α`` (α = 1 - t); a valid p-value of each
H_λ comes from the n(λ) accepted cases, which given n(λ) are an i.i.d. sample of the accepted distribution (LTT §5,
selective classification): the Waudby-Smith–Ramdas betting p-value of a loss in [0, 1] (what ``predict`` uses:
much tighter than Hoeffding–Bentkus when the accepted cases' Dice varies little: 40 cases of mean Dice 0.91 and
standard deviation 0.06 certify 0.8 at level 0.033, where Hoeffding–Bentkus needs 74 such cases) or the
Hoeffding–Bentkus one (LTT Prop. 3; Bates, Angelopoulos, Lei, Malik & Jordan, *Distribution-free, risk-controlling
prediction sets*, JACM 2021, eq. 13-14); and fixed-sequence testing over the grid ordered from the conservative
thresholds up (LTT §4) rejects H_λ while p ≤ δ and stops at the first that is not. Every rejected λ then holds, with
probability at least 1 - δ over the k cases drawn, jointly: the accepted cases' mean Dice at that site is at least t.
The rule takes the most permissive rejected λ (the highest coverage); no rejection means the k cases cannot certify
t at any coverage. :func:`certify_scores` runs one such sequence per case score and per start of :data:`STARTS`
(Bonferroni over them), as ``predict --calibrate`` does.

Pure functions (NumPy, SciPy), no FedUQ import: ``predict --calibrate`` and the exported bundle can share them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["hb_p_value", "wsr_p_value", "p_value", "Certificate", "certify_threshold",
           "cases_needed", "GRID", "STARTS", "min_cases", "certify_scores", "family_level", "best_certifiable_target",
           "cases_for_target"]

#: the thresholds tested, fixed before any data: 400 points evenly spaced in log scale from 1e-5 to 10 (3.5 % apart),
#: covering a case score's range in any unit FedUQ uses (nats of entropy, at most ln C; vacuity C/S, at most 1)
GRID = np.geomspace(1e-5, 10.0, 400)
#: each score is tested by one fixed sequence per start: from the first threshold accepting this fraction of the cases
#: (or :func:`min_cases`, if more) upwards. One start is weak either way: early, its first threshold accepts few cases
#: and cannot reject (the betting capital grows by at most 1 + ν (α - loss) per case), which ends the sequence before
#: the thresholds that can; late, it never tests the selective thresholds. Full coverage is among them (the plain
#: mean of all cases). Bonferroni over starts × scores.
STARTS = (0.25, 0.5, 1.0)


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


def wsr_p_value(losses: Sequence[float], alpha: float, delta: float) -> float:
    """Waudby-Smith–Ramdas betting p-value of ``H: E[loss] >= alpha`` from i.i.d. losses in [0, 1] taken in their
    given order (Waudby-Smith & Ramdas, *Estimating means of bounded random variables by betting*, JRSS-B 2024, the
    predictable plug-in bets; as LTT and Bates et al. 2021, Prop. 5 and its appendix, use it): the capital
    ``K_i = prod_{j<=i} (1 - nu_j (L_j - alpha))`` with ``nu_j = min(1, sqrt(2 log(1/delta) / (n s2_{j-1})))``,
    ``s2_j = (1/4 + sum_{m<=j} (L_m - mu_m)^2) / (j + 1)``, ``mu_j = (1/2 + sum_{m<=j} L_m) / (j + 1)``; under H it is a
    non-negative supermartingale, so ``1 / max_i K_i`` is a valid p-value (Ville's inequality); 1 for no losses.
    Much tighter than Hoeffding–Bentkus when the losses vary little; ``delta`` only tunes the bets.

    Raises:
        ValueError: ``alpha`` or ``delta`` not in (0, 1), or a loss outside [0, 1].
    """
    x = np.asarray(losses, dtype=np.float64).reshape(-1)
    if not 0 < alpha < 1 or not 0 < delta < 1:
        raise ValueError(f"alpha and delta must lie in (0, 1), got {alpha} and {delta}")
    if x.size and not (np.all(x >= 0) and np.all(x <= 1)):
        raise ValueError("losses must lie in [0, 1]")
    n = x.size
    if n == 0:
        return 1.0
    i = np.arange(1, n + 1)
    mu = (0.5 + np.cumsum(x)) / (i + 1)
    s2 = (0.25 + np.cumsum((x - mu) ** 2)) / (i + 1)
    s2_before = np.r_[0.25, s2[:-1]]
    nu = np.minimum(1.0, np.sqrt(2 * math.log(1 / delta) / (n * s2_before)))
    log_k = np.cumsum(np.log1p(-nu * (x - alpha)))  # 1 - nu (L - alpha) >= alpha > 0
    return float(min(1.0, math.exp(-float(log_k.max()))))


def p_value(losses: Sequence[float], alpha: float, delta: float, kind: str = "wsr") -> float:
    """The p-value of ``H: E[loss] > alpha`` that certification uses: ``"wsr"`` (:func:`wsr_p_value`, the default)
    or ``"hb"`` (:func:`hb_p_value`).

    Raises:
        ValueError: an unknown ``kind``.
    """
    x = np.asarray(losses, dtype=np.float64).reshape(-1)
    if kind == "hb":
        return hb_p_value(float(x.mean()) if x.size else 0.0, int(x.size), alpha)
    if kind == "wsr":
        return wsr_p_value(x, alpha, delta)
    raise ValueError(f"p-value kind {kind!r}: expected 'wsr' or 'hb'")


@dataclass(frozen=True)
class Certificate:
    """The certified rule of one site's k labelled cases.

    Attributes:
        threshold: accept a case when its score is at most this (None: no threshold certified).
        target / delta: the mean Dice certified, with probability at least 1 - delta.
        k: labelled cases; accepted: those the threshold accepts; coverage: accepted / k.
        accepted_dice: their empirical mean Dice (an estimate; the certified figure is ``target``).
    """

    threshold: float | None
    target: float
    delta: float
    k: int
    accepted: int
    coverage: float
    accepted_dice: float


def certify_threshold(scores: Sequence[float], dice: Sequence[float], target: float, delta: float = 0.1,
                      grid: Sequence[float] | None = None, min_accepted: int | None = None,
                      kind: str = "hb") -> Certificate:
    """Learn then Test on k labelled cases (see the module docstring).

    Args:
        scores: each case's review score (higher = less certain), ``[k]``.
        dice: each case's Dice in [0, 1], ``[k]``.
        target: the mean Dice the accepted cases must reach, in (0, 1).
        delta: the error level, in (0, 1).
        grid: the thresholds tested, fixed before the data (e.g. evenly spaced over the score's range, 0 to ln C
            nats); tested from the smallest (most conservative) up. Default: 200 evenly spaced in [0, max score]
            (a convenience for tests: a grid from the data weakens the guarantee).
        min_accepted: start at the first threshold of the grid accepting at least this many cases (e.g.
            :func:`min_cases`: fewer could not certify the target even with Dice 1). This start depends on the cases'
            scores (not their Dice); the guarantee then assumes what a review score is for: a case's expected Dice
            does not rise with its score (the start's accepted cases lean towards its upper end, so under that
            assumption their mean Dice is, if anything, below the selective mean the p-value is about).
            Infinite scores (cases another part of the rule flags) are never accepted.
        kind: the p-value (:func:`p_value`); the accepted cases are taken in their given order.

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
    if kind == "wsr":  # the betting p-value takes the cases in sequence: an order fixed before the data, not theirs
        order = np.random.default_rng(0).permutation(s.size)
        s, d = s[order], d[order]
    finite = s[np.isfinite(s)]
    lambdas = np.sort(np.asarray(grid if grid is not None else np.linspace(0.0, float(finite.max(initial=0.0)), 200),
                                 np.float64))
    if min_accepted is not None:
        counts = np.searchsorted(np.sort(s), lambdas, side="right")
        lambdas = lambdas[counts >= min_accepted]
    alpha, chosen = 1.0 - target, None
    for lam in lambdas:
        accepted = s <= lam
        if not accepted.any() or p_value(1.0 - d[accepted], alpha, delta, kind) > delta:
            break  # fixed sequence: the first hypothesis not rejected ends the testing
        chosen = float(lam)
    if chosen is None:
        return Certificate(None, target, delta, int(s.size), 0, 0.0, float("nan"))
    accepted = s <= chosen
    return Certificate(chosen, target, delta, int(s.size), int(accepted.sum()), float(accepted.mean()),
                       float(d[accepted].mean()))


def cases_needed(target: float, delta: float, mean_dice: float, kind: str = "hb") -> int | None:
    """Roughly how many accepted cases with mean Dice ``mean_dice`` certify ``target`` at level ``delta``: the smallest
    n whose p-value (:func:`p_value`; n equal losses 1 - mean_dice) is at most delta (None when mean_dice <= target:
    no number of such cases does)."""
    if mean_dice <= target:
        return None

    def p(m):
        return p_value(np.full(m, 1.0 - mean_dice), 1.0 - target, delta, kind)

    n = 1
    while p(n) > delta:
        n *= 2
        if n > 1 << 20:
            return None
    lo, hi = n // 2, n
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if p(mid) <= delta else (mid, hi)
    return hi


def min_cases(target: float, delta: float, kind: str = "hb") -> int:
    """The fewest accepted cases that can certify ``target`` at level ``delta`` at all: n cases of Dice 1 have the
    Hoeffding–Bentkus p-value ``target^n`` (risk 0 against α = 1 - target), so n is the smallest with
    ``target^n <= delta`` (11 for target 0.8 at δ = 0.1); for ``kind="wsr"`` the smallest n whose capital on n
    losses 0 reaches 1 / delta."""
    n = cases_needed(target, delta, 1.0, kind)
    assert n is not None
    return n


def certify_scores(scores: dict, dice: Sequence[float], target: float, delta: float = 0.1,
                   grid: Sequence[float] = GRID, kind: str = "wsr") -> tuple[str | None, Certificate, dict]:
    """Learn then Test over several case scores and starts at once: for each score and each start of :data:`STARTS`
    a fixed sequence at level ``delta / (m s)`` (m scores, s starts; Bonferroni, so whichever is chosen holds at
    ``delta`` jointly), starting at the first grid threshold accepting that fraction of the cases with a finite score
    (or :func:`min_cases` at that level, if more); the certified threshold of the highest coverage wins (ties: the
    first score given, the earlier start).

    Args:
        scores: score name -> ``[k]`` float (``inf``: a case the rule flags whatever the threshold).
        dice: ``[k]`` Dice in [0, 1].

    Returns:
        ``(name, its Certificate, {name: its best Certificate})``; ``(None, None, ...)`` when nothing certifies
        ``target``.
    """
    level = delta / (len(scores) * len(STARTS))
    floor = min_cases(target, level, kind)
    certs = {}
    for name, v in scores.items():
        v = np.asarray(v, np.float64)
        finite = int(np.isfinite(v).sum())
        tried = [certify_threshold(v, dice, target, level, grid=grid, kind=kind,
                                   min_accepted=max(floor, math.ceil(f * finite))) for f in STARTS]
        done = [c for c in tried if c.threshold is not None]
        certs[name] = max(done, key=lambda c: c.coverage) if done else tried[0]
    done = [n for n, c in certs.items() if c.threshold is not None]
    if done:
        name = max(done, key=lambda n: (certs[n].coverage, -list(certs).index(n)))
        return name, certs[name], certs
    return None, None, certs


def family_level(delta: float, n_scores: int) -> float:
    """The level each fixed sequence of :func:`certify_scores` runs at: ``delta / (scores × starts)``."""
    return delta / (n_scores * len(STARTS))


def best_certifiable_target(scores: dict, dice: Sequence[float], delta: float = 0.1,
                            grid: Sequence[float] = GRID, kind: str = "wsr") -> float:
    """The highest target (to 0.001) that :func:`certify_scores` certifies on these cases at some coverage; 0 when
    none (bisection over the target; near the answer a lower start may make the search's step coarse, hence "about"
    in what ``predict`` prints)."""
    lo, hi = 0.0, 1.0
    for _ in range(12):
        mid = (lo + hi) / 2
        if mid > 0 and certify_scores(scores, dice, mid, delta, grid, kind)[0] is not None:
            lo = mid
        else:
            hi = mid
    return round(lo - 5e-4, 3) if lo > 0 else 0.0


def cases_for_target(scores: dict, dice: Sequence[float], target: float, delta: float = 0.1,
                     grid: Sequence[float] = GRID, kind: str = "wsr", most: int = 10_000) -> int | None:
    """About how many labelled cases like these would certify ``target``: the smallest multiple of these cases (each
    repeated m times, the same procedure as :func:`certify_scores`, its starts and Bonferroni included) that
    certifies, times k; None when even ``most`` cases would not (their best accepted set does not reach the target,
    or only barely). A rough figure for a message: repeated cases vary less than new ones would."""
    k = len(np.asarray(dice))

    def certified(m: int) -> bool:
        return certify_scores({n: np.tile(np.asarray(v, np.float64), m) for n, v in scores.items()},
                              np.tile(np.asarray(dice, np.float64), m), target, delta, grid, kind)[0] is not None

    hi = 2
    while not certified(hi):
        if hi * k > most:
            return None
        hi *= 2
    lo = hi // 2  # not certified at lo (or lo = 1: the cases themselves, which did not certify)
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if certified(mid) else (mid, hi)
    return hi * k
