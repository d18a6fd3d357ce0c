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


# -- tests over independent units (video sequences, patients) -------------------------------------------------------
import numpy as np  # noqa: E402

from feduq.results.paired import cluster_bootstrap_ci, clustered_markdown, clustered_tests  # noqa: E402


def _rows(pairs, site="S", seed=0):
    """per-image rows of method "m" and baseline "b": pairs = [(image, m score, b score), ...]"""
    out = []
    for image, m, b in pairs:
        out += [{"method": "m", "seed": seed, "site": site, "image": image, "dice": m},
                {"method": "b", "seed": seed, "site": site, "image": image, "dice": b}]
    return out


def test_two_clusters_of_identical_frames_test_as_two_independent_images():
    """Sequence c1: 5 identical frames (0.8 vs 0.7), c2: 3 identical frames (0.5 vs 0.55): as two images, not eight."""
    frames = [(f"c1_{i}", 0.8, 0.7) for i in range(5)] + [(f"c2_{i}", 0.5, 0.55) for i in range(3)]
    clusters = {("S", f"c{c}_{i}"): f"c{c}" for c in (1, 2) for i in range(5)}
    grouped = clustered_tests(_rows(frames), "b", clusters, units={"S": "sequence"})
    alone = clustered_tests(_rows([("x", 0.8, 0.7), ("y", 0.5, 0.55)]), "b")
    keys = ("n", "mean_diff", "median_diff", "wins", "losses", "ties", "statistic", "p_value", "r", "ci_low", "ci_high")
    for g, a in zip(grouped, alone):
        assert g["scope"] == a["scope"] and {k: g[k] for k in keys} == pytest.approx({k: a[k] for k in keys})
    g = grouped[0]
    assert (g["n"], g["n_images"], g["unit"], a["unit"]) == (2, 8, "sequence", "image")
    assert g["mean_diff"] == pytest.approx((0.1 - 0.05) / 2) and (g["wins"], g["losses"]) == (1, 1)
    naive = paired_tests(_rows(frames), "b")[0]  # the per-image test counts the frames: 8 pairs
    assert naive["n"] == 8 and naive["p_value"] < g["p_value"]


def test_the_cluster_bootstrap_by_hand():
    """Two clusters d = (0.1, 0.3): a draw's mean is 0.1, 0.2 or 0.3 with probability 1/4, 1/2, 1/4, so the 95 %
    interval is exactly (0.1, 0.3); with seed 0 and three draws, the draws are the generator's integers, by hand."""
    assert cluster_bootstrap_ci([0.1, 0.3], n_boot=4000, seed=0) == pytest.approx((0.1, 0.3))
    draws = np.random.default_rng(0).integers(0, 2, size=(3, 2))  # the same generator calls the function makes
    d = np.array([0.1, 0.3])
    means = sorted((d[i] + d[j]) / 2 for i, j in draws)
    low = means[0] + 0.025 * 2 * (means[1] - means[0])  # numpy's linear quantile over 3 sorted values
    high = means[1] + (0.975 * 2 - 1) * (means[2] - means[1])
    assert cluster_bootstrap_ci([0.1, 0.3], n_boot=3, seed=0) == pytest.approx((low, high))
    # resampled within each site: one cluster per site (0.0 and 1.0) always gives the mean 0.5
    assert cluster_bootstrap_ci([0.0, 1.0], ["A", "B"], n_boot=500, seed=3) == pytest.approx((0.5, 0.5))
    assert cluster_bootstrap_ci([0.0, 1.0], n_boot=4000, seed=3) == pytest.approx((0.0, 1.0))
    with pytest.raises(ValueError, match="n_boot >= 1"):
        cluster_bootstrap_ci([0.1], n_boot=0)


