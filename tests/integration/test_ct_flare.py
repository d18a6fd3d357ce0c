"""Multi-head CT on FLARE: shared backbones, what a site sends, FIVA's variances, the server's checks, and
tiny real-data simulator runs of every CT job (slim nnU-Net plan, 2 rounds, held-out site scored)."""

import csv
import json
import math
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from conftest import REPO, FakeEngine, FakeServerEngine, simulator_process
from feduq.nnunet import pipeline as nc
from feduq.common.wire import FedUQMetaKey
from feduq.flare.ct import VAR_PREFIX, BackboneModel, CTController
from feduq.flare.ct import CTController, CTExecutor
from feduq.parts.ct_server import CTServer
from feduq.methods.fiva import FIVAServer
from feduq.parts.server import Answer

SLIM = nc.load_plans("ct_2d_slim")


def test_sites_with_different_label_sets_share_one_backbone():
    torch.manual_seed(0)
    one = nc.SitePipeline(SLIM, ("pancreas",)).build_network()
    three = nc.SitePipeline(SLIM, ("liver", "kidney", "pancreas"), dropout=0.3).build_network()
    shapes = lambda net: {n: tuple(p.shape) for n, p in net.named_parameters() if n in nc.backbone_names(net)}  # noqa: E731
    assert shapes(one) == shapes(three) and len(shapes(one)) > 40  # dropout changes no parameter name
    assert not any(n.startswith(nc.HEAD_PREFIX) for n in shapes(one))
    # heads: one 1x1 conv per deep-supervision stage, n_site + 1 outputs
    heads = dict(three.named_parameters())
    assert [heads[n].shape[0] for n in nc.head_names(three) if n.endswith("weight")] == [4] * 3
    assert [dict(one.named_parameters())[n].shape[0] for n in nc.head_names(one) if n.endswith("weight")] == [2] * 3
    # nnU-Net's state dict aliases tensors (decoder.encoder.* is encoder.*); the wire carries each once
    assert len(one.state_dict()) > len(list(one.named_parameters()))
    # the server's persisted model is exactly the backbone (plus FIVA's variance of each tensor, ones at start)
    model = BackboneModel("ct_2d_slim", variance=True).state_dict()
    assert {k for k in model if not k.startswith(VAR_PREFIX)} == set(shapes(one))
    assert all(torch.equal(model[VAR_PREFIX + k], torch.ones(s)) for k, s in shapes(one).items())


def _site(tmp_path, data_root, site="KiTS19", **args):
    engine = FakeEngine(tmp_path)
    (tmp_path / "local").mkdir(parents=True, exist_ok=True)
    (tmp_path / "local" / "feduq_site.json").write_text(json.dumps({"data_root": str(data_root)}))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, engine, private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "job", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=True, sticky=False)
    ex = CTExecutor(site_part="feduq.methods.fiva.site.FIVASite", plans="ct_2d_slim", iterations=3, batch_size=2, max_items=4, num_rounds=10, device="cpu",
                      num_threads=1, **args)
    ex.site = site
    ex._setup(ctx)
    return ex, ctx


def _global(ex, variance=0.5):
    named = dict(ex.net.named_parameters())
    params = {n: named[n].detach().numpy().copy() for n in ex.backbone}
    params.update({VAR_PREFIX + n: np.full(named[n].shape, variance, np.float32) for n in ex.backbone})
    return params


def test_fiva_g_site_sends_backbone_and_a_nonzero_gradient_variance_never_its_head(tmp_path, data_root):
    ex, ctx = _site(tmp_path, data_root, variance="gradient")
    sent = ex.train(FLModel(params=_global(ex), params_type=ParamsType.FULL, current_round=0), ctx)
    assert not any(k.startswith(nc.HEAD_PREFIX) for k in sent.params), "the site's head left the site"
    assert set(sent.params) == set(ex.backbone) | {VAR_PREFIX + n for n in ex.backbone}
    assert sent.meta[FedUQMetaKey.NUM_SAMPLES] == 1  # KiTS19 trains on one patient (cases, like FIVA's volumes)
    grown = [float((sent.params[VAR_PREFIX + n] - 0.5).max()) for n in ex.backbone]
    # sigma^2 = 0.5 + lr^2 * T * var(g): the official code's None gradients would leave it at exactly 0.5
    assert max(grown) > 0 and min(float(sent.params[VAR_PREFIX + n].min()) for n in ex.backbone) >= 0.5 - 1e-7
    assert ex.method._welford.count == 3
    head = ex.submit_head(FLModel(params={}), ctx)
    assert set(head.params) == {"weight", "bias"} and head.params["weight"].shape[0] == 2
    assert head.meta["feduq_head_organs"] == ["kidney"]


