"""Paired tests of two image-level classifiers (feduq.results.classification_paired), by hand."""

import math

import pytest

from feduq.results.classification_paired import classification_markdown, classification_tests


def _rows(method, seed, probs, labels, site="A"):
    return [{"method": method, "seed": seed, "site": site, "image": f"i{i}", "label": y, "p_0": 1 - p, "p_1": p,
             "correct": int((p >= 0.5) == (y == 1)), "predicted": int(p >= 0.5)} for i, (p, y) in enumerate(zip(probs, labels))]


def test_mcnemar_counts_auc_and_the_seeds_combined_by_hand():
    labels = [0, 0, 0, 1, 1, 1]
    # method: right on all six, ranks every positive above every negative (AUC 1)
    m0 = _rows("m", 0, [0.1, 0.2, 0.3, 0.7, 0.8, 0.9], labels)
    # baseline: wrong on images 2 (0.6 for a negative) and 3 (0.4 for a positive); AUC: 8 of 9 pairs ordered
    b0 = _rows("b", 0, [0.1, 0.2, 0.6, 0.4, 0.8, 0.9], labels)
    tests = classification_tests(m0 + b0, baseline="b", n_boot=200)
    assert len(tests) == 1
    t = tests[0]
    assert t["images"] == 6 and t["accuracy"] == 1.0 and t["accuracy_baseline"] == pytest.approx(4 / 6)
    assert (t["method_only_right"], t["baseline_only_right"]) == (2, 0)
    assert t["p_accuracy"] == pytest.approx(0.5)  # exact McNemar: 2 discordant pairs, both one way: 2 * 0.5**2
    assert t["auc"] == 1.0 and t["auc_baseline"] == pytest.approx(8 / 9) and t["auc_diff"] == pytest.approx(1 / 9)
    assert 0.0 <= t["auc_diff_low"] <= t["auc_diff"] <= t["auc_diff_high"] + 1e-12
    # a second seed where the two agree: the per-seed rows and the combined one (seed-mean correctness, Wilcoxon)
    m1, b1 = _rows("m", 1, [0.1] * 3 + [0.9] * 3, labels), _rows("b", 1, [0.1] * 3 + [0.9] * 3, labels)
    tests = {t["seed"]: t for t in classification_tests(m0 + b0 + m1 + b1, baseline="b", n_boot=50)}
    assert set(tests) == {0, 1, "all"} and tests[1]["p_accuracy"] == 1.0 and tests[1]["auc_diff"] == 0.0
    assert tests["all"]["accuracy_baseline"] == pytest.approx((4 / 6 + 1) / 2)
    assert tests["all"]["test_accuracy"].startswith("Wilcoxon") and 0 < tests["all"]["p_accuracy"] <= 1
    assert "| m vs b | 0 | 6 | 100.0 (66.7) | 2 / 0 | 0.5 (McNemar (exact)) | 100.0 (88.9) |" in \
        classification_markdown([tests[0]])
    with pytest.raises(ValueError, match="baseline 'x' has no per-image rows"):
        classification_tests(m0, baseline="x")


def test_one_class_test_set_has_no_auc():
    labels = [1, 1, 1]
    t = classification_tests(_rows("m", 0, [0.9, 0.8, 0.2], labels) + _rows("b", 0, [0.9, 0.1, 0.2], labels),
                             baseline="b", n_boot=20)[0]
    assert math.isnan(t["auc"]) and math.isnan(t["auc_diff_low"]) and (t["method_only_right"], t["baseline_only_right"]) == (1, 0)
