"""FedUAA's FLARE glue without a FLARE runtime: the server aggregator on hand-made updates, and the
client executor on a tiny synthetic site (what it sends, what it keeps)."""

import math

import numpy as np
import pytest
import torch
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from feduq.constants import FedUQMetaKey
from feduq.flare.aggregators import AGGREGATION_WEIGHTS
from feduq.flare.feduaa import FedUAAAggregator, FedUAASegExecutor, model_digest, segmentation_head_keys
from feduq.networks import SegUNet

HEAD = {"head.weight", "head.bias"}  # FedEvi's U-Net (the default network): the final 1x1 convolution


# -- server ----------------------------------------------------------------------------------------
def _global(shared=0.0, head=9.0):
    return {"body.w": np.full((2,), shared, np.float32), "head.w": np.full((1,), head, np.float32)}


def _update(site, value, theta, rnd=0, **meta):
    meta = {"client_name": site, FedUQMetaKey.NUM_SAMPLES: 5, **meta}
    if theta != "absent":
        meta[FedUQMetaKey.FEDUAA_THRESHOLD] = theta
    return FLModel(params={"body.w": np.full((2,), value, np.float32)}, params_type=ParamsType.FULL,
                   current_round=rnd, meta=meta)


def _aggregator(global_params=None):
    agg = FedUAAAggregator()
    agg.fl_ctx = FLContext()
    agg.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(global_params or _global(), {}), private=True)
    return agg


def _softmax(*theta):
    z = np.exp(np.array(theta))
    return z / z.sum()


def test_aggregator_weights_are_softmax_of_thresholds_and_heads_stay_global():
    agg = _aggregator()
    for site, value, theta in (("a", 1.0, 0.2), ("b", 2.0, 0.5), ("c", 4.0, 0.9)):
        assert agg.accept_model(_update(site, value, theta))
    out = agg.aggregate_model()
    w = _softmax(0.2, 0.5, 0.9)
    np.testing.assert_allclose(out.params["body.w"], np.full(2, w @ [1.0, 2.0, 4.0]), rtol=1e-6)
    np.testing.assert_allclose(out.params["head.w"], [9.0])  # nobody sent it: the global value, unchanged
    np.testing.assert_allclose([out.meta[AGGREGATION_WEIGHTS][s] for s in "abc"], w, atol=1e-12)
    assert out.meta[FedUQMetaKey.FEDUAA_THRESHOLDS] == {"a": 0.2, "b": 0.5, "c": 0.9}


def test_aggregator_keeps_previous_threshold_and_renormalises_over_accepted_sites():
    agg = _aggregator()
    for site, theta in (("a", 0.2), ("b", 0.5), ("c", 0.9)):
        agg.accept_model(_update(site, 1.0, theta))
    agg.aggregate_model()
    # round 1: a sends None (undefined ROC), b sends NaN params (rejected), c sends inf, d is new and
    # sends no threshold at all
    assert agg.accept_model(_update("a", 1.0, None, rnd=1))
    bad = _update("b", 1.0, 0.4, rnd=1)
    bad.params["body.w"][0] = np.nan
    assert not agg.accept_model(bad)
    assert agg.accept_model(_update("c", 3.0, float("inf"), rnd=1))
    assert agg.accept_model(_update("d", 5.0, "absent", rnd=1))
    out = agg.aggregate_model()
    # a keeps 0.2, c keeps 0.9, d gets the default 0.5; softmax over the accepted a, c, d only
    w = _softmax(0.2, 0.9, 0.5)
    np.testing.assert_allclose([out.meta[AGGREGATION_WEIGHTS][s] for s in "acd"], w, atol=1e-12)
    np.testing.assert_allclose(out.params["body.w"], np.full(2, w @ [1.0, 3.0, 5.0]), rtol=1e-6)
    assert agg.last_thresholds() == {"a": 0.2, "b": 0.5, "c": 0.9, "d": 0.5}


def test_aggregator_restores_thresholds_from_the_global_models_meta():
    agg = FedUAAAggregator()
    agg.fl_ctx = FLContext()
    agg.fl_ctx.set_prop(
        AppConstants.GLOBAL_MODEL,
        make_model_learnable(_global(), {FedUQMetaKey.FEDUAA_THRESHOLDS: {"a": 0.7, "b": float("nan")}}),
        private=True,
    )
    agg.accept_model(_update("a", 1.0, None))
    agg.accept_model(_update("b", 1.0, None))
    out = agg.aggregate_model()
    np.testing.assert_allclose([out.meta[AGGREGATION_WEIGHTS][s] for s in "ab"], _softmax(0.7, 0.5), atol=1e-12)


def test_aggregator_rejects_a_bad_default():
    with pytest.raises(ValueError, match="default threshold"):
        FedUAAAggregator(default_threshold=math.nan)