def test_ct_site_restarted_within_a_job_continues_its_sgd_momentum_and_streams_its_round(tmp_path, data_root):
    """nnU-Net's SGD (momentum 0.99) carries its momentum across rounds; a site process restarted within a job reads it
    from its run folder instead of starting from zero. The round's loss and learning rate go to the site's TBWriter."""
    class Writer:
        def __init__(self):
            self.scalars = []

        def add_scalar(self, key, value, global_step):
            self.scalars.append((key, round(value, 8), global_step))

    ex, ctx = _site(tmp_path, data_root, variance="parameter")
    ex.writer = Writer()
    ex.train(FLModel(params=_global(ex), params_type=ParamsType.FULL, current_round=1), ctx)
    momentum = {i: b["momentum_buffer"].clone() for i, b in ex.optimizer.state_dict()["state"].items()}  # by index
    assert momentum and any(float(m.abs().max()) > 0 for m in momentum.values())
    lr = ex.optimizer.param_groups[0]["lr"]
    assert [k for k, _, step in ex.writer.scalars] == ["train_loss", "lr"] and {s for *_, s in ex.writer.scalars} == {1}
    assert ex.writer.scalars[1][1] == round(lr, 8)
    again, _ = _site(tmp_path, data_root, variance="parameter")  # same run folder: a restarted process
    restored = again.optimizer.state_dict()["state"]
    assert set(restored) == set(momentum)
    assert all(torch.equal(restored[i]["momentum_buffer"], m) for i, m in momentum.items())
    fresh, _ = _site(tmp_path / "other", data_root, variance="parameter")  # another run folder: nothing to restore
    assert not fresh.optimizer.state_dict()["state"]


def test_fiva_p_variance_is_the_within_round_variance_of_the_parameters(tmp_path, data_root):
    ex, ctx = _site(tmp_path, data_root, variance="parameter")
    seen = []
    start_round = ex.method.start_round
    def spy(backbone, params):  # record every parameter vector Welford sees
        g, s = start_round(backbone, params)
        return g, (lambda net: (s(net), seen.append(dict(net.named_parameters())["encoder.stages.0.0.convs.0.conv.bias"].detach().clone())))
    ex.method.start_round = spy
    sent = ex.train(FLModel(params=_global(ex), params_type=ParamsType.FULL, current_round=0), ctx)
    expected = torch.stack(seen).double().var(dim=0, unbiased=False).numpy()
    np.testing.assert_allclose(sent.params[VAR_PREFIX + "encoder.stages.0.0.convs.0.conv.bias"], expected, rtol=1e-4, atol=1e-12)


def _answer(site, params, n=1):
    return Answer(site, params=params, meta={FedUQMetaKey.NUM_SAMPLES: n})


