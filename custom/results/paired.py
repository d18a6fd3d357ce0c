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

**Independent units.** Per-image tests are sound only where the images are independent (Kvasir-SEG). Video frames
of one sequence (CVC-ColonDB, CVC-ClinicDB) or slices of one patient are near-copies: a test over frames counts one
polyp many times and its p-value is too small. :func:`clustered_tests` therefore tests at the level of the site's
groups (the ``provenance.csv`` column or stem pattern its splits keep together, :func:`feduq.data.center_groups`):

* each image's difference is first averaged over the seeds (one estimate from all seeds: the same test images in
  every seed), then over the images of its group: one difference per independent unit, the cluster mean;
* the Wilcoxon signed-rank test and r as above, over those cluster means (a cluster of identical frames counts as one
  image; a site whose images are independent gives its per-image test);
* ``ci_low`` / ``ci_high``: the percentile interval of a **cluster bootstrap** of the mean cluster difference
  (clusters resampled with replacement within each site, ``n_boot`` draws, a seeded NumPy generator), which keeps
  the within-sequence correlation that an image bootstrap would break (Field & Welsh, JRSS-B 2007).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["wilcoxon_paired", "paired_tests", "with_q_values", "markdown_rows", "paired_markdown",
           "cluster_bootstrap_ci", "clustered_tests", "clustered_markdown", "site_clusters"]


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


