"""Numerical tests of feduq.core.evidential against closed forms and a hand-computed toy input."""

import math

import numpy as np
import pytest
import torch
from scipy.special import digamma as sp_digamma
from scipy.special import gammaln as sp_gammaln

from feduq.core.evidential import (
    Dirichlet,
    dirichlet_from_logits,
    dirichlet_kl_to_uniform,
    dirichlet_second_moment,
    evidential_uncertainty,
    image_uncertainty_means,
    kl_annealing_factor,
    target_to_one_hot,
    to_one_hot,
)
from feduq.core.evidential_loss import EvidentialDiceLoss, FedEviLoss, evidential_dice_loss

ATOL = 1e-6


# --------------------------------------------------------------------------------------------------
# a hand-computed toy input
# --------------------------------------------------------------------------------------------------
def toy_logits(dtype=torch.float64):
    class0 = [[0.0, 1.0], [2.0, -1.0]]
    class1 = [[1.0, 0.0], [-1.0, 3.0]]
    return torch.tensor([[class0, class1]], dtype=dtype)  # [1, 2, 2, 2]


def toy_labels():
    return torch.tensor([[[1, 0], [0, 1]]])  # [1, 2, 2]


def naive_kl_numpy(alpha, onehot):
    """Textbook closed form of KL(Dir(a~) || Dir(1)), float64 scipy; reference for the stable version."""
    a = onehot + (1.0 - onehot) * alpha
    s = a.sum(axis=1)
    c = a.shape[1]
    return (
        sp_gammaln(s)
        - sp_gammaln(c)
        - sp_gammaln(a).sum(axis=1)
        + ((a - 1.0) * (sp_digamma(a) - sp_digamma(s)[:, None])).sum(axis=1)
    )


def test_dirichlet_from_logits_toy_values_and_shapes():
    d = dirichlet_from_logits(toy_logits())
    assert isinstance(d, Dirichlet)
    assert d.alpha.shape == (1, 2, 2, 2) and d.strength.shape == (1, 1, 2, 2)
    # pixel (0,0): logits (0, 1) -> alpha (2, 1+e), S = 3+e
    e = math.e
    assert d.alpha[0, :, 0, 0].tolist() == pytest.approx([2.0, 1.0 + e], abs=1e-12)
    assert d.prob[0, :, 0, 0].tolist() == pytest.approx([2.0 / (3 + e), (1 + e) / (3 + e)], abs=1e-12)
    torch.testing.assert_close(d.prob.sum(1), torch.ones(1, 2, 2, dtype=torch.float64))


def test_dirichlet_clamp_is_upper_only():
    d = dirichlet_from_logits(torch.tensor([[200.0, -200.0, 80.0]]))
    assert torch.isfinite(d.alpha).all()
    assert d.evidence[0, 0].item() == pytest.approx(math.exp(80), rel=1e-6)  # clamped
    assert d.evidence[0, 1].item() == 0.0  # no lower clamp: exp(-200) underflows to 0
    assert d.alpha[0, 1].item() == 1.0
    d = dirichlet_from_logits(torch.tensor([[5.0, 0.0]]), clamp_max=2.0)
    assert d.evidence[0, 0].item() == pytest.approx(math.exp(2.0), rel=1e-6)


def test_dirichlet_rejects_1d_and_integer_logits():
    with pytest.raises(ValueError, match="logits"):
        dirichlet_from_logits(torch.zeros(3))
    with pytest.raises(TypeError, match="logits"):
        dirichlet_from_logits(torch.zeros(2, 3, dtype=torch.long))


def test_toy_uncertainties_match_methods_md():
    unc = evidential_uncertainty(dirichlet_from_logits(toy_logits()).alpha)
    assert unc.aleatoric.shape == (1, 2, 2)
    expected_ale = torch.tensor([[[0.568329, 0.568329], [0.360183, 0.209830]]], dtype=torch.float64)
    expected_epi = torch.tensor([[[0.078966, 0.078966], [0.045135, 0.019664]]], dtype=torch.float64)
    torch.testing.assert_close(unc.aleatoric, expected_ale, atol=ATOL, rtol=0)
    torch.testing.assert_close(unc.epistemic, expected_epi, atol=ATOL, rtol=0)
    means = image_uncertainty_means(toy_logits(torch.float32))
    assert means["aleatoric"].shape == (1,) and means["aleatoric"].dtype == torch.float64
    assert means["aleatoric"].item() == pytest.approx(0.426668, abs=ATOL)
    assert means["epistemic"].item() == pytest.approx(0.055683, abs=ATOL)
    assert means["total"].item() == pytest.approx(0.426668 + 0.055683, abs=2 * ATOL)


