"""Learn then Test's certified review threshold (feduq.inference.certify, issue 64's first piece): the Hoeffding-Bentkus
p-value against hand-computed values, certification where it must and must not happen, and the guarantee by
simulation (the accepted cases fall below the certified target in at most about delta of the draws)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from feduq.inference.certify import cases_needed, certify_threshold, hb_p_value, risk_upper_bound


def test_hoeffding_bentkus_p_value_by_hand():
    assert hb_p_value(0.0, 10, 0.2) == pytest.approx(0.8 ** 10)  # exp(-n log(1/(1-a))) = (1-a)^n < e (1-a)^n
    assert hb_p_value(0.5, 20, 0.2) == 1.0  # an empirical risk above alpha never rejects
    h1 = 0.05 * math.log(0.05 / 0.2) + 0.95 * math.log(0.95 / 0.8)
    bentkus = math.e * (0.8 ** 20 + 20 * 0.2 * 0.8 ** 19)  # P(Bin(20, 0.2) <= ceil(20 * 0.05) = 1)
    assert hb_p_value(0.05, 20, 0.2) == pytest.approx(min(math.exp(-20 * h1), bentkus))
    assert hb_p_value(0.1, 0, 0.2) == 1.0
    with pytest.raises(ValueError, match="alpha"):
        hb_p_value(0.1, 5, 1.0)


def test_perfect_cases_certify_once_there_are_enough():
    """Dice 1 everywhere, target 0.8, delta 0.1: the p-value is 0.8^n, at most 0.1 from n = 11 accepted cases."""
    for k, certified in ((10, False), (11, True)):
        cert = certify_threshold(np.zeros(k), np.ones(k), target=0.8, delta=0.1, grid=[0.0, 1.0])
        assert (cert.threshold is not None) == certified
    cert = certify_threshold(np.zeros(11), np.ones(11), 0.8, 0.1, grid=[0.0])
    assert cert.coverage == 1.0 and cert.accepted_dice == 1.0
    assert cert.lower_bound == pytest.approx(1 - risk_upper_bound(np.zeros(11), 0.1), abs=1e-9) and cert.lower_bound >= 0.8
    assert 0.8 ** 11 <= 0.1 < 0.8 ** 10
    assert cases_needed(0.8, 0.1, 1.0) == 11 and cases_needed(0.8, 0.1, 0.7) is None


def test_the_fixed_sequence_stops_at_the_first_threshold_it_cannot_certify():
    """Confident good cases, then uncertain bad ones: the rule accepts the good ones, and a start below them (no case
    accepted) certifies nothing."""
    scores = np.r_[np.full(30, 0.1), np.full(10, 0.9)]
    dice = np.r_[np.full(30, 0.95), np.full(10, 0.1)]
    cert = certify_threshold(scores, dice, target=0.8, delta=0.1, grid=[0.05, 0.2, 0.5, 1.0], start=0.2)
    assert cert.threshold == 0.5 and cert.accepted == 30 and cert.coverage == pytest.approx(0.75)
    assert cert.accepted_dice == pytest.approx(0.95) and 0.8 <= cert.lower_bound < 0.95
    none = certify_threshold(scores, dice, target=0.8, delta=0.1, grid=[0.05, 0.2, 0.5, 1.0])
    assert none.threshold is None and none.best_target == 0.0  # 0.05 accepts nothing: the sequence ends there
    with pytest.raises(ValueError, match="target and delta"):
        certify_threshold(scores, dice, target=1.2)


def test_the_guarantee_holds_by_simulation():
    """Scores and Dice from a known model (Dice falls with the score; the accepted cases' true mean Dice falls below
    0.8 past threshold 0.70): over 400 draws of 400 cases, the true mean Dice (200,000 fresh cases) of what the rule
    accepts is below the target in at most delta + 3 standard errors of the draws (Hoeffding-Bentkus is conservative:
    in this run none, the certified thresholds 0.30-0.55)."""
    rng = np.random.default_rng(0)

    def draw(n):
        s = rng.uniform(0, 1, n)
        return s, np.clip(0.98 - 0.5 * s + rng.normal(0, 0.08, n), 0, 1)

    big_s, big_d = draw(200_000)
    grid, target, delta = np.linspace(0, 1, 21), 0.8, 0.1
    violations, certified = 0, 0
    for _ in range(400):
        s, d = draw(400)
        cert = certify_threshold(s, d, target, delta, grid=grid, start=0.1)
        if cert.threshold is None:
            continue
        certified += 1
        violations += big_d[big_s <= cert.threshold].mean() < target
    assert certified > 300  # the test is not vacuous
    rate = violations / certified
    assert rate <= delta + 3 * math.sqrt(delta * (1 - delta) / certified)
