"""GraphFedSeg on FLARE: per-site payloads, the server's checks, and a short real-data simulator run."""

import json
import re

import numpy as np
import pytest
from nvflare.app_common.abstract.fl_model import FLModel

from conftest import read_table, run_simulator
from feduq.common.wire import FedUQMetaKey
from feduq.flare.controller import FedUQController
from feduq.methods.graphfedseg import NEIGHBOUR_KEY, GraphFedSegServer, neighbour_direction
from feduq.parts.server import Answer
from feduq.privacy.dp_sgd import spent_epsilon


def _payload(server, glob, site, graph, local_models):
    """What ``site`` receives for ``train`` when the server part knows ``graph`` and last round's models."""
    server.graph, server.local_models = graph, local_models
    return server.payload(None, site, glob)


def test_each_site_receives_its_own_neighbour_vector_and_none_in_round_0():
    ctl = GraphFedSegServer()
    model = {"b": np.zeros(1, np.float32), "a": np.ones(2, np.float32)}
    locals_ = {"x": {"a": np.array([1.0, 0.0]), "b": np.array([0.0])}, "y": {"a": np.array([0.0, 2.0]), "b": np.array([2.0])}}
    graph = {"sites": ["x", "y"], "W": [[0.75, 0.25], [0.1, 0.9]]}
    px, py = (_payload(ctl, model, s, graph, locals_) for s in ("x", "y"))
    # keys flattened in sorted order (a then b): x/||x|| = [1,0,0], y/||y|| = [0, 1/sqrt2, 1/sqrt2]
    r = 1 / np.sqrt(2)
    np.testing.assert_allclose(px[NEIGHBOUR_KEY], [0.75, 0.25 * r, 0.25 * r], rtol=1e-6)
    np.testing.assert_allclose(py[NEIGHBOUR_KEY], [0.1, 0.9 * r, 0.9 * r], rtol=1e-6)
    np.testing.assert_allclose(px[NEIGHBOUR_KEY], neighbour_direction([locals_["x"], locals_["y"]], [0.75, 0.25], keys=["a", "b"]))
    assert NEIGHBOUR_KEY not in _payload(ctl, model, "x", None, {})  # round 0: no graph yet
    assert NEIGHBOUR_KEY not in _payload(GraphFedSegServer(send_neighbour=False), model, "x", graph, locals_)


def test_server_rejects_bad_uncertainty_or_sample_count_naming_the_site():
    ctl = GraphFedSegServer()
    glob = {"w": np.zeros(2, np.float32)}
    ok = Answer("a", params={"w": np.ones(2, np.float32)}, meta={FedUQMetaKey.NUM_SAMPLES: 3, FedUQMetaKey.MEAN_VACUITY: 0.2})
    ctl.check("a", ok, glob)
    for meta, msg in (({FedUQMetaKey.MEAN_VACUITY: -0.1}, "U_k = -0.1"), ({FedUQMetaKey.MEAN_VACUITY: float("nan")}, "U_k = nan"),
                      ({FedUQMetaKey.NUM_SAMPLES: 0}, "n_k = 0")):
        bad = Answer("b", params=ok.params, meta={**ok.meta, **meta})
        with pytest.raises(ValueError, match=f"site 'b': {re.escape(msg)}"):
            ctl.check("b", bad, glob)
    with pytest.raises(ValueError, match="site 'c' parameter 'w' has 1 non-finite"):
        ctl.check("c", Answer("c", params={"w": np.array([np.nan, 0], np.float32)}, meta=ok.meta), glob)


@pytest.mark.parametrize("kwargs, msg", [({"gamma": -0.1}, "gamma >= 0"), ({"lam": 1.5}, "0 <= lam <= 1"),
                                         ({"min_clients": 1}, "K = 1"), ({"similarity": "l2"}, "similarity")])
def test_bad_settings_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=re.escape(msg)):
        FedUQController(server_part="feduq.methods.graphfedseg.GraphFedSegServer", num_rounds=1, **kwargs)