@pytest.mark.parametrize(
    "alpha, ale, epi, tol",
    [
        # alpha=(1,1): E[H] = psi(3) - psi(2) = 1/2; MI = ln 2 - 1/2 = 0.193147...
        ((1.0, 1.0), 0.5, 0.193147, 1e-6),
        ((1.0, 1.0), 0.5, math.log(2.0) - 0.5, 1e-12),
        ((10.0, 1.0), 0.2663, 0.0384, 5e-5),  # sanity values computed by hand (4 decimals)
    ],
)
def test_uncertainty_closed_values(alpha, ale, epi, tol):
    unc = evidential_uncertainty(torch.tensor([alpha], dtype=torch.float64))  # [B=1, C=2]
    assert unc.aleatoric.shape == (1,)
    assert unc.aleatoric.item() == pytest.approx(ale, abs=tol)
    assert unc.epistemic.item() == pytest.approx(epi, abs=tol)


def test_uncertainty_decomposition_on_random_alpha():
    g = torch.Generator().manual_seed(0)
    alpha = 1.0 + torch.exp(3.0 * torch.randn(16, 4, 5, 3, generator=g, dtype=torch.float64))
    unc = evidential_uncertainty(alpha)
    assert unc.total.shape == (16, 5, 3)
    torch.testing.assert_close(unc.total, unc.epistemic + unc.aleatoric, atol=1e-10, rtol=0)
    assert (unc.epistemic >= 0).all()
    assert (unc.aleatoric > 0).all()
    # total entropy is bounded by ln C
    assert (unc.total <= math.log(4) + 1e-12).all()
    # aleatoric reference via scipy
    a = alpha.numpy()
    s = a.sum(1, keepdims=True)
    ref = ((a / s) * (sp_digamma(s + 1) - sp_digamma(a + 1))).sum(1)
    np.testing.assert_allclose(unc.aleatoric.numpy(), ref, atol=1e-12)


def test_epistemic_shrinks_with_evidence():
    # same expected probability, 100x more evidence -> much lower epistemic uncertainty
    low = evidential_uncertainty(torch.tensor([[2.0, 1.0]], dtype=torch.float64)).epistemic.item()
    high = evidential_uncertainty(torch.tensor([[200.0, 100.0]], dtype=torch.float64)).epistemic.item()
    assert high < low / 50


# --------------------------------------------------------------------------------------------------
# Losses on the toy input
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant, expected", [("mean", 0.079638), ("second_moment", 0.101358)])
def test_toy_dice(variant, expected):
    loss = EvidentialDiceLoss(variant=variant)
    assert loss(toy_logits(), toy_labels()).item() == pytest.approx(expected, abs=ATOL)
    # every accepted target form gives the same loss
    onehot = to_one_hot(toy_labels(), 2, torch.float64)
    assert loss(toy_logits(), onehot).item() == pytest.approx(expected, abs=ATOL)
    assert loss(toy_logits(), toy_labels().unsqueeze(1).float()).item() == pytest.approx(expected, abs=ATOL)
    # float32 agrees as well
    assert loss(toy_logits(torch.float32), toy_labels()).item() == pytest.approx(expected, abs=ATOL)


def test_toy_dice_by_hand_per_class():
    # class 1 (foreground) only, mean variant, written out: rho1 at the 4 pixels and y1 = [1,0,0,1]
    e = math.e
    rho1 = [
        (1 + e) / (3 + e),  # logits (0, 1)
        2 / (3 + e),  # logits (1, 0)
        (1 + 1 / e) / (2 + e**2 + 1 / e),  # logits (2, -1)
        (1 + e**3) / (2 + e**3 + 1 / e),  # logits (-1, 3)
    ]
    y1 = [1, 0, 0, 1]
    inter = sum(r * y for r, y in zip(rho1, y1))
    dice1 = (2 * inter + 1e-5) / (sum(r * r for r in rho1) + 2 + 1e-5)
    got = EvidentialDiceLoss(include_background=False)(toy_logits(), toy_labels()).item()
    assert got == pytest.approx(1 - dice1, abs=1e-12)


