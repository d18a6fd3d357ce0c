"""FedEvi's round (FedUQController with FedEviServer) with FLARE's exchanges faked (NVFlare fedavg_test pattern).

Three sites a, b, c with N = (2, 1, 1) so β⁰ = (1/2, 1/4, 1/4). Every expected number below is
worked out by hand in the comments.
"""

import numpy as np
import pytest
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from conftest import FakeServerEngine
from feduq.common.wire import FedUQMetaKey, FedUQTask
from feduq.flare.controller import FedUQController
from feduq.flare.workflows import LAST_ROUND

SITES = ["a", "b", "c"]
N = {"a": 2, "b": 1, "c": 1}


def _w(value):
    return {"w": np.array([value], dtype=np.float32)}


class FakeFederation:
    """Answers the controller's tasks from per-round tables and records what it was sent."""

    def __init__(self, theta, u_ale, u_epi):
        self.theta, self.u_ale, self.u_epi = theta, u_ale, u_epi
        self.sent = []  # (round, task, targets, params)

    def __call__(self, task_name, data, targets=None, min_responses=None, timeout=0, **kwargs):
        r = data.current_round
        self.sent.append((r, task_name, list(targets), None if data.params is None else dict(data.params)))
        out = []
        for site in targets:
            if task_name == FedUQTask.TRAIN and site in self.theta[r]:
                meta = {"client_name": site, FedUQMetaKey.NUM_SAMPLES: N[site],
                        FedUQMetaKey.MEAN_ALEATORIC: self.u_ale[r][site]}
                out.append(FLModel(params=_w(self.theta[r][site]), params_type=ParamsType.FULL,
                                   current_round=r, meta=meta, metrics={"val_dice": 0.5}))
            elif task_name == FedUQTask.VALIDATE_SURROGATE and site in self.u_epi[r]:
                out.append(FLModel(metrics={"u_epi": self.u_epi[r][site]},
                                   meta={"client_name": site, FedUQMetaKey.MEAN_EPISTEMIC: self.u_epi[r][site]}))
        return out


def _controller(fed, num_rounds, initial_meta=None, min_clients=2):
    ctl = FedUQController(server_part="feduq.methods.fedevi.FedEviServer", num_rounds=num_rounds,
                          min_clients=min_clients)
    ctl._sites = lambda: list(SITES)
    ctl.failures = []  # (FEDUQ_JOB_FAILED line, panic reason)
    ctl.error = lambda msg: ctl.failures.append(msg) if msg.startswith("FEDUQ_JOB_FAILED") else None
    ctl.log_error = lambda fl_ctx, msg, **kw: ctl.error(msg)
    ctl.system_panic = lambda reason, fl_ctx: ctl.failures.append(("panic", reason))
    ctl.fl_ctx = FLContext()
    ctl.load_model = lambda: FLModel(params=_w(0.0), params_type=ParamsType.FULL, meta=dict(initial_meta or {}))
    ctl.send_model_and_wait = fed
    ctl.broadcast_model = lambda task_name, data, targets, min_responses, **kw: fed(task_name, data, targets)
    ctl.event = lambda *a, **k: None
    ctl.fire_event_with_data = lambda *a, **k: None
    ctl.saved = []
    ctl.engine = FakeServerEngine()
    ctl.save_model = lambda model: ctl.saved.append(
        (dict(model.params), dict(model.meta[FedUQMetaKey.FEDEVI_BETA]), model.meta[LAST_ROUND])
    )
    return ctl


