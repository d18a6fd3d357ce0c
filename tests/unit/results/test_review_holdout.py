"""feduq.results.review_holdout: the review flag judged at a held-out site (issue 52 item 2) on hand-made cases whose
flags, coverage, Dice and AURC are computed by hand, and one short real run (a seeded light model calibrated on
Kvasir-SEG's validation images, judged on CVC-ClinicDB's frames grouped by video)."""

import math
import re

import numpy as np
import pytest

from conftest import small_job
from helpers import light_model


def hand_cases():
    """Six cases: 0, 1, 4 certain and good; 2, 5 uncertain; 3 an empty prediction with a low uncertainty."""
    dice = np.array([0.9, 0.8, 0.1, 0.0, 0.7, 0.6])
    u = np.array([0.1, 0.2, 0.9, 0.05, 0.3, 0.8])
    return {"dice": dice, "u_foreground": u, "u_mean": u.copy(), "u_boundary": u.copy(),
            "area_fraction": np.array([0.1, 0.1, 0.1, 0.0, 0.1, 0.1]), "mask_fraction": np.full(6, 0.1)}


def rule(size_floor):
    from feduq.review.rule import ReviewThreshold

    return ReviewThreshold(uncertainty="total", threshold=0.5, target_dice=0.8, coverage=0, accepted_dice=0,
                           all_dice=0, n_cases=6, score="u_foreground", size_floor=size_floor)


def test_the_rule_with_a_size_floor_is_judged_by_hand_numbers():
    from feduq.results.review_holdout import judge_rule

    summary, reasons, curves = judge_rule(rule(0.02), hand_cases(), None)
    assert reasons == [[], [], ["uncertain"], ["implausible size"], [], ["uncertain"]]
    assert summary["coverage"] == pytest.approx(0.5)
    assert summary["accepted_dice"] == pytest.approx(0.8) and summary["flagged_dice"] == pytest.approx(0.7 / 3)
    assert summary["all_dice"] == pytest.approx(3.1 / 6)
    # rule order: 0, 1, 4, 5, 2 by score, then 3 (flagged for size); risks .1 .2 .3 .4 .9 1 -> running means
    assert summary["aurc_rule"] == pytest.approx((0.1 + 0.15 + 0.2 + 0.25 + 0.38 + 2.9 / 6) / 6)
    assert summary["aurc_oracle"] == pytest.approx(summary["aurc_rule"])  # here the rule orders as the oracle
    # the image mean puts the empty prediction (u 0.05, risk 1) first: 1, .55, .4333, .4, .4, .4833
    assert summary["aurc_image_mean"] == pytest.approx((1 + 0.55 + 1.3 / 3 + 0.4 + 0.4 + 2.9 / 6) / 6)
    assert summary["aurc_random"] == pytest.approx(2.9 / 6)
    assert summary["flagged_size"] == pytest.approx(1 / 6) and summary["flagged_uncertain"] == pytest.approx(2 / 6)
    assert summary["accepted_small"] == 0 and summary["goal_met"]
    assert set(curves) == {"rule (u_foreground)", "image mean (u_mean)", "oracle", "random (expected)"}


def test_without_a_size_floor_the_confident_empty_prediction_is_accepted_and_the_goal_is_missed():
    from feduq.results.review_holdout import judge_rule

    summary, reasons, _ = judge_rule(rule(None), hand_cases(), None)
    assert reasons[3] == []  # accepted: its uncertainty is low
    assert summary["accepted_dice"] == pytest.approx(2.4 / 4) and summary["flagged_dice"] == pytest.approx(0.35)
    assert summary["aurc_rule"] == pytest.approx(summary["aurc_image_mean"])
    assert summary["aurc_rule"] > summary["aurc_random"] and not summary["goal_met"]


