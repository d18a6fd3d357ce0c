"""The review flag judged at a hospital the model never saw: calibrate on the federation's sites, score a
held-out site with its masks.

The rule (:func:`feduq.review.rule.choose_rule`) is chosen on the calibration sites' labelled validation images;
the held-out site's every image is then scored with its mask, and the rule's decisions are judged there:

* the **risk–coverage curve** of the rule's ordering (cases flagged for implausible size or unfamiliar input last,
  the rest by the rule's case score; risk = 1 − Dice) and its area **AURC**, beside the image-mean score's (the rule
  of an older FedUQ), random ordering's (its expectation: the mean risk) and the oracle's (cases sorted by their
  true risk; Geifman et al., *Bias-reduced uncertainty estimation for deep neural classifiers*, ICLR 2019);
* at the rule's threshold: the **coverage**, the **accepted** and **flagged** cases' mean Dice with 95 % cluster
  bootstrap intervals over the site's independent units (a patient's slices, a video's frames, or the image:
  :func:`feduq.results.paired.site_clusters`), and the all-cases mean;
* the **goal**: accepted mean Dice >= flagged and >= all cases', AURC below random ordering's, and no accepted case
  whose prediction is empty or below the size floor when every calibration case holds the structure.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import numpy as np

__all__ = ["ratio_ci", "judge_rule", "held_out_review", "review_markdown", "rule_curves"]


def ratio_ci(values: Sequence[float], chosen: Sequence[bool], units: Sequence[str] | None = None, *,
             n_boot: int = 10_000, level: float = 0.95, seed: int = 0) -> tuple[float, float, float]:
    """The mean of ``values`` over the ``chosen`` cases, and its percentile interval under a cluster bootstrap (SciPy's
    ``stats.bootstrap``, paired over units: each draw resamples the units with replacement and takes the chosen cases'
    mean in them, a ratio of sums; a draw without a chosen case is left out of the quantiles).

    Args:
        values: ``[N]`` per case (Dice as a fraction). chosen: ``[N]`` bool. units: ``[N]`` each case's independent
            unit (None: every case its own).

    Returns:
        ``(mean, low, high)``; NaNs where no case is chosen; the interval is ``(mean, mean)`` for one unit.
    """
    from scipy import stats

    v, c = np.asarray(values, dtype=np.float64), np.asarray(chosen, dtype=bool)
    if not c.any():
        return math.nan, math.nan, math.nan
    mean = float(v[c].mean())
    keys = np.arange(v.size).astype(str) if units is None else np.asarray(list(units), dtype=object)
    names = list(dict.fromkeys(keys.tolist()))
    index = {k: i for i, k in enumerate(names)}
    unit = np.array([index[k] for k in keys.tolist()])
    sums = np.bincount(unit, weights=np.where(c, v, 0.0), minlength=len(names))
    counts = np.bincount(unit, weights=c.astype(np.float64), minlength=len(names))
    if len(names) < 2:
        return mean, mean, mean

    def statistic(s, n, axis=-1):
        total = n.sum(axis=axis)
        return np.where(total > 0, s.sum(axis=axis) / np.maximum(total, 1e-12), np.nan)

    import warnings

    with warnings.catch_warnings():  # a draw without a chosen case has no mean (NaN): left out of the quantiles below
        warnings.simplefilter("ignore", stats.DegenerateDataWarning)
        res = stats.bootstrap((sums, counts), statistic, paired=True, vectorized=True, n_resamples=n_boot,
                              confidence_level=level, method="percentile", random_state=seed)
    low, high = np.nanquantile(res.bootstrap_distribution, [(1 - level) / 2, (1 + level) / 2])
    return mean, float(low), float(high)


def rule_curves(rule, cases: Mapping[str, np.ndarray], flagged_first: np.ndarray) -> dict[str, tuple]:
    """Risk–coverage curves ``name -> (coverage [N], risk [N])`` of the rule's ordering (``flagged_first``: the cases
    its size or familiarity part flags, put last), the image mean's, the oracle's and random ordering's (flat at the
    mean risk, its expectation at every coverage)."""
    from ..scores.uncertainty_quality import risk_coverage

    risk = 1.0 - np.asarray(cases["dice"], dtype=np.float64)
    score = np.asarray(cases[rule.score], dtype=np.float64)
    # a lexicographic key as one number: flagged cases beyond every unflagged score
    span = np.nanmax(np.abs(score)) + 1.0 if score.size else 1.0
    key = np.where(flagged_first, score + 2 * span, score)
    out = {}
    for name, order_key in ((f"rule ({rule.score})", key), ("image mean (u_mean)", cases["u_mean"]),
                            ("oracle", risk)):
        coverage, curve, _ = risk_coverage(order_key, risk)
        out[name] = (coverage, curve)
    n = risk.size
    out["random (expected)"] = (np.arange(1, n + 1) / n, np.full(n, risk.mean()))
    return out


def judge_rule(rule, cases: Mapping[str, np.ndarray], features: np.ndarray | None, units: Sequence[str] | None = None,
               n_boot: int = 10_000) -> tuple[dict, list[list[str]], dict]:
    """Apply ``rule`` (:class:`feduq.review.rule.ReviewThreshold`) to labelled cases and judge it.

    Args:
        cases: ``[N]`` arrays of :data:`feduq.review.calibration.CASE_KEYS`. features: ``[N, F]`` or None.
        units: ``[N]`` each case's independent unit.

    Returns:
        ``(summary, reasons per case, curves)``: the summary has ``n_cases``, ``n_units``, ``coverage``,
        ``accepted_dice`` / ``flagged_dice`` (with ``_low`` / ``_high``), ``all_dice``, ``aurc_rule``,
        ``aurc_image_mean``, ``aurc_random``, ``aurc_oracle``, the fraction each part flags
        (``flagged_size``, ``flagged_unfamiliar``, ``flagged_uncertain``), ``accepted_small`` (accepted cases whose
        prediction is empty or below the size floor) and ``goal_met`` (the module doc's goal).
    """
    dice = np.asarray(cases["dice"], dtype=np.float64)
    n = dice.size
    reasons = [rule.reasons({k: float(cases[k][i]) for k in cases}, None if features is None else features[i])
               for i in range(n)]
    accepted = np.array([not r for r in reasons])
    size_or_odd = np.array([("implausible size" in r) or ("unfamiliar input" in r) for r in reasons])
    curves = rule_curves(rule, cases, size_or_odd)
    aurc = {name: float(np.mean(curve)) for name, (_, curve) in curves.items()}
    acc = ratio_ci(dice, accepted, units, n_boot=n_boot)
    flg = ratio_ci(dice, ~accepted, units, n_boot=n_boot)
    area = np.asarray(cases["area_fraction"], dtype=np.float64)
    # an empty or implausibly small prediction matters where every calibration case holds the structure (a size floor)
    small = ((area <= 0) | (area < rule.size_floor)) if rule.size_floor is not None else np.zeros(n, bool)
    summary = {
        "n_cases": int(n), "n_units": int(len(set(units)) if units is not None else n),
        "coverage": float(accepted.mean()) if n else math.nan,
        "accepted_dice": acc[0], "accepted_dice_low": acc[1], "accepted_dice_high": acc[2],
        "flagged_dice": flg[0], "flagged_dice_low": flg[1], "flagged_dice_high": flg[2],
        "all_dice": float(dice.mean()) if n else math.nan,
        "aurc_rule": aurc[f"rule ({rule.score})"], "aurc_image_mean": aurc["image mean (u_mean)"],
        "aurc_random": aurc["random (expected)"], "aurc_oracle": aurc["oracle"],
        "flagged_size": float(np.mean(["implausible size" in r for r in reasons])),
        "flagged_unfamiliar": float(np.mean(["unfamiliar input" in r for r in reasons])),
        "flagged_uncertain": float(np.mean(["uncertain" in r for r in reasons])),
        "accepted_small": int((accepted & small).sum()),
    }
    met = (summary["aurc_rule"] < summary["aurc_random"] and summary["accepted_small"] == 0
           and (not accepted.any() or (summary["accepted_dice"] >= summary["all_dice"] - 1e-12
                                       and (accepted.all() or summary["accepted_dice"] >= summary["flagged_dice"]))))
    summary["goal_met"] = bool(met)
    return summary, reasons, curves


def held_out_review(loaded, *, calibration_sites: Sequence[str], data_root, held_out_dir, target_dice: float,
                    split: str = "val", units: Mapping[str, str] | None = None, max_items: int | None = None,
                    n_boot: int = 10_000) -> tuple[dict, list[dict], dict]:
    """Choose the review rule of ``loaded``'s model on ``calibration_sites``' ``split`` and judge it on every labelled
    image of ``held_out_dir`` (:func:`judge_rule`).

    Args:
        units: held-out image stem -> its independent unit (a missing stem is its own unit).

    Returns:
        ``(summary, per-case rows, curves)``: the summary adds ``rule`` (the chosen rule's fields), ``score``,
        ``target_dice``, the calibration's ``calibration_coverage`` and ``calibration_accepted_dice``; a row has
        the image, its unit, Dice, case scores, ``review`` and ``review_reason``.

    Raises:
        feduq.review.rule.ReviewError: no threshold reaches ``target_dice`` on the calibration sites.
        feduq.data.DataError / feduq.site.evaluation.EvaluationError: a site or folder that cannot be scored.
    """
    from dataclasses import asdict

    from ..review.calibration import labelled_cases
    from ..review.rule import choose_rule

    cal, cal_features, where, _ = labelled_cases(loaded, sites=calibration_sites, data_root=data_root, split=split,
                                                 max_items=max_items)
    rule = choose_rule(cal, target_dice, features=cal_features, uncertainty=loaded.site.primary_uncertainty)
    rule.calibrated_on = where
    held, held_features, _, rows = labelled_cases(loaded, site_dirs=[held_out_dir], max_items=max_items)
    unit_of = [str((units or {}).get(r["image"], r["image"])) for r in rows]
    summary, reasons, curves = judge_rule(rule, held, held_features, unit_of, n_boot=n_boot)
    summary.update({"score": rule.score, "target_dice": float(target_dice), "calibration_coverage": rule.coverage,
                    "calibration_accepted_dice": rule.accepted_dice, "rule": asdict(rule)})
    per_case = [{"image": r["image"], "unit": u, "dice": r["dice"],
                 **{k: float(held[k][i]) for k in ("u_mean", "u_foreground", "u_boundary", "area_fraction")},
                 "review": "yes" if why else "no", "review_reason": "; ".join(why)}
                for i, (r, u, why) in enumerate(zip(rows, unit_of, reasons))]
    return summary, per_case, curves


def review_markdown(rows: Sequence[Mapping]) -> str:
    """A Markdown table of held-out review rows (``held_out``, ``method``, ``seed`` and :func:`judge_rule`'s
    summary): what the calibration promised (its coverage and accepted Dice), coverage, accepted / flagged Dice
    [95 % CI], all cases' Dice, AURC of the rule, the image mean, random
    and oracle ordering, what each part flagged, and whether the goal is met."""
    pct = lambda v: "–" if not math.isfinite(v) else f"{100 * v:.1f}"  # noqa: E731
    head = ["held-out site", "method", "seed", "cases (units)", "score", "calibration: coverage % / accepted Dice",
            "coverage %", "accepted Dice [95 % CI]",
            "flagged Dice [95 % CI]", "all Dice", "AURC rule", "AURC image mean", "AURC random", "AURC oracle",
            "flagged size / unfamiliar / uncertain %", "goal"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]
    for r in rows:
        cells = [r["held_out"], r["method"], str(r["seed"]), f"{r['n_cases']} ({r['n_units']})", r["score"],
                 f"{pct(float(r.get('calibration_coverage', math.nan)))} / "
                 f"{pct(float(r.get('calibration_accepted_dice', math.nan)))}",
                 pct(r["coverage"]),
                 f"{pct(r['accepted_dice'])} [{pct(r['accepted_dice_low'])}, {pct(r['accepted_dice_high'])}]",
                 f"{pct(r['flagged_dice'])} [{pct(r['flagged_dice_low'])}, {pct(r['flagged_dice_high'])}]",
                 pct(r["all_dice"]), f"{r['aurc_rule']:.4f}", f"{r['aurc_image_mean']:.4f}",
                 f"{r['aurc_random']:.4f}", f"{r['aurc_oracle']:.4f}",
                 f"{pct(r['flagged_size'])} / {pct(r['flagged_unfamiliar'])} / {pct(r['flagged_uncertain'])}",
                 "met" if r["goal_met"] else "not met"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