def test_toy_kl_and_total_loss():
    alpha = dirichlet_from_logits(toy_logits()).alpha
    onehot = to_one_hot(toy_labels(), 2, torch.float64)
    kl = dirichlet_kl_to_uniform(alpha, onehot)
    assert kl.shape == (1, 2, 2)
    assert kl.mean().item() == pytest.approx(0.118734, abs=ATOL)
    np.testing.assert_allclose(kl.numpy(), naive_kl_numpy(alpha.numpy(), onehot.numpy()), atol=1e-12)

    loss = FedEviLoss(kl_weight=0.01, annealing_step=10)
    assert loss(toy_logits(), toy_labels(), round_index=1).item() == pytest.approx(0.079756, abs=ATOL)
    parts = loss.last_components
    assert parts.dice.item() == pytest.approx(0.079638, abs=ATOL)
    assert parts.kl.item() == pytest.approx(0.118734, abs=ATOL)
    assert parts.kl_coefficient == pytest.approx(0.001)
    for r in (10, 37):
        assert loss(toy_logits(), toy_labels(), round_index=r).item() == pytest.approx(0.080825, abs=ATOL)
    sm = FedEviLoss(dice_variant="second_moment")
    assert sm(toy_logits(), toy_labels(), 10).item() == pytest.approx(0.101358 + 0.01 * 0.118734, abs=ATOL)


def test_kl_zero_iff_no_wrong_evidence():
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 3, (2, 4, 5), generator=g)
    onehot = to_one_hot(labels, 3, torch.float64)
    # wrong classes at alpha = 1 (zero evidence), true class with arbitrary evidence
    alpha = 1.0 + onehot * torch.exp(2.0 * torch.randn(2, 3, 4, 5, generator=g, dtype=torch.float64))
    kl = dirichlet_kl_to_uniform(alpha, onehot)
    assert kl.shape == (2, 4, 5)
    assert torch.equal(kl, torch.zeros_like(kl))
    assert torch.equal(dirichlet_kl_to_uniform(alpha.float(), onehot), torch.zeros(2, 4, 5))
    # one unit of evidence on one wrong class at one pixel -> positive there, zero elsewhere
    wrong = (labels[0, 0, 0].item() + 1) % 3
    alpha[0, wrong, 0, 0] += 1.0
    kl = dirichlet_kl_to_uniform(alpha, onehot)
    # KL(Dir(2,1,1) || Dir(1,1,1)) = ln Gamma(4) - ln Gamma(3) - ln Gamma(2) + (psi(2) - psi(4)) = ln 3 - 5/6
    assert kl[0, 0, 0].item() == pytest.approx(math.log(3) - 5.0 / 6.0, abs=1e-12)
    assert kl[0, 0, 0].item() > 0
    kl[0, 0, 0] = 0
    assert torch.equal(kl, torch.zeros_like(kl))


@pytest.mark.parametrize("num_classes", [2, 3, 7, 25])
def test_kl_matches_textbook_formula(num_classes):
    g = torch.Generator().manual_seed(num_classes)
    alpha = 1.0 + torch.exp(3.0 * torch.randn(32, num_classes, 6, generator=g, dtype=torch.float64))
    onehot = to_one_hot(torch.randint(0, num_classes, (32, 6), generator=g), num_classes, torch.float64)
    ref = naive_kl_numpy(alpha.numpy(), onehot.numpy())
    got = dirichlet_kl_to_uniform(alpha, onehot)
    assert (got >= 0).all()
    np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10, atol=1e-9)
    got32 = dirichlet_kl_to_uniform(alpha.float(), onehot.float()).double().numpy()
    np.testing.assert_allclose(got32, ref, rtol=1e-5, atol=1e-5)