def test_ratio_ci_is_a_cluster_bootstrap_of_the_chosen_cases_mean():
    from feduq.results.review_holdout import ratio_ci

    values = np.array([0.9, 0.1, 0.8, 0.2, 0.7, 0.3, 0.6, 0.4])
    chosen = np.array([True, False, True, True, True, False, True, True])
    mean, low, high = ratio_ci(values, chosen)
    assert mean == pytest.approx(values[chosen].mean()) and low < mean < high
    assert ratio_ci(values, chosen, ["a"] * 8) == (pytest.approx(mean),) * 3  # one unit: no spread to draw from
    assert all(math.isnan(v) for v in ratio_ci(values, np.zeros(8, bool)))
    # two units of identical means: every draw gives that mean
    same = ratio_ci([0.5, 0.7, 0.5, 0.7], [True] * 4, ["a", "a", "b", "b"])
    assert same == (pytest.approx(0.6),) * 3
    # grouping widens the interval of correlated cases (four units of two equal cases vs eight independent cases)
    grouped = ratio_ci(np.repeat(values[:4], 2), np.ones(8, bool), np.repeat(list("abcd"), 2))
    alone = ratio_ci(np.repeat(values[:4], 2), np.ones(8, bool))
    assert grouped[2] - grouped[1] > alone[2] - alone[1]


def test_held_out_review_on_real_images_applies_the_rule_chosen_on_the_calibration_site(tmp_path, data_root):
    from feduq.review.rule import ReviewError, choose_rule
    from feduq.review.calibration import labelled_cases
    from feduq.results.paired import site_clusters
    from feduq.results.review_holdout import held_out_review, review_markdown
    from feduq.site.evaluation import client_config, load_model

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64, sites=["Kvasir-SEG", "CVC-ClinicDB"])
    loaded = load_model(client_config(job), light_model(tmp_path / "model.pt"), device="cpu")
    cal, features, _, _ = labelled_cases(loaded, sites=["Kvasir-SEG"], data_root=data_root, split="val", max_items=12)
    with pytest.raises(ReviewError) as e:  # the highest target this model reaches on the calibration images
        choose_rule(cal, 1.0, features)
    found = re.search(r"has ([0-9.]+)\)", str(e.value))
    assert found, str(e.value)
    target = float(found.group(1)) - 0.001
    clusters, units = site_clusters(data_root, "polyp", ["CVC-ClinicDB"])
    summary, cases, curves = held_out_review(
        loaded, calibration_sites=["Kvasir-SEG"], data_root=data_root, split="val", max_items=12,
        held_out_dir=data_root / "polyp" / "CVC-ClinicDB", target_dice=target,
        units={stem: g for (_, stem), g in clusters.items()}, n_boot=500)
    assert len(cases) == summary["n_cases"] == 12 and units == {"CVC-ClinicDB": "sequence"}
    assert summary["n_units"] == len({c["unit"] for c in cases}) < 12  # frames of one video are one unit
    stored = summary["rule"]
    assert stored["familiarity"] is not None and stored["calibrated_on"] == ["Kvasir-SEG:val"]
    for c in cases:  # each decision recomputed from the case's own numbers and the rule (features aside)
        size = stored["size_floor"] is not None and c["area_fraction"] < stored["size_floor"]
        uncertain = c[stored["score"]] > stored["threshold"]
        assert ("implausible size" in c["review_reason"]) == size and ("uncertain" in c["review_reason"]) == uncertain
        assert c["review"] == ("yes" if c["review_reason"] else "no")
    accepted = [c["dice"] for c in cases if c["review"] == "no"]
    assert summary["coverage"] == pytest.approx(len(accepted) / 12)
    if accepted:
        assert summary["accepted_dice"] == pytest.approx(np.mean(accepted))
        assert summary["accepted_dice_low"] <= summary["accepted_dice"] <= summary["accepted_dice_high"]
    assert summary["aurc_oracle"] <= min(summary["aurc_rule"], summary["aurc_image_mean"], summary["aurc_random"])
    assert len(curves["oracle"][1]) == 12
    table = review_markdown([{"held_out": "CVC-ClinicDB", "method": "fedevi", "seed": 0, **summary}])
    assert "| CVC-ClinicDB | fedevi | 0 | 12 (" in table
