"""DP-SGD for every method's local training (feduq.privacy.dp_sgd): budget, accountant, clipping, noise, refusals."""

import math

import numpy as np
import pytest
import torch
from monai.losses import DiceCELoss
from opacus.accountants import RDPAccountant

from feduq.core.training import LocalTrainer
from feduq.core.evidential_loss import FedEviLoss
from feduq.methods.feduaa import FedUAASegLoss
from feduq.core.networks import build_network
from feduq.privacy.dp_sgd import DPConfig, PrivateTraining, check_private_model, noise_for_budget, spent_epsilon, steps_per_epoch


def test_config_defaults_and_errors_name_the_key():
    cfg = DPConfig.from_json({"epsilon": 10})
    assert (cfg.epsilon, cfg.delta, cfg.max_grad_norm, cfg.rounds) == (10.0, 1e-5, 1.0, None)
    assert DPConfig.from_json(None) is None
    for bad, key in [({"epsilon": 0}, "dp.epsilon"), ({"epsilon": 1, "delta": 1}, "dp.delta"),
                     ({"epsilon": 1, "max_grad_norm": -1}, "dp.max_grad_norm"), ({"epsilon": float("nan")}, "dp.epsilon"),
                     ({"epsilon": 1, "rounds": 0}, "dp.rounds"), ({"epsilon": 1, "sigma": 1}, "unknown keys"),
                     ({"delta": 1e-5}, "needs epsilon"), (5, "expected null")]:
        with pytest.raises(ValueError, match=key):
            DPConfig.from_json(bad)


@pytest.mark.parametrize("epsilon", [1.0, 10.0, 50.0])
def test_noise_spends_the_budget_and_matches_opacus_step_by_step(epsilon):
    q, steps = 4 / 200, 2 * 3 * steps_per_epoch(4 / 200)  # 200 images, batch 4, 3 rounds x 2 epochs
    assert steps == 300
    sigma = noise_for_budget(DPConfig(epsilon), q, steps)
    spent = spent_epsilon([(sigma, q, steps)], 1e-5)
    assert epsilon - 0.01 <= spent <= epsilon  # Opacus' tolerance: spends the target to 0.01, never more
    accountant = RDPAccountant()  # the same number when the steps are recorded one at a time
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    assert accountant.get_epsilon(1e-5) == pytest.approx(spent, rel=1e-12)
    assert spent_epsilon([], 1e-5) == 0.0


def test_batchnorm_networks_are_refused_and_the_paper_network_passes():
    check_private_model(build_network("fedevi_unet", 3, 2))  # InstanceNorm without affine: no state
    check_private_model(build_network("light", 3, 2))
    with pytest.raises(ValueError, match=r"site 'A'.*BatchNorm"):
        check_private_model(build_network("fedevi_unet", 3, 2, norm="batch"), "A")