def test_kl_stable_for_huge_alpha_in_float32():
    # C=2, true class reset to 1, wrong class alpha = A: KL = ln A - 1 + 1/A (closed form)
    big = 1.0 + math.exp(80.0)
    alpha = torch.tensor([[big, 1.0], [1.0 + math.exp(20.0), 1.0]], dtype=torch.float32)
    onehot = torch.tensor([[0.0, 1.0], [0.0, 1.0]])
    kl = dirichlet_kl_to_uniform(alpha, onehot)
    assert kl[0].item() == pytest.approx(math.log(big) - 1.0, abs=1e-4)
    assert kl[1].item() == pytest.approx(math.log(1.0 + math.exp(20.0)) - 1.0, abs=1e-4)


@pytest.mark.parametrize("variant", ["mean", "second_moment"])
def test_loss_and_gradients_finite_for_extreme_logits(variant):
    g = torch.Generator().manual_seed(2)
    logits = (200.0 * (2 * torch.rand(2, 3, 8, 8, generator=g) - 1)).requires_grad_()
    with torch.no_grad():
        logits[0, 0] = 200.0
        logits[0, 1] = -200.0
        logits[1, 2, :4] = 79.5  # just under the clamp, still differentiable
    labels = torch.randint(0, 3, (2, 8, 8), generator=g)
    loss = FedEviLoss(dice_variant=variant)
    total = loss(logits, labels, round_index=12)
    total.backward()
    assert torch.isfinite(total) and 0.0 <= loss.last_components.dice.item() <= 1.0
    assert torch.isfinite(loss.last_components.kl) and loss.last_components.kl.item() >= 0
    # KL is O(max logit) here, not a cancellation artefact of size ~1e29
    assert loss.last_components.kl.item() < 3 * 80
    assert torch.isfinite(logits.grad).all()
    assert logits.grad.abs().sum() > 0


def test_gradcheck_loss_float64():
    g = torch.Generator().manual_seed(3)
    logits = (3 * torch.randn(2, 3, 3, 2, generator=g, dtype=torch.float64)).requires_grad_()
    labels = torch.randint(0, 3, (2, 3, 2), generator=g)
    for variant in ("mean", "second_moment"):
        loss = FedEviLoss(kl_weight=0.5, dice_variant=variant)
        assert torch.autograd.gradcheck(lambda z: loss(z, labels, 10), (logits,))


def test_dirichlet_second_moment_monte_carlo():
    alpha = torch.tensor([[2.0, 0.7, 5.0], [1.0, 1.0, 30.0]], dtype=torch.float64)  # [B=2, C=3]
    closed = dirichlet_second_moment(alpha)
    s = alpha.sum(1, keepdim=True)
    torch.testing.assert_close(closed, alpha * (alpha + 1) / (s * (s + 1)))
    torch.manual_seed(4)
    samples = torch.distributions.Dirichlet(alpha).sample((200_000,))  # [N, 2, 3]
    mc = (samples**2).mean(0)
    torch.testing.assert_close(mc, closed, rtol=0.01, atol=0)


def test_second_moment_no_overflow_float32():
    alpha = torch.tensor([[1.0 + math.exp(80.0), 1.0]])
    m = dirichlet_second_moment(alpha)
    assert torch.isfinite(m).all()
    assert m[0, 0].item() == pytest.approx(1.0, abs=1e-6)


def test_dice_works_for_classification_and_3d_shapes():
    # [B, C] classification: perfect confident prediction -> loss ~ 0
    logits = torch.tensor([[30.0, -30.0], [-30.0, 30.0]])
    assert EvidentialDiceLoss()(logits, torch.tensor([0, 1])).item() == pytest.approx(0.0, abs=1e-6)
    assert EvidentialDiceLoss()(logits, torch.tensor([[0], [1]])).item() == pytest.approx(0.0, abs=1e-6)
    # 3-D volumes [B, C, D, H, W]; a spatial dim of size 1 must not be mistaken for the channel dim
    g = torch.Generator().manual_seed(5)
    vol = torch.randn(2, 3, 1, 4, 4, generator=g, dtype=torch.float64)
    lab = torch.randint(0, 3, (2, 1, 4, 4), generator=g)
    a = EvidentialDiceLoss()(vol, lab)
    b = EvidentialDiceLoss()(vol, lab.unsqueeze(1))
    c = evidential_dice_loss(dirichlet_from_logits(vol).alpha, target_to_one_hot(lab, vol))
    assert a.item() == pytest.approx(b.item(), abs=1e-12) and a.item() == pytest.approx(c.item(), abs=1e-12)
    assert 0.3 < a.item() < 1.0


