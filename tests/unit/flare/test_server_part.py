"""FedUQ's one round loop (feduq.parts.server.run_rounds) with a fake federation, no FLARE: hand-computed
weights, rejection, the quorum, a failing fusion, the method's state in every checkpoint, and K >= 2 for a graph."""

import json

import numpy as np
import pytest

from feduq.common.wire import FedUQMetaKey
from feduq.methods.feda3i import ESTIMATE_NOISE, FEDA3I_WEIGHTS, NOISE_Q, FedA3IServer
from feduq.methods.graphfedseg import GraphFedSegServer
from feduq.parts.server import Answer, ServerPart, Stop, run_rounds


class Fed:
    """Answers ``train`` with ``theta[round][site]`` (N_k from ``n``) and other tasks with ``extra(task, site)``;
    the quorum is every expected site unless ``min_clients``."""

    def __init__(self, theta, n, num_rounds, extra=None, min_clients=None, keys=("w",)):
        self.theta, self.n, self.num_rounds, self.extra, self.min_clients = theta, n, num_rounds, extra, min_clients
        self.keys = keys
        self.round, self.failures, self.lines, self.sent = None, {}, [], []

    def send(self, task, payload, sites, *, own=False, timeout="train_timeout", meta=None, quorum=True):
        self.sent.append((self.round, task, list(sites)))
        if task != "train":
            return {s: Answer(s, meta=self.extra(task, s)) for s in sites}
        return {s: Answer(s, params={k: np.array([self.theta[self.round][s]], np.float32) for k in self.keys},
                          meta={FedUQMetaKey.NUM_SAMPLES: self.n[s]}) for s in sites if s in self.theta[self.round]}

    def require(self, task, expected, valid, rejected):
        need = len(expected) if self.min_clients is None else self.min_clients
        if len(valid) < need:
            raise Stop(f"{task}: {len(valid)} of {need}", dict(rejected))

    def log(self, line):
        self.lines.append(line)

    warn = log


def _run(server, fed, sites, saved):
    def started(r):
        fed.round = r

    return run_rounds(server, fed, {k: np.zeros(1, np.float32) for k in fed.keys}, sites, 0, round_started=started,
                      save=lambda r, params, meta: saved.append((r, dict(params), dict(meta))))


def test_fedavg_round_rejects_a_nan_update_and_logs_hand_computed_weights():
    fed = Fed({0: {"a": 1.0, "b": 4.0, "c": float("nan")}}, {"a": 2, "b": 1, "c": 5}, 1, min_clients=2)
    saved = []
    out = _run(ServerPart(), fed, ["a", "b", "c"], saved)
    assert out["w"][0] == pytest.approx((2 * 1.0 + 1 * 4.0) / 3)  # c's NaN update never reaches the model
    record = json.loads(next(line for line in fed.lines if line.startswith("FEDUQ_AGGREGATION "))[18:])
    assert record == {"round": 0, "weights": {"a": 0.666667, "b": 0.333333}, "missing": ["c"], "rejected": ["c"]}
    assert saved[0][0] == 0 and saved[0][2] == {FedUQMetaKey.LAST_COMPLETED_ROUND: 0,
                                                FedUQMetaKey.SERVER_PART: "feduq.parts.server.ServerPart"}


def test_an_update_computed_by_another_site_is_rejected_not_averaged():
    """FLARE's simulator, on an overloaded host, once ran CVC-ColonDB's task in ETIS's process: the server got two
    answers from ColonDB's data, one under ETIS's name. The site names itself in its answer's meta; a mismatch is
    rejected by name and the model is the other sites' average."""
    class Swapped(Fed):
        def send(self, task, payload, sites, **kwargs):
            answers = super().send(task, payload, sites, **kwargs)
            for s, answer in answers.items():
                answer.meta[FedUQMetaKey.SITE] = "a" if s == "c" else s  # c's process ran a's task
            return answers

    fed = Swapped({0: {"a": 1.0, "b": 4.0, "c": 1.0}}, {"a": 2, "b": 1, "c": 2}, 1, min_clients=2)
    out = _run(ServerPart(), fed, ["a", "b", "c"], [])
    assert out["w"][0] == pytest.approx((2 * 1.0 + 1 * 4.0) / 3)
    assert any("site 'c': the update was computed by site 'a'" in line for line in fed.lines)
    record = json.loads(next(line for line in fed.lines if line.startswith("FEDUQ_AGGREGATION "))[18:])
    assert record["rejected"] == ["c"]


