"""Is a method better than its baseline on the same test images? Paired tests of per-image scores (no FLARE).

Two methods scored on identical test images give paired per-image Dice values; the question "does method A beat
FedAvg here" is a paired test over those images, not a comparison of two means over four sites. For each method
against the baseline, per seed, over all test images pooled over the sites and per site, :func:`paired_tests`
reports

* ``n`` paired images, ``mean_diff`` and ``median_diff`` (method − baseline, Dice as a fraction), ``wins`` /
  ``losses`` / ``ties`` (images where the method is higher / lower / equal);
* the **Wilcoxon signed-rank test** (``scipy.stats.wilcoxon``, two-sided, ``zero_method="wilcox"``: tied pairs are
  dropped, the normal approximation with continuity correction above 50 non-tied pairs as SciPy chooses);
* the effect size **r**, the matched-pairs rank-biserial correlation ``(W+ − W−) / (W+ + W−)`` from the signed ranks
  of the non-zero differences (Kerby, Comprehensive Psychology 2014), in [−1, 1]: +1 when the method wins every
  non-tied image;
* ``q_value``: the p-value adjusted for every test in the same call (Benjamini–Hochberg false discovery rate,
  ``scipy.stats.false_discovery_control``): a table of methods × seeds × (all images, each site) holds dozens of
  tests, and a claim should survive the adjustment (q < 0.05), not only its own p < 0.05.

Rows are tidy (FLamby style); :func:`paired_markdown` renders them.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["wilcoxon_paired", "paired_tests", "with_q_values", "paired_markdown"]


def wilcoxon_paired(method: Sequence[float], baseline: Sequence[float]) -> dict:
    """Paired comparison of two score vectors over the same items.

    Args:
        method, baseline: per-item scores (e.g. Dice in [0, 1]), the same length and item order.

    Returns:
        ``{"n", "mean_diff", "median_diff", "wins", "losses", "ties", "statistic", "p_value", "r"}``; ``statistic`` is
        SciPy's (the smaller of W+ and W− for the two-sided test), ``p_value`` 1.0 and ``r`` 0.0 when every pair is
        tied, NaN statistics for n = 0.

    Raises:
        ValueError: different lengths, or a non-finite score.
    """
    from scipy.stats import rankdata, wilcoxon

    a, b = np.asarray(method, dtype=np.float64), np.asarray(baseline, dtype=np.float64)
    if a.shape != b.shape or a.ndim != 1:
        raise ValueError(f"paired scores need two vectors of one length, got shapes {a.shape} and {b.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("paired scores must be finite")
    d = a - b
    out = {"n": int(d.size), "mean_diff": float(d.mean()) if d.size else float("nan"),
           "median_diff": float(np.median(d)) if d.size else float("nan"),
           "wins": int((d > 0).sum()), "losses": int((d < 0).sum()), "ties": int((d == 0).sum())}
    nonzero = d[d != 0]
    if nonzero.size == 0:
        return {**out, "statistic": float("nan") if d.size == 0 else 0.0,
                "p_value": float("nan") if d.size == 0 else 1.0, "r": float("nan") if d.size == 0 else 0.0}
    ranks = rankdata(np.abs(nonzero))
    w_plus, w_minus = float(ranks[nonzero > 0].sum()), float(ranks[nonzero < 0].sum())
    res = wilcoxon(a, b, zero_method="wilcox", alternative="two-sided")
    return {**out, "statistic": float(res.statistic), "p_value": float(res.pvalue),
            "r": (w_plus - w_minus) / (w_plus + w_minus)}


def paired_tests(rows: Iterable[Mapping], baseline: str, metric: str = "dice") -> list[dict]:
    """Every method against ``baseline``, per seed, over all images pooled over sites and per site.

    Args:
        rows: per-image rows with ``method``, ``seed``, ``site``, ``image`` and ``metric`` (a number).
        baseline: the method every other is compared with (e.g. ``"fedavg"``).
        metric: the score column.

    Returns:
        Tidy rows ``{"method", "baseline", "seed", "scope" ("all" or a site), **wilcoxon_paired(...), "q_value"}``, in
        the order methods then seeds then scopes. Only images scored for both (same seed, site and image) are
        paired. ``q_value``: Benjamini–Hochberg over every row with a p-value (NaN where the p-value is NaN).
    """
    scores: dict[tuple, dict[tuple, float]] = defaultdict(dict)
    for r in rows:
        scores[(str(r["method"]), int(r["seed"]))][(str(r["site"]), str(r["image"]))] = float(r[metric])
    methods = list(dict.fromkeys(m for m, _ in scores))
    out = []
    for method in methods:
        if method == baseline:
            continue
        for seed in sorted({s for m, s in scores if m == method}):
            base = scores.get((baseline, seed))
            if not base:
                continue
            mine = scores[(method, seed)]
            keys = sorted(set(mine) & set(base))
            sites = list(dict.fromkeys(site for site, _ in keys))
            for scope in ["all", *sites]:
                chosen = [k for k in keys if scope == "all" or k[0] == scope]
                out.append({"method": method, "baseline": baseline, "seed": seed, "scope": scope,
                            **wilcoxon_paired([mine[k] for k in chosen], [base[k] for k in chosen])})
    return with_q_values(out)


def with_q_values(tests: Sequence[Mapping]) -> list[dict]:
    """``tests`` with ``q_value``: their p-values adjusted together (Benjamini & Hochberg, JRSS-B 1995; SciPy's
    ``false_discovery_control``, method ``"bh"``). Rows whose p-value is NaN (no paired image) get NaN and do not
    count in the family."""
    from scipy.stats import false_discovery_control

    out = [{**t, "q_value": float("nan")} for t in tests]
    tested = [t for t in out if np.isfinite(t["p_value"])]
    if tested:
        for t, q in zip(tested, false_discovery_control([t["p_value"] for t in tested], method="bh")):
            t["q_value"] = float(q)
    return out


def paired_markdown(tests: Sequence[Mapping], scale: float = 100.0) -> str:
    """A Markdown table of :func:`paired_tests` rows: Δ mean and Δ median in Dice points (× ``scale``), wins/losses,
    r, p and q."""
    lines = ["| method vs baseline | seed | images | Δ mean | Δ median | wins / losses / ties | r | p (Wilcoxon) | q (BH) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for t in tests:
        lines.append(f"| {t['method']} vs {t['baseline']} ({t['scope']}) | {t['seed']} | {t['n']} | "
                     f"{t['mean_diff'] * scale:+.2f} | {t['median_diff'] * scale:+.2f} | "
                     f"{t['wins']} / {t['losses']} / {t['ties']} | {t['r']:+.2f} | {t['p_value']:.2g} | "
                     f"{t.get('q_value', float('nan')):.2g} |")
    return "\n".join(lines)