@pytest.mark.sim
def test_graphfedseg_simulator_logs_the_graph_every_round(tmp_path, data_root):
    """A real-data run with DP-SGD on (ε = 10): W every round, and each site's reported ε is the Opacus
    accountant's ε for the (σ, q, steps) it logged."""
    ws = tmp_path / "ws"
    proc = run_simulator("graphfedseg", ws, data_root, executor_args={"dp": {"epsilon": 10.0}})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = read_table(ws)
    assert set(table) == {"Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB", "Avg", "Std"}
    log = (ws / "server" / "log.txt").read_text()
    graphs = [json.loads(m) for m in re.findall(r"FEDUQ_GRAPHFEDSEG (\{.*\})", log)]
    assert [g["round"] for g in graphs] == [0, 1]
    for g in graphs:
        W = np.array(g["W"])
        assert W.shape == (4, 4) and np.allclose(W.sum(1), 1) and (W >= 0).all()
    site_log = (ws / "Kvasir-SEG" / "log.txt").read_text()
    records = [json.loads(m) for m in re.findall(r"FEDUQ_TRAIN (\{.*\})", site_log)]
    assert [r["neighbour_vector"] for r in records] == [False, True]  # v_i from round 1 on
    assert all(0 <= r[FedUQMetaKey.MEAN_VACUITY] <= 1 for r in records)
    for r in records:  # the accountant's epsilon for the logged (noise, sample rate, steps) is the reported one
        assert r["dp_epsilon"] == pytest.approx(spent_epsilon([(r["dp_noise_multiplier"], r["dp_sample_rate"], r["dp_steps"])], 1e-5), abs=1e-6)
    assert records[-1]["dp_steps"] == records[-1]["dp_planned_steps"] == 2 * records[0]["dp_steps"]
    assert 9.99 <= records[-1]["dp_epsilon"] <= 10.0  # the whole budget, spent by the last round
    for site in ("Kvasir-SEG", "CVC-ColonDB"):
        assert 9.99 <= float(table[site]["dp_epsilon"]) <= 10.0
    personalised = ws / "server" / "simulate_job" / "results" / "personalised" / "per_client_table.csv"
    import csv

    with open(personalised) as f:
        rows = {r["client"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(table) and all(0 <= float(rows[s]["dice"]) <= 1 for s in rows if s not in ("Avg", "Std"))
    # each site keeps both tests' per-image scores apart (the personalised test, sent before the final test of the
    # global model, once overwrote nothing by luck of order and left its own scores nowhere): each file's mean is
    # its own table's Dice, and feduq compare pairs both, the personalised one under "<label> (personalised)"
    from feduq.commands.research.compare import archive_run, per_image_scores

    sites = [s for s in table if s not in ("Avg", "Std")]
    for name, scores in (("global", table), ("personalised", rows)):
        for site in sites:
            path = ws / site / "simulate_job" / ("" if name == "global" else "personalised") / "per_image_test.csv"
            with open(path) as f:
                dice = [float(r["dice"]) for r in csv.DictReader(f)]
            assert len(dice) == int(float(scores[site]["num_images"])) > 0
            assert float(scores[site]["dice"]) == pytest.approx(sum(dice) / len(dice), abs=1e-5), (name, site)
    archive_run(ws, tmp_path / "archive")  # the archived run pairs as the run itself
    for folder in (ws, tmp_path / "archive"):
        paired = per_image_scores("graphfedseg", "graphfedseg", 0, folder, None)
        by_method = {m: [r for r in paired if r["method"] == m] for m in ("graphfedseg", "graphfedseg (personalised)")}
        assert len(paired) == sum(map(len, by_method.values())) == 2 * sum(int(float(table[s]["num_images"])) for s in sites)
        for m, scores in zip(by_method, (table, rows)):
            for site in sites:
                dice = [r["dice"] for r in by_method[m] if r["site"] == site]
                assert float(scores[site]["dice"]) == pytest.approx(sum(dice) / len(dice), abs=1e-5), (m, site)


def test_server_v_i_and_site_alignment_use_floating_entries_only_on_a_batchnorm_network():
    """3 sites with Conv + BatchNorm whose num_batches_tracked are 10, 1000 and 100000: the v_i the server sends and
    the alignment term the site adds run over the same sorted floating entries, equal a hand computation and do not
    move with the counts (the server's own cosine already skipped integer keys). Measured before the fix, when both
    ran over every state-dict key: the counts were 95.5 % / 99.9996 % / 99.99999995 % of sites x / y / z's squared
    norms (floating ||theta||^2 ~ 4.3-4.7), site x's v_i had 29 entries, its count entry 0.989 of a norm 0.994, and
    the alignment term was -0.0098875 (-0.0098863 once x's count changed); after it: 28 entries, norm 0.957, and
    -0.0093014 whatever the counts."""
    from types import SimpleNamespace

    import torch

    from feduq.methods.graphfedseg import GraphFedSegSite

    def site_net(seed, batches):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
        with torch.no_grad():
            net[1].running_mean.uniform_(-0.1, 0.1)
            net[1].running_var.uniform_(0.9, 1.1)
        net[1].num_batches_tracked.fill_(batches)
        return net

    nets = {s: site_net(i, n) for i, (s, n) in enumerate((("x", 10), ("y", 1000), ("z", 100000)))}
    locals_ = {s: {k: v.detach().numpy().copy() for k, v in m.state_dict().items()} for s, m in nets.items()}
    assert locals_["z"]["1.num_batches_tracked"].dtype == np.int64
    keys = ["0.bias", "0.weight", "1.bias", "1.running_mean", "1.running_var", "1.weight"]  # floating, sorted
    flat = {s: np.concatenate([m[k].ravel().astype(np.float64) for k in keys]) for s, m in locals_.items()}
    assert flat["x"].size == 28
    graph = {"sites": ["x", "y", "z"], "W": [[0.5, 0.3, 0.2], [0.2, 0.6, 0.2], [0.1, 0.1, 0.8]]}
    glob = {k: v.copy() for k, v in locals_["x"].items()}

    ctl = GraphFedSegServer()
    v = _payload(ctl, glob, "x", graph, locals_)[NEIGHBOUR_KEY]
    by_hand = sum(w * flat[s] / np.linalg.norm(flat[s]) for w, s in zip(graph["W"][0], "xyz"))
    assert v.dtype == np.float32 and v.shape == (28,)
    np.testing.assert_allclose(v, by_hand, rtol=1e-6, atol=1e-9)
    recounted = {s: {**m, "1.num_batches_tracked": np.array(7, np.int64)} for s, m in locals_.items()}
    np.testing.assert_array_equal(_payload(ctl, glob, "x", graph, recounted)[NEIGHBOUR_KEY], v)

    site_part = GraphFedSegSite(lam1=0.01, align_sign=1)  # the site part alone: no data, no executor
    assert site_part.receive({"w": 1, NEIGHBOUR_KEY: v}) == {"w": 1}  # the site takes its v_i out of the payload
    term = site_part.regularizer(SimpleNamespace(model=nets["x"]))
    value = term(nets["x"])
    expected = -0.01 * float(v.astype(np.float64) @ flat["x"]) / np.linalg.norm(flat["x"])
    assert float(value.detach()) == pytest.approx(expected, rel=1e-5)
    value.backward()
    assert nets["x"][0].weight.grad is not None and nets["x"][0].weight.grad.abs().sum() > 0
    nets["x"][1].num_batches_tracked.fill_(123456789)
    assert float(term(nets["x"]).detach()) == float(value.detach())
