"""Paired tests of two image-level classification methods over the same test images (FedUAA's form against FedAvg).

Each site's test task writes one row per test image (:class:`feduq.site.classification.ClassificationSite`:
``site, image, label, predicted, correct, p_0 .. p_{K-1}``); ``feduq compare`` adds ``method`` and ``seed``. For
each method against the baseline, per seed and with the seeds combined, over the test images of all sites together
(the images are the independent units):

* **accuracy**: both accuracies and the discordant images (method right / baseline wrong and the reverse); per seed
  the exact McNemar test (``scipy.stats.binomtest`` of the discordant counts against 1/2); seeds combined, each
  image's correctness is averaged over the seeds and the per-image differences go to the Wilcoxon signed-rank test
  (:func:`feduq.results.paired.wilcoxon_paired`);
* **AUC** of the class probabilities (scikit-learn ``roc_auc_score``; binary: ``p_1``; K > 2: one-vs-rest macro) on
  the pooled images, the difference and its 95 % percentile bootstrap interval over images (resamples holding one
  class only are skipped; seeds combined: each image's probabilities averaged over the seeds).
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence

import numpy as np

__all__ = ["classification_tests", "classification_markdown"]


def _auc(labels: np.ndarray, probs: np.ndarray) -> float:
    from sklearn.metrics import roc_auc_score

    if len(np.unique(labels)) < probs.shape[1]:
        return math.nan
    if probs.shape[1] == 2:
        return float(roc_auc_score(labels, probs[:, 1]))
    return float(roc_auc_score(labels, probs, multi_class="ovr", average="macro"))


def _table(rows: Iterable[Mapping], method: str, seeds: Sequence) -> dict[tuple[str, str], tuple[int, float, np.ndarray]]:
    """(site, image) -> (label, correctness averaged over ``seeds``, probabilities averaged over ``seeds``)."""
    acc: dict[tuple[str, str], list] = {}
    for r in rows:
        if r["method"] != method or r["seed"] not in seeds:
            continue
        k = sorted(int(c[2:]) for c in r if c.startswith("p_") and c[2:].isdigit())
        probs = np.array([float(r[f"p_{i}"]) for i in k])
        acc.setdefault((r["site"], r["image"]), []).append((int(r["label"]), float(r["correct"]), probs))
    return {key: (v[0][0], float(np.mean([c for _, c, _ in v])), np.mean([p for _, _, p in v], axis=0))
            for key, v in acc.items() if len(v) == len(seeds)}


def classification_tests(rows: Iterable[Mapping], baseline: str, n_boot: int = 2000, seed: int = 0) -> list[dict]:
    """One row per (method != baseline, seed or ``"all"``): see the module docstring.

    Args:
        rows: per-image rows with ``method``, ``seed``, ``site``, ``image``, ``label``, ``correct`` and ``p_k``.
        baseline: the method the others are compared with.
        n_boot: bootstrap resamples of the AUC difference. seed: their generator's seed.

    Returns:
        ``{"method", "baseline", "seed", "images", "accuracy", "accuracy_baseline", "method_only_right",
        "baseline_only_right", "p_accuracy", "test_accuracy", "auc", "auc_baseline", "auc_diff", "auc_diff_low",
        "auc_diff_high"}`` (fractions; NaN where undefined).

    Raises:
        ValueError: ``baseline`` has no rows.
    """
    from scipy.stats import binomtest

    from .paired import wilcoxon_paired

    rows = list(rows)
    methods = sorted({r["method"] for r in rows})
    if baseline not in methods:
        raise ValueError(f"classification_tests: baseline {baseline!r} has no per-image rows (methods: {methods})")
    rng = np.random.default_rng(seed)
    out = []
    for method in (m for m in methods if m != baseline):
        common = sorted({r["seed"] for r in rows if r["method"] == method} & {r["seed"] for r in rows
                                                                             if r["method"] == baseline})
        for which in [*[[s] for s in common], *([common] if len(common) > 1 else [])]:
            a, b = _table(rows, method, which), _table(rows, baseline, which)
            keys = sorted(set(a) & set(b))
            if not keys:
                continue
            labels = np.array([a[k][0] for k in keys])
            ca, cb = np.array([a[k][1] for k in keys]), np.array([b[k][1] for k in keys])
            pa, pb = np.stack([a[k][2] for k in keys]), np.stack([b[k][2] for k in keys])
            only_a, only_b = int(((ca == 1) & (cb == 0)).sum()), int(((ca == 0) & (cb == 1)).sum())
            if len(which) == 1:
                n = only_a + only_b
                p_acc, test = (binomtest(only_a, n, 0.5).pvalue if n else 1.0), "McNemar (exact)"
            else:
                p_acc, test = wilcoxon_paired(list(ca), list(cb))["p_value"], "Wilcoxon (seed-mean correctness)"
            auc_a, auc_b = _auc(labels, pa), _auc(labels, pb)
            # a percentile bootstrap by hand, not scipy.stats.bootstrap: a resample of a small test set can hold one
            # class only, where the AUC is undefined; such draws are skipped here, while SciPy's interval would be NaN
            diffs = []
            for _ in range(n_boot if math.isfinite(auc_a - auc_b) else 0):
                i = rng.integers(0, len(keys), len(keys))
                d = _auc(labels[i], pa[i]) - _auc(labels[i], pb[i])
                if math.isfinite(d):
                    diffs.append(d)
            low, high = (np.percentile(diffs, [2.5, 97.5]) if diffs else (math.nan, math.nan))
            out.append({"method": method, "baseline": baseline, "seed": which[0] if len(which) == 1 else "all",
                        "images": len(keys), "accuracy": float(ca.mean()), "accuracy_baseline": float(cb.mean()),
                        "method_only_right": only_a, "baseline_only_right": only_b, "p_accuracy": float(p_acc),
                        "test_accuracy": test, "auc": auc_a, "auc_baseline": auc_b, "auc_diff": auc_a - auc_b,
                        "auc_diff_low": float(low), "auc_diff_high": float(high)})
    return out


def classification_markdown(tests: Sequence[Mapping]) -> str:
    """A Markdown table of :func:`classification_tests` rows (percentages)."""
    from .paired import markdown_rows

    pct = lambda v: "–" if not math.isfinite(float(v)) else f"{100 * float(v):.1f}"  # noqa: E731
    head = ["method vs baseline", "seed", "images", "accuracy % (baseline)", "only method / only baseline right",
            "p (accuracy)", "AUC % (baseline)", "Δ AUC [95 % CI]"]
    return markdown_rows(head, ([f"{t['method']} vs {t['baseline']}", str(t["seed"]), str(t["images"]),
                                 f"{pct(t['accuracy'])} ({pct(t['accuracy_baseline'])})",
                                 f"{t['method_only_right']} / {t['baseline_only_right']}",
                                 f"{float(t['p_accuracy']):.3g} ({t['test_accuracy']})",
                                 f"{pct(t['auc'])} ({pct(t['auc_baseline'])})",
                                 f"{pct(t['auc_diff'])} [{pct(t['auc_diff_low'])}, {pct(t['auc_diff_high'])}]"]
                                for t in tests))
