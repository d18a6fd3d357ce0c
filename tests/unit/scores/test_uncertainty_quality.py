"""Uncertainty-quality metrics (feduq.scores.uncertainty_quality): hand-computed values, library cross-checks, streaming."""

import math

import numpy as np
import pytest
import torch
from sklearn.calibration import calibration_curve
from sklearn.metrics import brier_score_loss, log_loss, roc_auc_score

from feduq.scores.metrics import calibration_error
from feduq.scores.uncertainty_quality import (
    PixelAccumulator,
    brier_score,
    error_detection,
    expected_calibration_error,
    nll,
    optimal_aurc,
    plot_reliability,
    plot_risk_coverage,
    reliability_bins,
    risk_coverage,
    uncertainty_dice_spearman,
)


def test_ece_hand_example_15_bins():
    conf, correct = [0.9, 0.9, 0.6, 0.6], [1, 0, 1, 1]
    bins = reliability_bins(conf, correct)
    assert len(bins["count"]) == 15 and bins["edges"][[0, -1]].tolist() == [0.0, 1.0]
    assert np.flatnonzero(bins["count"]).tolist() == [9, 13]  # 0.6 in [9/15, 10/15), 0.9 in [13/15, 14/15)
    assert bins["accuracy"][13] == pytest.approx(0.5) and bins["accuracy"][9] == pytest.approx(1.0)
    assert bins["confidence"][13] == pytest.approx(0.9) and np.isnan(bins["accuracy"][0])
    assert expected_calibration_error(conf, correct) == pytest.approx(0.5 * 0.4 + 0.5 * 0.4)  # 0.4


def test_reliability_bins_edges_and_sklearn():
    bins = reliability_bins([0.0, 1.0, 1.0, 0.5], [0, 1, 1, 0], n_bins=2)
    assert bins["count"].tolist() == [1, 3]  # 1.0 is in the last bin, 0.5 starts the upper bin
    assert bins["confidence"][1] == pytest.approx(2.5 / 3) and bins["accuracy"][1] == pytest.approx(2 / 3)
    rng = np.random.default_rng(1)
    conf = rng.random(500)
    correct = rng.random(500) < conf
    bins = reliability_bins(conf, correct, 15)
    acc, mean_conf = calibration_curve(correct, conf, n_bins=15, strategy="uniform")
    nonempty = bins["count"] > 0
    np.testing.assert_allclose(bins["accuracy"][nonempty], acc)
    np.testing.assert_allclose(bins["confidence"][nonempty], mean_conf)
    with pytest.raises(ValueError):
        reliability_bins([0.5, 0.5], [1])


@pytest.mark.parametrize("num_classes", [2, 3])
def test_ece_equals_feduq_metrics_calibration_error(num_classes):
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(2.0 * torch.randn(3, num_classes, 16, 16, generator=g), dim=1)
    label = torch.randint(0, num_classes, (3, 1, 16, 16), generator=g)
    monai = calibration_error(probs, label, num_bins=15)  # per image, mean over foreground classes (one-vs-rest)
    ours = [
        np.mean([expected_calibration_error(probs[b, c], label[b, 0] == c, 15) for c in range(1, num_classes)])
        for b in range(3)
    ]
    assert monai.shape == (3,) and all(v > 0.01 for v in ours)
    np.testing.assert_allclose(ours, monai, atol=1e-6)


def test_brier_and_nll_hand_values_and_sklearn():
    onehot = np.eye(3)[[0, 2, 1]]
    assert brier_score(onehot, [0, 2, 1]) == 0.0 and nll(onehot, [0, 2, 1]) == pytest.approx(0.0, abs=1e-12)
    uniform = np.full((4, 2), 0.5)
    assert brier_score(uniform, [0, 1, 1, 0]) == pytest.approx(0.5)  # 0.25 + 0.25
    assert nll(uniform, [0, 1, 1, 0]) == pytest.approx(math.log(2))
    assert nll([[1.0, 0.0]], [1], eps=1e-12) == pytest.approx(-math.log(1e-12))  # a certain mistake stays finite
    rng = np.random.default_rng(2)
    p = rng.dirichlet(np.ones(3), size=(2, 5, 4)).transpose(0, 3, 1, 2)  # [B=2, C=3, H=5, W=4]
    y = rng.integers(0, 3, size=(2, 1, 5, 4))
    flat_p, flat_y = p.transpose(0, 2, 3, 1).reshape(-1, 3), y.ravel()
    assert brier_score(p, y) == pytest.approx(brier_score_loss(flat_y, flat_p, labels=[0, 1, 2], scale_by_half=False))
    assert nll(p, y) == pytest.approx(log_loss(flat_y, flat_p, labels=[0, 1, 2]))
    with pytest.raises(ValueError):
        brier_score(uniform, [0, 2, 1, 0])  # label outside [0, C)


def test_error_detection_perfect_constant_and_undefined():
    wrong = np.array([0, 1, 0, 0, 1, 0], bool)
    perfect = error_detection(np.where(wrong, 2.0, 0.1), wrong)
    assert perfect["auroc"] == 1.0 and perfect["auprc"] == 1.0 and perfect["error_rate"] == pytest.approx(1 / 3)
    constant = error_detection(np.ones(6), wrong)
    assert constant["auroc"] == 0.5 and constant["auprc"] == pytest.approx(1 / 3)  # AUPRC of chance = error rate
    assert error_detection(np.where(wrong, 0.0, 1.0), wrong)["auroc"] == 0.0  # inverted ranking
    for w, reason in ((np.zeros(4, bool), "no wrong pixel"), (np.ones(4, bool), "every pixel is wrong")):
        res = error_detection(np.arange(4.0), w)
        assert math.isnan(res["auroc"]) and math.isnan(res["auprc"]) and res["reason"] == reason


