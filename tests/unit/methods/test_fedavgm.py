"""FedAvgM (server momentum, Hsu et al. 2019): a method added as one module (feduq.methods.fedavgm) and one
registration; its fusion by hand, FedAvg as its β = 0, η = 1 case, the momentum carried through a resume."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import REPO
from feduq.core.aggregation import weighted_average
from feduq.common.wire import FedUQMetaKey
from feduq.methods.fedavgm import MOMENTUM_FILE, FedAvgMServer
from feduq.parts.server import Answer


def _answers():
    n = FedUQMetaKey.NUM_SAMPLES
    return {"A": Answer("A", {"w": np.array([0.0, 0.0], np.float32), "count": np.array([4])}, {n: 1}),
            "B": Answer("B", {"w": np.array([2.0, 4.0], np.float32), "count": np.array([8])}, {n: 3})}


def _fed(tmp_path):
    return SimpleNamespace(run_dir=tmp_path, warnings=[], warn=lambda line: None)


def test_two_rounds_by_hand(tmp_path):
    """θ0 = (1, 2); the N_k-weighted average of (0, 0)·1 and (2, 4)·3 is θ̄ = (1.5, 3). β = 0.5, η = 2:
    round 1: Δ = θ0 − θ̄ = (−0.5, −1), v = Δ, θ1 = θ0 − 2v = (2, 4); round 2: Δ = θ1 − θ̄ = (0.5, 1),
    v = 0.5·(−0.5, −1) + (0.5, 1) = (0.25, 0.5), θ2 = θ1 − 2v = (1.5, 3). Counters take the average (4·1 + 8·3)/4 = 7."""
    server, fed = FedAvgMServer(server_lr=2.0, momentum=0.5), _fed(tmp_path)
    server.start(fed, {}, ["A", "B"], None)
    theta = {"w": np.array([1.0, 2.0], np.float32), "count": np.array([0])}
    theta, weights = server.fuse(fed, _answers(), theta)
    assert weights == {"A": 0.25, "B": 0.75}
    np.testing.assert_allclose(theta["w"], [2.0, 4.0])
    assert theta["w"].dtype == np.float32 and theta["count"].tolist() == [7]
    theta, _ = server.fuse(fed, _answers(), theta)
    np.testing.assert_allclose(theta["w"], [1.5, 3.0])
    np.testing.assert_allclose(server.velocity["w"], [0.25, 0.5])


def test_no_momentum_and_unit_step_is_fedavg(tmp_path):
    server, fed = FedAvgMServer(server_lr=1.0, momentum=0.0), _fed(tmp_path)
    server.start(fed, {}, ["A", "B"], None)
    theta = {"w": np.array([7.0, -3.0], np.float32), "count": np.array([0])}
    fused, _ = server.fuse(fed, _answers(), theta)
    fedavg = weighted_average({s: a.params for s, a in _answers().items()}, {"A": 1, "B": 3})
    for key in fedavg:
        np.testing.assert_allclose(fused[key], fedavg[key], rtol=0, atol=1e-6)


def test_the_momentum_survives_a_resume_through_its_file(tmp_path):
    """After a round the buffer is in the run folder and the checkpoint state names it; a new server part started
    from that state continues with the same v (the second round gives what the uninterrupted server gives)."""
    server, fed = FedAvgMServer(server_lr=2.0, momentum=0.5), _fed(tmp_path)
    server.start(fed, {}, ["A", "B"], None)
    theta, _ = server.fuse(fed, _answers(), {"w": np.array([1.0, 2.0], np.float32), "count": np.array([0])})
    server.after_round(fed, theta, ["A", "B"])
    state = json.loads(json.dumps(server.state()))  # what the checkpoint meta holds
    assert state == {"file": str(tmp_path / MOMENTUM_FILE)}
    resumed = FedAvgMServer(server_lr=2.0, momentum=0.5)
    resumed.start(fed, theta, ["A", "B"], state)
    a, _ = server.fuse(fed, _answers(), dict(theta))
    b, _ = resumed.fuse(fed, _answers(), dict(theta))
    np.testing.assert_array_equal(a["w"], b["w"])
    lost = FedAvgMServer()
    lost.start(fed, theta, ["A", "B"], {"file": str(tmp_path / "gone.npz")})  # warned, restarts at 0
    assert lost.velocity == {}


@pytest.mark.parametrize("kwargs, message", [({"momentum": 1.0}, "momentum must be finite and >= 0.0 and < 1.0"),
                                             ({"server_lr": 0}, "server_lr must be > 0"),
                                             ({"momentum": -0.1}, "momentum")])
def test_bad_settings_are_refused_when_the_job_is_built(kwargs, message):
    from feduq.jobs.jobcheck import JobConfigError
    from feduq.recipes.recipe import FedUQRecipe

    with pytest.raises(ValueError, match=message):
        FedAvgMServer(**kwargs)
    with pytest.raises(JobConfigError, match=r"FedUQController\): FedAvgM: "):
        FedUQRecipe("fedavgm", workflow_args=kwargs)


def test_the_registration_is_the_whole_job():
    """One registration gives the committed job: FedUQ's executor and controller, the server part with its
    arguments, FedAvg's sites and ledger."""
    server = json.loads((REPO / "jobs" / "fedavgm" / "app" / "config" / "config_fed_server.json").read_text())
    args = server["workflows"][0]["args"]
    assert server["workflows"][0]["path"] == "feduq.flare.controller.FedUQController"
    assert (args["server_part"], args["server_lr"], args["momentum"]) == ("feduq.methods.fedavgm.FedAvgMServer", 1.0,
                                                                          0.9)
