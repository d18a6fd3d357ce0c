"""FLARE 2.9's simulator shares one build context among its site threads; FedUQ's entry point
(:mod:`feduq.flare.simulator`) gives each thread its own, so no worker starts under another site's name."""

import pickle
import threading
from types import SimpleNamespace

from nvflare.private.fed.app.simulator.simulator_runner import SimulatorClientRunner

from feduq.flare.simulator import ThreadOwnBuildContext, close_identity_race
from feduq.recipes.simulation import simulator_command


def _sent_names(runner_class) -> dict[str, str]:
    """Two site threads run FLARE's two steps of ``do_one_task`` (write the site's name into the build context, pickle
    it into the worker's message) with the other thread's write in between; returns site -> the name it sent."""
    args = SimpleNamespace(workspace="ws", set=[], threads=2)
    runner = runner_class("", args, [], {}, None, {"client_name": None, "kept": 7})  # FLARE's own __init__
    both_written, sent = threading.Barrier(2), {}

    def one_task(site):
        runner.build_ctx["client_name"] = site  # simulator_runner.py: self.build_ctx["client_name"] = ...
        both_written.wait()
        ctx = pickle.loads(pickle.dumps({"build_ctx": runner.build_ctx}))["build_ctx"]  # conn.send(data)
        assert ctx["kept"] == 7
        sent[site] = ctx["client_name"]

    threads = [threading.Thread(target=one_task, args=(s,)) for s in ("Kvasir-SEG", "CVC-ColonDB")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sent


def test_flares_runner_sends_one_site_name_for_two_sites():
    """The race itself, on FLARE's class: both workers are told the site written last."""
    sent = _sent_names(type("Plain", (SimulatorClientRunner,), {}))
    assert len(set(sent.values())) == 1


def test_each_thread_sends_its_own_site_name_once_the_race_is_closed():
    patched = type("Patched", (SimulatorClientRunner,), {})
    close_identity_race(patched)
    close_identity_race(patched)  # idempotent
    assert isinstance(patched.__dict__["build_ctx"], ThreadOwnBuildContext)
    assert _sent_names(patched) == {"Kvasir-SEG": "Kvasir-SEG", "CVC-ColonDB": "CVC-ColonDB"}
    assert not isinstance(SimulatorClientRunner.__dict__.get("build_ctx"), ThreadOwnBuildContext)  # FLARE's untouched


def test_feduq_runs_the_simulator_through_its_entry_point(tmp_path):
    cmd = simulator_command(tmp_path / "job", tmp_path / "ws", 3)
    assert cmd[1:3] == ["-m", "feduq.flare.simulator"] and cmd[-2:] == ["-t", "3"]
