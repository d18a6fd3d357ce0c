"""FedUAA without a FLARE runtime: the server part on hand-made updates, and the
client executor on a tiny synthetic site (what it sends, what it keeps)."""

import json
import math

import numpy as np
import pytest
import torch
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from feduq.common.wire import FedUQMetaKey
from feduq.flare.executor import FedUQExecutor

FEDUAA_SITE = "feduq.methods.feduaa.FedUAASegSite"
from feduq.site.local_entries import model_digest
from feduq.methods.feduaa import segmentation_head_keys
from feduq.methods.feduaa import FedUAAServer
from feduq.parts.server import Answer, run_rounds
from feduq.core.networks import SegUNet

HEAD = {"head.weight", "head.bias"}  # FedEvi's U-Net (the default network): the final 1x1 convolution


# -- server ----------------------------------------------------------------------------------------
def _global(shared=0.0, head=9.0):
    return {"body.w": np.full((2,), shared, np.float32), "head.w": np.full((1,), head, np.float32)}


def _update(value, theta, nan=False):
    """What a FedUAA site sends: its shared entries (no head), N_k and θ_k ("absent": no threshold at all)."""
    params = {"body.w": np.full((2,), value, np.float32)}
    if nan:
        params["body.w"][0] = np.nan
    meta = {FedUQMetaKey.NUM_SAMPLES: 5}
    if theta != "absent":
        meta[FedUQMetaKey.FEDUAA_THRESHOLD] = theta
    return params, meta


class _Fed:
    def __init__(self, answers, rnd):
        self.answers, self.round, self.num_rounds, self.failures, self.lines = answers, rnd, rnd + 1, {}, []

    def send(self, task, payload, sites, **kw):
        return {s: Answer(s, params=p, meta=m) for s, (p, m) in self.answers.items()}

    def require(self, task, expected, valid, rejected):
        assert valid

    def log(self, line):
        self.lines.append(line)

    warn = log


def _round(server, answers, rnd=0, glob=None):
    """Round ``rnd`` of FedUQ's loop with ``server``: the new global model and the logged weights."""
    fed = _Fed(answers, rnd)
    out = run_rounds(server, fed, glob or _global(), list(answers), rnd)
    record = next(json.loads(line.split(" ", 1)[1]) for line in fed.lines if line.startswith("FEDUQ_AGGREGATION "))
    return out, record["weights"]


def _softmax(*theta):
    z = np.exp(np.array(theta))
    return z / z.sum()


def test_server_weights_are_softmax_of_thresholds_and_heads_stay_global():
    server = FedUAAServer()
    out, weights = _round(server, {"a": _update(1.0, 0.2), "b": _update(2.0, 0.5), "c": _update(4.0, 0.9)})
    w = _softmax(0.2, 0.5, 0.9)
    np.testing.assert_allclose(out["body.w"], np.full(2, w @ [1.0, 2.0, 4.0]), rtol=1e-6)
    np.testing.assert_allclose(out["head.w"], [9.0])  # nobody sent it: the global value, unchanged
    np.testing.assert_allclose([weights[s] for s in "abc"], w, atol=1e-6)
    assert server.state() == {"a": 0.2, "b": 0.5, "c": 0.9}  # checkpointed with the model


def test_server_keeps_previous_threshold_and_renormalises_over_accepted_sites():
    server = FedUAAServer()
    _round(server, {"a": _update(1.0, 0.2), "b": _update(1.0, 0.5), "c": _update(1.0, 0.9)})
    # round 1: a sends None (undefined ROC), b sends NaN params (rejected), c sends inf, d is new and
    # sends no threshold at all
    answers = {"a": _update(1.0, None), "b": _update(1.0, 0.4, nan=True), "c": _update(3.0, float("inf")),
               "d": _update(5.0, "absent")}
    out, weights = _round(server, answers, rnd=1)
    # a keeps 0.2, c keeps 0.9, d gets the default 0.5; softmax over the accepted a, c, d only
    w = _softmax(0.2, 0.9, 0.5)
    np.testing.assert_allclose([weights[s] for s in "acd"], w, atol=1e-6)
    np.testing.assert_allclose(out["body.w"], np.full(2, w @ [1.0, 3.0, 5.0]), rtol=1e-6)
    assert server.state() == {"a": 0.2, "b": 0.5, "c": 0.9, "d": 0.5}


