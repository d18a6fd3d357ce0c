"""The quorum on real simulator runs (4 polyp sites, 32 px): a job stops at once, with every failed
site's reason, when fewer than ``min_clients`` sites can answer, and finishes when enough can.

Each test fails if its guard is removed: without the site's error reply the server never learns
why; without the quorum the job runs its rounds on nothing and ends "successfully"; without
reading the outcome from the workspace ``nvflare simulator`` exits 0.
"""

import json
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import REPO, read_table, run_simulator, small_job
from feduq.recipes.outcome import simulator_outcome

pytestmark = pytest.mark.sim
SITES = ["Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"]


def _failed_record(ws):
    lines = re.findall(r"FEDUQ_JOB_FAILED (\{.*\})", (ws / "server" / "log.txt").read_text())
    assert lines, "the server never logged FEDUQ_JOB_FAILED"
    return json.loads(lines[0])


@pytest.mark.timed
@pytest.mark.parametrize("method", ["graphfedseg"])  # one round loop for all methods; graphfedseg: a payload per site
def test_every_site_failing_at_setup_stops_the_job_with_their_errors(tmp_path, data_root, method):
    """Each center folder is there (so the pre-flight check passes) but holds no images: every site
    fails at start-up inside FLARE. The job must stop in round 0 with a non-zero exit code and print
    each site's own error, not run its rounds and report success."""
    bad_root = tmp_path / "data"
    for site in SITES:
        (bad_root / "polyp" / site).mkdir(parents=True)
        shutil.copy(data_root / "polyp" / site / "labels.json", bad_root / "polyp" / site / "labels.json")
    job = small_job(method, tmp_path / "job", num_rounds=5)
    ws = tmp_path / "ws"
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "feduq", "simulate", str(job), "-w", str(ws),
                           "--data-root", str(bad_root), "--log", str(tmp_path / "sim.log")],
                          capture_output=True, text=True, timeout=300)
    elapsed = time.time() - t0
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert elapsed < 60, f"the failed job took {elapsed:.0f} s to stop"
    for site in SITES:  # every site's own first error is printed
        assert re.search(rf"{re.escape(site)}.*site '{re.escape(site)}'", proc.stdout), proc.stdout[-3000:]
    record = _failed_record(ws)
    assert record["reason"].startswith("round 0 task 'train'")
    assert "but the job needs 4" in record["reason"]
    server_log = (ws / "server" / "log.txt").read_text()
    assert not re.search(r"\w+ round 1 started", server_log)  # stopped in round 0
    assert not (ws / "server" / "simulate_job" / "results").exists()


@pytest.mark.timed
def test_min_clients_3_of_4_survives_one_failing_site_and_stops_at_two(tmp_path, data_root):
    one = [{"site": "ETIS-LaribPolypDB", "kind": "setup"}]
    ws = tmp_path / "one"
    run_simulator("fedavg", ws, data_root, executor="feduq.testing.faults.FaultyExecutor", min_clients=3,
                  executor_args={"faults": one})
    outcome = simulator_outcome(ws)
    assert outcome.ok, outcome.summary()
    assert set(read_table(ws)) == set(SITES[:3]) | {"Avg", "Std"}  # the failed site is not in the table
    log = (ws / "server" / "log.txt").read_text()
    assert log.count("aggregated 3 site(s)") == 2  # both rounds, with the three healthy sites
    assert "site 'ETIS-LaribPolypDB' failed its task: setup failed: site 'ETIS-LaribPolypDB': injected setup failure" in log

    two = one + [{"site": "CVC-ClinicDB", "kind": "setup"}]
    ws2 = tmp_path / "two"
    t0 = time.time()
    run_simulator("fedavg", ws2, data_root, executor="feduq.testing.faults.FaultyExecutor", min_clients=3,
                  executor_args={"faults": two})
    assert time.time() - t0 < 60
    outcome = simulator_outcome(ws2)
    assert not outcome.ok
    record = _failed_record(ws2)
    assert record["reason"].startswith("round 0 task 'train': 2 of 4 sites failed, so at most 2 can answer, "
                                       "but the job needs 3")
    assert record["sites"] == {s: f"setup failed: site '{s}': injected setup failure"
                               for s in ("CVC-ClinicDB", "ETIS-LaribPolypDB")}
    assert "aggregated" not in (ws2 / "server" / "log.txt").read_text()  # no round was completed