def test_dice_is_one_dice_per_class_over_the_batch():
    # joint sum over batch: loss of the concatenated batch != mean of the per-image losses
    g = torch.Generator().manual_seed(6)
    logits = torch.randn(2, 2, 4, 4, generator=g, dtype=torch.float64)
    labels = torch.zeros(2, 4, 4, dtype=torch.long)
    labels[0, :2] = 1
    loss = EvidentialDiceLoss()
    joint = loss(logits, labels).item()
    per_image = 0.5 * (loss(logits[:1], labels[:1]).item() + loss(logits[1:], labels[1:]).item())
    assert abs(joint - per_image) > 1e-3


def test_loss_validation_errors():
    with pytest.raises(ValueError, match=r"variant.*'mean'.*'second_moment'.*'median'"):
        EvidentialDiceLoss(variant="median")
    with pytest.raises(ValueError, match="variant"):
        FedEviLoss(dice_variant="bayes")
    loss = EvidentialDiceLoss()
    with pytest.raises(ValueError, match=r"expected .*\(1, 2, 2, 2\).*got \(1, 3, 2, 2\)"):
        loss(toy_logits(), torch.zeros(1, 3, 2, 2))
    with pytest.raises(ValueError, match="got \\(2, 2, 2\\)"):
        loss(toy_logits(), torch.zeros(2, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="index 2"):
        loss(toy_logits(), torch.full((1, 2, 2), 2))
    with pytest.raises(ValueError, match="non-integral"):
        loss(toy_logits(), torch.full((1, 2, 2), 0.5))
    with pytest.raises(ValueError, match="C >= 2"):
        loss(torch.zeros(1, 1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="target_onehot"):
        dirichlet_kl_to_uniform(torch.ones(1, 2, 3), torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="kl_weight"):
        FedEviLoss(kl_weight=-1.0)
    with pytest.raises(ValueError, match="annealing_step"):
        FedEviLoss(annealing_step=0)
    with pytest.raises(ValueError, match="round_index"):
        FedEviLoss()(toy_logits(), toy_labels(), round_index=0)


def test_kl_annealing_factor():
    assert kl_annealing_factor(1) == pytest.approx(0.1)
    assert kl_annealing_factor(5) == pytest.approx(0.5)
    assert kl_annealing_factor(10) == 1.0
    assert kl_annealing_factor(25) == 1.0
    assert kl_annealing_factor(3, annealing_step=4) == pytest.approx(0.75)
    for bad in (0, -3):
        with pytest.raises(ValueError, match="annealing_step"):
            kl_annealing_factor(1, annealing_step=bad)
    with pytest.raises(ValueError, match="round_index"):
        kl_annealing_factor(0)


def test_binary_kl_fast_path_matches_scipy_closed_form():
    """C = 2 uses KL = ln w - 1 + 1/w; it must equal the general formula (SciPy, float64)."""
    import numpy as np
    from scipy.special import digamma, gammaln

    gen = torch.Generator().manual_seed(0)
    # alpha up to e^12: beyond that the float64 textbook form itself loses digits to cancellation
    alpha = torch.exp(torch.empty(500, 2, dtype=torch.float64).uniform_(-5, 12, generator=gen)) + 1
    y = torch.nn.functional.one_hot(torch.randint(0, 2, (500,), generator=gen), 2).double()
    at = (y + (1 - y) * alpha).numpy()
    s = at.sum(1)
    ref = gammaln(s) - gammaln(2) - gammaln(at).sum(1) + ((at - 1) * (digamma(at) - digamma(s)[:, None])).sum(1)
    got = dirichlet_kl_to_uniform(alpha, y).numpy()
    np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-9)
    # float32 at the clamp: wrong-class alpha = e^80 + 1 -> KL = 80 - 1 + e^-80
    big = torch.tensor([[1.0, math.exp(80.0) + 1.0]], dtype=torch.float32)
    kl = dirichlet_kl_to_uniform(big, torch.tensor([[1.0, 0.0]]))
    assert kl.item() == pytest.approx(79.0, rel=1e-6)