def test_server_restores_thresholds_from_the_checkpoint():
    server = FedUAAServer()
    server.start(_Fed({}, 0), _global(), ["a", "b"], {"a": 0.7, "b": float("nan")})  # a resumed job's meta
    _, weights = _round(server, {"a": _update(1.0, None), "b": _update(1.0, None)})
    np.testing.assert_allclose([weights[s] for s in "ab"], _softmax(0.7, 0.5), atol=1e-6)


def test_server_rejects_a_bad_default():
    with pytest.raises(ValueError, match="default threshold"):
        FedUAAServer(default_threshold=math.nan)


# -- client ----------------------------------------------------------------------------------------
def test_segmentation_head_is_the_output_layer():
    from feduq.core.networks import FedEviUNet

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
    from feduq.commands.research import synthetic as make_synthetic

    root = tmp_path_factory.mktemp("feduaa_synth")
    assert make_synthetic.main(["--out", str(root), "--n-per-center", "10", "--size", "32"]) == 0
    return root


def _site(tmp_path, synthetic_root, monkeypatch, **args):
    monkeypatch.setenv("FEDUQ_DATA_ROOT", str(synthetic_root))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, _Engine(tmp_path), private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "job", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "Kvasir-SEG", private=True, sticky=False)
    ex = FedUQExecutor(site_part=FEDUAA_SITE, task="polyp", image_size=32, batch_size=2, local_epochs=1, max_items=4,
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
    head_before = {k: v.numpy().copy() for k, v in ex.local_entries._current(ex.trainer.model).items()}

    sent = ex.train(FLModel(params=server_model, params_type=ParamsType.FULL, current_round=0))

    assert not HEAD & set(sent.params), "the local head left the site"
    assert set(sent.params) == set(server_model) - HEAD
    assert FedUQMetaKey.FEDUAA_THRESHOLD in sent.meta
    theta = sent.meta[FedUQMetaKey.FEDUAA_THRESHOLD]
    assert theta is None or 0.0 <= theta <= 1.0
    assert ex.method.last_point.num_samples == (4 * 32 * 32 if not args else len(ex.val_ds))
    local = ex.trainer.model.state_dict()
    assert all(not torch.all(local[k] == 7.0) for k in HEAD)
    assert ex.submit_model(FLModel(params={})).params.keys() == sent.params.keys()

    # the test task scores the received model with the head this site validated it with
    model = ex._load_eval_model(FLModel(params=server_model))
    assert ex.eval_local == "matched"
    for k in HEAD:
        np.testing.assert_array_equal(model.state_dict()[k].numpy(), head_before[k])
    metrics = ex.test(FLModel(params=server_model)).metrics
    assert 0.0 <= metrics["dice"] <= 1.0 and metrics["num_images"] == len(ex.test_ds)
    # a model the site never validated: its current head
    other = {k: v + 0.01 for k, v in server_model.items()}
    model = ex._load_eval_model(FLModel(params=other))
    assert ex.eval_local == "current"
    for k in HEAD:
        torch.testing.assert_close(model.state_dict()[k], local[k])


def test_client_restores_its_head_after_a_restart(tmp_path, synthetic_root, monkeypatch):
    ex, ctx = _site(tmp_path, synthetic_root, monkeypatch)
    ex.train(FLModel(params=ex.trainer.get_params(), params_type=ParamsType.FULL, current_round=0))
    trained = {k: v.clone() for k, v in ex.trainer.model.state_dict().items() if k in HEAD}
    again, _ = _site(tmp_path, synthetic_root, monkeypatch)  # same run folder: a restarted process
    assert any(not torch.equal(again.eval_model.state_dict()[k], trained[k]) for k in HEAD)  # a fresh network...
    for k, v in trained.items():  # ...given the trained head back
        torch.testing.assert_close(again.trainer.model.state_dict()[k], v, rtol=0, atol=0)
    assert len(again.local_entries.by_model) == 1


def test_client_rejects_unknown_switches():
    with pytest.raises(ValueError, match="threshold_source"):
        FedUQExecutor(site_part=FEDUAA_SITE, threshold_source="test")
    with pytest.raises(ValueError, match="level"):
        FedUQExecutor(site_part=FEDUAA_SITE, roc_level="voxel")
