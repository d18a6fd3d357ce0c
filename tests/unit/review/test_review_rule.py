"""The review flag at a hospital the model never saw (issue 52): case scores by hand, the bottleneck features, and the
rule's three parts on hand-made calibration cases whose correct flags are known."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feduq.scores.case_scores import BottleneckTap, case_scores
from feduq.review.rule import Familiarity, ReviewError, aurc, choose_rule


def test_case_scores_by_hand():
    """A 4 x 4 predicted square in a 10 x 10 image, uncertainty 1 on the ring around it (rows/cols 2..7) and 0.5 inside.
    Band of half-width 1: the dilated square (6 x 6 = 36 px) minus the eroded one (2 x 2): 32 px, of which the outer
    ring's 20 px have 1 and the inner ring's 12 px 0.5 -> 26 / 32; image mean (20 + 8) / 100; inside 0.5."""
    label = torch.zeros(10, 10, dtype=torch.long)
    label[3:7, 3:7] = 1
    u = torch.zeros(10, 10)
    u[2:8, 2:8] = 1.0
    u[3:7, 3:7] = 0.5
    got = {k: float(v) for k, v in case_scores(label, u, radius=1).items()}
    assert got == pytest.approx({"u_mean": 0.28, "u_foreground": 0.5, "u_boundary": 26 / 32, "area_fraction": 0.16})
    # an empty prediction is never "certain inside": both regional scores fall back to the image mean
    empty = {k: float(v) for k, v in case_scores(torch.zeros_like(label), u, radius=1).items()}
    assert empty == pytest.approx({"u_mean": 0.28, "u_foreground": 0.28, "u_boundary": 0.28, "area_fraction": 0.0})
    # a prediction touching the image's border: the border is no boundary (band = 2 x 10 columns 3..4 minus none)
    left = torch.zeros_like(label)
    left[:, :4] = 1
    u2 = torch.arange(10.0).repeat(10, 1)  # u = column index
    band = float(case_scores(left, u2, radius=1)["u_boundary"])
    assert band == pytest.approx((3 + 4) / 2)  # columns 3 (inside edge) and 4 (outside edge)


def test_the_bottleneck_tap_takes_the_deepest_encoder_level():
    from feduq.core.networks import build_network

    model = build_network("fedevi_unet", 3, 2).eval()
    tap = BottleneckTap(model, 3, 64)
    assert tap.name == "encoder.4"
    x = torch.rand(2, 3, 64, 64)
    with torch.no_grad():
        model(x)
        feats = tap.take()
        deep = x
        for level in model.encoder:  # (the hook sees these passes too)
            deep = level(deep)
    assert feats.shape == (2, 256)
    torch.testing.assert_close(feats, deep.mean(dim=(2, 3)))
    tap.take()
    tap.close()
    with pytest.raises(ValueError, match="no forward pass"):
        tap.take()


def _calibration(n=30, seed=0, misses=5):
    """n labelled cases: every mask holds a polyp (area fraction 0.04..0.3); the first 5 are confident misses (empty
    prediction, Dice 0, the lowest image-mean uncertainty), the rest are ordered by the boundary score alone (Dice
    falls as u_boundary rises, while u_mean and u_foreground are noise); features a Gaussian cluster in 8 dimensions."""
    rng = np.random.default_rng(seed)
    mask = np.linspace(0.04, 0.3, n)
    boundary = np.linspace(0.1, 0.6, n)
    dice = np.clip(1.0 - boundary, 0, 1)
    area = mask.copy()
    u_mean = rng.uniform(0.2, 0.4, n)
    u_fg = rng.uniform(0.2, 0.4, n)
    miss = np.arange(misses)
    dice[miss], area[miss], u_mean[miss], u_fg[miss] = 0.0, 0.0, 0.01, u_mean[miss]
    cases = {"u_mean": u_mean, "u_foreground": u_fg, "u_boundary": boundary, "area_fraction": area,
             "mask_fraction": mask, "dice": dice}
    return cases, rng.normal(0.0, 1.0, (n, 8))


def test_the_rule_flags_confident_misses_as_implausible_and_chooses_the_score_that_orders_the_rest():
    cases, feats = _calibration()
    assert aurc(cases["u_mean"], cases["dice"]) > aurc(cases["u_boundary"], cases["dice"])  # the image mean misleads
    rule = choose_rule(cases, target_dice=0.7, features=feats)
    assert rule.size_floor == pytest.approx(0.5 * 0.04)
    assert rule.score == "u_boundary"
    # the kept cases 5..29 have Dice 1 - u_boundary; the widest set of most certain ones with mean >= 0.7
    kept = cases["u_boundary"][5:]
    prefix = np.cumsum(1 - kept) / np.arange(1, kept.size + 1)
    k = int(np.flatnonzero(prefix >= 0.7 - 1e-12)[-1])
    assert rule.threshold == pytest.approx((kept[k] + kept[k + 1]) / 2)
    assert rule.coverage == pytest.approx((k + 1) / 30) and rule.accepted_dice == pytest.approx(prefix[k])
    assert rule.flagged_on_calibration["implausible size"] == pytest.approx(5 / 30)
    typical = {"u_mean": 0.3, "u_foreground": 0.3, "u_boundary": 0.1, "area_fraction": 0.1}
    assert rule.reasons(typical, feats[10]) == []
    assert rule.reasons({**typical, "area_fraction": 0.0}, feats[10]) == ["implausible size"]
    assert rule.reasons({**typical, "u_boundary": 0.9}, feats[10]) == ["uncertain"]
    far = feats[10] + 25.0
    assert rule.reasons(typical, far) == ["unfamiliar input"]
    assert rule.reasons({**typical, "area_fraction": 0.0, "u_boundary": 0.9}, far) == [
        "implausible size", "unfamiliar input", "uncertain"]


def test_familiarity_flags_about_none_of_its_own_kind_and_every_shifted_image():
    rng = np.random.default_rng(1)
    fam = Familiarity.fit(rng.normal(0, 1, (60, 12)))
    same = fam.unfamiliar(rng.normal(0, 1, (200, 12))).mean()
    shifted = fam.unfamiliar(rng.normal(3, 1, (200, 12))).mean()
    assert same < 0.1 and shifted == 1.0
    with pytest.raises(ReviewError, match=">= 10 finite feature rows"):
        Familiarity.fit(rng.normal(0, 1, (5, 12)))


def test_familiarity_with_few_images_and_wide_features_sees_a_shift_outside_the_principal_components():
    """24 calibration images of 256-channel features (6 latent directions + noise, as a network's bottleneck): 6
    principal components are fitted; the principal part alone flagged 0.5 % of images shifted by 1 per channel
    (the shift lies mostly outside the components) and every real calibration image of a seeded network in-sample
    (the cross-fitted components over-fit, so held-out distances were too small); with the residual term none of the
    calibration images and few of their kind are flagged, every shifted one is."""
    rng = np.random.default_rng(2)
    basis = rng.normal(0, 1, (6, 256))

    def draw(n, shift=0.0):
        return rng.normal(0, 1, (n, 6)) @ basis + rng.normal(0, 0.5, (n, 256)) + shift

    x = draw(24)
    fam = Familiarity.fit(x)
    assert np.asarray(fam.components).shape == (6, 256) and 0.1 < fam.residual_variance < 0.3  # the noise: 0.25
    assert not fam.unfamiliar(x).any()
    assert fam.unfamiliar(draw(400)).mean() < 0.05 and fam.unfamiliar(draw(200, 1.0)).all()
    old = Familiarity(**{**fam.__dict__, "residual_variance": None})  # a record of before: the principal part only
    assert old.distance(x[:3]) == pytest.approx(np.sqrt(np.maximum(np.einsum(
        "ni,ij,nj->n", (x[:3] - fam.center) @ np.asarray(fam.components).T - fam.location, np.asarray(fam.precision),
        (x[:3] - fam.center) @ np.asarray(fam.components).T - fam.location), 0)))


def test_without_a_structure_in_every_mask_there_is_no_size_rule_and_few_cases_no_familiarity():
    cases, feats = _calibration(n=8, misses=1)
    cases["mask_fraction"][0] = 0.0  # one labelled case without a polyp: an empty prediction can be right
    rule = choose_rule(cases, target_dice=0.5, features=feats)
    assert rule.size_floor is None and rule.familiarity is None


def test_predict_says_when_a_site_is_unfamiliar_instead_of_trusting_the_calibration():
    from feduq.review.rule import ReviewThreshold
    from feduq.review.notes import unfamiliar_note

    cases, feats = _calibration(n=40)
    rule = choose_rule(cases, target_dice=0.7, features=feats)
    assert isinstance(rule, ReviewThreshold) and rule.familiarity["n_cases"] == 40
    rows = [{"review_reason": "unfamiliar input; uncertain"}] * 3 + [{"review_reason": ""}] * 7
    note = unfamiliar_note(rows, rule)
    assert note.startswith("note: 30 % of these cases are unfamiliar to the 40 calibration images")
    assert f"coverage ({100 * rule.coverage:.1f} %)" in note
    assert unfamiliar_note(rows[2:] + [{"review_reason": ""}] * 3, rule) is None  # 1 of 11: under 10 %
    assert unfamiliar_note(rows, None) is None


def test_predict_says_when_it_accepts_far_more_or_fewer_cases_than_calibration_did():
    """Issue 52 item 3: at a held-out prostate site a rule of 3.8 % calibration coverage accepted 89.5 % of the
    cases, below the Dice it promised; predict now ends with a note when its accepted fraction is unlike the
    calibration's coverage (issue 64: two samples, Fisher's exact test, p < 0.01), and says nothing when it is alike,
    also when the calibration's own few cases leave its coverage uncertain."""
    from feduq.review.rule import ReviewThreshold
    from feduq.review.notes import coverage_note

    rule = ReviewThreshold(uncertainty="total", threshold=0.1, target_dice=0.7, coverage=0.038, accepted_dice=0.735,
                           all_dice=0.5, n_cases=53)
    rows = [{"review": "no"}] * 137 + [{"review": "yes"}] * 16  # BMC: 89.5 % of 153
    note = coverage_note(rows, rule)
    assert note.startswith("note: 89.5 % of these 153 cases were accepted where the rule accepted 3.8 % of its 53")
    assert "73.5 %" in note
    rule.coverage = 0.9
    assert coverage_note(rows, rule) is None  # 137 of 153 against 90 %: alike
    assert coverage_note(rows[:5], rule) is None  # too few cases to tell
    assert coverage_note(rows, None) is None
    # issue 64's dermoscopy site: 50 % of 20 calibration cases, then 121 of 180 (67 %): an exact binomial test against
    # 50 % called them unlike (p = 1e-5); 20 cases give the calibration's coverage a wide interval (Fisher p = 0.14)
    derm = ReviewThreshold(uncertainty="total", threshold=0.1, target_dice=0.65, coverage=0.5, accepted_dice=0.661,
                           all_dice=0.5, n_cases=20)
    assert coverage_note([{"review": "no"}] * 121 + [{"review": "yes"}] * 59, derm) is None
    assert coverage_note([{"review": "no"}] * 175 + [{"review": "yes"}] * 5, derm).startswith("note: 97.2 % of these")
