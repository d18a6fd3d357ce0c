"""Numerical tests of FedUAA's math (feduq.methods.feduaa) on hand-made inputs."""

import math

import numpy as np
import pytest
import torch
from scipy.special import digamma

from feduq.core.evidential import dirichlet_from_logits
from feduq.core.evidential_loss import EvidentialDiceLoss, FedEviLoss
from feduq.methods.feduaa import (
    DEFAULT_THRESHOLD,
    FedUAALoss,
    FedUAASegLoss,
    YoudenCollector,
    aggregation_weights,
    edl_cross_entropy,
    evidential_output,
    image_samples,
    pixel_samples,
    resolve_threshold,
    temperature_cross_entropy,
    youden_point,
    youden_threshold,
)


def _logit_for_evidence(e):
    """softplus^{-1}(e) = ln(exp(e) - 1)."""
    return math.log(math.expm1(e))


# -- aggregation weights ---------------------------------------------------------------------------
def test_softmax_weights_match_methods_md_toy():
    w = aggregation_weights([0.35, 0.50, 0.62, 0.41, 0.80])
    np.testing.assert_allclose(w, [0.163882, 0.190404, 0.214680, 0.174016, 0.257018], atol=1e-6)
    assert w.dtype == np.float64 and w.sum() == pytest.approx(1.0, abs=1e-15)


def test_softmax_over_the_sites_that_answered_is_the_renormalised_full_softmax():
    full = aggregation_weights([0.35, 0.50, 0.62, 0.41, 0.80])
    subset = aggregation_weights([0.35, 0.62, 0.80])
    np.testing.assert_allclose(subset, full[[0, 2, 4]] / full[[0, 2, 4]].sum(), atol=1e-15)
    # shift invariant and overflow-free
    np.testing.assert_allclose(aggregation_weights([1000.0, 1000.0]), [0.5, 0.5])
    assert aggregation_weights([0.7]).tolist() == [1.0]


@pytest.mark.parametrize(
    "thresholds, pattern",
    [([], "must not be empty"), ([0.2, float("nan")], r"thresholds\[1\].*finite"),
     ([float("inf"), 0.1], r"thresholds\[0\].*finite"), ([[0.1, 0.2]], "1-D")],
)
def test_softmax_weights_never_return_nan(thresholds, pattern):
    with pytest.raises(ValueError, match=pattern):
        aggregation_weights(thresholds)


def test_resolve_threshold_keeps_previous_then_default():
    assert resolve_threshold(0.42, previous=0.3) == (0.42, "reported")
    assert resolve_threshold(np.float32(1.0)) == (1.0, "reported")
    for bad in (None, float("nan"), float("inf"), -0.1, 1.5, "0.4", True):
        assert resolve_threshold(bad, previous=0.3) == (0.3, "previous"), bad
        assert resolve_threshold(bad) == (DEFAULT_THRESHOLD, "default"), bad
    assert resolve_threshold(None, default=0.2) == (0.2, "default")
    with pytest.raises(ValueError, match="default threshold"):
        resolve_threshold(None, default=2.0)


# -- Youden threshold ------------------------------------------------------------------------------
def test_youden_threshold_hand_computed():
    u = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    wrong = [0, 0, 1, 0, 1, 1, 0, 1]  # 4 wrong (P), 4 correct (N)
    # ROC points (flag "wrong" when u >= t), sklearn with drop_intermediate=True:
    #   t     TP FP  TPR   FPR   J
    #   inf    0  0  0     0     0
    #   0.8    1  0  0.25  0     0.25
    #   0.7    1  1  0.25  0.25  0
    #   0.5    3  1  0.75  0.25  0.50   <- first maximum
    #   0.4    3  2  0.75  0.50  0.25
    #   0.3    4  2  1     0.50  0.50   (tie, later: not chosen)
    #   0.1    4  4  1     1     0
    # (0.6 and 0.2 lie on straight ROC segments and are dropped; J there is 0.25 and 0.25.)
    point = youden_point(u, wrong)
    assert point.threshold == pytest.approx(0.5)
    assert (point.youden_j, point.tpr, point.fpr) == pytest.approx((0.5, 0.75, 0.25))
    assert (point.num_samples, point.num_wrong, point.reason) == (8, 4, "ok")
    # same from torch tensors and bool arrays
    assert youden_threshold(torch.tensor(u), np.array(wrong, dtype=bool)) == pytest.approx(0.5)