def test_two_rounds_with_a_nan_update_and_hand_computed_beta():
    fed = FakeFederation(
        theta={0: {"a": 1.0, "b": 2.0, "c": 4.0}, 1: {"a": 3.0, "b": 6.0, "c": float("nan")}},
        u_ale={0: {"a": 0.5, "b": 0.25, "c": 0.5}, 1: {"a": 0.5, "b": 0.5, "c": 0.5}},
        u_epi={0: {"a": 0.1, "b": 0.05, "c": 0.2}, 1: {"a": 0.05, "b": 0.1}},
    )
    ctl = _controller(fed, num_rounds=2)
    ctl.run()

    # round 0: surrogate = Σ β⁰θ = 0.5*1 + 0.25*2 + 0.25*4 = 2.0, sent to all three sites
    r0_sur = [s for s in fed.sent if s[0] == 0 and s[1] == FedUQTask.VALIDATE_SURROGATE][0]
    assert r0_sur[2] == SITES
    np.testing.assert_allclose(r0_sur[3]["w"], [2.0], rtol=1e-6)
    # x = G/A = (0.2, 0.2, 0.4); β¹ = (β⁰ + x) / 1.8 = (0.7, 0.45, 0.65) / 1.8
    params0, beta1, last0 = ctl.saved[0]
    assert last0 == 0
    np.testing.assert_allclose([beta1[s] for s in SITES], [0.7 / 1.8, 0.45 / 1.8, 0.65 / 1.8], rtol=1e-6)
    # θ¹ = Σ β¹θ = (0.7*1 + 0.45*2 + 0.65*4) / 1.8 = 2.333333
    np.testing.assert_allclose(params0["w"], [2.3333333], rtol=1e-6)

    # round 1: site c's update is NaN -> rejected; the surrogate only goes to a and b and uses
    # β¹ renormalised over them: (0.388889*3 + 0.25*6) / 0.638889 = 4.173913
    r1_sur = [s for s in fed.sent if s[0] == 1 and s[1] == FedUQTask.VALIDATE_SURROGATE][0]
    assert r1_sur[2] == ["a", "b"]
    np.testing.assert_allclose(r1_sur[3]["w"], [4.173913], rtol=1e-6)
    # a and b share the mass 0.638889 they held: (β + x)/Σ * mass with x = (0.1, 0.2)
    params1, beta2, _ = ctl.saved[1]
    np.testing.assert_allclose([beta2["a"], beta2["b"]], [0.33267587, 0.30621302], rtol=1e-6)
    assert beta2["c"] == pytest.approx(0.65 / 1.8)  # carried forward unchanged
    assert sum(beta2.values()) == pytest.approx(1.0)
    # the global model is finite and ignores c: (0.332676*3 + 0.306213*6) / 0.638889 = 4.437870
    np.testing.assert_allclose(params1["w"], [4.4378698], rtol=1e-6)
    assert ctl.failures == []  # 2 valid updates meet min_clients=2
    # each round's aggregation weights reach experiment tracking as the sites' own records (FLARE's fed event):
    # round 0 β¹, round 1 β² renormalised over the accepted a and b
    tracked = {(site, step): value for _, site, tag, value, step in ctl.engine.tracked if tag == "aggregation_weight"}
    assert {e for e, *_ in ctl.engine.tracked} == {"fed.analytix_log_stats"}
    assert tracked == pytest.approx({("a", 0): 0.7 / 1.8, ("b", 0): 0.25, ("c", 0): 0.65 / 1.8,
                                     ("a", 1): 0.33267587 / 0.63888889, ("b", 1): 0.30621302 / 0.63888889}, rel=1e-5)


def test_every_site_required_a_nan_update_stops_the_job_before_aggregation():
    """min_clients=None: all 3 sites are required; c's NaN update in round 1 leaves 2 -> the job stops."""
    import json

    fed = FakeFederation(
        theta={0: {"a": 1.0, "b": 2.0, "c": 4.0}, 1: {"a": 3.0, "b": 6.0, "c": float("nan")}},
        u_ale={0: {"a": 0.5, "b": 0.25, "c": 0.5}, 1: {"a": 0.5, "b": 0.5, "c": 0.5}},
        u_epi={0: {"a": 0.1, "b": 0.05, "c": 0.2}, 1: {"a": 0.05, "b": 0.1}},
    )
    ctl = _controller(fed, num_rounds=2, min_clients=None)
    ctl.run()
    assert [saved[2] for saved in ctl.saved] == [0]  # round 1 was never aggregated or saved
    assert [s[1] for s in fed.sent if s[0] == 1] == [FedUQTask.TRAIN]  # no surrogate was sent
    line, (kind, reason) = ctl.failures
    assert kind == "panic"
    record = json.loads(line.split(" ", 1)[1])
    assert record["reason"] == reason
    assert reason.startswith("round 1 task 'train': 2 valid answer(s) ['a', 'b'], but the job needs 3")
    assert list(record["sites"]) == ["c"] and "non-finite" in record["sites"]["c"]


