"""Numerical tests of FedA3I's math (feduq.methods.feda3i) and network (feduq.core.networks.FedA3IUNet),
hand numbers in comments; the toy is computed by hand below."""

import json
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from feduq.methods.feda3i import (
    FEDEVI_UNET_LAYERS,
    LAYER_NAMES,
    FedA3IWeights,
    band_losses,
    band_regions,
    compute_weights,
    foreground_logit,
    group_sites,
    layer_index,
    layer_names_for,
    layer_schedule,
    layerwise_average,
    layerwise_weights,
    quality_weights,
    quality_weights_minmax,
    quantity_weights,
    site_noise_statistic,
    strengths,
)
from feduq.core.networks import (
    FedA3IUNet,
    build_network,
    check_input_size,
    count_parameters,
    head_keys,
    network_class_path,
    network_note,
)

# hand toy
TOY_Q = np.array([[.5, .2], [.45, .25], [.6, .1], [.2, .5], [.25, .4]])
TOY_GROUPS = np.array([1, 1, 1, 0, 0])  # G_l = {0, 1, 2}, G_s = {3, 4}


# ------------------------------------------------------------------------------------------ network


@pytest.mark.parametrize("cin, params", [(3, 1_082_033), (1, 1_081_745)])
def test_feda3i_unet_parameter_and_entry_counts(cin, params):
    # per block (conv weights + biases, BN weight + bias): inc 2,832 (RGB), down1 14,016, down2 55,680,
    # down3 221,952, down4 295,680, up1 369,216, up2 92,448, up3 23,184, up4 7,008, outc 17
    model = build_network("feda3i_unet", cin, 2)
    assert count_parameters(model) == params
    sd = model.state_dict()
    assert len(sd) == 19 * 2 + 18 * 5  # 19 convolutions; 18 BatchNorms with running stats and counter
    assert sd["outc.conv.weight"].shape == (1, 16, 1, 1)  # the paper's single-channel head
    assert sd["down4.maxpool_conv.1.double_conv.3.weight"].shape == (128, 128, 3, 3)  # bilinear: 256 // 2
    assert sd["up1.conv.double_conv.0.weight"].shape == (128, 256, 3, 3)  # mid = in // 2
    assert sd["up1.conv.double_conv.3.weight"].shape == (64, 128, 3, 3)
    inst = build_network("feda3i_unet", cin, 2, norm="instance")
    assert len(inst.state_dict()) == 38  # no BatchNorm affine parameters or running statistics
    assert count_parameters(inst) == params - 2 * (16 * 5 + 32 * 4 + 64 * 4 + 128 * 5)


def test_feda3i_unet_registry_children_and_errors():
    model = build_network("feda3i_unet", 3, 2)
    assert isinstance(model, FedA3IUNet) and network_class_path("feda3i_unet") == "feduq.core.networks.FedA3IUNet"
    assert tuple(name for name, _ in model.named_children()) == LAYER_NAMES
    assert head_keys(model) == ["outc.conv.weight", "outc.conv.bias"]
    assert "network feda3i_unet (FedA3IUNet, 1,082,033 parameters)" == network_note(model)
    assert not any(isinstance(m, torch.nn.Dropout2d) for m in model.modules())
    for bad in (1, 3):
        with pytest.raises(ValueError, match=rf"'feda3i_unet'.*out_channels must be 2, got {bad}"):
            build_network("feda3i_unet", 3, bad)
    with pytest.raises(ValueError, match="norm must be one of"):
        build_network("feda3i_unet", 3, 2, norm="group")
    check_input_size(model, 50)  # the decoder pads: any size >= 16
    with pytest.raises(ValueError, match="too small"):
        check_input_size(model, 8)


def test_feda3i_unet_seeded_init_and_any_size():
    a, b = FedA3IUNet(init_seed=3), FedA3IUNet(init_seed=3)
    assert all(torch.equal(a.state_dict()[k], b.state_dict()[k]) for k in a.state_dict())
    assert not torch.equal(FedA3IUNet(init_seed=4).inc.double_conv[0].weight, a.inc.double_conv[0].weight)
    state = torch.random.get_rng_state()
    FedA3IUNet(init_seed=5)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is untouched
    with torch.no_grad():
        assert a.eval()(torch.rand(1, 3, 50, 50)).shape == (1, 2, 50, 50)  # 50 -> 25 -> 12 -> 6 -> 3, padded back