def test_youden_threshold_equals_brute_force_first_maximum():
    rng = np.random.default_rng(3)
    wrong = rng.random(400) < 0.3
    u = np.clip(rng.normal(0.4 + 0.2 * wrong, 0.15), 0.01, 1.0).round(3)  # ties included
    best_j, best_t = -1.0, None
    for t in np.sort(np.unique(u))[::-1]:  # decreasing thresholds, as the ROC walks
        flagged = u >= t
        j = flagged[wrong].mean() - flagged[~wrong].mean()
        if j > best_j + 1e-12:
            best_j, best_t = j, t
    point = youden_point(u, wrong)
    assert point.threshold == pytest.approx(best_t) and point.youden_j == pytest.approx(best_j)


def test_youden_degenerate_cases_return_none():
    # +inf first ROC threshold: u ranks errors *below* correct samples, no finite t has J > 0
    p = youden_point([0.9, 0.8, 0.1, 0.2], [0, 0, 1, 1])
    assert p.threshold is None and p.reason == "uninformative" and p.youden_j == 0.0
    # constant u: the only finite point is (1, 1), J = 0 -> the +inf point wins the tie
    assert youden_point([0.3, 0.3, 0.3], [0, 1, 0]).reason == "uninformative"
    assert youden_point([0.1, 0.5], [0, 0]).reason == "no_errors"  # TPR undefined
    assert youden_point([0.1, 0.5], [1, 1]).reason == "no_correct"  # FPR undefined
    assert youden_point([], []).reason == "empty"
    for u, w in (([0.1, 0.5], [0, 0]), ([0.1, 0.5], [1, 1]), ([], [])):
        assert youden_threshold(u, w) is None


def test_youden_threshold_is_clamped_to_unit_interval():
    assert youden_threshold([0.5, 3.0], [0, 1]) == 1.0  # a score above 1 (not a u = K/S)


@pytest.mark.parametrize(
    "u, wrong, pattern",
    [([0.1, 0.2], [0], "same number"), ([0.1, float("nan")], [0, 1], r"uncertainty\[1\].*finite"),
     ([0.1, 0.2], [0, 2], r"wrong\[1\] must be 0 or 1")],
)
def test_youden_rejects_bad_input(u, wrong, pattern):
    with pytest.raises(ValueError, match=pattern):
        youden_point(u, wrong)


# -- TWEU head and loss ----------------------------------------------------------------------------
def test_evidential_output_hand_values_and_identity():
    z = torch.tensor([[_logit_for_evidence(1.0), _logit_for_evidence(2.0)]], dtype=torch.float64)
    out = evidential_output(z)
    # e = (1, 2), alpha = (2, 3), S = 5, b = (0.2, 0.4), u = 2/5
    np.testing.assert_allclose(out.evidence.numpy(), [[1.0, 2.0]], rtol=1e-12)
    np.testing.assert_allclose(out.alpha.numpy(), [[2.0, 3.0]], rtol=1e-12)
    np.testing.assert_allclose(out.belief.numpy(), [[0.2, 0.4]], rtol=1e-12)
    np.testing.assert_allclose(out.uncertainty.numpy(), [0.4], rtol=1e-12)
    seg = evidential_output(torch.randn(2, 3, 4, 5))
    assert seg.uncertainty.shape == (2, 4, 5) and seg.strength.shape == (2, 1, 4, 5)
    torch.testing.assert_close(seg.belief.sum(1) + seg.uncertainty, torch.ones(2, 4, 5))
    assert float(seg.uncertainty.min()) > 0 and float(seg.uncertainty.max()) <= 1


def test_loss_terms_hand_computed_k2():
    z = torch.tensor([[_logit_for_evidence(1.0), _logit_for_evidence(2.0)]], dtype=torch.float64)
    y = torch.tensor([1])
    onehot = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
    alpha = evidential_output(z).alpha
    # L_Ice = psi(S) - psi(alpha_y) = psi(5) - psi(3) = 1/3 + 1/4 = 7/12
    ice = float(edl_cross_entropy(alpha, onehot))
    assert ice == pytest.approx(digamma(5.0) - digamma(3.0), abs=1e-12) and ice == pytest.approx(7 / 12, abs=1e-12)
    # alpha~ = (2, 1): KL(Dir(2, 1) || Dir(1, 1)) = ln 2 - 1 + 1/2
    kl = math.log(2.0) - 0.5
    # L_Tce = -log softmax((0.2, 0.4) / 0.05)_1 = log(1 + e^-4)
    tce = math.log1p(math.exp(-4.0))
    assert float(temperature_cross_entropy(evidential_output(z).belief, onehot, 0.05)) == pytest.approx(tce, abs=1e-12)

    loss = FedUAALoss(annealing_step=101, temperature=0.05)
    # round 101: a = 1
    assert float(loss(z, y, 101)) == pytest.approx(7 / 12 + kl + tce, abs=1e-12)
    parts = loss.last_components
    assert (float(parts.main), float(parts.kl), float(parts.tce), parts.kl_coefficient) == pytest.approx(
        (7 / 12, kl, tce, 1.0), abs=1e-12
    )
    # round 1 of 101: a = 1/101; no temperature term
    assert float(FedUAALoss(temperature=None)(z, y, 1)) == pytest.approx(7 / 12 + kl / 101, abs=1e-12)
    # one-hot target and batch mean
    z2 = torch.cat([z, z.flip(1)])  # second sample: alpha = (3, 2), y = 0 -> same values
    assert float(loss(z2, torch.tensor([[0.0, 1.0], [1.0, 0.0]], dtype=torch.float64), 101)) == pytest.approx(
        7 / 12 + kl + tce, abs=1e-12
    )