def test_a_site_missing_from_the_surrogate_exchange_breaks_a_quorum_of_all():
    fed = FakeFederation(
        theta={0: {"a": 1.0, "b": 1.0, "c": 1.0}},
        u_ale={0: {"a": 0.5, "b": 0.5, "c": 0.5}},
        u_epi={0: {"a": 0.1, "b": 0.1}},  # c trains but never answers validate_surrogate
    )
    ctl = _controller(fed, num_rounds=1, min_clients=None)
    ctl.run()
    assert ctl.saved == []
    assert "task 'validate_surrogate': 2 valid answer(s) ['a', 'b'], but the job needs 3" in ctl.failures[-1][1]
    assert "c: no answer" in ctl.failures[-1][1]


def test_site_without_surrogate_answer_keeps_its_beta():
    fed = FakeFederation(
        theta={0: {"a": 1.0, "b": 1.0, "c": 1.0}},
        u_ale={0: {"a": 0.5, "b": 0.5, "c": 0.5}},
        u_epi={0: {"a": 0.1, "b": 0.1}},  # c trains but never answers validate_surrogate
    )
    ctl = _controller(fed, num_rounds=1)
    ctl.run()
    _, beta1, _ = ctl.saved[0]
    assert beta1["c"] == pytest.approx(0.25)
    # a, b share 0.75: x = (0.2, 0.2) -> (0.5+0.2, 0.25+0.2)/1.15 * 0.75
    np.testing.assert_allclose([beta1["a"], beta1["b"]], [0.7 / 1.15 * 0.75, 0.45 / 1.15 * 0.75], rtol=1e-6)


def test_resume_continues_from_checkpointed_round_and_beta():
    beta = {"a": 0.2, "b": 0.3, "c": 0.5}
    fed = FakeFederation(
        theta={2: {"a": 1.0, "b": 1.0, "c": 1.0}},
        u_ale={2: {"a": 1.0, "b": 1.0, "c": 1.0}},
        u_epi={2: {"a": 0.0, "b": 0.0, "c": 0.0}},
    )
    ctl = _controller(fed, num_rounds=3, initial_meta={FedUQMetaKey.FEDEVI_BETA: beta, LAST_ROUND: 1})
    ctl.run()
    assert [s[0] for s in fed.sent] == [2, 2]  # only round 2 ran
    _, beta3, last = ctl.saved[0]
    assert last == 2
    # G = 0 -> x = 0 -> β unchanged: the restored β, not β⁰ from sample counts, was used
    np.testing.assert_allclose([beta3[s] for s in SITES], [0.2, 0.3, 0.5], rtol=1e-6)


def test_virtual_federation_runs_fedevis_server_part_in_one_process(tmp_path, data_root):
    """The same FedEviServer as the FLARE controller, in feduq virtual: β⁰, one β per round, the
    β it checkpoints is the last logged one, and every site is tested."""
    import json

    from feduq.commands.research import virtual as virtual_federation
    from conftest import small_job

    job = small_job("fedevi", tmp_path / "job", sites=["Kvasir-SEG", "CVC-ColonDB"])
    lines = []
    out = virtual_federation.run(job, data_root, tmp_path / "vf", num_threads=1, log=lines.append)
    betas = [json.loads(line.split(" ", 1)[1]) for line in lines if line.startswith("FEDEVI_BETA ")]
    assert [b["round"] for b in betas] == ["initial", 0, 1]
    assert out["state"] == pytest.approx(betas[-1]["beta"], abs=1e-6) and sum(out["state"].values()) == pytest.approx(1)
    assert set(out["table"]) == {"Kvasir-SEG", "CVC-ColonDB"}
    assert sum(line.startswith("FEDUQ_AGGREGATION ") for line in lines) == 2