def test_risk_coverage_perfect_ranking_closed_form_and_reversed():
    risk = np.array([0.0, 0.1, 0.2, 0.5])
    coverage, curve, aurc = risk_coverage([0.1, 0.2, 0.3, 0.9], risk)
    np.testing.assert_allclose(coverage, [0.25, 0.5, 0.75, 1.0])
    np.testing.assert_allclose(curve, [0.0, 0.05, 0.1, 0.2])
    assert aurc == pytest.approx(0.0875) and optimal_aurc(risk) == pytest.approx(0.0875)
    _, reversed_curve, reversed_aurc = risk_coverage([0.9, 0.3, 0.2, 0.1], risk)
    np.testing.assert_allclose(reversed_curve, [0.5, 0.35, 0.8 / 3, 0.2])
    assert reversed_aurc == pytest.approx((0.5 + 0.35 + 0.8 / 3 + 0.2) / 4) and reversed_aurc > aurc
    assert curve[-1] == pytest.approx(reversed_curve[-1]) and curve[-1] == pytest.approx(risk.mean())  # full coverage
    rng = np.random.default_rng(3)
    r = rng.random(30)
    assert risk_coverage(r, r)[2] == pytest.approx(optimal_aurc(r))  # closed form on a random perfect ranking
    assert risk_coverage(rng.random(30), r)[2] >= optimal_aurc(r)


def test_spearman_monotone_and_constant():
    rho, p = uncertainty_dice_spearman([0.1, 0.2, 0.4, 0.8, 1.6], [0.9, 0.8, 0.5, 0.3, 0.1])
    assert rho == pytest.approx(-1.0) and p < 0.05
    assert all(math.isnan(v) for v in uncertainty_dice_spearman([1.0, 1.0, 1.0], [0.1, 0.2, 0.3]))
    with pytest.raises(ValueError):
        uncertainty_dice_spearman([1.0, 2.0], [0.5])


def _batch(rng, b, c=3, h=8, w=8):
    probs = rng.dirichlet(np.full(c, 0.5), size=(b, h, w)).transpose(0, 3, 1, 2)
    label = np.where(rng.random((b, 1, h, w)) < 0.7, probs.argmax(1)[:, None], rng.integers(0, c, (b, 1, h, w)))
    entropy = -(probs * np.log(probs + 1e-12)).sum(1)
    return probs, label, entropy


def test_pixel_accumulator_matches_one_call_on_concatenated_arrays(tmp_path):
    rng = np.random.default_rng(4)
    batches = [_batch(rng, 2), _batch(rng, 3)]
    acc = PixelAccumulator(max_pixels=10**6)
    for probs, label, unc in batches:
        acc.update(torch.from_numpy(probs).float(), torch.from_numpy(label), unc)  # torch and numpy both accepted
    probs = np.concatenate([b[0] for b in batches]).astype(np.float32).astype(np.float64)
    label, unc = np.concatenate([b[1] for b in batches]), np.concatenate([b[2] for b in batches])
    conf, pred = probs.max(1).ravel(), probs.argmax(1).ravel()
    wrong = pred != label.ravel()
    dice = rng.random(5)
    res = acc.result(dice)
    assert res["n_pixels"] == res["n_sampled"] == 5 * 64 and 0 < res["error_rate"] < 1
    assert res["ece"] == pytest.approx(expected_calibration_error(conf, ~wrong), abs=1e-12)
    assert res["auroc"] == pytest.approx(roc_auc_score(wrong, unc.ravel()), abs=1e-12)
    assert res["auroc"] == pytest.approx(error_detection(unc, wrong)["auroc"], abs=1e-12)
    assert res["brier"] == pytest.approx(brier_score(probs, label)) and res["nll"] == pytest.approx(nll(probs, label))
    np.testing.assert_allclose(res["image_uncertainty"], unc.mean(axis=(1, 2)))
    assert res["aurc"] == pytest.approx(risk_coverage(unc.mean(axis=(1, 2)), 1 - dice)[2])
    assert res["spearman_rho"] == pytest.approx(uncertainty_dice_spearman(unc.mean(axis=(1, 2)), dice)[0])
    assert res["aurc"] >= res["optimal_aurc"]
    assert plot_reliability(res["bins"], tmp_path / "rel.png", "toy").stat().st_size > 0
    curves = {"a": (res["coverage"], res["risk"]), "b": risk_coverage(dice, 1 - dice)[:2]}
    assert plot_risk_coverage(curves, tmp_path / "rc.png").stat().st_size > 0


def test_pixel_accumulator_subsample_is_bounded_seeded_and_bins_exact():
    rng = np.random.default_rng(5)
    batches = [_batch(rng, 4, h=16, w=16) for _ in range(3)]

    def run(seed):
        acc = PixelAccumulator(max_pixels=500, seed=seed)
        for b in batches:
            acc.update(*b)
        return acc

    a, b, full = run(0), run(0), PixelAccumulator(max_pixels=10**6)
    for batch in batches:
        full.update(*batch)
    ra, rb, rf = a.result(), b.result(), full.result()
    assert ra["n_sampled"] == 500 and ra["n_pixels"] == 3 * 4 * 256
    assert ra["auroc"] == rb["auroc"] and ra["auroc"] != run(1).result()["auroc"]
    assert ra["auroc"] == pytest.approx(rf["auroc"], abs=0.08)  # a subsample estimates the full AUROC
    assert ra["ece"] == rf["ece"] and np.array_equal(ra["bins"]["count"], rf["bins"]["count"])  # bins never sampled
    with pytest.raises(ValueError):
        a.result(np.ones(3))  # 12 images were added
    with pytest.raises(ValueError):
        PixelAccumulator().update(batches[0][0], batches[0][1], batches[0][2][:, :8])