def test_loss_gradients_finite_for_large_logits():
    for scale in (1e2, 1e4, 3e4):
        z = torch.tensor([[scale, -scale, 0.0], [-scale, scale, scale]], requires_grad=True)
        loss = FedUAALoss(temperature=0.05)(z, torch.tensor([1, 2]), 50)
        loss.backward()
        assert torch.isfinite(loss) and torch.isfinite(z.grad).all(), scale
    z = (torch.randn(2, 2, 8, 8) * 1e4).requires_grad_(True)
    seg = FedUAASegLoss(temperature=0.05)(z, torch.randint(0, 2, (2, 1, 8, 8)), 3)
    seg.backward()
    assert torch.isfinite(seg) and torch.isfinite(z.grad).all()


def test_loss_rejects_bad_arguments():
    with pytest.raises(ValueError, match="annealing_step"):
        FedUAALoss(annealing_step=0)
    with pytest.raises(ValueError, match="temperature"):
        FedUAALoss(temperature=0.0)
    with pytest.raises(ValueError, match="kl_weight"):
        FedUAALoss(kl_weight=float("nan"))
    with pytest.raises(ValueError, match="round_index"):
        FedUAALoss()(torch.zeros(1, 2), torch.tensor([0]), 0)


def test_seg_loss_is_fedevi_loss_with_softplus_evidence_and_fedevi_default_is_unchanged():
    torch.manual_seed(0)
    z, y = torch.randn(2, 2, 6, 6, dtype=torch.float64), torch.randint(0, 2, (2, 1, 6, 6))
    seg = FedUAASegLoss(kl_weight=0.01, annealing_step=10)
    ref = FedEviLoss(kl_weight=0.01, annealing_step=10, evidence="softplus")
    assert float(seg(z, y, 4)) == pytest.approx(float(ref(z, y, 4)), abs=1e-14)
    assert float(seg.last_components.tce) == 0.0
    # softplus evidence: alpha = softplus(z) + 1
    torch.testing.assert_close(dirichlet_from_logits(z, evidence="softplus").alpha, torch.nn.functional.softplus(z) + 1)
    # FedEvi keeps exp evidence by default
    torch.testing.assert_close(dirichlet_from_logits(z).alpha, torch.exp(z) + 1)
    assert EvidentialDiceLoss().evidence == "exp" and FedEviLoss().dice.evidence == "exp"
    assert float(FedEviLoss()(z, y, 4)) != pytest.approx(float(ref(z, y, 4)))
    with pytest.raises(ValueError, match="evidence"):
        dirichlet_from_logits(z, evidence="relu")
    # optional per-pixel temperature term adds the mean L_Tce
    with_t = FedUAASegLoss(temperature=0.05)
    total = float(with_t(z, y, 4))
    assert total == pytest.approx(float(ref(z, y, 4)) + float(with_t.last_components.tce), abs=1e-12)


# -- segmentation ROC samples ----------------------------------------------------------------------
def test_pixel_samples_are_seeded_subsamples():
    u = torch.arange(32, dtype=torch.float32).reshape(2, 4, 4) / 32
    wrong = u > 0.5
    a = pixel_samples(u, wrong, 5, torch.Generator().manual_seed(1))
    b = pixel_samples(u, wrong, 5, torch.Generator().manual_seed(1))
    assert a[0].shape == (10,) and a[1].dtype == bool
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], a[0] > 0.5)  # pairs stay aligned
    assert set(a[0][:5] * 32) <= set(range(16)) and set(a[0][5:] * 32) <= set(range(16, 32))  # 5 per image
    full = pixel_samples(u, wrong, None)
    np.testing.assert_array_equal(full[0], u.reshape(-1).numpy())