# -- client ----------------------------------------------------------------------------------------
def test_segmentation_head_is_the_output_layer():
    from feduq.networks import FedEviUNet

    assert set(segmentation_head_keys(FedEviUNet())) == HEAD
    assert set(segmentation_head_keys(SegUNet())) == {"model.2.conv.weight", "model.2.conv.bias"}
    res = SegUNet(num_res_units=1)
    keys = segmentation_head_keys(res)
    assert keys and all(k.startswith("model.2.") for k in keys) and "model.2.0.conv.weight" in keys
    with pytest.raises(ValueError, match="output block"):
        segmentation_head_keys(torch.nn.Linear(2, 2))


def test_model_digest_ignores_excluded_entries_and_dtype():
    a = {"x": np.ones(3, np.float32), "h": np.zeros(2, np.float32)}
    b = {"x": torch.ones(3, dtype=torch.float64), "h": np.full(2, 5.0, np.float32)}
    assert model_digest(a, {"h"}) == model_digest(b, {"h"}) != model_digest(a)


from conftest import FakeEngine as _Engine  # noqa: E402


@pytest.fixture(scope="module")
def synthetic_root(tmp_path_factory):
    import make_synthetic

    root = tmp_path_factory.mktemp("feduaa_synth")
    assert make_synthetic.main(["--out", str(root), "--n-per-center", "10", "--size", "32"]) == 0
    return root


def _site(tmp_path, synthetic_root, monkeypatch, **args):
    monkeypatch.setenv("FEDUQ_DATA_ROOT", str(synthetic_root))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, _Engine(tmp_path), private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "job", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "Kvasir-SEG", private=True, sticky=False)
    ex = FedUAASegExecutor(task="polyp", image_size=32, batch_size=2, local_epochs=1, max_items=4,
                           num_threads=1, device="cpu", **args)
    ex.site = "Kvasir-SEG"
    ex._setup(ctx)
    return ex, ctx


@pytest.mark.parametrize("args", [{}, {"threshold_source": "val", "roc_level": "image"}])
def test_client_sends_no_head_and_a_threshold(tmp_path, synthetic_root, monkeypatch, args):
    ex, ctx = _site(tmp_path, synthetic_root, monkeypatch, **args)
    assert ex.local_keys() == HEAD
    server_model = {k: v.copy() for k, v in ex.trainer.get_params().items()}
    for k in HEAD:  # the global model's head must never overwrite the site's
        server_model[k] = np.full_like(server_model[k], 7.0)
    head_before = ex._head()

    sent = ex.train(FLModel(params=server_model, params_type=ParamsType.FULL, current_round=0), ctx)

    assert not HEAD & set(sent.params), "the local head left the site"
    assert set(sent.params) == set(server_model) - HEAD
    assert FedUQMetaKey.FEDUAA_THRESHOLD in sent.meta
    theta = sent.meta[FedUQMetaKey.FEDUAA_THRESHOLD]
    assert theta is None or 0.0 <= theta <= 1.0
    assert ex._last_point.num_samples == (4 * 32 * 32 if not args else len(ex.val_ds))
    local = ex.trainer.model.state_dict()
    assert all(not torch.all(local[k] == 7.0) for k in HEAD)
    assert ex.submit_model(FLModel(params={}), ctx).params.keys() == sent.params.keys()

    # the test task scores the received model with the head this site validated it with
    model = ex._load_eval_model(FLModel(params=server_model))
    assert ex._eval_head == "matched"
    for k in HEAD:
        np.testing.assert_array_equal(model.state_dict()[k].numpy(), head_before[k])
    metrics = ex.test(FLModel(params=server_model), ctx).metrics
    assert 0.0 <= metrics["dice"] <= 1.0 and metrics["num_images"] == len(ex.test_ds)
    # a model the site never validated: its current head
    other = {k: v + 0.01 for k, v in server_model.items()}
    model = ex._load_eval_model(FLModel(params=other))
    assert ex._eval_head == "current"
    for k in HEAD:
        torch.testing.assert_close(model.state_dict()[k], local[k])


def test_client_restores_its_head_after_a_restart(tmp_path, synthetic_root, monkeypatch):
    ex, ctx = _site(tmp_path, synthetic_root, monkeypatch)
    ex.train(FLModel(params=ex.trainer.get_params(), params_type=ParamsType.FULL, current_round=0), ctx)
    trained = ex._head()
    again, _ = _site(tmp_path, synthetic_root, monkeypatch)  # same run folder: a restarted process
    for k, v in trained.items():
        np.testing.assert_array_equal(again._head()[k], v)
    assert len(again._heads_by_model) == 1


def test_client_rejects_unknown_switches():
    with pytest.raises(ValueError, match="threshold_source"):
        FedUAASegExecutor(threshold_source="test")
    with pytest.raises(ValueError, match="level"):
        FedUAASegExecutor(roc_level="voxel")