def test_two_channel_output_is_the_sigmoid_head_exactly():
    model = build_network("feda3i_unet", 1, 2).eval()
    x = torch.rand(2, 1, 32, 32) * 255  # raw 0-255 intensities, as the official code
    with torch.no_grad():
        out, z = model(x), model.logit(x)
    assert out.shape == (2, 2, 32, 32) and z.shape == (2, 1, 32, 32)
    assert torch.equal(out[:, :1], torch.zeros_like(z)) and torch.equal(out[:, 1:], z)
    assert torch.equal(foreground_logit(out), z[:, 0])
    # softmax over [0, z] is (1 - sigmoid(z), sigmoid(z))
    torch.testing.assert_close(out.softmax(1)[:, 1:], torch.sigmoid(z), atol=1e-6, rtol=0)
    torch.testing.assert_close(out.softmax(1)[:, :1], 1 - torch.sigmoid(z), atol=1e-6, rtol=0)
    # argmax == threshold at 0.5 (ties z = 0 go to background in both)
    assert torch.equal(out.argmax(1), (torch.sigmoid(z[:, 0]) > 0.5).long())
    # cross entropy == BCE-with-logits, also with a hand z of both signs and a tie
    y = (torch.rand(2, 32, 32) > 0.5).long()
    ce = F.cross_entropy(out, y)
    bce = F.binary_cross_entropy_with_logits(z[:, 0], y.float())
    assert abs(ce.item() - bce.item()) < 1e-6
    zz = torch.tensor([[[[-30.0, -1.0, 0.0, 2.5, 40.0]]]])
    two = torch.cat([torch.zeros_like(zz), zz], 1)
    assert two.argmax(1).tolist() == [[[0, 0, 0, 1, 1]]]
    yy = torch.tensor([[[1, 0, 1, 1, 0]]])
    assert abs(F.cross_entropy(two, yy, reduction="sum").item()
               - F.binary_cross_entropy_with_logits(zz[:, 0], yy.float(), reduction="sum").item()) < 1e-5


def test_gradients_flow_through_the_two_channel_output():
    model = build_network("feda3i_unet", 1, 2).train()
    x, y = torch.rand(2, 1, 16, 16), (torch.rand(2, 16, 16) > 0.5).long()
    F.cross_entropy(model(x), y).backward()
    assert model.outc.conv.weight.grad is not None and model.outc.conv.weight.grad.abs().sum() > 0
    assert int(model.state_dict()["inc.double_conv.1.num_batches_tracked"]) == 1


# ----------------------------------------------------------------------------------- noise estimation


def test_band_regions_on_a_square():
    mask = np.zeros((12, 12), bool)
    mask[3:8, 3:8] = True  # 5x5 square, rows/cols 3..7
    inner, outer, d = band_regions(mask)
    # inner depths: ring 1, ring 2, centre 3 -> max 3; outer: (11, 11) is sqrt(4^2 + 4^2) = 5.66 away -> d = 3
    # R_in = the whole square (25). R_out: 4 sides x (3 rows x 5 cols) = 60, plus per corner the offsets
    # (1,1), (1,2), (2,1), (2,2) with dr^2 + dc^2 <= 9 (not (1,3): 10) = 4 x 4 = 16 -> 76
    assert d == 3.0 and inner.sum() == 25 and outer.sum() == 76
    assert not (inner & outer).any() and not (outer & mask).any() and (inner <= mask).all()
    big = np.zeros((12, 12), bool)
    big[1:11, 1:11] = True  # 10x10 in a one-pixel frame: outer max sqrt(2) (image corners), inner max 5
    inner, outer, d = band_regions(big)
    # d = sqrt(2); inner depths are 1 (rim), 2, ... (no sqrt(2)): R_in = the rim 100 - 64; R_out = the frame 44
    assert d == pytest.approx(math.sqrt(2)) and inner.sum() == 36 and outer.sum() == 44