class _Linear(torch.nn.Module):
    """y = w·x per pixel (one 1x1 convolution): per-image gradients are easy to write by hand."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 1, 1, bias=False)
        torch.nn.init.constant_(self.conv.weight, 0.5)

    def forward(self, x):
        return self.conv(x)


def _sgd_trainer(model):
    trainer = LocalTrainer(model, torch.device("cpu"), lr=1.0, lr_gamma=1.0)
    trainer.optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    return trainer


def _private(model, n, batch, clip, sigma=0.0):
    p = PrivateTraining(model, DPConfig(epsilon=10, max_grad_norm=clip), n, batch, total_steps=10)
    p.noise_multiplier = sigma  # no noise: the step is the clipped mean, checkable by hand
    return p


def test_per_image_clipping_is_the_hand_computed_step():
    # loss_i = mean over pixels of (w x_i)^2 / 2  ->  g_i = w * mean(x_i^2); w = 0.5
    xs = [torch.full((1, 2, 2), 1.0), torch.full((1, 2, 2), 4.0)]  # g = 0.5, 8.0
    data = [{"image": x, "label": torch.zeros(1, 2, 2)} for x in xs]
    model = _Linear()
    trainer = _sgd_trainer(model)
    privacy = _private(model, n=2, batch=2, clip=1.0)
    trainer.enable_privacy(privacy)
    # force both images into one batch: sample rate 1
    privacy.sample_rate = 1.0
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    stats = trainer.train_epochs(loader, 1, lambda out, _y: (out ** 2).mean() / 2)
    # clipped: 0.5 stays, 8.0 -> 1.0; step = -(0.5 + 1.0) / expected batch 2 = -0.75
    assert stats.num_steps == 1 and stats.num_samples == 2
    assert model.conv.weight.item() == pytest.approx(0.5 - 0.75, abs=1e-6)
    assert privacy.steps_taken == 1


def test_regulariser_gradient_is_added_after_the_noise_and_not_clipped():
    model = _Linear()
    trainer = _sgd_trainer(model)
    privacy = _private(model, n=1, batch=1, clip=0.1)
    privacy.sample_rate = 1.0
    trainer.enable_privacy(privacy)
    data = [{"image": torch.full((1, 2, 2), 4.0), "label": torch.zeros(1, 2, 2)}]
    loader = torch.utils.data.DataLoader(data, batch_size=1)
    # data gradient 8.0 clipped to 0.1; regulariser 3 w^2 -> gradient 6 w = 3.0, unclipped
    trainer.train_epochs(loader, 1, lambda out, _y: (out ** 2).mean() / 2, regularizer=lambda m: 3 * m.conv.weight.sum() ** 2)
    assert model.conv.weight.item() == pytest.approx(0.5 - 0.1 - 3.0, abs=1e-6)


def test_empty_poisson_batch_takes_a_noise_only_step_and_is_accounted():
    model = _Linear()
    trainer = _sgd_trainer(model)
    privacy = _private(model, n=10, batch=1, clip=1.0, sigma=2.0)
    trainer.enable_privacy(privacy)
    opt = privacy.optimizer(trainer.optimizer)
    opt.zero_grad(set_to_none=True)
    privacy.empty_step(opt)
    opt.pre_step()
    # noise N(0, (sigma C)^2) / expected batch 1: non-zero, finite
    assert model.conv.weight.grad is not None and model.conv.weight.grad.abs().item() > 0
    # through the trainer: two Poisson draws that hold no image still step (and are accounted)
    loader = torch.utils.data.DataLoader([{"image": torch.ones(1, 2, 2), "label": torch.zeros(1, 2, 2)}] * 10)
    privacy._loaders[id(loader)] = [None, None]  # what the empty-aware collate yields for empty draws
    before = model.conv.weight.item()
    stats = trainer.train_epochs(loader, 1, lambda o, y: (o ** 2).mean())
    assert stats.num_samples == 0 and stats.num_steps == privacy.steps_taken == 2
    assert model.conv.weight.item() != before


def test_accountant_survives_a_site_restart():
    model = _Linear()
    trainer = _sgd_trainer(model)
    trainer.enable_privacy(_private(model, n=4, batch=2, clip=1.0, sigma=1.0))
    data = [{"image": torch.ones(1, 2, 2), "label": torch.zeros(1, 2, 2)}] * 4
    trainer.train_epochs(torch.utils.data.DataLoader(data, batch_size=2), 2, lambda o, y: (o ** 2).mean())
    spent, state = trainer.privacy.epsilon, trainer.state()
    fresh = _sgd_trainer(_Linear())
    fresh.load_state(state)  # restored before DP is switched on again at the next round
    fresh.enable_privacy(_private(fresh.model, n=4, batch=2, clip=1.0, sigma=1.0))
    assert spent > 0 and fresh.privacy.epsilon == pytest.approx(spent)


def _per_image_mean(loss, logits, label):
    return torch.stack([loss(logits[i:i + 1], label[i:i + 1]) for i in range(len(logits))]).mean()


@pytest.mark.parametrize("name", ["fedavg", "fedevi", "feduaa"])
def test_method_losses_are_means_of_per_image_losses(name):
    """DP-SGD's per-image gradients are right only when the batch loss is the mean of per-image losses."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 2, 8, 8, generator=g)
    label = (torch.rand(3, 1, 8, 8, generator=g) > 0.5).float()
    loss = {
        "fedavg": lambda lo, la: DiceCELoss(to_onehot_y=True, softmax=True)(lo, la),
        "fedevi": lambda lo, la: FedEviLoss(batch_dice=False)(lo, la, 3),  # what FedEvi trains with under dp
        "feduaa": lambda lo, la: FedUAASegLoss(batch_dice=False)(lo, la, 3),
    }[name]
    assert loss(logits, label).item() == pytest.approx(_per_image_mean(loss, logits, label).item(), rel=1e-5)
    if name != "fedavg":  # the official batch Dice is not: the reason dp switches it off
        official = {"fedevi": FedEviLoss(), "feduaa": FedUAASegLoss()}[name]
        batch, per_image = official(logits, label, 3).item(), _per_image_mean(lambda a, b: official(a, b, 3), logits, label).item()
        assert abs(batch - per_image) > 1e-3


def test_private_training_keeps_state_dict_keys_and_spends_as_planned():
    torch.manual_seed(0)
    model = build_network("light", 3, 2)
    keys = list(model.state_dict())
    trainer = LocalTrainer(model, torch.device("cpu"))
    n, batch, epochs = 8, 4, 2
    steps = epochs * steps_per_epoch(batch / n)
    privacy = PrivateTraining(model, DPConfig(epsilon=5.0), n, batch, total_steps=steps)
    trainer.enable_privacy(privacy)
    data = [{"image": torch.rand(3, 32, 32), "label": (torch.rand(1, 32, 32) > 0.5).float()} for _ in range(n)]
    stats = trainer.train_epochs(torch.utils.data.DataLoader(data, batch_size=batch), epochs,
                                 DiceCELoss(to_onehot_y=True, softmax=True))
    assert list(trainer.get_params()) == keys  # no "_module." prefix reaches the wire
    assert stats.num_steps == steps == privacy.steps_taken == 4
    assert 5.0 - 0.01 <= privacy.epsilon <= 5.0
    assert all(np.isfinite(v).all() for v in trainer.get_params().values())
    assert math.isclose(privacy.summary()["dp_epsilon"], privacy.epsilon, rel_tol=1e-5)


def test_executors_switch_to_per_image_dice_under_dp_only():
    from functools import partial

    from feduq.flare.executor import FedUQExecutor

    FedEviExecutor = partial(FedUQExecutor, site_part="feduq.methods.fedevi.FedEviSite")

    assert FedEviExecutor(dp={"epsilon": 1}).build_loss().batch_dice is False
    assert FedEviExecutor().build_loss().batch_dice is True
    with pytest.raises(ValueError, match="dp.max_grad_norm"):
        FedEviExecutor(dp={"epsilon": 1, "max_grad_norm": 0})
