"""Does the certified review threshold keep its promise at a site? (issue 64's evidence)

A held-out site's every case scored with its mask (``benchmarks/review-holdout/<site>/<method>_s<seed>_cases.csv``:
Dice and the three case scores per case) stands for the site. Each **draw** takes k of its cases at random as the
labelled cases the site's team would label, chooses the rule's threshold on them and applies it to the site's other
cases:

* **certified** (:func:`feduq.inference.review.certify_rule`'s threshold part, :func:`feduq.inference.certify.
  certify_scores`): when it certifies, the draw **holds** if the accepted other cases' mean Dice reaches the target.
  Over the draws that certify, the fraction that holds must be at least 1 - δ up to sampling error;
* **uncertified** (today's empirical rule, :func:`feduq.inference.review.choose_threshold` on the score of the lowest
  AURC on the k cases): it reaches the target on the k cases whenever it returns; the draw holds on the same terms.

The per-case CSVs carry neither the labelled masks' area nor the bottleneck features, so the size and familiarity
parts of the rule are not re-fitted here: both rules are the uncertainty threshold on every case.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["SCORES", "read_cases", "acceptance_draws", "acceptance_row", "acceptance_markdown"]

SCORES = ("u_mean", "u_foreground", "u_boundary")


def read_cases(path: str | Path) -> tuple[dict, np.ndarray]:
    """``({score: [N] float64}, dice [N] float64)`` of a per-case CSV (columns ``dice`` and :data:`SCORES`).

    Raises:
        ValueError: a column is missing (naming the file and the column).
    """
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    for col in ("dice", *SCORES):
        if not rows or col not in rows[0]:
            raise ValueError(f"{path}: no column {col!r} (a per-case CSV of benchmarks/review-holdout)")
    return {s: np.array([float(r[s]) for r in rows]) for s in SCORES}, np.array([float(r["dice"]) for r in rows])


def acceptance_draws(scores: dict, dice: np.ndarray, k: int, *, target: float, delta: float = 0.1,
                     draws: int = 200, seed: int = 0) -> list[dict]:
    """``draws`` random draws of k labelled cases (without replacement); per draw the certified and the uncertified
    rule's outcome on the other cases.

    Returns:
        one dict per draw: ``certified`` (bool), ``cert_holds`` (bool or None), ``cert_coverage`` (the fraction of
        the other cases accepted; 0 when not certified), ``cert_dice`` (their mean Dice, NaN when none),
        ``uncert_chosen`` (bool: the empirical rule reached the target on the k cases), ``uncert_holds``,
        ``uncert_coverage``, ``uncert_dice``, ``uncert_promised`` (its accepted Dice on the k cases).

    Raises:
        ValueError: ``k`` not below the number of cases.
    """
    from ..inference.certify import certify_scores
    from ..inference.review import ReviewError, aurc, choose_threshold

    n = dice.size
    if not 0 < k < n:
        raise ValueError(f"k = {k}: expected 0 < k < {n} (the site's cases)")
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(draws):
        pick = np.zeros(n, bool)
        pick[rng.choice(n, k, replace=False)] = True
        rest = ~pick
        row = {}
        name, cert, _ = certify_scores({s: v[pick] for s, v in scores.items()}, dice[pick], target, delta)
        row["certified"] = name is not None
        accepted = rest & (scores[name] <= cert.threshold) if name is not None else np.zeros(n, bool)
        row.update(_outcome("cert", accepted, rest, dice, target if name is not None else None))
        best = min(SCORES, key=lambda s: aurc(scores[s][pick], dice[pick]))
        try:
            t = choose_threshold(scores[best][pick], dice[pick], target)
            accepted, row["uncert_chosen"], row["uncert_promised"] = rest & (scores[best] <= t.threshold), True, \
                t.accepted_dice
        except ReviewError:
            accepted, row["uncert_chosen"], row["uncert_promised"] = np.zeros(n, bool), False, float("nan")
        row.update(_outcome("uncert", accepted, rest, dice, target if row["uncert_chosen"] else None))
        out.append(row)
    return out


def _outcome(prefix: str, accepted: np.ndarray, rest: np.ndarray, dice: np.ndarray, target: float | None) -> dict:
    mean = float(dice[accepted].mean()) if accepted.any() else float("nan")
    holds = None if target is None else bool(not accepted.any() or mean >= target)  # none accepted: nothing promised
    return {f"{prefix}_holds": holds, f"{prefix}_coverage": float(accepted.sum() / rest.sum()),
            f"{prefix}_dice": mean}


def _rate(flags: Sequence[bool | None]) -> tuple[float, int]:
    kept = [f for f in flags if f is not None]
    return (float(np.mean(kept)) if kept else float("nan")), len(kept)


def acceptance_row(draws: list[dict], delta: float) -> dict:
    """One table row of a site, method and k: the fraction of draws certified, of those the fraction that holds with
    its binomial standard error, whether it is at least 1 - delta - 2 standard errors (``bound ok``), the mean
    coverage of the other cases over every draw (a draw without a certificate accepts none) and the same figures of
    the uncertified rule."""
    holds, m = _rate([d["cert_holds"] for d in draws])
    se = math.sqrt(max(holds * (1 - holds), 1e-12) / m) if m else float("nan")
    u_holds, u_m = _rate([d["uncert_holds"] for d in draws])
    return {"draws": len(draws), "certified": float(np.mean([d["certified"] for d in draws])),
            "holds": holds, "holds_se": se, "bound_ok": (holds >= 1 - delta - 2 * se) if m else None,
            "coverage": float(np.mean([d["cert_coverage"] for d in draws])),
            "uncert_chosen": float(np.mean([d["uncert_chosen"] for d in draws])), "uncert_holds": u_holds,
            "uncert_coverage": float(np.mean([d["uncert_coverage"] for d in draws]))}


def acceptance_markdown(rows: list[dict]) -> str:
    """The table of ``rows`` (each :func:`acceptance_row` plus ``site``, ``method``, ``k``, ``target``, ``n``)."""

    def pct(v):
        return "–" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{100 * v:.1f}"

    lines = ["| held-out site | method | cases | target | k | certified % of draws | holds % of certified (1 - δ = "
             "90) | bound ok | coverage % | uncertified: chosen % | holds % of chosen | coverage % |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ok = "–" if r["bound_ok"] is None else ("yes" if r["bound_ok"] else "**no**")
        lines.append(f"| {r['site']} | {r['method']} | {r['n']} | {pct(r['target'])} | {r['k']} | "
                     f"{pct(r['certified'])} | {pct(r['holds'])} | {ok} | {pct(r['coverage'])} | "
                     f"{pct(r['uncert_chosen'])} | {pct(r['uncert_holds'])} | {pct(r['uncert_coverage'])} |")
    return "\n".join(lines) + "\n"
