"""Does a certified review threshold keep its promise where the promise is sharp?

:func:`feduq.review.certificate.certify_units` promises: with probability at least 1 - δ over the n labelled units
(patients, videos) drawn, the image-weighted mean Dice of the images its threshold accepts at the site is at least
the target. Two procedures run on the same labelled sets:

* **unit** (``predict --calibrate``): units = the site's patients or videos, M = :func:`site_bound`, fixed per site
  before any draw (64 for the polyp video sites, 32 for prostate, 1 where every unit is one image);
* **image** (the negative control, the procedure before the per-patient certificate): every image its own unit, M = 1. Valid for
  independent images only; with correlated frames or slices it may certify thresholds that miss.

Three checks (``feduq acceptance-study`` runs them): (a) **real sites**: draws of n units with replacement from a
held-out site's units (each with all its images; a unit drawn twice counts as two), judged against that finite
population's exact accepted Dice; (b) **simulation** with a known truth (:func:`simulate`, :func:`sim_truth`);
(c) **power**: the highest target a draw certifies against what a threshold fixed in advance could certify.

A **violation** is a draw that certified *and* whose threshold's true accepted Dice is below the target, counted over
all draws (the promise is unconditional); rates carry Clopper–Pearson 95 % intervals (:func:`clopper_pearson`).

Shapes: k images, U units, G = ``len(GRID)`` thresholds. A ``[U, G]`` array holds, per unit p and threshold λ_g, a
sum over p's images of a value times ``1{s_j <= λ_g}``; with the loss sums ``Λ`` (value 1 - Dice) and the counts
``C`` (value 1), certify.py's unit excess at α = 1 - target is ``Λ - α C``, so each site's arrays are built once
and a draw only selects rows. :func:`certify_draw` is then :func:`~feduq.review.certificate.certify_units` on the
drawn units relabelled in draw order (tests check the two agree). Dice, targets and coverages are fractions in [0, 1].
"""

from __future__ import annotations

import csv
import functools
import math
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from ..review.certificate import GRID, MAX_UNIT_IMAGES, certify_excess, split_units, unit_codes, wsr_p_values
from ..review.certificate import accepted_sums as accept_sums  # per unit (or image) and threshold, one bincount
from ..review.certificate import highest_target as bisect_target  # the highest target certified

__all__ = ["SCORES", "FIXED_SCORE", "SITE_BOUNDS", "read_cases", "site_bound", "accept_sums", "Population",
           "population", "boundary", "certify_draw", "site_draws", "clopper_pearson", "rates", "simulate",
           "sim_truth", "sim_draws", "bisect_target", "fixed_rule_p", "site_power", "population_curve", "SIM",
           "SIM_SIZES", "SIM_BOUND", "load_site", "site_rows", "sim_rows", "power_row", "checks", "markdown"]

SCORES = ("u_mean", "u_foreground", "u_boundary")
#: the score of the "fixed score" comparison (certify on it alone instead of choosing among :data:`SCORES`)
FIXED_SCORE = "u_mean"
#: M by the site's family (its folder name's first word); 1 where every unit is one image
SITE_BOUNDS = {"polyp": 64, "prostate": 32}
#: the simulation's generator (:func:`simulate`): Dice mean and spread, score slope, scale and noise; unit sizes; M
SIM = {"mu": 0.65, "sd": 0.2, "c": 1.0, "scale": 0.2, "noise": 0.3}
SIM_SIZES, SIM_BOUND = (5, 20), 20