def test_a_fault_in_the_methods_server_part_fails_the_job_with_its_reason_and_saves_nothing():
    from feduq.parts.server import ServerPart

    fed = FakeFederation(theta={0: {"a": 1.0, "b": 2.0, "c": 4.0}}, u_ale={0: {"a": 0.5, "b": 0.5, "c": 0.5}},
                         u_epi={0: {}})
    ctl = _controller(fed, num_rounds=1)

    class Broken(ServerPart):
        label = "Broken"

        def fuse(self, fed, answers, global_params):
            raise TypeError("float() argument must be a string or a real number, not 'NoneType'")

    ctl.server = Broken()
    ctl.info = ctl.warning = ctl.exception = lambda msg: None
    ctl.run()
    assert ctl.saved == []
    (kind, reason), = [f for f in ctl.failures if isinstance(f, tuple)]
    assert kind == "panic" and reason == ("Broken: round 0: TypeError: float() argument must be a string or a real "
                                          "number, not 'NoneType'")


def test_virtual_federation_resumes_a_killed_run_from_its_last_round(tmp_path, data_root, capsys):
    """A one-process run stopped after round 0 (its checkpoint written) continues with ``--resume`` from round 1:
    β restored from the checkpoint (not β⁰ again), only round 1 aggregated, and the same final model and β as the
    run that was never stopped. Another job's configuration is refused by name."""
    import json

    import numpy as np
    from feduq.commands.research import virtual as virtual_federation
    from conftest import small_job

    import shutil

    import torch

    job = small_job("fedevi", tmp_path / "job", sites=["Kvasir-SEG", "CVC-ColonDB"])

    def keep_round_0(line):  # the never-stopped run's checkpoint of round 0, kept aside
        if line.startswith("round 0 done"):
            shutil.copy(tmp_path / "whole" / "checkpoint.pt", tmp_path / "whole_round0.pt")

    whole = virtual_federation.run(job, data_root, tmp_path / "whole", num_threads=1, log=keep_round_0)

    class Killed(Exception):
        pass

    def dies_after_round_0(line):
        if line.startswith("round 0 done"):
            raise Killed

    with pytest.raises(Killed):
        virtual_federation.run(job, data_root, tmp_path / "cut", num_threads=1, log=dies_after_round_0)
    cut, kept = (torch.load(p, weights_only=True) for p in (tmp_path / "cut" / "checkpoint.pt", tmp_path / "whole_round0.pt"))
    assert cut["meta"] == kept["meta"] and cut["meta"]["fedevi_beta"]  # round 0 and its β, as the whole run's
    for k, v in kept["model"].items():
        torch.testing.assert_close(cut["model"][k], v, rtol=0, atol=1e-6)
    lines = []
    resumed = virtual_federation.run(job, data_root, tmp_path / "cut", num_threads=1, log=lines.append, resume=True)
    assert any(line.startswith("resumed from") and "continuing with round 1" in line for line in lines)
    assert [json.loads(x.split(" ", 1)[1])["round"] for x in lines if x.startswith("FEDUQ_AGGREGATION ")] == [1]
    assert [json.loads(x.split(" ", 1)[1])["round"] for x in lines if x.startswith("FEDEVI_BETA ")] == [1]  # no β⁰
    assert set(resumed["state"]) == set(whole["state"]) and sum(resumed["state"].values()) == pytest.approx(1.0)
    # (round 1 itself differs a little: the sites' data order restarts with the process, as a restarted FLARE site's)

    other = small_job("fedevi", tmp_path / "other", sites=["Kvasir-SEG", "CVC-ColonDB"], num_rounds=3)
    from feduq.outputs import write_marker

    write_marker(tmp_path / "cut", "feduq virtual")  # as main() leaves its run folder (run() writes none)
    assert virtual_federation.main([str(other), "--data-root", str(data_root), "--out", str(tmp_path / "cut"),
                                    "--resume", "--num-threads", "1"]) == 2
    assert "made with another job config sha256" in capsys.readouterr().err