def test_fiva_server_rejects_bad_variances_naming_the_site():
    server = FIVAServer()
    good = {"w": np.ones((2, 2), np.float32), VAR_PREFIX + "w": np.full((2, 2), 0.1, np.float32)}
    server.check("A", _answer("A", good), good)
    for bad, msg in ((-0.1, r"variance 'w' has 0 NaN, 0 Inf and 1 negative"), (np.nan, r"'variance::w' has 1 non-finite")):
        upd = dict(good)
        upd[VAR_PREFIX + "w"] = np.array([[0.1, bad], [0.1, 0.1]], np.float32)
        with pytest.raises(ValueError, match=f"site 'B'.*{msg}"):
            server.check("B", _answer("B", upd), good)
    with pytest.raises(ValueError, match=r"site 'C' parameter 'variance::w' shape .* expected=\(2, 2\), got=\(3,\)"):
        server.check("C", _answer("C", {**good, VAR_PREFIX + "w": np.ones(3, np.float32)}), good)
    with pytest.raises(ValueError, match="site 'E' parameter names do not match.*missing=\\['variance::w'\\]"):
        server.check("E", _answer("E", {"w": good["w"]}), good)
    with pytest.raises(ValueError, match="site 'D'.*non-finite"):
        CTServer().check("D", _answer("D", {"w": np.array([[np.inf, 0], [0, 0]], np.float32)}), {"w": good["w"]})
    with pytest.raises(ValueError, match=r"site 'F': n_k = 0 \(expected a finite number > 0\)"):
        CTServer().check("F", _answer("F", {"w": good["w"]}, n=0), {"w": good["w"]})


def test_fiva_server_aggregates_the_inverse_variance_toy():
    logged = []
    fed = SimpleNamespace(round=0, log=logged.append)
    glob = {"w": np.zeros(1, np.float32), VAR_PREFIX + "w": np.ones(1, np.float32)}
    ups = {s: _answer(s, {"w": np.array([t], np.float32), VAR_PREFIX + "w": np.array([v], np.float32)}, n)
           for s, t, v, n in (("A", 1, 0.01, 6), ("B", 2, 0.04, 3), ("C", 3, 0.0025, 1))}
    out, weights = FIVAServer().fuse(fed, ups, glob)
    assert out["w"][0] == pytest.approx(1.812643, rel=1e-6)  # the hand toy of test_fiva_math
    assert out[VAR_PREFIX + "w"][0] == pytest.approx(9.239683e-3, rel=1e-6)
    assert sum(weights.values()) == pytest.approx(1.0) and logged[0].startswith("FEDUQ_FIVA ")


# -- tiny real-data simulator runs ------------------------------------------------------------------
CT_SITES = ["KiTS19", "MSD-Task09-Spleen", "CURVAS-Erlangen"]