def read_cases(path: str | Path) -> tuple[dict, np.ndarray, np.ndarray]:
    """``({score: [k] float64}, dice [k] float64, units [k] str)`` of a per-case CSV of benchmarks/review-holdout
    (columns ``dice`` and :data:`SCORES`; ``unit``, else each image its own unit).

    Raises:
        ValueError: a column is missing (naming the file and the column).
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for col in ("image", "dice", *SCORES):
        if not rows or col not in rows[0]:
            raise ValueError(f"{path}: no column {col!r} (a per-case CSV of benchmarks/review-holdout)")
    units = np.array([r.get("unit") or f"image {r['image']}" for r in rows], dtype=str)
    return ({s: np.array([float(r[s]) for r in rows]) for s in SCORES}, np.array([float(r["dice"]) for r in rows]),
            units)


def site_bound(site: str, sizes: Sequence[int]) -> int:
    """M for a site (a folder name such as ``polyp-CVC-ClinicDB``) whose units hold ``sizes`` images: 1 when each
    holds one, else :data:`SITE_BOUNDS` by family (certify.py's default for another family).

    Raises:
        ValueError: a unit holds more than M images."""
    if max(sizes) == 1:
        return 1
    m = SITE_BOUNDS.get(site.split("-")[0], MAX_UNIT_IMAGES)
    if max(sizes) > m:
        raise ValueError(f"{site}: a unit holds {max(sizes)} images, more than M = {m}")
    return m


@dataclass(frozen=True)
class Population:
    """A site's images as the finite population draws come from. ``loss`` / ``count``: score -> ``[U, G]`` loss sums
    and counts per unit; ``image_loss`` / ``image_count``: the same per image ``[k, G]``; ``members``: each unit's
    image indices; ``accepted`` / ``coverage``: score -> ``[G]`` the site's image-weighted accepted Dice (NaN where
    none is accepted) and accepted share; ``bound``: M."""

    loss: dict
    count: dict
    image_loss: dict
    image_count: dict
    members: list
    accepted: dict
    coverage: dict
    bound: int


def _curve(loss: np.ndarray, count: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, 1.0 - loss / np.maximum(count, 1e-300), np.nan), count / k


def population_curve(score, dice, grid=GRID) -> tuple[np.ndarray, np.ndarray]:
    """``(accepted dice [G], coverage [G])`` of a population of images: the mean Dice of the images with
    ``score <= λ_g`` (NaN where none) and their share."""
    d = np.asarray(dice, np.float64)
    zero = np.zeros(d.size, np.int64)
    return _curve(accept_sums(score, 1 - d, zero, 1, grid)[0], accept_sums(score, np.ones(d.size), zero, 1, grid)[0],
                  d.size)


def population(scores: dict, dice, units, bound: int, grid=GRID) -> Population:
    """:class:`Population` of k images (``scores``: name -> ``[k]``; ``dice [k]``; ``units [k]``) under M = ``bound``.
    """
    d = np.asarray(dice, np.float64)
    codes, names = unit_codes(units)
    u, k = len(names), d.size
    loss = {s: accept_sums(v, 1 - d, codes, u, grid) for s, v in scores.items()}
    count = {s: accept_sums(v, np.ones(k), codes, u, grid) for s, v in scores.items()}
    image_loss = {s: accept_sums(v, 1 - d, np.arange(k), k, grid) for s, v in scores.items()}
    image_count = {s: accept_sums(v, np.ones(k), np.arange(k), k, grid) for s, v in scores.items()}
    curves = {s: _curve(loss[s].sum(0), count[s].sum(0), k) for s in scores}
    members = list(np.split(np.argsort(codes, kind="stable"), np.cumsum(np.bincount(codes, minlength=u))[:-1]))
    return Population(loss, count, image_loss, image_count, members, {s: c[0] for s, c in curves.items()},
                      {s: c[1] for s, c in curves.items()}, int(bound))


def boundary(accepted: np.ndarray, coverage: np.ndarray, c: float) -> tuple[int, float, float]:
    """``(g, target, coverage)``: the first grid threshold accepting at least a share ``c``, its accepted Dice (the
    target at the boundary: every threshold above it that accepts worse images violates) and its coverage."""
    hits = np.flatnonzero(coverage >= c - 1e-12)
    g = int(hits[0]) if hits.size else len(coverage) - 1
    return g, float(accepted[g]), float(coverage[g])


@functools.lru_cache(maxsize=4096)
def _split(n: int) -> tuple[np.ndarray, np.ndarray]:
    return split_units(n)


def certify_draw(loss: dict, count: dict, rows: np.ndarray, target: float, delta: float, bound: int,
                 scores: Sequence[str] | None = None) -> tuple[str | None, int | None]:
    """``(score, g)`` certified on the rows ``rows`` of ``loss`` / ``count`` (each a labelled unit, in this order),
    as :func:`~feduq.review.certificate.certify_units` with those units named in that order; ``(None, None)``: not
    certified."""
    alpha = 1.0 - target
    excess = {s: loss[s][rows] - alpha * count[s][rows] for s in (scores or loss)}
    name, g, _ = certify_excess(excess, alpha, delta, bound, *_split(len(rows)))
    return (name, g) if g is not None else (None, None)


def site_draws(pop: Population, n: int, targets: Sequence[float], delta: float, draws: int,
               rng: np.random.Generator) -> dict:
    """``draws`` sets of n units drawn with replacement; on each, per target, the procedures ``unit`` (M = the
    site's), ``image`` (the negative control) and ``unit_fixed`` (unit, :data:`FIXED_SCORE` alone).

    Returns:
        ``{(procedure, target): (truth [draws], coverage [draws])}``: the site's accepted Dice and coverage at the
        certified threshold; NaN truth and 0 coverage where not certified.
    """
    out = {(p, t): (np.full(draws, np.nan), np.zeros(draws)) for p in ("unit", "image", "unit_fixed") for t in targets}
    for i in range(draws):
        pick = rng.integers(0, len(pop.members), n)
        images = np.concatenate([pop.members[p] for p in pick])
        for t in targets:
            for proc, (name, g) in (("unit", certify_draw(pop.loss, pop.count, pick, t, delta, pop.bound)),
                                    ("image", certify_draw(pop.image_loss, pop.image_count, images, t, delta, 1)),
                                    ("unit_fixed", certify_draw(pop.loss, pop.count, pick, t, delta, pop.bound,
                                                                [FIXED_SCORE]))):
                if name is not None:
                    out[proc, t][0][i], out[proc, t][1][i] = pop.accepted[name][g], pop.coverage[name][g]
    return out


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper–Pearson) two-sided ``level`` interval of a binomial proportion, k successes of n."""
    from scipy.stats import binomtest

    ci = binomtest(k, n).proportion_ci(level, method="exact")
    return float(ci.low), float(ci.high)


def rates(truth: np.ndarray, target: float, coverage: np.ndarray | None = None) -> dict:
    """One procedure's figures over its draws (``truth [draws]``: NaN = not certified): ``draws``, ``certified``
    (share), ``violations`` (count: certified and truth below the target), ``violation`` (share of all draws) with
    ``viol_lo`` / ``viol_hi`` (Clopper–Pearson 95 %), ``accepted`` (the mean share of the site's images accepted,
    over all draws, 0 where not certified; NaN without ``coverage``)."""
    n, target = int(truth.size), float(target)
    cert = ~np.isnan(truth)
    bad = int(np.sum(cert & (np.nan_to_num(truth, nan=1.0) < target - 1e-12)))
    lo, hi = clopper_pearson(bad, n)
    return {"draws": n, "certified": float(cert.mean()), "violations": bad, "violation": bad / n, "viol_lo": lo,
            "viol_hi": hi, "accepted": float(np.mean(coverage)) if coverage is not None else float("nan")}


def simulate(rng: np.random.Generator, n_units: int, rho: float, mu: float = 0.65, sd: float = 0.2, c: float = 1.0,
             sizes: tuple[int, int] = (5, 20), scale: float = 0.2, noise: float = 0.3):
    """n units of uniformly ``sizes[0]..sizes[1]`` images, intra-unit correlation ``rho``: latent
    ``q = sqrt(rho) b_unit + sqrt(1 - rho) e_image`` (standard normals), ``dice = clip(mu + sd q, 0, 1)``,
    ``score = scale exp(-c q + noise N(0, 1))``. Returns ``(score [k], dice [k], codes [k])`` (codes: unit index)."""
    m = rng.integers(sizes[0], sizes[1] + 1, n_units)
    codes = np.repeat(np.arange(n_units), m)
    q = math.sqrt(rho) * rng.standard_normal(n_units)[codes] + math.sqrt(1 - rho) * rng.standard_normal(codes.size)
    return scale * np.exp(-c * q + noise * rng.standard_normal(codes.size)), np.clip(mu + sd * q, 0, 1), codes


def sim_truth(grid=GRID, mu: float = 0.65, sd: float = 0.2, c: float = 1.0, scale: float = 0.2,
              noise: float = 0.3) -> tuple[np.ndarray, np.ndarray]:
    """``(accepted dice [G], coverage [G])`` of :func:`simulate` exactly (quadrature over q; NaN where nothing is
    accepted). q is N(0, 1) whatever ρ and the sizes are independent of it, so the image-weighted accepted Dice
    ``E[Σ D 1acc] / E[Σ 1acc]`` is ``E[D 1acc] / P(acc)`` with ``P(acc | q) = Φ((log(λ/scale) + c q) / noise)``."""
    from scipy.stats import norm

    q = np.linspace(-10, 10, 40001)
    w = norm.pdf(q) * (q[1] - q[0])
    p = norm.cdf((np.log(np.asarray(grid, np.float64) / scale)[:, None] + c * q) / noise)  # [G, Q]
    cov = p @ w
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(cov > 1e-12, (p @ (w * np.clip(mu + sd * q, 0, 1))) / cov, np.nan), cov


def sim_draws(n: int, rho: float, targets: Sequence[float], delta: float, draws: int, rng: np.random.Generator,
              truth: np.ndarray, bound: int = 20, grid=GRID, **gen) -> dict:
    """``draws`` simulated sets of n units (:func:`simulate` with ``gen``); on each, per target, the ``unit``
    procedure (M = ``bound``) and the ``image`` control. Returns ``{(procedure, target): truth [draws]}``
    (``truth [G]``: the curve of :func:`sim_truth`; NaN where not certified)."""
    out = {(p, t): np.full(draws, np.nan) for p in ("unit", "image") for t in targets}
    for i in range(draws):
        score, dice, codes = simulate(rng, n, rho, **gen)
        k = dice.size
        sums = {"unit": (accept_sums(score, 1 - dice, codes, n, grid), accept_sums(score, np.ones(k), codes, n, grid)),
                "image": (accept_sums(score, 1 - dice, np.arange(k), k, grid),
                          accept_sums(score, np.ones(k), np.arange(k), k, grid))}
        for t in targets:
            for proc, m in (("unit", bound), ("image", 1)):
                rows = np.arange(len(sums[proc][0]))
                _, g = certify_draw({"u": sums[proc][0]}, {"u": sums[proc][1]}, rows, t, delta, m)
                if g is not None:
                    out[proc, t][i] = truth[g]
    return out


def fixed_rule_p(loss: np.ndarray, count: np.ndarray, target: float, delta: float, bound: int) -> float:
    """The WSR p-value of ``H: accepted Dice < target`` for a threshold fixed in advance, on every drawn unit's loss
    sum and count there (``[n]`` each, in draw order): ``Y_p = α + (Λ_p - α C_p) / M`` (certify.py's unit values)."""
    alpha = 1.0 - target
    y = np.clip(alpha + (loss - alpha * count) / bound, 0.0, 1.0)
    return float(wsr_p_values(y[None], alpha, delta)[0])


def site_power(pop: Population, n: int, draws: int, delta: float, rng: np.random.Generator,
               fixed: dict) -> dict:
    """Per draw of n units: the highest target certified (``certified``: :data:`SCORES` chosen among;
    ``certified_fixed``: :data:`FIXED_SCORE` alone) and, per ``fixed`` label -> ``(score, g)`` (a threshold fixed
    before the draw), the highest target its WSR lower bound reaches on all n units. Returns label -> ``[draws]``."""
    out = {key: np.zeros(draws) for key in ("certified", "certified_fixed", *fixed)}
    for i in range(draws):
        pick = rng.integers(0, len(pop.members), n)
        for key, scores in (("certified", None), ("certified_fixed", [FIXED_SCORE])):
            out[key][i] = bisect_target(lambda t: certify_draw(pop.loss, pop.count, pick, t, delta, pop.bound,
                                                               scores)[1] is not None)
        for key, (s, g) in fixed.items():
            lam, cnt = pop.loss[s][pick, g], pop.count[s][pick, g]
            out[key][i] = bisect_target(lambda t: fixed_rule_p(lam, cnt, t, delta, pop.bound) <= delta)
    return out


def load_site(path: str | Path) -> dict:
    """A per-case CSV ``<site>/<method>_s<seed>_cases.csv`` as ``{"site", "method", "images", "units", "pop"
    (:class:`Population` under :func:`site_bound`), "score" (the score of the lowest AURC over all its images)}``."""
    from ..review.rule import aurc

    path = Path(path)
    scores, dice, units = read_cases(path)
    sizes = np.unique(units, return_counts=True)[1]
    return {"site": path.parent.name, "method": re.sub(r"_s\d+_cases$", "", path.stem), "images": int(dice.size),
            "units": int(sizes.size), "pop": population(scores, dice, units, site_bound(path.parent.name, sizes)),
            "score": min(SCORES, key=lambda s: aurc(scores[s], dice))}


def _seed(seed: int, *parts) -> np.random.Generator:
    return np.random.default_rng([seed, *(zlib.crc32(str(p).encode()) for p in parts)])


def site_rows(path: str | Path, n: int, coverages: Sequence[float], delta: float, draws: int, seed: int = 0) -> list:
    """(a): per coverage c (target: the site's accepted Dice at c under its best-AURC score, :func:`boundary`) and
    procedure of :func:`site_draws`, one row of :func:`rates` with the site's figures, on ``draws`` draws of n units."""
    s = load_site(path)
    pop = s["pop"]
    bounds = {c: boundary(pop.accepted[s["score"]], pop.coverage[s["score"]], c) for c in coverages}
    rng = _seed(seed, s["site"], s["method"], n)
    out = site_draws(pop, n, sorted({b[1] for b in bounds.values()}), delta, draws, rng)
    head = {k: s[k] for k in ("site", "method", "images", "units")} | {"M": pop.bound, "score": s["score"], "n": n}
    return [head | {"coverage": c, "site_coverage": cov, "target": t, "procedure": p}
            | rates(out[p, t][0], t, out[p, t][1]) for c, (g, t, cov) in bounds.items()
            for p in ("unit", "image", "unit_fixed")]


def sim_rows(rho: float, n: int, coverages: Sequence[float], margins: Sequence[float], delta: float, draws: int,
             seed: int = 0) -> list:
    """(b): per coverage c and margin m (target: the true accepted Dice at c less m) and procedure, one row of
    :func:`rates` on ``draws`` simulated sets of n units (:data:`SIM`, :data:`SIM_SIZES`, M = :data:`SIM_BOUND`)."""
    truth, cov = sim_truth(GRID, **SIM)
    cells = [(c, m, boundary(truth, cov, c)[1] - m) for c in coverages for m in margins]
    out = sim_draws(n, rho, sorted({t for *_, t in cells}), delta, draws, _seed(seed, "sim", rho, n), truth,
                    SIM_BOUND, sizes=SIM_SIZES, **SIM)
    return [{"rho": rho, "n": n, "coverage": c, "margin": m, "target": t, "procedure": p, "M": SIM_BOUND if p == "unit"
             else 1} | rates(out[p, t], t) for c, m, t in cells for p in ("unit", "image")]


def power_row(path: str | Path, n: int, coverages: Sequence[float], delta: float, draws: int, seed: int = 0) -> dict:
    """(c): the means over ``draws`` draws of n units of :func:`site_power`'s targets, the fixed thresholds at each
    coverage c of the best-AURC score (``fixed_<c>``, with the site's accepted Dice there, ``truth_<c>``), and
    ``gap``: the mean of (fixed at the first coverage - certified)."""
    s = load_site(path)
    pop, score = s["pop"], s["score"]
    bounds = {c: boundary(pop.accepted[score], pop.coverage[score], c) for c in coverages}
    out = site_power(pop, n, draws, delta, _seed(seed, "power", s["site"], s["method"], n),
                     {f"fixed_{c:g}": (score, b[0]) for c, b in bounds.items()})
    row = {k: s[k] for k in ("site", "method", "images", "units")} | {"M": pop.bound, "score": score, "n": n,
                                                                       "draws": draws}
    row |= {k: float(v.mean()) for k, v in out.items()} | {f"truth_{c:g}": b[1] for c, b in bounds.items()}
    row["gap"] = float(np.mean(out[f"fixed_{coverages[0]:g}"] - out["certified"]))
    return row


def checks(sim_rows: list[dict], site_rows: list[dict], delta: float, power_n: int = 100,
           power_coverage: float = 0.8) -> list[tuple[str, bool]]:
    """The requirements the benchmark must show, each ``(statement with its figures, holds)``: (1) at
    ``power_n`` simulated units and the target 0.05 below the truth at ``power_coverage`` at least half the sets
    certify (every ρ); (2) the unit procedure's violation rate is at most δ within Monte Carlo error (its
    Clopper–Pearson lower bound <= δ) in every cell, simulated and real; (3) the image-level control's lower bound
    exceeds δ in at least one cell."""
    power = [r for r in sim_rows if r["n"] == power_n and r["margin"] > 0 and r["procedure"] == "unit"
             and abs(r["coverage"] - power_coverage) < 1e-9]
    worst = min(power, key=lambda r: r["certified"], default=None)
    out = [(f"{power_n} simulated units, target 0.05 below the truth at coverage {power_coverage:g}: at least half the "
            "sets certify (lowest: " + (f"{100 * worst['certified']:.1f} % at rho {worst['rho']:g}, target "
                                        f"{worst['target']:.3f})" if worst else "no such cell)"),
            bool(power) and worst["certified"] >= 0.5)]
    for label, rows in (("simulated", sim_rows), ("real-site", site_rows)):
        unit = [r for r in rows if r["procedure"] != "image"]
        w = max(unit, key=lambda r: (r["viol_lo"], r["violation"]), default=None)
        out.append((f"unit procedure, every {label} cell: violation rate <= δ = {delta:g} within Monte Carlo error "
                    + (f"(worst: {_cell(w)})" if w else "(no cell)"), all(r["viol_lo"] <= delta for r in unit)))
    ctrl = [r for r in sim_rows + site_rows if r["procedure"] == "image"]
    w = max(ctrl, key=lambda r: (r["viol_lo"], r["violation"]), default=None)
    out.append(("image-level control: Clopper–Pearson lower bound on violations above δ in at least one cell "
                + (f"(worst: {_cell(w)})" if w else "(no cell)"), bool(ctrl) and w["viol_lo"] > delta))
    return out


def _cell(r: dict) -> str:
    where = (f"{r['site']} {r['method']}" if "site" in r else f"rho {r['rho']:g}") + f", n {r['n']} units"
    return (f"{where}, target {r['target']:.3f}: {r['violations']} of {r['draws']} draws, {100 * r['violation']:.1f} % "
            f"[{100 * r['viol_lo']:.1f}, {100 * r['viol_hi']:.1f}]")


def markdown(rows: list[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """A Markdown table of ``rows``: ``columns`` are ``(key, header, format)``; format ``"%"`` writes a share as a
    percentage with one decimal, ``"ci"`` the row's ``<key>violation`` in percent with its Clopper–Pearson interval
    ``[<key>viol_lo, <key>viol_hi]``, any other a ``str.format`` spec (``""``: as is); NaN as "–"."""

    def cell(r, key, fmt):
        if fmt == "ci":
            return f"{100 * r[key + 'violation']:.1f} [{100 * r[key + 'viol_lo']:.1f}, {100 * r[key + 'viol_hi']:.1f}]"
        v = r[key]
        if isinstance(v, float) and math.isnan(v):
            return "–"
        return f"{100 * v:.1f}" if fmt == "%" else format(v, fmt)

    lines = ["| " + " | ".join(h for _, h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r, k, f) for k, _, f in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"