def test_image_samples_hand_computed_dice():
    label = torch.tensor([[[1, 1], [0, 0]], [[0, 0], [0, 0]], [[1, 0], [0, 0]]])
    pred = torch.tensor([[[1, 0], [0, 0]], [[0, 0], [0, 0]], [[0, 1], [0, 0]]])
    u = torch.tensor([0.1, 0.2, 0.3]).reshape(3, 1, 1).expand(3, 2, 2)
    mean_u, wrong = image_samples(u, pred, label, num_classes=2, dice_cutoff=0.7)
    # Dice: 2*1/(1+2) = 0.667 (wrong at cut-off 0.7), both empty -> 1, disjoint -> 0
    np.testing.assert_allclose(mean_u, [0.1, 0.2, 0.3], rtol=1e-6)
    assert wrong.tolist() == [True, False, True]
    assert image_samples(u, pred, label, 2, dice_cutoff=0.5)[1].tolist() == [False, False, True]


def test_collector_pixel_and_image_levels():
    # two images, 1x4 pixels; channel 1 logit high = confident foreground
    z = torch.tensor(
        [[[[5.0, 5.0, -5.0, 0.1]], [[-5.0, -5.0, 5.0, 0.3]]],
         [[[5.0, 0.2, 5.0, 5.0]], [[-5.0, 0.0, -5.0, -5.0]]]]
    )
    label = torch.tensor([[[[0, 0, 1, 0]]], [[[0, 1, 0, 0]]]])
    col = YoudenCollector(level="pixel", pixels_per_image=0)
    col.add(z, label)
    # the two uncertain pixels (logits near 0) are exactly the two errors -> J = 1
    p = col.result()
    assert p.reason == "ok" and p.youden_j == pytest.approx(1.0) and p.num_samples == 8 and p.num_wrong == 2
    out = evidential_output(z)
    # errors: image 0 pixel 3 (pred 1, label 0) and image 1 pixel 1 (pred 0, label 1); the first
    # maximum of J is at the smaller of their u (all correct pixels have u ~ 2/(5+2) ~ 0.29)
    u_err = min(float(out.uncertainty[0, 0, 3]), float(out.uncertainty[1, 0, 1]))
    assert p.threshold == pytest.approx(u_err, rel=1e-6)
    col.reset(1)
    assert col.num_samples == 0 and col.result().reason == "empty"
    img = YoudenCollector(level="image", dice_cutoff=0.5)
    img.add(z, label)
    assert img.num_samples == 2  # one (mean u, Dice < 0.5) pair per image
    with pytest.raises(ValueError, match="level"):
        YoudenCollector(level="voxel")
    with pytest.raises(ValueError, match="pixels_per_image"):
        YoudenCollector(pixels_per_image=-1)


def test_collector_classification_is_the_papers_per_sample_roc():
    # [B, K] logits: one (u, wrong) pair per sample, whatever the level
    z = torch.tensor([[4.0, -4.0, -4.0], [-4.0, 4.0, -4.0], [0.2, 0.1, 0.0], [0.0, 0.3, 0.1]])
    y = torch.tensor([0, 1, 1, 0])  # the two low-evidence samples are the wrong ones
    for level in ("pixel", "image"):
        col = YoudenCollector(level=level)
        col.add(z, y)
        p = col.result()
        assert (p.num_samples, p.num_wrong, p.youden_j) == (4, 2, pytest.approx(1.0))
        u = evidential_output(z).uncertainty
        assert p.threshold == pytest.approx(float(u[2:].min()), rel=1e-6)


def test_feduaa_seg_site_part_collects_one_rounds_training_pixels_and_sends_their_youden_threshold():
    """FLARE-free: the site part's loss feeds the ROC only between before_round and statistics (the official
    protocol: the training batches of that round), and statistics sends θ_k of exactly those pixels."""
    from types import SimpleNamespace

    from feduq.common.wire import FedUQMetaKey
    from feduq.methods.feduaa import FedUAASegSite, YoudenCollector

    part = FedUAASegSite(pixels_per_image=0, seed=3)
    site = SimpleNamespace(dp=None)
    loss = part.loss(site)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(2, 2, 4, 4, generator=g), torch.randint(0, 2, (2, 1, 4, 4), generator=g)) for _ in range(3)]
    loss(*batches[0], 1)  # before the round: not collected
    part.before_round(site, 0)
    for logits, label in batches[1:]:
        value = loss(logits, label, 1)
        assert value.ndim == 0 and torch.isfinite(value)
    meta = part.statistics(site, 0)
    loss(*batches[0], 1)  # after statistics: not collected
    assert part.last_point.num_samples == 2 * 2 * 16  # two batches of 2 images of 4 x 4 pixels
    reference = YoudenCollector(pixels_per_image=0, seed=3)
    reference.reset(0)
    for logits, label in batches[1:]:
        reference.add(logits, label)
    assert meta == {FedUQMetaKey.FEDUAA_THRESHOLD: reference.result().threshold}
    assert part.record(0)["feduaa_roc_samples"] == 64
    with pytest.raises(ValueError, match="threshold_source"):
        FedUAASegSite(threshold_source="test")
