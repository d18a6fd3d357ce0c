"""Paired per-image tests (feduq.results.paired): hand-computed signed ranks, pairing by (seed, site, image)."""

import math

import pytest

from feduq.results.paired import paired_markdown, paired_tests, wilcoxon_paired, with_q_values


def test_wilcoxon_paired_by_hand():
    """d = [+.25, -.125, 0, +.5, +.125]: the tie is dropped; |d| ranks .125 -> 1.5, 1.5; .25 -> 3; .5 -> 4, so
    W+ = 3 + 4 + 1.5 = 8.5, W- = 1.5, statistic min = 1.5, r = (8.5 - 1.5) / 10 = 0.7."""
    res = wilcoxon_paired([1.0, 0.5, 0.75, 0.75, 0.5], [0.75, 0.625, 0.75, 0.25, 0.375])
    assert (res["n"], res["wins"], res["losses"], res["ties"]) == (5, 3, 1, 1)
    assert res["mean_diff"] == pytest.approx(0.75 / 5) and res["median_diff"] == 0.125
    assert res["statistic"] == 1.5 and res["r"] == pytest.approx(0.7)
    assert 0.0 < res["p_value"] < 1.0
    tied = wilcoxon_paired([0.5, 0.5], [0.5, 0.5])
    assert tied["p_value"] == 1.0 and tied["r"] == 0.0 and tied["ties"] == 2
    assert math.isnan(wilcoxon_paired([], [])["p_value"])
    with pytest.raises(ValueError, match="one length"):
        wilcoxon_paired([0.1, 0.2], [0.1])


def test_a_method_that_wins_every_image_has_r_one_and_a_small_p():
    base = [i / 40 for i in range(30)]
    res = wilcoxon_paired([b + 0.01 * (1 + i % 3) for i, b in enumerate(base)], base)
    assert res["wins"] == 30 and res["r"] == 1.0 and res["statistic"] == 0.0 and res["p_value"] < 1e-5


def test_paired_tests_pair_by_seed_site_and_image():
    rows = []
    for seed in (0, 1):
        for site, n in (("A", 3), ("B", 2)):
            for i in range(n):
                rows.append({"method": "fedavg", "seed": seed, "site": site, "image": f"{i}", "dice": 0.5})
                rows.append({"method": "fedevi", "seed": seed, "site": site, "image": f"{i}",
                             "dice": 0.5 + (0.1 if site == "A" else -0.2)})
    rows.append({"method": "fedevi", "seed": 0, "site": "B", "image": "only-here", "dice": 1.0})  # unpaired: left out
    tests = paired_tests(rows, baseline="fedavg")
    assert [(t["seed"], t["scope"], t["n"]) for t in tests] == [(0, "all", 5), (0, "A", 3), (0, "B", 2),
                                                               (1, "all", 5), (1, "A", 3), (1, "B", 2)]
    everything = tests[0]
    assert everything["mean_diff"] == pytest.approx((3 * 0.1 - 2 * 0.2) / 5)
    assert (everything["wins"], everything["losses"]) == (3, 2)
    assert everything["r"] == pytest.approx((6 - 9) / 15)  # ranks: the three +0.1 get 1..3 (2 each), the -0.2 4.5
    # each row's q is its p adjusted over the six tests, never below it (the values: the hand-computed test below)
    assert all(t["q_value"] >= t["p_value"] for t in tests)
    md = paired_markdown(tests)
    assert "| fedevi vs fedavg (all) | 0 | 5 | -2.00 | +10.00 | 3 / 2 / 0 | -0.20 |" in md


def test_q_values_are_benjamini_hochberg_over_the_table_by_hand():
    """p = .01, .04, .03, .2 (m = 4): sorted .01 .03 .04 .2 -> p*m/rank = .04, .06, .0533, .2; the running minimum from
    the largest gives .04, .0533, .0533, .2. A row without a p-value (no paired image) is left out of the family."""
    rows = [{"p_value": p} for p in (0.01, 0.04, 0.03, float("nan"), 0.2)]
    q = [t["q_value"] for t in with_q_values(rows)]
    assert q[0] == pytest.approx(0.04) and q[1] == pytest.approx(0.16 / 3) and q[2] == pytest.approx(0.16 / 3)
    assert math.isnan(q[3]) and q[4] == pytest.approx(0.2)
    assert "q_value" not in rows[0]  # the input rows are not changed