@pytest.mark.parametrize("mask", [np.zeros((6, 6)), np.ones((6, 6))])
def test_band_regions_empty_and_full_masks(mask):
    inner, outer, d = band_regions(mask)
    assert math.isnan(d) and not inner.any() and not outer.any() and inner.shape == (6, 6)
    with pytest.raises(ValueError, match="2-D"):
        band_regions(np.zeros((1, 6, 6)))


def test_band_losses_hand_values_and_nan_for_empty_labels():
    masks = np.zeros((3, 12, 12), np.int64)
    masks[0, 3:8, 3:8] = 1
    masks[2, 1:11, 1:11] = 1  # image 1 stays empty
    z = torch.zeros(3, 1, 12, 12)
    out = band_losses(z, masks)
    assert out.shape == (3, 2) and np.all(np.isnan(out[1]))
    np.testing.assert_allclose(out[[0, 2]], math.log(2), rtol=0, atol=1e-12)  # z = 0: BCE = ln 2 everywhere
    z[0, 0][masks[0] == 1] = 2.0  # inside: BCE(2, 1) = log(1 + e^-2); outside still ln 2
    z[0, 0, 0, 0] = 50.0  # far outside the outer band (distance 4.2 > 3): no effect
    out = band_losses(z[:, 0], torch.as_tensor(masks))
    np.testing.assert_allclose(out[0], [math.log1p(math.exp(-2)), math.log(2)], rtol=0, atol=1e-12)
    q = site_noise_statistic(out)  # the empty image is skipped by the nanmean
    np.testing.assert_allclose(q, [(math.log1p(math.exp(-2)) + math.log(2)) / 2, math.log(2)], atol=1e-12)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an all-NaN site: NaN, silently
        assert np.all(np.isnan(site_noise_statistic(np.full((2, 2), np.nan))))
    with pytest.raises(ValueError, match="0 and 1"):
        band_losses(z, masks * 2)
    with pytest.raises(ValueError, match="same size"):
        band_losses(z, masks[:, :6])


# ---------------------------------------------------------------------------------- server weights


def test_methods_toy():
    assert group_sites(TOY_Q, seed=0).tolist() == TOY_GROUPS.tolist()
    s = strengths(TOY_Q, TOY_GROUPS)
    np.testing.assert_allclose(s, [0.3, 0.2, 0.5, 0.3, 0.15], atol=1e-12)
    wbar = quality_weights(s, TOY_GROUPS, r=0.5)
    np.testing.assert_allclose(wbar, [0.2, 0.3, 0.0, 0.0, 0.5], atol=1e-12)
    wtil = quantity_weights([40] * 5)
    np.testing.assert_allclose(wtil, [0.2] * 5)
    assert layer_schedule(5) == pytest.approx(4 / 9)
    key = "down4.maxpool_conv.1.double_conv.0.weight"  # layer 5 of 10
    w = layerwise_weights([key], wbar, wtil)[key]
    np.testing.assert_allclose(w, [0.2, 0.244444, 0.111111, 0.111111, 0.333333], atol=1e-6)
    all_w = layerwise_weights(["inc.double_conv.0.weight", "outc.conv.bias"], wbar, wtil)
    np.testing.assert_allclose(all_w["inc.double_conv.0.weight"], wtil)  # j = 1: quantity only
    np.testing.assert_allclose(all_w["outc.conv.bias"], wbar)  # j = L: quality only
    bundle = compute_weights(TOY_Q, [40] * 5, sites=list("ABCDE"))
    np.testing.assert_allclose(bundle.w_quality, wbar, atol=1e-12)
    back = FedA3IWeights.from_json(bundle.to_json())
    assert json.loads(bundle.to_json())["groups"] == [1, 1, 1, 0, 0] and back.sites == tuple("ABCDE")
    np.testing.assert_array_equal(back.w_quality, bundle.w_quality)