@pytest.fixture
def short_tmp():
    """A scratch folder with a short path, removed afterwards: the simulator's multiprocessing manager binds an AF_UNIX
    socket under TMPDIR, whose path may not exceed 107 bytes (pytest's ``tmp_path`` under pytest-xdist is longer)."""
    path = Path(tempfile.mkdtemp(prefix="feduq-t-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.mark.sim
# fiva_p runs in tests/integration/test_golden.py; funavg runs the CT server without a server part (fedavg_ct's)
@pytest.mark.parametrize("method", ["fiva_g", "funavg"])
def test_ct_job_runs_and_scores_the_held_out_site(tmp_path, short_tmp, data_root, method):
    from feduq.recipes.job_folders import configure

    job = configure(REPO / "jobs" / method, tmp_path / "job", num_rounds=2, max_items=3, sites=CT_SITES,
                    executor_args={"plans": "ct_2d_slim", "iterations": 2, "batch_size": 2, "inference_samples": 2,
                                   "num_threads": 1, "device": "cpu"})
    ws, scratch = tmp_path / "ws", short_tmp
    proc = simulator_process(job, ws, data_root, stdout=-1, stderr=-1, env_extra={"TMPDIR": str(scratch)})
    out, err = proc.communicate(timeout=900)
    results = ws / "server" / "simulate_job" / "results"
    assert proc.returncode == 0 and (results / "per_organ_table.csv").is_file(), (out + err)[-4000:]
    with open(results / "per_organ_table.csv") as f:
        rows = list(csv.DictReader(f))
    by_site = {}
    for r in rows:
        by_site.setdefault(r["site"], {})[r["organ"]] = r
        assert 0.0 <= float(r["dice"]) <= 1.0 and 0.0 <= float(r["dice_un"]) <= 1.0 and math.isfinite(float(r["hd95"]))
    assert set(by_site["KiTS19"]) == {"kidney"} and set(by_site["MSD-Task09-Spleen"]) == {"spleen"}
    assert by_site["CURVAS-Erlangen"] and set(by_site["CURVAS-Erlangen"]) <= {"liver", "kidney", "pancreas"}
    assert all(r["held_out"] == "1" for r in by_site["CURVAS-Erlangen"].values())
    for site, organs in by_site.items():  # each site's per-slice file gives back the server's per-organ table
        with open(ws / site / "simulate_job" / "per_image_test.csv") as f:
            slices = list(csv.DictReader(f))
        assert len(slices) == 3 and all(r["site"] == site for r in slices)
        for organ, r in organs.items():
            for metric in ("dice", "dice_un", "hd95"):
                col = f"{metric}_{organ}" if metric != "dice_un" else f"dice_un_{organ}"
                values = [float(x[col]) for x in slices if x.get(col) not in (None, "")]
                assert np.mean(values) == pytest.approx(float(r[metric]), abs=1e-5), (site, organ, metric)
        for x in slices:  # the patient: KiTS19 10036_103 -> 10036; CURVAS r1_10001_458 -> 10001
            assert x["case"] == {"KiTS19": x["image"].split("_")[0], "CURVAS-Erlangen": x["image"].split("_")[1],
                                 "MSD-Task09-Spleen": "_".join(x["image"].split("_")[1:])}[site]
            present = [float(x[k]) for k in x if k.startswith("dice_") and not k.startswith("dice_un") and x[k] != ""]
            assert (float(x["dice"]) == pytest.approx(np.mean(present), abs=1e-6) if present
                    else math.isnan(float(x["dice"])))
    log = (ws / "server" / "log.txt").read_text()
    assert log.count("CT round ") == 2 and "FEDUQ_JOB_FAILED" not in log
    if method.startswith("fiva"):
        assert log.count("FEDUQ_FIVA ") == 2
    site_log = (ws / "CURVAS-Erlangen" / "log.txt").read_text()
    assert "held-out (test only)" in site_log and "SLIM test/demo architecture" in site_log
    # the training sites' preprocessed slices (a temporary folder each) are deleted when the run ends
    assert not list(scratch.glob("feduq-ct-*")), sorted(p.name for p in scratch.iterdir())


def _fiva_controller(monkeypatch, answers, num_rounds, initial, min_clients=None):
    """FIVA's CT round (CTController with FIVAServer).run with FLARE's exchanges faked: ``answers[round][site] = (theta, variance)``."""
    ctl = CTController(server_part="feduq.methods.fiva.FIVAServer", num_rounds=num_rounds, min_clients=min_clients)
    ctl.engine = FakeServerEngine(["a", "b", "CURVAS-Erlangen"])  # the held-out site never gets 'train'
    ctl.fl_ctx = FLContext()
    ctl.sent, ctl.saved, ctl.failures = [], [], []
    ctl.log_error = lambda fl_ctx, msg, **kw: ctl.failures.append(msg)
    ctl.system_panic = lambda reason, fl_ctx: ctl.failures.append(("panic", reason))
    ctl.event = lambda *a, **k: None
    ctl.load_model = lambda: FLModel(params=dict(initial["params"]), params_type=ParamsType.FULL, meta=dict(initial["meta"]))
    ctl.save_model = lambda m: ctl.saved.append((dict(m.params), m.meta[LAST_ROUND]))
    ctl.server.finish = lambda *a: ctl.sent.append(("heads_and_test",))

    def exchange(task_name, data, targets, **kw):
        r = data.current_round
        ctl.sent.append((r, task_name, list(targets), dict(data.params)))
        return [FLModel(params={"w": np.array([t], np.float32), VAR_PREFIX + "w": np.array([v], np.float32)},
                        meta={"client_name": s, FedUQMetaKey.NUM_SAMPLES: n})
                for s, (t, v, n) in answers[r].items() if s in targets]

    ctl.send_model_and_wait = exchange
    ctl.broadcast_model = lambda task_name, data, targets, **kw: exchange(task_name, data, targets)
    return ctl


from feduq.flare.workflows import LAST_ROUND  # noqa: E402


def test_fiva_resumes_with_the_checkpointed_variance_and_rejects_a_nan_variance(monkeypatch):
    initial = {"params": {"w": np.array([0.5], np.float32), VAR_PREFIX + "w": np.array([0.25], np.float32)},
               "meta": {LAST_ROUND: 1}}
    answers = {2: {"a": (1.0, 0.01, 3), "b": (3.0, float("nan"), 1)}}
    ctl = _fiva_controller(monkeypatch, answers, num_rounds=3, initial=initial, min_clients=1)
    ctl.run()
    (r, task, targets, params), *_ = ctl.sent
    assert (r, task, targets) == (2, "train", ["a", "b"])  # only round 2; CURVAS is held out
    assert params[VAR_PREFIX + "w"][0] == pytest.approx(0.25)  # the checkpointed global variance is broadcast
    (saved, last), = ctl.saved
    assert last == 2
    # b's NaN variance is rejected: only a counts. c = 1/(0.01+1e-5); theta_g = 1; sigma^2 = 1/(0.95/0.25 + c)
    c = 1 / (0.01 + 1e-5)
    assert saved["w"][0] == pytest.approx(1.0) and saved[VAR_PREFIX + "w"][0] == pytest.approx(1 / (0.95 / 0.25 + c), rel=1e-5)
    assert ctl.sent[-1] == ("heads_and_test",)


def test_fiva_with_every_site_required_stops_on_a_bad_variance_and_keeps_the_model(monkeypatch):
    initial = {"params": {"w": np.array([0.5], np.float32), VAR_PREFIX + "w": np.ones(1, np.float32)}, "meta": {}}
    answers = {0: {"a": (1.0, 0.01, 3), "b": (3.0, -0.5, 1)}}
    ctl = _fiva_controller(monkeypatch, answers, num_rounds=1, initial=initial)
    ctl.run()
    assert ctl.saved == []  # never aggregated, the global model stays as it was
    assert any(isinstance(f, tuple) and "site 'b'" in f[1] and "negative" in f[1] for f in ctl.failures)


def test_the_nnunet_back_end_answers_through_the_shared_site_executor(tmp_path, data_root):
    """FedUQ's one site executor (feduq.flare.site_executor) under nnU-Net's back-end: a site whose set-up failed stays
    connected and answers every task with its site-named reason; an unknown task is named with the known ones; a
    held-out site refuses to train but tests."""
    from nvflare.apis.event_type import EventType
    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.shareable import Shareable
    from nvflare.apis.signal import Signal

    from feduq.flare.quorum import site_error

    ex, ctx = _site(tmp_path / "ok", data_root, site="CURVAS-Erlangen", variance="parameter")
    assert ex.held_out and ex.ready()
    refused = ex.execute("train", Shareable(), ctx, Signal())
    assert refused.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
    assert site_error(refused) == "site 'CURVAS-Erlangen' is a held-out test site: it never trains"
    unknown = ex.execute("validate", Shareable(), ctx, Signal())
    assert unknown.get_return_code() == ReturnCode.TASK_UNKNOWN
    assert site_error(unknown) == "site 'CURVAS-Erlangen': unknown task 'validate' (known: ['submit_head', 'test', 'train'])"

    (tmp_path / "bad" / "local").mkdir(parents=True)
    (tmp_path / "bad" / "local" / "feduq_site.json").write_text(json.dumps({"data_root": str(tmp_path / "nowhere")}))
    bad = CTExecutor(site_part="feduq.methods.fiva.site.FIVASite", plans="ct_2d_slim", device="cpu", num_threads=1)
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, FakeEngine(tmp_path / "bad"), private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "job", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, "KiTS19", private=True, sticky=False)
    bad.handle_event(EventType.START_RUN, ctx)
    assert not bad.ready()
    for task in ("train", "test", "submit_head"):
        reply = bad.execute(task, Shareable(), ctx, Signal())
        assert reply.get_return_code() == ReturnCode.EXECUTION_EXCEPTION
        assert site_error(reply).startswith("setup failed: site 'KiTS19': ") and "nowhere" in site_error(reply), site_error(reply)