def test_below_the_quorum_or_a_failing_fusion_stops_before_anything_is_saved():
    fed = Fed({0: {"a": 1.0, "b": float("nan")}}, {"a": 1, "b": 1}, 1)  # every site required
    saved = []
    with pytest.raises(Stop, match="train: 1 of 2") as e:
        _run(ServerPart(), fed, ["a", "b"], saved)
    assert "non-finite" in e.value.sites["b"] and saved == []

    class Broken(ServerPart):
        def fuse(self, fed, answers, global_params):
            raise ValueError("site 'a': variance 'w' is negative")

    with pytest.raises(Stop, match=r"round 0: aggregation failed: site 'a': variance 'w' is negative"):
        _run(Broken(), Fed({0: {"a": 1.0}}, {"a": 1}, 1), ["a"], saved)
    assert saved == []


def test_feda3i_estimates_once_after_the_warm_up_and_checkpoints_the_estimate_in_every_later_round():
    q = {"a": [0.5, 0.2], "b": [0.45, 0.25], "c": [0.2, 0.5]}
    theta = {r: {"a": 1.0, "b": 2.0, "c": 3.0} for r in range(3)}
    n = {"a": 1, "b": 1, "c": 2}
    fed = Fed(theta, n, 3, extra=lambda task, s: {NOISE_Q: q[s], FedUQMetaKey.NUM_SAMPLES: n[s]} if task == ESTIMATE_NOISE else {},
              keys=("inc.w", "outc.w"))
    server = FedA3IServer(warmup_rounds=1)
    server.start(fed, {"inc.w": 0, "outc.w": 0}, ["a", "b", "c"], None)
    saved = []
    _run(server, fed, ["a", "b", "c"], saved)
    assert [s[:2] for s in fed.sent if s[1] == ESTIMATE_NOISE] == [(0, ESTIMATE_NOISE)]  # once, after round T1 - 1 = 0
    assert [FEDA3I_WEIGHTS in meta for _r, _p, meta in saved] == [True, True, True]  # a resumed job keeps the estimate
    # round 0 is FedAvg (n = 1, 1, 2): (1 + 2 + 2*3) / 4
    assert saved[0][1]["inc.w"][0] == pytest.approx(9 / 4)
    # after it: inc (j = 1) pure quantity weights n/Σn = (1, 1, 2)/4 again; outc (j = L) pure quality weights w̄
    w_bar = server.state()["w_bar"]
    assert saved[1][1]["inc.w"][0] == pytest.approx(9 / 4)
    assert saved[1][1]["outc.w"][0] == pytest.approx(float(np.dot(w_bar, [1.0, 2.0, 3.0])), rel=1e-6)


def test_a_graph_needs_two_training_sites():
    with pytest.raises(Stop, match=r"GraphFedSeg needs at least 2 training site\(s\), the job has \['a'\]"):
        _run(GraphFedSegServer(), Fed({0: {"a": 1.0}}, {"a": 1}, 1), ["a"], [])


def test_feda3i_resumed_after_the_warm_up_without_an_estimate_estimates_once():
    """A checkpoint of round >= T1 that lacks the estimate (written before it was checkpointed every round) must not
    silently go on as FedAvg: the first resumed round estimates."""
    q = {"a": [0.5, 0.2], "b": [0.45, 0.25], "c": [0.2, 0.5]}
    n = {"a": 1, "b": 1, "c": 2}
    fed = Fed({r: {"a": 1.0, "b": 2.0, "c": 3.0} for r in range(5)}, n, 5, keys=("inc.w", "outc.w"),
              extra=lambda task, s: {NOISE_Q: q[s], FedUQMetaKey.NUM_SAMPLES: n[s]})
    server = FedA3IServer(warmup_rounds=2)
    server.start(fed, {"inc.w": 0, "outc.w": 0}, ["a", "b", "c"], None)
    saved = []
    run_rounds(server, fed, {k: np.zeros(1, np.float32) for k in fed.keys}, ["a", "b", "c"], 3,
               round_started=lambda r: setattr(fed, "round", r), save=lambda r, p, meta: saved.append(meta))
    assert [s[:2] for s in fed.sent if s[1] == ESTIMATE_NOISE] == [(3, ESTIMATE_NOISE)]
    assert all(FEDA3I_WEIGHTS in meta for meta in saved)


