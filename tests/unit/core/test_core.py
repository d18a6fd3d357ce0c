"""The shared core: the local trainer's guards and state, its precision, the networks it trains."""

import numpy as np
import pytest
import torch

from feduq.core.training import LocalTrainer
from feduq.core.networks import FedEviUNet, SegUNet, normalisation_keys


def test_segunet_is_seeded_and_instance_norm_has_no_state():
    a, b = SegUNet(init_seed=3), SegUNet(init_seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(next(iter(SegUNet(init_seed=4).state_dict().values())), next(iter(a.state_dict().values())))
    assert normalisation_keys(list(a.state_dict()), a) == []
    bn = SegUNet(norm="batch")
    keys = normalisation_keys(list(bn.state_dict()), bn)
    assert keys and all(("running_" in k or "num_batches" in k or k.endswith(("weight", "bias"))) for k in keys)
    with pytest.raises(ValueError, match="norm must be one of"):
        SegUNet(norm="group")


def _loader(n=4, size=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(n):
        label = (torch.rand(2, 1, size, size, generator=g) > 0.6).float()
        batches.append({"image": label.repeat(1, 3, 1, 1) + 0.1 * torch.rand(2, 3, size, size, generator=g),
                        "label": label})
    return batches


def test_set_params_rejects_shape_and_name_mismatch_and_keeps_optimizer_binding():
    trainer = LocalTrainer(SegUNet(channels=(4, 8, 16), strides=(2, 2)), torch.device("cpu"))
    params = trainer.get_params()
    name = next(iter(params))
    bad = dict(params)
    bad[name] = np.zeros((1,), np.float32)
    with pytest.raises(ValueError, match=rf"parameter '{name}' shape mismatch: expected=.*got=\(1,\)"):
        trainer.set_params(bad)
    with pytest.raises(ValueError, match="unknown to the local model"):
        trainer.set_params({**params, "ghost.weight": np.zeros(1)})
    with pytest.raises(ValueError, match="lacks parameters"):
        trainer.set_params({k: v for k, v in params.items() if k != name})
    zeros = {k: np.zeros_like(v) for k, v in params.items()}
    trainer.set_params(zeros)
    p0 = trainer.optimizer.param_groups[0]["params"][0]
    assert float(p0.detach().abs().sum()) == 0.0  # in-place: the optimizer still owns the same tensors


def test_training_reduces_loss_and_steps_lr_once_per_round():
    from monai.losses import DiceCELoss

    torch.manual_seed(0)
    trainer = LocalTrainer(SegUNet(channels=(8, 16, 32), strides=(2, 2)), torch.device("cpu"), lr=1e-2, lr_gamma=0.5)
    loss = DiceCELoss(to_onehot_y=True, softmax=True)
    first = trainer.train_epochs(_loader(), 1, loss)
    for _ in range(4):
        last = trainer.train_epochs(_loader(), 1, loss)
    assert first.num_steps == 4 and first.num_samples == 8
    assert last.mean_loss < first.mean_loss
    assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**5)
    state = trainer.state()
    fresh = LocalTrainer(SegUNet(channels=(8, 16, 32), strides=(2, 2)), torch.device("cpu"), lr=1e-2, lr_gamma=0.5)
    fresh.load_state(state)
    assert fresh.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * 0.5**5)
    assert fresh.scheduler.last_epoch == 5


def test_nan_loss_raises_instead_of_updating():
    trainer = LocalTrainer(SegUNet(channels=(4, 8), strides=(2,)), torch.device("cpu"))
    before = trainer.get_params()
    with pytest.raises(FloatingPointError, match="training loss is nan"):
        trainer.train_epochs(_loader(1), 1, lambda lo, la: lo.sum() * float("nan"))
    after = trainer.get_params()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_amp_is_a_cuda_switch_and_its_scaler_state_round_trips(monkeypatch):
    """AMP=True is float16 on CUDA only; on a CPU without bfloat16 hardware "auto" is plain float32 (scaler
    disabled), and the scaler's state travels with the optimizer's across a site restart."""
    import feduq.core.training as training

    monkeypatch.setattr(training, "cpu_has_bf16", lambda: False)
    for amp in ("auto", True, False):
        trainer = LocalTrainer(SegUNet(channels=(4, 8), strides=(2,)), torch.device("cpu"), amp=amp)
        assert trainer.amp is False and not trainer.scaler.is_enabled()
    assert set(trainer.state()) == {"optimizer", "scheduler", "scaler"}
    trainer.load_state(trainer.state())
    with pytest.raises(ValueError, match="amp must be 'auto', true, false or 'bf16', got 'fp16'"):
        LocalTrainer(SegUNet(channels=(4, 8), strides=(2,)), torch.device("cpu"), amp="fp16")