def test_seeds_combine_into_one_estimate_per_image():
    """Seed 0: m beats b by 0.2 on image x, seed 1 loses by 0.1: one unit with the mean difference 0.05; an image
    scored in only one seed is left out."""
    rows = _rows([("x", 0.9, 0.7), ("only0", 0.5, 0.1)], seed=0) + _rows([("x", 0.6, 0.7)], seed=1)
    [t, site] = clustered_tests(rows, "b")
    assert (t["seeds"], t["n"], t["n_images"]) == ("0 1", 1, 1) and t["mean_diff"] == pytest.approx(0.05)
    assert site["scope"] == "S" and "| m vs b (all) | 0 1 | image | 1 (1) | +5.00 [+5.00, +5.00] |" in \
        clustered_markdown([t])


def test_ct_ordering_is_tested_over_patients_against_fedavg_and_funavg(tmp_path):
    """FIVA Table 2's ordering: every CT method against FedAvg-CT, FIVA against FUNAvg, each patient one unit.
    KiTS19 patient 1 has slices a, b and patient 2 slice c; CURVAS patient 10001 three annotators' copies of one slice.
    FIVA-P: +0.2 on a, +0.1 on b (patient 1: +0.15), -0.3 on c, +0.06 on each CURVAS copy; FUNAvg +0.05 everywhere."""
    from feduq.results.sweeps import ct_paired_tests, ct_slice_rows
    from feduq.results.paired import with_q_values

    slices = [("KiTS19", "1_a", "1"), ("KiTS19", "1_b", "1"), ("KiTS19", "2_c", "2"),
              ("CURVAS-Erlangen", "r1_10001_5", "10001"), ("CURVAS-Erlangen", "r2_10001_5", "10001"),
              ("CURVAS-Erlangen", "r3_10001_5", "10001")]
    fiva = {"1_a": 0.2, "1_b": 0.1, "2_c": -0.3}
    rows = []
    for seed in (0, 1):
        for site, image, case in slices:
            for method, delta in (("fedavg_ct", 0.0), ("funavg", 0.05), ("fiva_p", fiva.get(image, 0.06))):
                rows.append({"method": method, "seed": seed, "site": site, "image": image, "case": case,
                             "dice": 0.5 + delta, "dice_un": 0.4 + delta})
    tests = ct_paired_tests(rows, ["fedavg_ct", "funavg", "fiva_p"], "fedavg_ct", n_boot=200)
    pairs = {(t["method"], t["baseline"], t["metric"], t["scope"]): t for t in tests}
    assert {(m, b) for m, b, _, _ in pairs} == {("funavg", "fedavg_ct"), ("fiva_p", "fedavg_ct"), ("fiva_p", "funavg")}
    t = pairs[("fiva_p", "fedavg_ct", "dice", "all")]
    assert (t["n"], t["n_images"], t["unit"], t["seeds"]) == (3, 6, "patient", "0 1")
    assert t["mean_diff"] == pytest.approx((0.15 - 0.3 + 0.06) / 3) and (t["wins"], t["losses"]) == (2, 1)
    assert pairs[("fiva_p", "fedavg_ct", "dice_un", "all")]["mean_diff"] == pytest.approx(t["mean_diff"])
    assert pairs[("fiva_p", "funavg", "dice", "KiTS19")]["mean_diff"] == pytest.approx((0.10 - 0.35) / 2)
    assert pairs[("fiva_p", "funavg", "dice", "CURVAS-Erlangen")]["n"] == 1  # one patient, three annotations
    trained = pairs[("fiva_p", "fedavg_ct", "dice", "training sites")]  # CURVAS-Erlangen is the held-out site
    assert (trained["n"], trained["n_images"]) == (2, 3) and trained["mean_diff"] == pytest.approx((0.15 - 0.3) / 2)
    assert [x["q_value"] for x in tests] == [x["q_value"] for x in with_q_values(tests)]  # BH over the whole table

    site_file = tmp_path / "per_image_test.csv"  # a site's file: a slice where no organ of the site is present is left out
    site_file.write_text("site,image,case,dice,dice_un,dice_kidney\nKiTS19,1_a,1,0.5,0.4,0.5\nKiTS19,1_z,1,nan,nan,\n")
    assert ct_slice_rows("fiva_p", 1, [site_file]) == [{"method": "fiva_p", "seed": 1, "site": "KiTS19", "image": "1_a",
                                                        "case": "1", "dice": 0.5, "dice_un": 0.4}]
