"""The network registry and FedEvi's U-Net: exact sizes, shapes, state, init, and the forward pass
against a hand-written functional reference of the official code's layers."""

import math

import pytest
import torch
import torch.nn.functional as F

from feduq.core.networks import (
    FedEviUNet,
    SegUNet,
    build_network,
    check_input_size,
    count_parameters,
    head_keys,
    network_class_path,
)


@pytest.mark.parametrize("cin, cout, params", [(3, 2, 3_179_890), (1, 2, 3_179_602), (3, 3, 3_179_923)])
def test_fedevi_unet_has_the_papers_parameter_and_entry_counts(cin, cout, params):
    model = build_network("fedevi_unet", cin, cout)
    assert count_parameters(model) == params
    assert len(model.state_dict()) == 54  # 27 convolutions, weight + bias each, nothing else
    assert all(k.endswith((".weight", ".bias")) for k in model.state_dict())


@pytest.mark.parametrize("size", [64, 128, 384])
def test_output_has_the_input_size(size):
    model = build_network("fedevi_unet", 3, 2).eval()
    with torch.no_grad():
        assert model(torch.zeros(1, 3, size, size)).shape == (1, 2, size, size)


def test_normalisation_state_only_with_batch_norm():
    assert not [k for k in build_network("fedevi_unet", 3, 2).state_dict() if "adn" in k]  # instance: stateless
    bn = build_network("fedevi_unet", 3, 2, norm="batch").state_dict()
    # 26 normalised convolutions (all but the head) x (weight, bias, running_mean, running_var, num_batches_tracked)
    assert len([k for k in bn if ".adn.N." in k]) == 26 * 5 and len(bn) == 54 + 130


def test_seeded_kaiming_fan_out_init():
    a, b = FedEviUNet(init_seed=7), FedEviUNet(init_seed=7)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(FedEviUNet(init_seed=8).head.weight, a.head.weight)
    w = FedEviUNet(init_seed=0).encoder[4][2].conv.weight  # 256 -> 256, 3x3: fan_out = 256 * 9
    assert w.std().item() == pytest.approx(math.sqrt(2 / (256 * 9)), rel=0.02)
    assert all(float(m.bias.detach().abs().max()) == 0 for m in a.modules() if isinstance(m, torch.nn.Conv2d))


def _reference_forward(model: FedEviUNet, x: torch.Tensor) -> torch.Tensor:
    """The official U-Net written out with torch.nn.functional and the model's weights (instance norm)."""
    p = model.state_dict()

    def conv(t, key, relu=True):
        w = p[f"{key}.conv.weight"]
        t = F.instance_norm(F.conv2d(t, w, p[f"{key}.conv.bias"], padding=w.shape[-1] // 2))
        return F.relu(t) if relu else t

    skips = []
    for i in range(5):
        o = 1 if i else 0  # the max-pool is module 0 of levels 2-5
        if i:
            x = F.max_pool2d(x, 2)
        x = conv(x, f"encoder.{i}.{o}", relu=False)  # the first convolution of a level has no ReLU
        x = conv(conv(x, f"encoder.{i}.{o + 1}"), f"encoder.{i}.{o + 2}")
        skips.append(x)
    x = skips.pop()
    for j in range(4):
        if j:
            x = conv(x, f"decoder.{j}.reduce")
        x = conv(F.interpolate(x, scale_factor=2, mode="nearest"), f"decoder.{j}.project")
        x = conv(torch.cat([skips.pop(), x], dim=1), f"decoder.{j}.fuse.0")
    return F.conv2d(x, p["head.weight"], p["head.bias"])


def test_forward_matches_the_functional_reference():
    model = FedEviUNet(in_channels=3, out_channels=2, init_seed=1).eval()
    x = torch.randn(2, 3, 32, 48, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), _reference_forward(model, x), rtol=1e-4, atol=1e-4)


def test_dropout_is_the_only_difference_and_is_random_in_train_mode():
    plain, mc = FedEviUNet(init_seed=3), FedEviUNet(init_seed=3, dropout=0.3)
    assert list(plain.state_dict()) == list(mc.state_dict())
    x = torch.randn(1, 3, 32, 32)
    mc.train()
    assert not torch.equal(mc(x), mc(x))  # MC dropout samples
    mc.eval()
    torch.testing.assert_close(mc(x), plain.eval()(x))


def test_registry_class_paths_and_heads():
    assert network_class_path("fedevi_unet") == "feduq.core.networks.FedEviUNet"
    assert network_class_path("light") == "feduq.core.networks.SegUNet"
    assert isinstance(build_network("light", 3, 2), SegUNet) and count_parameters(build_network("light", 3, 2)) == 660_570
    assert head_keys(build_network("fedevi_unet", 3, 2)) == ["head.weight", "head.bias"]
    assert head_keys(build_network("light", 3, 2)) == ["model.2.conv.weight", "model.2.conv.bias"]
    with pytest.raises(ValueError, match=r"unknown network 'unet3'; known networks: \['feda3i_unet', 'fedevi_unet', 'light', 'resnet_tweu'\]"):
        build_network("unet3", 3, 2)
    with pytest.raises(ValueError, match="network 'fedevi_unet'.*'channels'"):
        build_network("fedevi_unet", 3, 2, channels=[8, 16])
    with pytest.raises(ValueError, match="norm must be one of"):
        build_network("fedevi_unet", 3, 2, norm="group")


def test_input_size_check_names_the_stride():
    check_input_size(FedEviUNet(), 96)
    with pytest.raises(ValueError, match="image_size=100 is not a multiple of 16, the total stride of network FedEviUNet; use 96 or 112"):
        check_input_size(FedEviUNet(), 100)