def test_auto_precision_is_bfloat16_on_a_cpu_with_bfloat16_hardware(monkeypatch):
    """amp="auto": bfloat16 on a CPU whose /proc/cpuinfo flags list avx512_bf16 or amx_bf16 for a network without
    BatchNorm, float32 for one with it and on any other CPU; True stays float32 on a CPU; the hardware check reads the
    flags line only."""
    import feduq.core.training as training

    cpu = torch.device("cpu")
    amx = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f amx_bf16 amx_tile\nbugs\t\t: spectre_v1\n"
    avx512 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
    avx2 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\nbugs\t\t: avx512_bf16\n"
    assert [training.cpu_has_bf16(t) for t in (amx, avx512, avx2, "")] == [True, True, False, False]
    for has, expected in ((True, torch.bfloat16), (False, None)):
        monkeypatch.setattr(training, "cpu_has_bf16", lambda has=has: has)
        assert training.autocast_dtype("auto", cpu) is expected
        assert training.autocast_dtype(True, cpu) is None and training.autocast_dtype(False, cpu) is None
        assert training.autocast_dtype("bf16", cpu) is torch.bfloat16
        assert LocalTrainer(SegUNet(channels=(4, 8), strides=(2,)), cpu).autocast_dtype is expected
        # a network with BatchNorm (FedBN's) stays float32 under "auto" on any CPU; "bf16" still applies
        batchnorm = FedEviUNet(base_width=4, norm="batch")
        assert training.has_batchnorm(batchnorm) and not training.has_batchnorm(FedEviUNet(base_width=4))
        assert LocalTrainer(batchnorm, cpu).autocast_dtype is None
        assert training.autocast_dtype("bf16", cpu, batchnorm) is torch.bfloat16
    with pytest.raises(ValueError, match="got 'fp16'"):
        training.autocast_dtype("fp16", cpu)


def test_bf16_autocasts_the_forward_pass_on_the_cpu_and_keeps_the_loss_in_float32():
    """amp="bf16": the convolutions run in bfloat16 (no scaler), the loss sees float32 logits, the parameters and
    Adam's state stay float32, and the model still learns; amp=False stays float32."""
    from monai.losses import DiceCELoss

    seen = {}
    for amp in (False, "bf16"):
        torch.manual_seed(0)
        trainer = LocalTrainer(SegUNet(channels=(8, 16, 32), strides=(2, 2)), torch.device("cpu"), lr=1e-2, amp=amp)
        conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
        handle = conv.register_forward_hook(lambda m, i, o, amp=amp: seen.setdefault(amp, o.dtype) and None)
        logits_dtype = []
        dice = DiceCELoss(to_onehot_y=True, softmax=True)

        def loss(lo, la):
            logits_dtype.append(lo.dtype)
            return dice(lo, la)

        first = trainer.train_epochs(_loader(), 1, loss)
        for _ in range(3):
            last = trainer.train_epochs(_loader(), 1, loss)
        handle.remove()
        assert set(logits_dtype) == {torch.float32} and not trainer.scaler.is_enabled()
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters())
        assert last.mean_loss < first.mean_loss
    assert seen == {False: torch.float32, "bf16": torch.bfloat16}


def test_bf16_trains_a_batchnorm_network_with_float32_statistics():
    """amp="bf16" with FedEvi's U-Net in its BatchNorm form (FedBN's network): BatchNorm's running mean and variance
    and its affine parameters stay float32 and finite, the running statistics move from their initial 0 / 1, the
    convolutions run in bfloat16, and the loss falls over a few epochs as in float32."""
    from monai.losses import DiceCELoss

    from feduq.core.networks import FedEviUNet

    torch.manual_seed(0)
    trainer = LocalTrainer(FedEviUNet(base_width=4, norm="batch"), torch.device("cpu"), lr=1e-2, amp="bf16")
    bns = [m for m in trainer.model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    conv = next(m for m in trainer.model.modules() if isinstance(m, torch.nn.Conv2d))
    seen = []
    handle = conv.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    dice = DiceCELoss(to_onehot_y=True, softmax=True)
    first = trainer.train_epochs(_loader(), 1, dice)
    for _ in range(3):
        last = trainer.train_epochs(_loader(), 1, dice)
    handle.remove()
    assert set(seen) == {torch.bfloat16}
    for bn in bns:
        for t in (bn.running_mean, bn.running_var, bn.weight, bn.bias):
            assert t.dtype == torch.float32 and torch.isfinite(t).all()
    assert float(bns[0].running_mean.abs().max()) > 1e-3 and float((bns[0].running_var - 1).abs().max()) > 1e-3
    assert last.mean_loss < first.mean_loss
