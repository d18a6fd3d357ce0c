"""A review threshold certified on a site's own labelled patients: selective risk control by Learn then Test, with the
patient (a volume, a video, a case) as the unit.

**What is promised.** A site labels k images from n independent units (patients, volumes, videos; a unit may hold
one image). For a threshold λ on a case score s (higher = less certain) the rule accepts an image when ``s <= λ``.
With L = 1 - Dice, the image-weighted accepted risk over whole new units is
``R(λ) = E[Σ_j L_j 1{s_j <= λ}] / E[Σ_j 1{s_j <= λ}]`` (sums over one unit's images, expectations over the site's
units): the mean Dice of the accepted images is ``1 - R(λ)``. The certificate says: with probability at least
1 - δ over the n units drawn, ``1 - R(λ̂) >= t`` for the threshold λ̂ it returns (α = 1 - t).

**One value per unit.** Frames of one video or slices of one patient are not independent, so a p-value that counts
images as independent is wrong (a simulation with an intra-patient correlation of 0.33 certified a threshold that
misses the target in up to 17 % of the labelled sets at δ = 10 %). Here each unit p gives one number

    Y_p(λ) = α + Σ_{j∈p} (L_j - α) 1{s_j <= λ} / M,

with M (:data:`MAX_UNIT_IMAGES`, or the caller's, fixed before the data; a larger unit is refused) a bound on a
unit's image count. Then ``Y_p ∈ [0, 1]`` (the sum lies in [-α m, (1 - α) m], m <= M), the Y_p of the n units are
i.i.d., and ``E[Y] - α = (E[Σ L 1acc] - α E[Σ 1acc]) / M``, so ``E[Y] >= α`` exactly when ``R(λ) >= α``, for any
mix of unit sizes. The null ``H_λ: R(λ) > α`` is therefore ``E[Y] > α`` for a variable in [0, 1], which the
Waudby-Smith–Ramdas betting p-value (:func:`wsr_p_value`; Waudby-Smith & Ramdas, JRSS-B 2024) or the
Hoeffding–Bentkus one (:func:`hb_p_value`; Bates et al., JACM 2021, eq. 13-14) tests on the n values. A unit of one
image with M = 1 gives ``Y = α + (L - α) 1acc``: the image-level test of before, its non-accepted images neutral.

**Which thresholds are tested (Learn then Test).** Angelopoulos, Bates, Candès, Jordan & Lei (*Learn then Test*,
2021, §4) control the family-wise error over the grid :data:`GRID` (fixed before the data) by fixed-sequence
testing: the hypotheses are tested in an order fixed before the test data, each at level δ, until the first that
is not rejected; every rejected λ then holds jointly with probability >= 1 - δ (the first true null in the order
must be rejected for any error, which happens with probability <= δ). The order matters: starting where no unit is
accepted rejects nothing. The order is *learned* on a part of the units (LTT §4, "learning the order on a split"):
the units are split by a seeded permutation of their sorted names (:func:`split_units`, data-free) into a learn
fold (:data:`LEARN_FRACTION`) and a test fold. On the learn fold each (score, λ) gets the final log-capital of the
betting test (larger: more evidence that λ holds); the best pair gives the score and the start λ₀; the test fold
then tests the chosen score's λ from λ₀ upwards at level δ, and the most permissive rejected λ is the rule. Given
the learn fold, the order is fixed, the test fold's units are independent of it, and the fixed-sequence argument
applies unchanged: the start and the score cost no Bonferroni correction, only the learn fold's units (which give no
evidence to the test). This replaces the earlier data-driven starts (three per score, chosen on the same cases'
scores, Bonferroni over starts and scores), whose validity rested on an assumption (a case's expected Dice does not
rise with its score); data-free starts at fixed grid points would mostly fall below or above a model's narrow band
of scores (0.056-0.072 nats at a held-out prostate site).

The units' order within the test fold is a seeded permutation too (the betting p-value reads its values in order).

Pure functions (NumPy, SciPy), no FedUQ import: ``predict --calibrate``, the exported bundle and the benchmark share
them.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["hb_p_value", "wsr_p_value", "wsr_p_values", "p_value", "GRID", "MAX_UNIT_IMAGES", "LEARN_FRACTION",
           "MIN_UNITS_HINT", "POWER", "BET_CAP", "UnitCertificate", "unit_codes", "unit_excess", "split_units",
           "compress_excess", "certify_excess", "certify_units", "units_needed", "best_certifiable_target", "min_units",
           "accepted_sums", "highest_target"]

#: the thresholds tested, fixed before any data: 400 points evenly spaced in log scale from 1e-5 to 10 (3.5 % apart),
#: covering a case score's range in any unit FedUQ uses (nats of entropy, at most ln C; vacuity C/S, at most 1)
GRID = np.geomspace(1e-5, 10.0, 400)
#: default bound M on a unit's labelled images when units group several (fixed before the data; a larger unit is
#: refused, naming it; ``predict --max-unit-images`` sets it). Units of one image (``--units images``, a volume task's
#: volumes) use M = 1.
MAX_UNIT_IMAGES = 32
#: the share of the units (at least one) on which the score and the start of the fixed sequence are learned
LEARN_FRACTION = 0.25
#: the bets' cap c: ``nu <= c / (1 - α)``, so one unit at the worst possible value (Y = 1) keeps a share 1 - c of the
#: capital (any c < 1 keeps the capital a non-negative supermartingale under the null; Waudby-Smith & Ramdas truncate
#: their bets the same way). With units, whose values vary little around α, the cap decides the power: on 60
#: simulated patients of 20 images (tests/unit/review/test_certify.py) a cap of 1 (Bates et al.'s) certified 29 % of 1,000 sets
#: where 0.9 / (1 - α) certifies 86 %.
BET_CAP = 0.9
#: the units-needed hint never says fewer than this many units
MIN_UNITS_HINT = 5
#: the units-needed hint: the number of units at which at least this share of bootstrap sets certify
POWER = 0.8


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


def _log_capital(x: np.ndarray, alpha: float, delta: float) -> np.ndarray:
    """The betting log-capital path ``[..., n]`` of values ``x [..., n]`` in [0, 1] (:func:`wsr_p_value`'s bets),
    along the last axis."""
    n = x.shape[-1]
    i = np.arange(1, n + 1)
    mu = (0.5 + np.cumsum(x, axis=-1)) / (i + 1)
    s2 = (0.25 + np.cumsum((x - mu) ** 2, axis=-1)) / (i + 1)
    s2_before = np.concatenate([np.full(x.shape[:-1] + (1,), 0.25), s2[..., :-1]], axis=-1)
    nu = np.minimum(BET_CAP / (1 - alpha), np.sqrt(2 * math.log(1 / delta) / (n * s2_before)))
    return np.cumsum(np.log1p(-nu * (x - alpha)), axis=-1)  # 1 - nu (x - alpha) >= 1 - c > 0


def wsr_p_value(losses: Sequence[float], alpha: float, delta: float) -> float:
    """Waudby-Smith–Ramdas betting p-value of ``H: E[loss] >= alpha`` from i.i.d. losses in [0, 1] taken in their
    given order (Waudby-Smith & Ramdas, *Estimating means of bounded random variables by betting*, JRSS-B 2024, the
    predictable plug-in bets; as LTT and Bates et al. 2021, Prop. 5 and its appendix, use it): the capital
    ``K_i = prod_{j<=i} (1 - nu_j (L_j - alpha))`` with ``nu_j = min(c / (1 - alpha), sqrt(2 log(1/delta) /
    (n s2_{j-1})))`` (c = :data:`BET_CAP`),
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
    if x.size == 0:
        return 1.0
    return float(min(1.0, math.exp(-float(_log_capital(x, alpha, delta).max()))))


def wsr_p_values(values: np.ndarray, alpha: float, delta: float) -> np.ndarray:
    """:func:`wsr_p_value` of each row of ``values [G, n]`` (values in [0, 1]) at once: ``[G]`` float64; ones when
    ``n == 0``."""
    x = np.asarray(values, dtype=np.float64)
    if x.shape[-1] == 0:
        return np.ones(x.shape[:-1])
    return np.minimum(1.0, np.exp(-_log_capital(x, alpha, delta).max(axis=-1)))


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


def _p_values(values: np.ndarray, alpha: float, delta: float, kind: str) -> np.ndarray:
    if kind == "wsr":
        return wsr_p_values(values, alpha, delta)
    if kind == "hb":
        n = values.shape[-1]
        return np.array([hb_p_value(float(np.clip(v.mean(), 0, 1)) if n else 0.0, n, alpha) for v in values])
    raise ValueError(f"p-value kind {kind!r}: expected 'wsr' or 'hb'")


@dataclass(frozen=True)
class UnitCertificate:
    """The outcome of :func:`certify_units` on one site's labelled units.

    Attributes:
        score: the case score the threshold applies to (None: nothing certified).
        threshold: accept an image when its score is at most this (None: nothing certified).
        target / delta: the image-weighted accepted mean Dice certified, with probability at least 1 - delta.
        k: labelled images; n_units: independent units; learn_units / test_units: the two folds' sizes.
        max_unit_images: the bound M used.
        p_start: the test fold's p-value at the start of the sequence (1: no evidence there).
    """

    score: str | None
    threshold: float | None
    target: float
    delta: float
    k: int
    n_units: int
    learn_units: int
    test_units: int
    max_unit_images: int
    p_start: float


def unit_codes(units: Sequence) -> tuple[np.ndarray, list[str]]:
    """``(codes [k] int64, names)``: each image's unit as an index into ``names`` (the distinct unit names, sorted;
    integer units sorted as numbers)."""
    values = np.asarray(units)
    if values.dtype.kind not in "iu":  # names: compared as strings, sorted as strings
        values = np.asarray([str(u) for u in units], dtype=object).astype(str)
    names, codes = np.unique(values, return_inverse=True)  # integers (a benchmark's draws): sorted as numbers
    return codes.astype(np.int64).reshape(-1), [str(n) for n in names]


def accepted_sums(score: np.ndarray, values: np.ndarray, codes: np.ndarray, n_units: int,
                  grid: np.ndarray = GRID) -> np.ndarray:
    """``[n_units, G]``: unit p's ``Σ_{j∈p} v_j 1{s_j <= λ_g}`` for every grid threshold (one bincount; an infinite or
    NaN score is never accepted)."""
    s = np.asarray(score, np.float64)
    first = np.searchsorted(grid, np.where(np.isfinite(s), s, np.inf), side="left")  # accepted from this index on
    width = len(grid) + 1
    out = np.bincount(np.asarray(codes, np.int64) * width + first, weights=np.asarray(values, np.float64),
                      minlength=n_units * width).reshape(n_units, width)
    return np.cumsum(out, axis=1)[:, :-1]


def unit_excess(score: np.ndarray, loss: np.ndarray, codes: np.ndarray, n_units: int, alpha: float,
                grid: np.ndarray = GRID) -> np.ndarray:
    """``D [n_units, G]``: unit p's ``Σ_{j∈p} (L_j - α) 1{s_j <= λ_g}`` for every grid threshold, so that
    ``Y = α + D / M`` (:func:`accepted_sums` of ``L - α``)."""
    return accepted_sums(score, np.asarray(loss, np.float64) - alpha, codes, n_units, grid)


def split_units(n_units: int, learn_fraction: float = LEARN_FRACTION, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(learn, test)``: index arrays of the units (positions in the sorted names) in the learn fold and, in the
    order the test reads them, the test fold; a seeded permutation, so data-free. The learn fold has
    ``round(learn_fraction n)`` units, at least one and at most n - 1 (n >= 2)."""
    perm = np.random.default_rng(seed).permutation(n_units)
    n_learn = min(max(1, int(round(learn_fraction * n_units))), n_units - 1)
    return perm[:n_learn], perm[n_learn:]


def compress_excess(d: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(D's distinct runs of columns [n_units, R], the grid index of each run's last column [R])``: consecutive
    thresholds that accept the same images give the same unit values and the same p-value, so the procedure runs on
    one column per run and reports the run's most permissive threshold (a model's scores often span a few grid
    points only: 0.056-0.072 nats is 8 of the 400)."""
    new = np.r_[True, np.any(d[:, 1:] != d[:, :-1], axis=0)]
    starts = np.flatnonzero(new)
    return d[:, starts], np.r_[starts[1:] - 1, d.shape[1] - 1]


def certify_excess(excess: dict, alpha: float, delta: float, max_unit_images: int, learn: np.ndarray,
                   test: np.ndarray, kind: str = "wsr") -> tuple[str | None, int | None, float]:
    """The procedure of the module doc on precomputed :func:`unit_excess` arrays.

    Args:
        excess: score name -> ``D [n_units, G]``, or its :func:`compress_excess` pair.
        learn / test: unit indices of the folds (:func:`split_units`; the test fold in its reading order).

    Returns:
        ``(score, g, p_start)``: the chosen score, the index in the grid of the most permissive rejected threshold
        (None: none rejected) and the test fold's p-value at the start.
    """
    m = float(max_unit_images)
    runs = {n: v if isinstance(v, tuple) else compress_excess(v) for n, v in excess.items()}
    best, start = -np.inf, None
    for name, (d, _) in runs.items():  # learn: the final log-capital of each threshold, per score
        y = np.clip(alpha + d[learn].T / m, 0.0, 1.0)  # [R, n_learn]
        stat = _log_capital(y, alpha, delta)[:, -1]
        r = int(np.argmax(stat))
        if stat[r] > best + 1e-12:
            best, start = float(stat[r]), (name, r)
    name, r0 = start
    d, last_column = runs[name]
    if best <= 0:  # the learn fold shows no evidence anywhere: test full coverage (the plain mean) alone
        r0 = d.shape[1] - 1
    d_test, last, p_start = d[test], -1, None
    for lo in range(r0, d.shape[1], 32):  # the sequence from r0 upwards, in chunks: it usually stops early
        y = np.clip(alpha + d_test[:, lo:lo + 32].T / m, 0.0, 1.0)  # [chunk, n_test]
        p = _p_values(y, alpha, delta, kind)
        p_start = float(p[0]) if p_start is None else p_start
        failed = np.flatnonzero(p > delta)
        if failed.size:
            last = lo - r0 + int(failed[0]) - 1
            break
        last = lo - r0 + p.size - 1
    return name, (int(last_column[r0 + last]) if last >= 0 else None), p_start


def _check(scores: dict, dice, units, target: float, delta: float):
    d = np.asarray(dice, np.float64).reshape(-1)
    if not scores or d.size == 0 or len(units) != d.size or any(np.asarray(v).shape != d.shape
                                                                  for v in scores.values()):
        raise ValueError(f"scores, dice and units must be equal-length non-empty lists, got {d.size} Dice values and "
                         f"{len(units)} units")
    if not (np.all(d >= 0) and np.all(d <= 1)):
        raise ValueError("dice values must lie in [0, 1]")
    if not 0 < target < 1 or not 0 < delta < 1:
        raise ValueError(f"target and delta must lie in (0, 1), got {target} and {delta}")
    codes, names = unit_codes(units)
    if len(names) < 2:
        raise ValueError(f"the {d.size} labelled images are one unit ({names[0]!r}): a certificate needs independent "
                         f"units (patients), at least two")
    return d, codes, names


def _bound(codes: np.ndarray, names: list[str], max_unit_images: int | None) -> int:
    sizes = np.bincount(codes, minlength=len(names))
    m = MAX_UNIT_IMAGES if max_unit_images is None else int(max_unit_images)  # fixed before the data, never from it
    if m < 1:
        raise ValueError(f"max_unit_images {max_unit_images}: expected an integer >= 1")
    if sizes.max() > m:
        big = int(np.argmax(sizes))
        raise ValueError(f"unit {names[big]!r} holds {int(sizes[big])} labelled images, more than the bound "
                         f"{m} on a unit's images fixed before the data (--max-unit-images): raise it to the most "
                         f"images your protocol labels per patient")
    return m


def certify_units(scores: dict, dice: Sequence[float], units: Sequence, target: float, delta: float = 0.1,
                  max_unit_images: int | None = None, grid: Sequence[float] = GRID,
                  learn_fraction: float = LEARN_FRACTION, seed: int = 0, kind: str = "wsr") -> UnitCertificate:
    """Certify a review threshold on k labelled images grouped in units (see the module doc).

    Args:
        scores: score name -> ``[k]`` float (higher = less certain; ``inf``: an image the rule flags whatever the
            threshold).
        dice: ``[k]`` Dice in [0, 1]; units: ``[k]`` each image's unit (patient, volume, video; any hashable, compared
            as strings).
        target / delta: the image-weighted accepted mean Dice and the error level, each in (0, 1).
        max_unit_images: M, the bound on a unit's image count fixed before the data, from the units' mode (1 when
            each image is its own unit by construction: ``--units images``, a volume task's volumes); None:
            :data:`MAX_UNIT_IMAGES` (never read off the data: an M of 1 because every unit observed happened to hold
            one image would not bound the units the site draws next).
        grid: thresholds fixed before the data; learn_fraction / seed: :func:`split_units`; kind: the p-value.

    Returns:
        :class:`UnitCertificate` (``threshold`` None: nothing certified).

    Raises:
        ValueError: lengths differ or nothing given, a Dice outside [0, 1], target or delta outside (0, 1), fewer
            than two units, or a unit holding more than M images (named).
    """
    d, codes, names = _check(scores, dice, units, target, delta)
    m = _bound(codes, names, max_unit_images)
    grid = np.sort(np.asarray(grid, np.float64))
    alpha = 1.0 - target
    excess = {n: unit_excess(v, 1.0 - d, codes, len(names), alpha, grid) for n, v in scores.items()}
    learn, test = split_units(len(names), learn_fraction, seed)
    name, g, p0 = certify_excess(excess, alpha, delta, m, learn, test, kind)
    return UnitCertificate(name if g is not None else None, float(grid[g]) if g is not None else None, float(target),
                           float(delta), int(d.size), len(names), int(learn.size), int(test.size), m, p0)


def units_needed(scores: dict, dice: Sequence[float], units: Sequence, target: float, delta: float = 0.1,
                 max_unit_images: int | None = None, power: float = POWER, resamples: int = 200, seed: int = 0,
                 most: int = 5000, time_limit: float = 30.0, grid: Sequence[float] = GRID,
                 kind: str = "wsr") -> int | None:
    """How many units like these the site would need to label: the smallest n (at least :data:`MIN_UNITS_HINT`) at
    which at least ``power`` of ``resamples`` bootstrap sets of n units, drawn with replacement from these units
    (each with all its images), certify ``target`` with :func:`certify_units`'s procedure. A power figure, not a
    promise: new units vary more than resampled ones when the site has few.

    Returns:
        n, or None when even ``most`` units would not do it, or when ``time_limit`` seconds (wall clock) ran out
        before an answer.

    Raises:
        ValueError: as :func:`certify_units`.
    """
    d, codes, names = _check(scores, dice, units, target, delta)
    m = _bound(codes, names, max_unit_images)
    grid = np.sort(np.asarray(grid, np.float64))
    alpha = 1.0 - target
    excess = {n: unit_excess(v, 1.0 - d, codes, len(names), alpha, grid) for n, v in scores.items()}
    if min(float(e.sum(axis=0).min()) for e in excess.values()) >= 0:
        return None  # at no threshold do these units' accepted images reach the target: no number of them certifies
    runs = {k: compress_excess(v) for k, v in excess.items()}
    deadline, cache = time.monotonic() + time_limit, {}

    def rate(n: int) -> float:
        if n not in cache:
            rng = np.random.default_rng([seed, n])
            learn, test = split_units(n)
            cut = min(len(names) - 1, max(1, round(len(names) * learn.size / n)))
            hits = 0
            for _ in range(resamples):
                if time.monotonic() > deadline:
                    raise TimeoutError
                # the two folds drawn from disjoint halves of the units: a unit drawn twice never lands in both
                # (which would let the Learn fold see a Test unit, an optimistic count)
                order = rng.permutation(len(names))
                pick = np.empty(n, np.int64)
                pick[learn] = rng.choice(order[:cut], learn.size)
                pick[test] = rng.choice(order[cut:], test.size)
                hits += certify_excess({k: (v[pick], last) for k, (v, last) in runs.items()}, alpha, delta, m, learn,
                                       test, kind)[1] is not None
            cache[n] = hits / resamples
        return cache[n]

    try:
        lo, hi = None, MIN_UNITS_HINT
        while rate(hi) < power:
            if hi >= most:
                return None
            lo, hi = hi, min(2 * hi, most)
        if lo is None:
            return hi
        while lo + 1 < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if rate(mid) >= power else (mid, hi)
        return hi
    except TimeoutError:
        return None


def best_certifiable_target(scores: dict, dice: Sequence[float], units: Sequence, delta: float = 0.1,
                            max_unit_images: int | None = None, grid: Sequence[float] = GRID,
                            kind: str = "wsr") -> float:
    """The highest target (to 0.001) that :func:`certify_units` certifies on these units at some coverage; 0 when
    none (bisection over the target: "about", as the start learned may change with the target)."""
    return highest_target(lambda t: certify_units(scores, dice, units, t, delta, max_unit_images, grid,
                                                  kind=kind).threshold is not None)


def highest_target(certifies, steps: int = 12) -> float:
    """The highest target in (0, 1) for which ``certifies(target)`` is True, by bisection to ``2^-steps`` (reported to
    0.001, rounded down); 0 when none."""
    lo, hi = 0.0, 1.0
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mid > 0 and certifies(mid) else (lo, mid)
    return round(lo - 5e-4, 3) if lo > 0 else 0.0


def min_units(target: float, delta: float, max_unit_images: int = 1, unit_images: int = 1,
              learn_fraction: float = LEARN_FRACTION) -> int:
    """The fewest units that can certify ``target`` at all: units of ``unit_images`` images of Dice 1 under the bound
    ``max_unit_images``, the learn fold set aside (e.g. 16 units of one image for 0.8 at δ = 0.1)."""
    alpha = 1.0 - target

    def certifies(n: int) -> bool:
        y = np.full((1, split_units(n, learn_fraction)[1].size), alpha - alpha * unit_images / max_unit_images)
        return bool(wsr_p_values(y, alpha, delta)[0] <= delta)

    hi = 2
    while not certifies(hi):  # doubling, then bisection: perfect units' capital only grows with their number
        if hi >= 1 << 16:
            return hi
        hi *= 2
    lo = hi // 2
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if certifies(mid) else (mid, hi)
    return hi