def test_group_sites_flips_with_the_columns_and_handles_multi_class():
    assert group_sites(TOY_Q[:, ::-1]).tolist() == (1 - TOY_GROUPS).tolist()  # swap in/out: swap the groups
    q2 = np.hstack([TOY_Q, TOY_Q * 0.5])  # two classes, [in, out] interleaved
    assert group_sites(q2).tolist() == TOY_GROUPS.tolist()
    np.testing.assert_allclose(strengths(q2, TOY_GROUPS), 1.5 * strengths(TOY_Q, TOY_GROUPS))
    np.testing.assert_allclose(strengths(q2, TOY_GROUPS, mode="first"), strengths(TOY_Q, TOY_GROUPS))
    with pytest.raises(ValueError, match="finite"):
        group_sites([[0.1, np.nan], [0.2, 0.3]])
    with pytest.raises(ValueError, match="2C columns"):
        group_sites(np.zeros((3, 3)))


def test_minmax_form_equals_the_paper_form():
    rng = np.random.default_rng(0)
    for _ in range(50):
        k = int(rng.integers(2, 12))
        s, g = rng.normal(size=k), rng.integers(0, 2, size=k)
        r = float(rng.uniform())
        a, b = quality_weights(s, g, r), quality_weights_minmax(s, g, r)
        np.testing.assert_allclose(a, b, atol=1e-12)
        assert a.sum() == pytest.approx(1.0) and (a >= 0).all()


@pytest.mark.parametrize("fn", [quality_weights, quality_weights_minmax])
def test_degenerate_weights_are_finite_and_sum_to_one(fn):
    # singleton G_s: its share 1 - r goes to it alone; G_l as usual
    w = fn([0.3, 0.1, 0.9], [1, 1, 0], r=0.5)
    np.testing.assert_allclose(w, [0.0, 0.5, 0.5])
    # equal strengths in G_l: equal split of r
    np.testing.assert_allclose(fn([0.2, 0.2, 0.2, 0.1, 0.3], [1, 1, 1, 0, 0], r=0.6),
                               [0.2, 0.2, 0.2, 0.4, 0.0])
    # an empty group: the other gets everything
    np.testing.assert_allclose(fn([0.1, 0.3], [0, 0], r=0.7), [1.0, 0.0])
    # K = 1
    np.testing.assert_allclose(fn([0.4], [1]), [1.0])
    with pytest.raises(ValueError, match="r must be"):
        fn([0.1], [1], r=1.5)
    with pytest.raises(ValueError, match=r"groups\[1\]"):
        fn([0.1, 0.2], [1, 2])


def test_degenerate_grouping_never_crashes():
    assert group_sites([[0.5, 0.2]]).tolist() == [1]  # K = 1, in > out: G_l
    assert group_sites([[0.1, 0.2]] * 4).tolist() == [0] * 4  # all equal, in < out: G_s
    for q in ([[0.5, 0.2]], [[0.3, 0.3]] * 3, [[0.5, 0.2], [0.5, 0.21]]):
        b = compute_weights(q, [10] * len(q))
        for w in (b.w_quality, b.w_quantity, b.s):
            assert np.isfinite(w).all()
        assert b.w_quality.sum() == pytest.approx(1.0)


def test_quantity_weights_and_their_errors():
    np.testing.assert_allclose(quantity_weights([10, 30, 0]), [0.25, 0.75, 0.0])
    with pytest.raises(ValueError, match=r"n\[1\] \(site 1\)"):
        quantity_weights([3, -1])
    with pytest.raises(ValueError, match=r"n\[2\] \(site 2\)"):
        quantity_weights([3, 1, float("nan")])
    with pytest.raises(ValueError, match="positive total"):
        quantity_weights([0, 0])


# ------------------------------------------------------------------------------------ layer-wise mix


def test_layer_schedule_and_index():
    assert [layer_schedule(j) for j in (1, 10)] == [0.0, 1.0]
    assert layer_schedule(4, weight=0.5, power=2.0, bias=0.1) == pytest.approx(0.5 * (1 / 3) ** 2 + 0.1)
    with pytest.raises(ValueError, match="1..10"):
        layer_schedule(11)
    assert layer_index("inc.double_conv.0.weight") == 1 and layer_index("outc.conv.bias") == 10
    assert layer_index("down3.maxpool_conv.1.double_conv.4.running_var") == 4
    with pytest.raises(ValueError, match="'incx.weight' matches none"):
        layer_index("incx.weight")  # the code's substring match would take it as inc
    with pytest.raises(ValueError, match="'head.weight'"):
        layerwise_weights(["head.weight"], [1.0], [1.0])
    with pytest.raises(ValueError, match="no FedA3I layer map"):
        layer_names_for("light")


