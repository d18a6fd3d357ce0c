"""Issue 64's evidence tool (feduq.results.site_acceptance, tools/site_acceptance.py): draws of k labelled cases at a
site, the certified and the uncertified rule applied to the other cases, counted by hand on constructed sites."""

from __future__ import annotations

import csv
import math

import numpy as np
import pytest

from conftest import load_tool


def _site(n_good=150, n_bad=50):
    scores = np.r_[np.full(n_good, 0.01), np.full(n_bad, 0.5)]
    return {"u_mean": scores, "u_foreground": scores, "u_boundary": scores}, np.r_[np.full(n_good, 0.97),
                                                                                   np.full(n_bad, 0.1)]


def test_a_site_whose_scores_separate_good_from_bad_certifies_and_holds_every_draw():
    """150 confident cases of Dice 0.97 and 50 uncertain ones of Dice 0.1: with k = 100 labelled cases (about 75
    good) every draw certifies 0.9, which only a threshold below 0.5 reaches, so exactly the other good cases are
    accepted: the coverage of the other 100 is their share of good cases and the accepted Dice is 0.97 (holds)."""
    from feduq.results.site_acceptance import acceptance_draws, acceptance_row

    scores, dice = _site()
    draws = acceptance_draws(scores, dice, 100, target=0.9, draws=20, seed=1)
    assert all(d["certified"] and d["cert_holds"] and d["cert_dice"] == pytest.approx(0.97) for d in draws)
    rng = np.random.default_rng(1)  # the same draws, recounted: the other cases' good share
    for d in draws:
        pick = np.zeros(200, bool)
        pick[rng.choice(200, 100, replace=False)] = True
        assert d["cert_coverage"] == pytest.approx(float(np.sum(~pick & (dice > 0.5)) / 100))
        assert d["uncert_chosen"] and d["uncert_holds"] and d["uncert_coverage"] == d["cert_coverage"]
    row = acceptance_row(draws, 0.1)
    assert row["certified"] == 1.0 and row["holds"] == 1.0 and row["bound_ok"] is True
    with pytest.raises(ValueError, match="expected 0 < k < 200"):
        acceptance_draws(scores, dice, 200, target=0.7)


def test_too_few_labelled_cases_certify_nothing_where_the_uncertified_rule_promises_and_misses():
    """k = 10 cannot certify 0.7 (at least 13 cases are needed at delta 0.1 over three scores); today's rule chooses
    a threshold on every draw that holds a confident case, although uncertain cases sit among the other cases
    with the same score."""
    from feduq.results.site_acceptance import acceptance_draws, acceptance_row

    scores = np.r_[np.full(100, 0.01), np.full(100, 0.5)]
    dice = np.r_[np.r_[np.full(60, 0.95), np.full(40, 0.2)], np.full(100, 0.1)]  # confident ones: mean 0.65
    draws = acceptance_draws({"u_mean": scores, "u_foreground": scores, "u_boundary": scores}, dice, 10, target=0.7,
                             draws=50)
    row = acceptance_row(draws, 0.1)
    assert row["certified"] == 0.0 and math.isnan(row["holds"]) and row["coverage"] == 0.0
    assert row["uncert_chosen"] > 0 and row["uncert_holds"] == 0.0  # whatever it accepts has mean 0.65 < 0.7


def test_the_tool_writes_its_table_csv_and_picture(tmp_path):
    site = tmp_path / "holdout" / "site-A"
    site.mkdir(parents=True)
    scores, dice = _site(60, 20)
    with open(site / "fedevi_s0_cases.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["image", "dice", "u_mean", "u_foreground", "u_boundary"])
        w.writerows([f"c{i}", dice[i], scores["u_mean"][i], scores["u_mean"][i], scores["u_mean"][i]]
                    for i in range(80))
    tool = load_tool("site_acceptance")
    out = tmp_path / "out"
    assert tool.main(["--holdout-dir", str(tmp_path / "holdout"), "--k", "40", "--targets", "0.7", "--draws", "5",
                      "--out", str(out)]) == 0
    rows = list(csv.DictReader(open(out / "acceptance.csv")))
    assert [(r["site"], r["method"], r["k"], float(r["certified"])) for r in rows] == [("site-A", "fedevi", "40", 1.0)]
    assert "| site-A | fedevi | 80 | 70.0 | 40 | 100.0 | 100.0 | yes |" in (out / "acceptance.md").read_text()
    from PIL import Image

    assert Image.open(out / "acceptance.png").size[0] > 100
    assert tool.main(["--holdout-dir", str(tmp_path / "holdout"), "--targets", "1.5", "--out", str(tmp_path / "o2")]) == 2
    assert not (tmp_path / "o2").exists()