def markdown_rows(head: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A Markdown table: the header ``head``, its rule, then one line per row of cells (already formatted)."""
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    return "\n".join(lines + ["| " + " | ".join(cells) + " |" for cells in rows])


def paired_markdown(tests: Sequence[Mapping], scale: float = 100.0) -> str:
    """A Markdown table of :func:`paired_tests` rows: Δ mean and Δ median in Dice points (× ``scale``), wins/losses,
    r, p and q."""
    head = ["method vs baseline", "seed", "images", "Δ mean", "Δ median", "wins / losses / ties", "r", "p (Wilcoxon)",
            "q (BH)"]
    return markdown_rows(head, ([f"{t['method']} vs {t['baseline']} ({t['scope']})", str(t["seed"]), str(t["n"]),
                                 f"{t['mean_diff'] * scale:+.2f}", f"{t['median_diff'] * scale:+.2f}",
                                 f"{t['wins']} / {t['losses']} / {t['ties']}", f"{t['r']:+.2f}", f"{t['p_value']:.2g}",
                                 f"{t.get('q_value', float('nan')):.2g}"] for t in tests))


def cluster_bootstrap_ci(cluster_diffs: Sequence[float], strata: Sequence[str] | None = None, *, n_boot: int = 10_000,
                         level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile interval of the mean of ``cluster_diffs`` (one difference per independent unit) under a cluster
    bootstrap: each draw resamples, within each stratum (site), as many clusters as it has, with replacement, and
    takes the mean over all drawn clusters.

    Args:
        cluster_diffs: ``[C]`` cluster-mean differences (Dice as a fraction).
        strata: ``[C]`` the stratum of each cluster (its site); None: one stratum.
        n_boot: bootstrap draws. level: the interval's coverage, in (0, 1). seed: NumPy ``default_rng`` seed.

    Returns:
        ``(low, high)``: the ``(1 - level) / 2`` and ``(1 + level) / 2`` quantiles of the draws (NumPy's linear
        interpolation); ``(nan, nan)`` for no cluster.

    Raises:
        ValueError: lengths differ, a non-finite difference, ``n_boot < 1`` or ``level`` outside (0, 1).
    """
    d = np.asarray(cluster_diffs, dtype=np.float64)
    strata = np.asarray(["all"] * d.size if strata is None else list(strata), dtype=object)
    if d.ndim != 1 or strata.shape != d.shape:
        raise ValueError(f"cluster_bootstrap_ci: {d.shape[0] if d.ndim else 0} differences, {strata.size} strata")
    if not np.isfinite(d).all() or not (isinstance(n_boot, int) and n_boot >= 1) or not 0.0 < level < 1.0:
        raise ValueError(f"cluster_bootstrap_ci: needs finite differences, n_boot >= 1 and 0 < level < 1 "
                         f"(got n_boot={n_boot!r}, level={level!r})")
    if d.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    sums = np.zeros(n_boot)
    for stratum in dict.fromkeys(strata.tolist()):
        values = d[strata == stratum]
        sums += values[rng.integers(0, values.size, size=(n_boot, values.size))].sum(axis=1)
    means = sums / d.size
    return float(np.quantile(means, (1 - level) / 2)), float(np.quantile(means, (1 + level) / 2))


def clustered_tests(rows: Iterable[Mapping], baseline: str, clusters: Mapping[tuple[str, str], str] | None = None,
                    units: Mapping[str, str] | None = None, metric: str = "dice", n_boot: int = 10_000,
                    seed: int = 0) -> list[dict]:
    """Every method against ``baseline`` over independent units (see the module docstring), all seeds in one
    estimate, over all sites and per site.

    Args:
        rows: per-image rows with ``method``, ``seed``, ``site``, ``image`` and ``metric``.
        baseline: the method every other is compared with.
        clusters: ``(site, image) -> group`` for sites whose images are not independent (video sequence, patient);
            an image not listed is its own unit.
        units: site -> what its unit is called (e.g. ``"sequence"``); default ``"image"``.
        n_boot, seed: the cluster bootstrap's draws and generator seed (:func:`cluster_bootstrap_ci`).

    Returns:
        Tidy rows ``{"method", "baseline", "seeds", "scope", "unit", "n_images", "n" (independent units), "mean_diff"
        (mean of the cluster-mean differences), "median_diff", "wins", "losses", "ties" (units), "statistic",
        "p_value", "r", "ci_low", "ci_high", "q_value"}``. Only images scored for both methods in every seed both ran
        are paired; ``q_value``: Benjamini–Hochberg over the returned rows.
    """
    clusters, units = clusters or {}, units or {}
    scores: dict[str, dict[int, dict[tuple, float]]] = defaultdict(lambda: defaultdict(dict))
    for r in rows:
        scores[str(r["method"])][int(r["seed"])][(str(r["site"]), str(r["image"]))] = float(r[metric])
    out = []
    for method in scores:
        if method == baseline or baseline not in scores:
            continue
        seeds = sorted(set(scores[method]) & set(scores[baseline]))
        if not seeds:
            continue
        keys = set.intersection(*(set(scores[method][s]) & set(scores[baseline][s]) for s in seeds))
        mine = {k: np.mean([scores[method][s][k] for s in seeds]) for k in keys}
        base = {k: np.mean([scores[baseline][s][k] for s in seeds]) for k in keys}
        sites = sorted({site for site, _ in keys})
        for scope in ["all", *sites]:
            groups: dict[tuple, list[tuple]] = defaultdict(list)
            for k in sorted(keys):
                if scope == "all" or k[0] == scope:
                    groups[(k[0], clusters.get(k, f"image:{k[1]}"))].append(k)
            ids = list(groups)
            a = [float(np.mean([mine[k] for k in groups[g]])) for g in ids]
            b = [float(np.mean([base[k] for k in groups[g]])) for g in ids]
            low, high = cluster_bootstrap_ci(np.subtract(a, b), [g[0] for g in ids], n_boot=n_boot, seed=seed)
            scope_units = {units.get(site, "image") for site, _ in ids}
            unit = "image" if all(len(groups[g]) == 1 for g in ids) else " / ".join(sorted(scope_units))
            out.append({"method": method, "baseline": baseline, "seeds": " ".join(map(str, seeds)), "scope": scope,
                        "unit": unit, "n_images": sum(len(v) for v in groups.values()),
                        **wilcoxon_paired(a, b), "ci_low": low, "ci_high": high})
    return with_q_values(out)


def clustered_markdown(tests: Sequence[Mapping], scale: float = 100.0) -> str:
    """A Markdown table of :func:`clustered_tests` rows: units, Δ (mean over units) with its cluster-bootstrap 95 %
    interval in Dice points (× ``scale``), wins/losses over units, r, p and q."""
    head = ["method vs baseline", "seeds", "unit", "units (images)", "Δ mean [95 % CI]", "wins / losses / ties", "r",
            "p (Wilcoxon)", "q (BH)"]
    return markdown_rows(head, ([f"{t['method']} vs {t['baseline']} ({t['scope']})", str(t["seeds"]), str(t["unit"]),
                                 f"{t['n']} ({t['n_images']})",
                                 f"{t['mean_diff'] * scale:+.2f} [{t['ci_low'] * scale:+.2f}, {t['ci_high'] * scale:+.2f}]",
                                 f"{t['wins']} / {t['losses']} / {t['ties']}", f"{t['r']:+.2f}", f"{t['p_value']:.2g}",
                                 f"{t.get('q_value', float('nan')):.2g}"] for t in tests))


def site_clusters(data_root, task: str, sites: Iterable[str]) -> tuple[dict[tuple[str, str], str], dict[str, str]]:
    """The independent units of each site's images, read from its folder (:func:`feduq.data.center_groups`):
    ``({(site, image stem): group}, {site: unit name})`` for the sites whose images are grouped (CVC-ColonDB and
    CVC-ClinicDB: ``"sequence"``); a site whose images are independent (Kvasir-SEG) is in neither.

    Raises:
        DataError: a site's folder or its provenance column is missing (named).
    """
    from ..sites.centers import site_center
    from ..sites.folder import SiteFolder

    clusters, units = {}, {}
    for site in sites:
        table, unit = SiteFolder.of(task, site_center(task, site), data_root).groups()
        if table is not None:
            clusters.update({(site, name): group for name, group in table.items()})
            units[site] = unit
    return clusters, units
