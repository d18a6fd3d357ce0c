"""Issue 68's evidence tool (feduq.results.site_acceptance, feduq acceptance-study): draws of units at a site
judged against the site's exact accepted Dice, a simulation with a known truth, counted by hand on constructed
sites."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from conftest import load_tool


def _site(kinds, copies=1):
    """A site of one unit per entry of ``kinds`` (``(dice, score)``), each unit ``copies`` identical images."""
    dice = np.repeat([d for d, _ in kinds], copies).astype(float)
    score = np.repeat([s for _, s in kinds], copies).astype(float)
    units = np.repeat([f"p{i:02d}" for i in range(len(kinds))], copies)
    return {"u_mean": score, "u_foreground": score + 0.0, "u_boundary": score + 0.0}, dice, units


def test_a_sites_population_is_counted_by_hand():
    """Three units: p0 = two images (Dice 1 at score 0.01, Dice 0.5 at score 0.1), p1 = one (Dice 0 at 0.1), p2 = one
    (Dice 0.8, score inf: never accepted). At a threshold in [0.01, 0.1) one image is accepted (Dice 1, coverage
    1/4); from 0.1 on three (Dice 0.5, coverage 3/4); below 0.01 none (NaN)."""
    from feduq.results.site_acceptance import boundary, population, site_bound

    score = np.array([0.01, 0.1, 0.1, np.inf])
    pop = population({"u_mean": score}, [1.0, 0.5, 0.0, 0.8], ["p0", "p0", "p1", "p2"], bound=2,
                     grid=np.array([0.005, 0.01, 0.05, 0.1, 1.0]))
    assert np.isnan(pop.accepted["u_mean"][0]) and list(pop.accepted["u_mean"][1:]) == [1.0, 1.0, 0.5, 0.5]
    assert list(pop.coverage["u_mean"]) == [0, 0.25, 0.25, 0.75, 0.75]
    assert pop.loss["u_mean"][0].tolist() == [0, 0, 0, 0.5, 0.5] and pop.count["u_mean"][0].tolist() == [0, 1, 1, 2, 2]
    assert pop.count["u_mean"][2].tolist() == [0] * 5 and [m.tolist() for m in pop.members] == [[0, 1], [2], [3]]
    assert pop.image_loss["u_mean"][1].tolist() == [0, 0, 0, 0.5, 0.5]
    assert boundary(pop.accepted["u_mean"], pop.coverage["u_mean"], 0.5) == (3, 0.5, 0.75)
    assert boundary(pop.accepted["u_mean"], pop.coverage["u_mean"], 1.0)[0] == 4  # never reached: the last
    assert site_bound("polyp-CVC-ClinicDB", [59, 3]) == 64 and site_bound("prostate-BMC", [19]) == 32
    assert site_bound("polyp-Kvasir-SEG", [1, 1]) == 1 and site_bound("other", [2]) == 32
    with pytest.raises(ValueError, match="more than M = 32"):
        site_bound("prostate-X", [33])


def test_the_fast_draw_is_certify_units_on_the_drawn_units_relabelled():
    """certify_draw on a draw's rows of the precomputed sums gives certify_units' score and threshold, for the unit
    procedure (units named in draw order, M) and the image-level control (images named in order, M = 1)."""
    from feduq.review.certificate import GRID, certify_units
    from feduq.results.site_acceptance import certify_draw, population

    rng = np.random.default_rng(5)
    sizes = rng.integers(1, 7, 25)
    units = np.repeat([f"u{i}" for i in range(25)], sizes)
    q = rng.standard_normal(25)[np.repeat(np.arange(25), sizes)] + rng.standard_normal(units.size)
    dice = np.clip(0.7 + 0.15 * q, 0, 1)
    scores = {s: 0.2 * np.exp(-q + 0.3 * rng.standard_normal(units.size)) for s in ("u_mean", "u_foreground")}
    pop = population(scores, dice, units, bound=8)
    certified = 0
    for _ in range(6):
        pick = rng.integers(0, 25, 30)
        images = np.concatenate([pop.members[p] for p in pick])
        names = np.concatenate([[f"d{j:03d}"] * pop.members[p].size for j, p in enumerate(pick)])
        for target in (0.6, 0.7):
            for rows, labels, m, loss, count in ((pick, names, 8, pop.loss, pop.count),
                                                 (images, [f"i{j:04d}" for j in range(images.size)], 1,
                                                  pop.image_loss, pop.image_count)):
                name, g = certify_draw(loss, count, rows, target, 0.1, m)
                ref = certify_units({s: v[images] for s, v in scores.items()}, dice[images], labels, target, 0.1,
                                    max_unit_images=m)
                assert (name, None if g is None else GRID[g]) == (ref.score, ref.threshold)
                certified += g is not None
    assert certified > 0


def test_a_site_below_the_target_counts_every_certificate_as_a_violation():
    """9 units of Dice 1 and one of Dice 0, all at score 0.01: the site's accepted Dice is 0.9 at every threshold
    that accepts, so every certificate of 0.92 is a violation (violations = certified draws); of 0.7 none is. With
    units of ten identical images the image-level control, counting each image as independent, certifies 0.92 in
    more draws than the unit procedure."""
    from feduq.results.site_acceptance import population, rates, site_draws

    scores, dice, units = _site([(1.0, 0.01)] * 9 + [(0.0, 0.01)], copies=10)
    pop = population(scores, dice, units, bound=10)
    out = site_draws(pop, 30, [0.7, 0.92], 0.1, 30, np.random.default_rng(0))
    for proc in ("unit", "image", "unit_fixed"):
        truth, cov = out[proc, 0.92]
        assert set(truth[~np.isnan(truth)]) <= {0.9} and set(cov) <= {0.0, 1.0}
        r = rates(truth, 0.92, cov)
        assert r["violations"] == round(r["certified"] * 30) and r["accepted"] == r["certified"]
        truth, cov = out[proc, 0.7]
        assert rates(truth, 0.7, cov)["violations"] == 0
    assert rates(out["image", 0.92][0], 0.92)["violations"] > rates(out["unit", 0.92][0], 0.92)["violations"]
    assert rates(out["unit", 0.7][0], 0.7)["certified"] > 0.5


def test_a_site_rows_judge_the_target_at_the_boundary(tmp_path):
    """The same site as a CSV: every score ties, so the target at any coverage is the site's accepted Dice 0.9 and no
    certificate can violate it; "accepted" is the share certified (a certificate accepts every image)."""
    from feduq.results.site_acceptance import site_rows

    scores, dice, units = _site([(1.0, 0.01)] * 9 + [(0.0, 0.01)], copies=10)
    path = tmp_path / "prostate-X" / "fedavg_s0_cases.csv"
    path.parent.mkdir()
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "unit", "dice", "u_mean", "u_foreground", "u_boundary"])
        w.writerows([i, units[i], dice[i], *(scores[s][i] for s in scores)] for i in range(dice.size))
    rows = site_rows(path, 30, (0.5, 0.8), 0.1, 20)
    assert [(r["coverage"], r["procedure"]) for r in rows] == [(c, p) for c in (0.5, 0.8)
                                                              for p in ("unit", "image", "unit_fixed")]
    assert all(r["target"] == pytest.approx(0.9) and r["M"] == 32 and r["violations"] == 0 for r in rows)
    assert all(r["accepted"] == r["certified"] and r["site_coverage"] == 1.0 for r in rows)
    assert max(r["certified"] for r in rows if r["procedure"] == "image") > 0


def test_rates_and_clopper_pearson_by_hand():
    from feduq.results.site_acceptance import clopper_pearson, rates

    assert clopper_pearson(0, 10) == (0.0, pytest.approx(1 - 0.025 ** 0.1))
    assert clopper_pearson(10, 10) == (pytest.approx(0.025 ** 0.1), 1.0)
    lo, hi = clopper_pearson(3, 20)
    from scipy.stats import binomtest

    ci = binomtest(3, 20).proportion_ci(0.95, method="exact")
    assert (lo, hi) == (pytest.approx(ci.low), pytest.approx(ci.high))
    r = rates(np.array([np.nan, 0.5, 0.7, 0.9]), 0.8, np.array([0, 0.2, 0.4, 0.6]))
    assert (r["draws"], r["certified"], r["violations"], r["violation"]) == (4, 0.75, 2, 0.5)
    assert r["accepted"] == pytest.approx(0.3) and r["viol_lo"] < 0.5 < r["viol_hi"]


def test_the_simulations_truth_is_right():
    """Tiny case by hand (population_curve); the quadrature against a closed form (no clipping: among the accepted,
    q has mean c φ(a/σ) / (σ Φ(a/σ)), a = log(λ/scale), σ² = c² + noise²; coverage Φ(a/σ)); and against a simulated
    population of 20,000 units whatever ρ (q is N(0, 1) for every ρ)."""
    from scipy.stats import norm

    from feduq.results.site_acceptance import SIM, SIM_SIZES, population_curve, sim_truth, simulate

    acc, cov = population_curve([0.3, 0.1, 0.2], [0.2, 1.0, 0.6], grid=np.array([0.05, 0.1, 0.25, 0.5]))
    assert np.isnan(acc[0]) and acc[1:].tolist() == pytest.approx([1.0, 0.8, 0.6])
    assert cov.tolist() == pytest.approx([0, 1 / 3, 2 / 3, 1])
    grid = np.geomspace(0.05, 1.0, 9)
    acc, cov = sim_truth(grid, mu=0.5, sd=0.02, c=1.5, scale=0.2, noise=0.4)
    a, s = np.log(grid / 0.2), math.hypot(1.5, 0.4)
    assert cov == pytest.approx(norm.cdf(a / s), abs=1e-6)
    assert acc == pytest.approx(0.5 + 0.02 * 1.5 * norm.pdf(a / s) / (s * norm.cdf(a / s)), abs=1e-6)
    truth, tcov = sim_truth(**SIM)
    for rho in (0.0, 0.4):
        score, dice, codes = simulate(np.random.default_rng(1), 20_000, rho, sizes=SIM_SIZES, **SIM)
        assert codes.max() == 19_999 and 5 <= np.bincount(codes).min() and np.bincount(codes).max() <= 20
        emp, ecov = population_curve(score, dice)
        ok = tcov > 0.1
        assert np.abs(emp - truth)[ok].max() < 0.005 and np.abs(ecov - tcov).max() < 0.005
    _, d1, c1 = simulate(np.random.default_rng(2), 50, 1.0, mu=0.5, sd=0.1)  # rho 1: a unit's images share q
    assert all(np.ptp(d1[c1 == u]) == 0 for u in range(50))


def test_the_requirements_are_checked_on_the_cells():
    from feduq.results.site_acceptance import checks

    def row(proc, viol_lo, certified=1.0, **kw):
        return {"procedure": proc, "viol_lo": viol_lo, "violation": viol_lo, "viol_hi": 1.0, "violations": 0,
                "draws": 100, "certified": certified, "target": 0.7, "n": 100, "rho": 0.4, "margin": 0.05,
                "coverage": 0.8} | kw

    sim = [row("unit", 0.0, 0.6), row("image", 0.15)]
    assert all(ok for _, ok in checks(sim, [row("unit", 0.02, site="s", method="m")], 0.1))
    found = checks([row("unit", 0.0, 0.4), row("image", 0.05)], [row("unit", 0.12, site="s", method="m")], 0.1)
    assert [ok for _, ok in found] == [False, True, False, False] and "40.0 %" in found[0][0]


def test_the_tool_writes_its_tables_and_picture_quickly(tmp_path):
    """--quick on two constructed sites (one of patients of three images, one of single images; a third with too
    few units is skipped): every file, one acceptance row per site, coverage, n and procedure."""
    holdout = tmp_path / "holdout"
    rng = np.random.default_rng(0)
    for site, units, size in (("prostate-A", 12, 3), ("polyp-B", 20, 1), ("prostate-C", 3, 2)):
        (holdout / site).mkdir(parents=True)
        with open(holdout / site / "fedevi_s0_cases.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", "unit", "dice", "u_mean", "u_foreground", "u_boundary"])
            for i in range(units * size):
                q = rng.standard_normal()
                w.writerow([f"c{i}", f"p{i // size}", min(1.0, max(0.0, 0.7 + 0.2 * q)), *(0.2 * np.exp(
                    -q + 0.3 * rng.standard_normal(3)))])
    tool = load_tool("site_acceptance")
    out = tmp_path / "out"
    code = tool.main(["--holdout-dir", str(holdout), "--quick", "--jobs", "1", "--n", "10", "--sim-n", "10", "20",
                      "--out", str(out)])
    assert code == 0
    names = {p.name for p in out.iterdir()}
    assert {"acceptance.csv", "acceptance.md", "simulation.csv", "simulation.md", "power.csv", "power.md",
            "acceptance.png", ".feduq-output.json"} == names
    rows = list(csv.DictReader(open(out / "acceptance.csv")))
    assert sorted({(r["site"], r["M"]) for r in rows}) == [("polyp-B", "1"), ("prostate-A", "32")]
    assert len(rows) == 2 * 2 * 3 and {r["procedure"] for r in rows} == {"unit", "image", "unit_fixed"}
    sim = list(csv.DictReader(open(out / "simulation.csv")))
    assert len(sim) == 2 * 2 * 2 * 2 and all(0 <= float(r["viol_lo"]) <= float(r["viol_hi"]) <= 1 for r in sim)
    assert len(list(csv.DictReader(open(out / "power.csv")))) == 2
    assert "## Requirements (every part)" in (out / "acceptance.md").read_text()
    from PIL import Image

    assert Image.open(out / "acceptance.png").size[0] > 100
    assert tool.main(["--holdout-dir", str(holdout), "--rho", "1.5", "--out", str(tmp_path / "o2")]) == 2
    assert not (tmp_path / "o2").exists()