def test_a_hand_edited_job_stops_at_start_up_with_the_configure_message(tmp_path, data_root):
    """A typo written into a job by hand (not through feduq configure) stops the job before round 0,
    and the server gives the message feduq configure gives for the same setting."""
    job = small_job("fedevi", tmp_path / "job")
    path = job / "app" / "config" / "config_fed_client.json"
    cfg = json.loads(path.read_text())
    cfg["executors"][0]["executor"]["args"]["klweight"] = 1
    path.write_text(json.dumps(cfg))
    ws = tmp_path / "ws"
    proc = subprocess.run([sys.executable, "-m", "feduq", "simulate", str(job), "-w", str(ws),
                           "--data-root", str(data_root), "--log", str(tmp_path / "sim.log")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    message = ("client executor 'executor' (feduq.flare.executor.FedUQExecutor): unknown argument 'klweight'; "
               "did you mean 'kl_weight'?")
    assert f"FAILED: invalid job configuration: {message}" in proc.stdout
    assert _failed_record(ws)["reason"] == f"invalid job configuration: {message}"
    assert "FedEvi round 0 started" not in (ws / "server" / "log.txt").read_text()
    from feduq.recipes.job_folders import configure
    from feduq.jobs.jobcheck import JobConfigError

    with pytest.raises(JobConfigError) as err:  # the same setting through the tool: the same message
        configure(REPO / "jobs" / "fedevi", tmp_path / "again", executor_args={"klweight": 1})
    assert str(err.value) == message


def test_the_final_test_leaves_out_a_result_computed_in_another_sites_place(tmp_path):
    """FLARE's simulator once ran site a's test in site b's process: b's answer names a (feduq_site). The table holds
    a's row only, b is named with the reason, and with every site required the job fails instead of writing it."""
    from types import SimpleNamespace

    import numpy as np

    from nvflare.apis.fl_context import FLContext
    from nvflare.apis.signal import Signal
    from nvflare.app_common.abstract.fl_model import FLModel
    from nvflare.app_common.abstract.model import ModelLearnableKey

    from conftest import FakeServerEngine
    from feduq.common.wire import FedUQMetaKey
    from feduq.flare.workflows import FinalTestEvaluation

    def final_test(min_clients):
        wf = FinalTestEvaluation(method="fedavg", validate_last=False, min_clients=min_clients)
        wf.fl_ctx, wf.abort_signal, wf.engine = FLContext(), Signal(), FakeServerEngine(["a", "b"])
        wf.persistor = SimpleNamespace(get_model=lambda name, ctx: {ModelLearnableKey.WEIGHTS: {"w": np.zeros(1)}})
        scores = {"dice": 0.5, "hd95": 3.0, "ece": 0.1, "num_images": 2}
        wf.send_model_and_wait = lambda **kw: [
            FLModel(metrics=scores, meta={"client_name": "a", FedUQMetaKey.SITE: "a"}),
            FLModel(metrics=scores, meta={"client_name": "b", FedUQMetaKey.SITE: "a"})]
        wf.get_run_dir = lambda: str(tmp_path / f"run{min_clients}")
        wf.lines, wf.failed_with = [], []
        wf.info = wf.warning = wf.lines.append
        wf.panic = wf.lines.append
        return wf

    wf = final_test(1)
    wf.run()
    table = (tmp_path / "run1" / "results" / "per_client_table.csv").read_text()
    assert "\na," in table and "\nb," not in table
    assert any("site 'b': its test result was computed by site 'a'" in line for line in wf.lines)
    wf = final_test(None)  # every site required: no table, the job fails naming b
    import feduq.flare.workflows as workflows

    failed = []
    original = workflows.fail_job
    workflows.fail_job = lambda component, ctx, reason, sites: failed.append((reason, sites))
    try:
        wf.run()
    finally:
        workflows.fail_job = original
    assert failed and "computed by site 'a'" in failed[0][1]["b"]
    assert not (tmp_path / "runNone" / "results").exists()