def test_graphfedseg_resumed_sends_each_site_the_v_i_it_would_have_sent_without_the_restart(tmp_path):
    """v_i is formed from the previous round's local models, which are not the global model: the checkpoint names the
    file the server wrote them to, so a server started from it sends every site the same v_i as the one that ran on
    (without the file it warns and sends none; loading never unpickles)."""
    from feduq.methods.graphfedseg.parts import LOCAL_MODELS_FILE, NEIGHBOUR_KEY

    class GraphFed(Fed):
        run_dir = tmp_path

        def send(self, task, payload, sites, **kwargs):
            answers = super().send(task, payload, sites, **kwargs)
            for s, a in answers.items():
                a.meta[FedUQMetaKey.MEAN_VACUITY] = {"a": 0.1, "b": 0.3, "c": 0.2}[s]
            return answers

    theta = {r: {"a": 1.0 + r, "b": -2.0 + r, "c": 3.0 - r} for r in range(3)}
    n = {"a": 1, "b": 2, "c": 1}
    fed = GraphFed(theta, n, 3, keys=("w", "v"), extra=lambda task, s: {})  # the personalised test: no scores
    server = GraphFedSegServer()
    server.start(fed, None, ["a", "b", "c"], None)
    saved = []
    global_after = {}

    def save(r, params, meta):
        saved.append(json.loads(json.dumps(meta)))  # what the checkpoint keeps: JSON-able state only
        global_after[r] = dict(params)

    run_rounds(server, fed, {k: np.zeros(1, np.float32) for k in fed.keys}, ["a", "b", "c"], 0,
               round_started=lambda r: setattr(fed, "round", r), save=save)
    state = saved[1][FedUQMetaKey.GRAPH]  # the checkpoint after round 1
    assert state["local_models"] == {"file": str(tmp_path / LOCAL_MODELS_FILE.format(round=1)), "round": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCAL_MODELS_FILE.format(round=r) for r in (1, 2)]

    # what the server sent in round 2, from round 1's local models a = 2, b = -1, c = 2 ...
    reference = GraphFedSegServer()
    reference.graph = {"sites": state["sites"], "W": state["W"]}
    reference.local_models = {s: {k: np.array([theta[1][s]], np.float32) for k in fed.keys} for s in "abc"}
    expected = {s: reference.payload(fed, s, global_after[1])[NEIGHBOUR_KEY] for s in "abc"}
    # ... is what a server started from the checkpoint of round 1 sends
    resumed = GraphFedSegServer()
    resumed.start(fed, global_after[1], ["a", "b", "c"], state)
    for s in "abc":
        np.testing.assert_array_equal(resumed.payload(fed, s, global_after[1])[NEIGHBOUR_KEY], expected[s])
    assert np.abs(expected["b"]).max() > 0
    for damage in ("truncated", "empty", "gone"):
        path = tmp_path / LOCAL_MODELS_FILE.format(round=1)
        if damage == "truncated":
            path.write_bytes(path.read_bytes()[:100])
        elif damage == "empty":
            path.write_bytes(b"")
        else:
            path.unlink()
        lost = GraphFedSegServer()
        lost.start(fed, global_after[1], ["a", "b", "c"], state)
        assert NEIGHBOUR_KEY not in lost.payload(fed, "a", global_after[1]), damage
        assert "cannot read the local models of round 1" in fed.lines[-1] and "sends no v_i" in fed.lines[-1], damage


def test_a_job_names_a_server_part_its_arguments_and_its_timeouts():
    from feduq.flare.controller import FedUQController
    from feduq.jobs.jobcheck import JobConfigError, check_arguments
    from feduq.methods.fedevi import FedEviServer
    from feduq.methods.graphfedseg import GraphFedSegServer

    ctl = FedUQController(server_part="feduq.methods.fedevi.FedEviServer", num_rounds=3, delta=0.5,
                          initial_weights="uniform", surrogate_timeout=7, min_clients=2)
    assert isinstance(ctl.server, FedEviServer)
    assert (ctl.server.config.delta, ctl.server.config.initial) == (0.5, "uniform")  # initial_weights -> initial
    assert (ctl.surrogate_timeout, ctl.num_rounds, ctl.min_clients) == (7, 3, 2)
    # a declared timeout the job leaves out: no limit
    assert FedUQController(server_part="feduq.methods.fedevi.FedEviServer").surrogate_timeout == 0
    graph = FedUQController(server_part="feduq.methods.graphfedseg.GraphFedSegServer", gamma=0.3, send_neighbour=False)
    assert isinstance(graph.server, GraphFedSegServer) and (graph.server.gamma, graph.server.send_neighbour) == (0.3, False)
    assert type(FedUQController().server).__name__ == "ServerPart"  # FedAvg's

    generic = "feduq.flare.controller.FedUQController"
    check_arguments(generic, {"server_part": "feduq.methods.graphfedseg.GraphFedSegServer", "gamma": 0.3,
                              "num_rounds": 2, "min_clients": 2}, "workflow")
    check_arguments(generic, {"server_part": "feduq.methods.fedevi.FedEviServer", "surrogate_timeout": 5,
                              "delta": 1.0}, "workflow")
    for args, message in [
        ({"server_part": "feduq.methods.graphfedseg.GraphFedSegServer", "gama": 0.3}, "did you mean 'gamma'"),
        ({"gamma": 0.3}, "unknown argument 'gamma'"),  # FedAvg's server part takes no gamma
        ({"server_part": "os.path"}, "expected a class in feduq.methods"),
        ({"server_part": "feduq.methods.fedevi.FedEviSite"}, "is not a feduq.parts.server.ServerPart"),
    ]:
        with pytest.raises(JobConfigError, match="workflow") as e:
            check_arguments(generic, args, "workflow")
        assert message in str(e.value), str(e.value)
