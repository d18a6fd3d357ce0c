"""Learn then Test's certified review threshold (feduq.inference.certify, issue 64's first piece): the Hoeffding-Bentkus
p-value against hand-computed values, certification where it must and must not happen, and the guarantee by
simulation (the accepted cases fall below the certified target in at most about delta of the draws)."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest

from feduq.inference.certify import cases_needed, certify_threshold, hb_p_value


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
    assert 0.8 ** 11 <= 0.1 < 0.8 ** 10
    assert cases_needed(0.8, 0.1, 1.0) == 11 and cases_needed(0.8, 0.1, 0.7) is None


def test_the_fixed_sequence_stops_at_the_first_threshold_it_cannot_certify():
    """Confident good cases, then uncertain bad ones: the rule accepts the good ones, and a sequence starting below
    them (no case accepted) certifies nothing."""
    scores = np.r_[np.full(30, 0.1), np.full(10, 0.9)]
    dice = np.r_[np.full(30, 0.95), np.full(10, 0.1)]
    cert = certify_threshold(scores, dice, target=0.8, delta=0.1, grid=[0.05, 0.2, 0.5, 1.0], min_accepted=1)
    assert cert.threshold == 0.5 and cert.accepted == 30 and cert.coverage == pytest.approx(0.75)
    assert cert.accepted_dice == pytest.approx(0.95)
    none = certify_threshold(scores, dice, target=0.8, delta=0.1, grid=[0.05, 0.2, 0.5, 1.0])
    assert none.threshold is None  # 0.05 accepts nothing: the sequence ends there
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
        cert = certify_threshold(s, d, target, delta, grid=grid[grid >= 0.1])
        if cert.threshold is None:
            continue
        certified += 1
        violations += big_d[big_s <= cert.threshold].mean() < target
    assert certified > 300  # the test is not vacuous
    rate = violations / certified
    assert rate <= delta + 3 * math.sqrt(delta * (1 - delta) / certified)


def _cases(scores, dice):
    """Labelled cases as predict --calibrate scores them, every score the same, every structure found."""
    scores, dice = np.asarray(scores, float), np.asarray(dice, float)
    return {"u_mean": scores, "u_foreground": scores.copy(), "u_boundary": scores.copy(),
            "area_fraction": np.full(dice.size, 0.1), "mask_fraction": np.full(dice.size, 0.1), "dice": dice}


def _wsr_by_hand(losses, alpha, delta):
    """Waudby-Smith-Ramdas capital written out loop by loop (the paper's predictable plug-in bets)."""
    n, s, sq, mu_prev_var, best, k = len(losses), 0.0, 0.0, 0.25, 1.0, 1.0
    for j, x in enumerate(losses, start=1):
        nu = min(1.0, math.sqrt(2 * math.log(1 / delta) / (n * mu_prev_var)))
        k *= 1 - nu * (x - alpha)
        best = max(best, k)
        s += x
        mu = (0.5 + s) / (j + 1)
        sq += (x - mu) ** 2
        mu_prev_var = (0.25 + sq) / (j + 1)
    return min(1.0, 1 / best)


def test_betting_p_value_by_hand():
    from feduq.inference.certify import min_cases, wsr_p_value

    rng = np.random.default_rng(3)
    for n, alpha in ((5, 0.3), (40, 0.2), (200, 0.1)):
        x = np.clip(rng.normal(0.1, 0.08, n), 0, 1)
        assert wsr_p_value(x, alpha, 0.05) == pytest.approx(_wsr_by_hand(x, alpha, 0.05), rel=1e-9)
    assert wsr_p_value(np.full(50, 0.5), 0.2, 0.1) == 1.0  # losses above alpha: the capital only falls
    # Dice 1 everywhere: the capital 1 + nu alpha grows each case; 25 cases reach 1 / 0.0111 for target 0.8 (delta
    # 0.1 over 3 scores x 3 starts), 24 do not; Hoeffding-Bentkus: 0.8^n <= 0.0111 from n = 21
    assert _wsr_by_hand([0.0] * 25, 0.2, 0.1 / 9) <= 0.1 / 9 < _wsr_by_hand([0.0] * 24, 0.2, 0.1 / 9)
    assert min_cases(0.8, 0.1 / 9, "wsr") == 25 and min_cases(0.8, 0.1 / 9, "hb") == 21 == math.ceil(
        math.log(0.1 / 9) / math.log(0.8))


def test_certified_rule_by_hand():
    """30 confident cases of Dice 1 (score 0.01) and 10 uncertain ones of Dice 0.1 (score 0.5); target 0.8, delta
    0.1 over 3 scores x 3 starts (0.0111 each): at least 25 cases are needed (above); the starts accepting a quarter
    and half of the cases (25 at least) begin at the first grid threshold at or above 0.01, which accepts the 30
    (p <= 0.0111), every later one below 0.5 too; the first at 0.5 or above accepts all 40 (empirical risk 0.325 >
    0.2, the capital falls), as does the full-coverage start alone: the certified threshold is the last grid value
    below 0.5."""
    from feduq.inference.certify import GRID
    from feduq.inference.review import certify_rule

    rule = certify_rule(_cases([0.01] * 30 + [0.5] * 10, [1.0] * 30 + [0.1] * 10), target_dice=0.8, delta=0.1)
    assert rule.threshold == pytest.approx(GRID[GRID < 0.5].max()) and rule.score == "u_mean"
    assert rule.coverage == pytest.approx(30 / 40) and rule.accepted_dice == 1.0
    c = rule.certificate
    assert c["k"] == 40 and c["delta"] == 0.1 and c["bound"] == 0.8
    assert c["scores_tested"] == ["u_mean", "u_foreground", "u_boundary"]


def test_certified_rule_refuses_too_few_cases_and_says_what_the_cases_can_certify():
    from feduq.inference.certify import cases_for_target, certify_scores
    from feduq.inference.review import ReviewError, certify_rule

    with pytest.raises(ReviewError, match="24 labelled cases cannot certify a mean Dice of 0.800 at delta 0.1: at "
                                          "least 25 are needed"):
        certify_rule(_cases([0.01] * 24, [1.0] * 24), 0.8, 0.1)
    # 30 cases of Dice 0.9: too few to certify 0.8; 0.9 > 0.8, so enough such cases would do: the hint is the
    # procedure itself run on these cases repeated (cases_for_target)
    cases = _cases([0.01] * 30, [0.9] * 30)
    with pytest.raises(ReviewError) as err:
        certify_rule(cases, 0.8, 0.1)
    scores = {k: cases[k] for k in ("u_mean", "u_foreground", "u_boundary")}
    need = cases_for_target(scores, cases["dice"], 0.8, 0.1)
    assert 30 < need <= 300 and need % 30 == 0
    m = re.search(r"cannot certify a mean Dice of 0.800 at any coverage \(delta 0.1\): the highest target they "
                  r"certify is about (0\.\d+); about ([\d,]+) labelled cases like these would be needed",
                  str(err.value))
    assert m and int(m.group(2).replace(",", "")) == need
    tiled = {k: np.tile(v, need // 30) for k, v in scores.items()}
    assert certify_scores(tiled, np.tile(cases["dice"], need // 30), 0.8, 0.1)[0] is not None  # what it says holds
    best = float(m.group(1))
    assert certify_scores(scores, cases["dice"], best, 0.1)[0] is not None
    assert certify_scores(scores, cases["dice"], best + 0.01, 0.1)[0] is None
    # identical Dice 0.9 and distinct scores: one early start alone stopped at its first, small set (20 cases,
    # target 0.5 refused, "best 0.274"); the full-coverage start certifies it
    spread = _cases(np.linspace(0.01, 0.5, 20), [0.9] * 20)
    assert certify_scores({k: spread[k] for k in ("u_mean", "u_foreground", "u_boundary")}, spread["dice"], 0.5,
                          0.1)[0] is not None
    for bad in (dict(target_dice=1.0, delta=0.1), dict(target_dice=0.8, delta=0.0)):
        with pytest.raises(ReviewError, match="in \\(0, 1\\)"):
            certify_rule(cases, **bad)


def test_the_guarantee_holds_with_the_data_driven_start_and_three_scores():
    """As above, with what predict runs: the betting p-value, the fixed grid, three starts per score, the best of three
    scores (one informative, one noisier, one pure noise), delta / 9 for each sequence: over 300
    draws of 300 cases the fresh cases' accepted mean Dice (the true selective mean falls below 0.8 past 0.5) is
    below the target in at most delta + 3 standard errors of the draws (in this run: 299 of 300 certified, no
    violation, thresholds 0.30-0.49, always the informative score)."""
    from feduq.inference.certify import certify_scores

    rng = np.random.default_rng(1)

    def draw(n):
        s = rng.uniform(0, 1, n)
        d = np.clip(1.0 - 0.8 * s + rng.normal(0, 0.05, n), 0, 1)
        return {"a": 0.01 + s, "b": 0.01 + np.clip(s + rng.normal(0, 0.3, n), 0, 2), "c": rng.uniform(0.01, 1, n)}, d

    big, big_d = draw(200_000)
    target, delta, violations, certified = 0.8, 0.1, 0, 0
    for _ in range(300):
        scores, d = draw(300)
        name, cert, _ = certify_scores(scores, d, target, delta)
        if name is None:
            continue
        certified += 1
        violations += big_d[big[name] <= cert.threshold].mean() < target
    assert certified > 250
    assert violations / certified <= delta + 3 * math.sqrt(delta * (1 - delta) / certified)