@pytest.mark.parametrize("network", ["feda3i_unet", "fedevi_unet"])
def test_layer_map_covers_every_state_dict_key_once(network):
    norm = {"feda3i_unet": "batch", "fedevi_unet": "batch"}[network]
    keys = list(build_network(network, 3, 2, norm=norm).state_dict())
    names = layer_names_for(network)
    layers = [layer_index(k, names) for k in keys]  # raises if a key matches no name or several
    assert set(layers) == set(range(1, 11))
    assert sum(1 for k in keys for n in names if k == n or k.startswith(n + ".")) == len(keys)  # exactly once
    w = layerwise_weights(keys, [0.0, 1.0], [0.5, 0.5], layer_names=names)
    assert set(w) == set(keys) and all(v.sum() == pytest.approx(1.0) for v in w.values())
    head = {"feda3i_unet": "outc.conv.weight", "fedevi_unet": "head.weight"}[network]
    np.testing.assert_allclose(w[head], [0.0, 1.0])
    if network == "fedevi_unet":  # the same mapping as a layer_of function
        w2 = layerwise_weights(keys, [0.0, 1.0], [0.5, 0.5], layer_of=lambda k: layer_index(k, FEDEVI_UNET_LAYERS))
        assert all(np.array_equal(w[k], w2[k]) for k in keys)


def test_layerwise_average_on_a_two_site_hand_example():
    a = {"inc.w": np.array([1.0, 2.0], np.float32), "outc.b": np.array(4.0),
         "up2.bn.num_batches_tracked": np.array(10, np.int64)}
    b = {"inc.w": np.array([3.0, 6.0], np.float32), "outc.b": np.array(8.0),
         "up2.bn.num_batches_tracked": np.array(13, np.int64)}
    weights = layerwise_weights(list(a), [0.0, 1.0], [0.75, 0.25])
    # inc (j=1): 0.75 a + 0.25 b = [1.5, 3]; outc (j=10): b = 8; up2 (j=7, L=6/9): 2/3 [0, 1] + 1/3 [.75, .25]
    # = [0.25, 0.75] -> 0.25 * 10 + 0.75 * 13 = 12.25 -> 12
    np.testing.assert_allclose(weights["up2.bn.num_batches_tracked"], [0.25, 0.75])
    avg = layerwise_average([a, b], weights)
    np.testing.assert_allclose(avg["inc.w"], [1.5, 3.0])
    assert avg["inc.w"].dtype == np.float32 and float(avg["outc.b"]) == 8.0
    assert avg["up2.bn.num_batches_tracked"].dtype == np.int64 and int(avg["up2.bn.num_batches_tracked"]) == 12
    for k in a:  # equals sum_i w_ij theta_i per key
        np.testing.assert_allclose(avg[k], np.rint(weights[k] @ np.stack([a[k], b[k]]).astype(float))
                                   if k.endswith("tracked") else weights[k] @ np.stack([a[k], b[k]]), rtol=1e-6)
    with pytest.raises(ValueError, match="different keys"):
        layerwise_average([a, {"inc.w": a["inc.w"]}], weights)
    with pytest.raises(ValueError, match="no weights for state-dict key 'outc.b'"):
        layerwise_average([a, b], {"inc.w": weights["inc.w"]})


def test_layerwise_average_of_real_models_keeps_identical_models():
    models = [{k: v.numpy() for k, v in build_network("feda3i_unet", 1, 2, init_seed=0).state_dict().items()}
              for _ in range(3)]
    w = layerwise_weights(list(models[0]), [0.2, 0.3, 0.5], [1 / 3] * 3)
    avg = layerwise_average(models, w)
    for k, v in models[0].items():
        assert avg[k].dtype == v.dtype and avg[k].shape == v.shape
        np.testing.assert_allclose(avg[k], v, rtol=1e-6, atol=1e-7)
