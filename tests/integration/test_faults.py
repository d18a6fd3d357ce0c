"""Faults a real federation has, injected into real simulator runs (polyp sites, 32 px; 4 sites, 2 for the resume tests;
one faulty run read by two tests).

Each test fails if its guard is removed: without the aggregator's finiteness check the NaN update
reaches the global model; without renormalisation over who answered the round raises or stalls;
without resume support the restarted job re-runs round 0 with β⁰.
"""

import csv
import json
import math
import re
import signal
import subprocess
import time

import numpy as np
import pytest
import torch

from conftest import read_table, run_simulator, simulator_process, small_job
from feduq.commands.consortium.resume import resume

pytestmark = pytest.mark.sim
SITES = ["Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"]


def _final_model(ws):
    ckpt = torch.load(ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False)
    return ckpt["model"], ckpt.get("meta_props") or {}


#: the smuggling routes (feduq.testing.faults ROUTES) and the line each is blocked with on its site
SAYS = {"dict_as_scalar": "meta key 'feduq_num_val_samples' is a dict, not a plain number",
        "set_as_scalar": "meta key 'feduq_num_val_samples' is a set, not a plain number",
        "object_0d_array": "meta key 'feduq_num_val_samples' is a ndarray, not a plain number",
        "nested_dxo": "meta key 'feduq_num_val_samples' is a DXO, not a plain number",
        "initial_metrics": "metrics key 'val_dice' is a ndarray, not a plain number",
        "header": "header 'current_round' is a ndarray",
        "beside_the_dxo": "the result carries ['image'] beside its DXO",
        "dxo_field": "the DXO carries fields ['image']",
        "ok_without_dxo": "the result carries ['image'] beside its DXO"}
SMUGGLERS, HONEST = SITES[:3], SITES[3]  # rounds 2-4: three sites smuggle one route each per round, 9 routes in all
ROUTES_OF = {site: list(SAYS)[i::3] for i, site in enumerate(SMUGGLERS)}
SMUGGLING_ROUNDS = [2, 3, 4]


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory, data_root):
    """One 4-site FedAvg run of 5 rounds (4 images per split) that both tests below read: round 0 is complete; in
    round 1 ETIS fails, ClinicDB sends NaN and ColonDB tries to send a per-image Dice list; in rounds 2-4 three sites
    each try one route of smuggling an image a round while ETIS answers honestly. One run for both (they read
    different rounds of it): each failure stays within its own round, which is what the round loop must ensure."""
    faults = [{"site": "ETIS-LaribPolypDB", "round": 1, "kind": "error"},
              {"site": "CVC-ClinicDB", "round": 1, "kind": "nan"},
              {"site": "CVC-ColonDB", "round": 1, "kind": "leak"}]
    faults += [{"site": site, "round": r, "kind": "smuggle", "route": route}
               for site, mine in ROUTES_OF.items() for r, route in zip(SMUGGLING_ROUNDS, mine)]
    ws = tmp_path_factory.mktemp("faulty") / "ws"
    proc = run_simulator("fedavg", ws, data_root, executor="feduq.testing.faults.FaultyExecutor", min_clients=1,
                         num_rounds=5, max_items=4, train_timeout=300, executor_args={"faults": faults})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return ws


def test_fedavg_survives_a_failing_site_a_nan_update_and_a_leak(faulty_run):
    """Round 1: ETIS fails, ClinicDB sends NaN, ColonDB tries to send a per-image Dice list (blocked on the site by
    the privacy ledger, feduq.flare.ledger); only Kvasir-SEG's update reaches the global model."""
    ws = faulty_run
    log = (ws / "server" / "log.txt").read_text()
    assert re.search(r"rejected update: site 'CVC-ClinicDB' parameter '[^']+' has \d+ non-finite", log)
    assert "round 1: aggregated 1 site(s) (answered=['Kvasir-SEG'] " \
           "missing=['CVC-ClinicDB', 'CVC-ColonDB', 'ETIS-LaribPolypDB'], rejected=['CVC-ClinicDB'])" in log
    assert "round 0: aggregated 4 site(s)" in log  # round 0 was complete
    site_log = (ws / "CVC-ColonDB" / "log.txt").read_text()
    assert "FEDUQ_LEDGER_BLOCKED site 'CVC-ColonDB': task 'train' of 'fedavg' would send undeclared meta key " \
           "'per_image_dice'" in site_log
    ledger = list(csv.DictReader(open(ws / "CVC-ColonDB" / "simulate_job" / "privacy_ledger.csv")))
    leaks = [r for r in ledger if r["section"] == "BLOCKED" and "'per_image_dice'" in r["key"]]  # key: the refusal
    assert [r["round"] for r in leaks] == ["1"]
    assert {r["key"] for r in ledger if r["section"] != "model"} == {  # what did leave, every round and the test
        "val_dice", "val_loss", "train_loss", "feduq_num_samples", "feduq_num_val_samples", "NUM_STEPS_CURRENT_ROUND",
        "dice", "hd95", "ece", "num_images", "feduq_site"} | {r["key"] for r in ledger if r["section"] == "BLOCKED"}
    model, meta = _final_model(ws)
    assert all(np.isfinite(np.asarray(v)).all() for v in model.values())
    assert meta["feduq_last_completed_round"] == 4
    assert set(read_table(ws)) == set(SITES) | {"Avg", "Std"}  # every site is still tested at the end


def test_a_site_smuggling_an_image_by_every_route_gets_none_of_it_to_the_server(faulty_run):
    """Three sites each try one smuggling route per round (feduq.testing.faults ROUTES: a dict, a set, a 0-d object array or a
    nested DXO under a declared scalar key, an image in initial_metrics, in a header, beside the DXO, in the DXO's
    fields, a result with return code OK and no DXO). Each is blocked on its site with one line naming the key and
    its type; the server aggregates only the honest site every round, and no result it received carried an array."""
    from feduq.testing.faults import ROUTES

    assert list(SAYS) == list(ROUTES)
    ws = faulty_run
    for site, mine in ROUTES_OF.items():
        site_log = (ws / site / "log.txt").read_text()
        blocked = [line.split("FEDUQ_LEDGER_BLOCKED ", 1)[1] for line in site_log.splitlines()
                   if "FEDUQ_LEDGER_BLOCKED" in line and "'per_image_dice'" not in line]  # not round 1's leak
        assert len(blocked) == len(mine) == 3
        for line, route in zip(blocked, mine):
            assert SAYS[route] in line and f"site {site!r}" in line, (route, line)
        ledger = list(csv.DictReader(open(ws / site / "simulate_job" / "privacy_ledger.csv")))
        smuggled = [r["round"] for r in ledger if r["section"] == "BLOCKED" and "'per_image_dice'" not in r["key"]]
        assert smuggled == [str(r) for r in SMUGGLING_ROUNDS]
    log = (ws / "server" / "log.txt").read_text()
    for r in SMUGGLING_ROUNDS:
        assert f"round {r}: aggregated 1 site(s) (answered=[{HONEST!r}] missing={sorted(SMUGGLERS)!r}" in log, r
    model, _ = _final_model(ws)
    assert all(np.isfinite(np.asarray(v)).all() for v in model.values())


@pytest.mark.timed
def test_a_killed_site_ends_each_task_within_the_timeout_and_is_named(tmp_path, data_root):
    """Kvasir-SEG's simulator process is killed as round 0 starts: with the task timeout (configure_job's
    train_timeout sets the round's and the final test's), the run does not wait forever: round 0, the last validation
    and the test each end after 30 s naming the site, CVC-ClinicDB's table is written, and the simulator exits.
    (30 s: round 0's timeout counts the site's start-up too; with the second pass's other stream beside it, the live
    site answered round 0 after 11.5 s.)"""
    import psutil

    sites = ["Kvasir-SEG", "CVC-ClinicDB"]
    job = small_job("fedavg", tmp_path / "job", sites=sites, num_rounds=1, max_items=4, min_clients=1,
                    train_timeout=30)
    ws = tmp_path / "ws"
    t0 = time.monotonic()
    proc = simulator_process(job, ws, data_root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        killed = []
        while proc.poll() is None and time.monotonic() - t0 < 240:
            log = ws / "server" / "log.txt"
            if not killed and log.is_file() and "FedAvg round 0 started" in log.read_text():
                for child in psutil.Process(proc.pid).children(recursive=True):
                    if "simulator_worker" in " ".join(child.cmdline()) and "Kvasir-SEG" in child.cmdline():
                        child.kill()
                        killed.append(child.pid)
            time.sleep(0.2)
        elapsed = time.monotonic() - t0
        assert proc.poll() is not None, "the run still waits for the killed site"
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    assert len(killed) == 1 and elapsed < 200
    log = (ws / "server" / "log.txt").read_text()
    assert "round 0 task 'train': no valid answer from ['Kvasir-SEG']; continuing" in log
    assert "no test result from ['Kvasir-SEG']; they are left out of the table" in log
    assert set(read_table(ws)) == {"CVC-ClinicDB", "Avg", "Std"}


@pytest.mark.timed
def test_a_site_killed_mid_round_is_noticed_in_seconds_with_the_committed_timeouts(tmp_path, data_root):
    """Issue 53: a site process killed with SIGKILL (a crash, the OOM killer) in round 2, with the committed task
    timeout (3600 s) and every site required: the server names it gone after 40 s of silence
    (feduq.flare.liveness), the quorum fails naming it, and the run ends within 120 s of the kill instead of an hour."""
    import psutil

    job = small_job("fedavg", tmp_path / "job", sites=["Kvasir-SEG", "CVC-ClinicDB"], num_rounds=30, max_items=4)
    assert json.loads((job / "app" / "config" / "config_fed_server.json").read_text())["workflows"][0]["args"][
        "train_timeout"] == 3600
    ws = tmp_path / "ws"
    proc = simulator_process(job, ws, data_root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed_at = None
    try:
        t0 = time.monotonic()
        while proc.poll() is None and time.monotonic() - t0 < 400:
            log = ws / "server" / "log.txt"
            if killed_at is None and log.is_file() and "FedAvg round 2 started" in log.read_text():
                for child in psutil.Process(proc.pid).children(recursive=True):
                    if "simulator_worker" in " ".join(child.cmdline()) and "CVC-ClinicDB" in child.cmdline():
                        child.kill()
                        killed_at = time.monotonic()
            if killed_at is not None and time.monotonic() - killed_at > 150:
                break
            time.sleep(0.2)
        ended = proc.poll() is not None
        waited = time.monotonic() - (killed_at or t0)
    finally:
        if proc.poll() is None:
            for child in psutil.Process(proc.pid).children(recursive=True):
                child.kill()
            proc.kill()
    assert killed_at is not None, "round 2 never started"
    assert ended and waited < 120, f"the run still waited for the killed site {waited:.0f} s after the kill"
    log = (ws / "server" / "log.txt").read_text()
    assert "FEDUQ_SITE_GONE site 'CVC-ClinicDB': no sign of life for 4" in log
    failed = json.loads(re.search(r"FEDUQ_JOB_FAILED (\{.*\})", log).group(1))
    assert "CVC-ClinicDB" in failed["sites"] and "its process is gone" in failed["sites"]["CVC-ClinicDB"]


def test_site_watch_names_a_silent_site_and_cancels_only_when_every_waited_site_is_gone():
    from feduq.flare.liveness import SiteWatch

    now = [0.0]
    watch = SiteWatch(lambda gone, cancel: None, silent_s=40, clock=lambda: now[0])
    watch.heard("A")
    watch.heard("B")
    watch.expect(["A", "B"])
    now[0] = 30.0
    watch.heard("A")
    assert watch.check() == ({}, False)
    now[0] = 41.0  # B silent since the task started 41 s ago; A heard 11 s ago
    gone, cancel = watch.check()
    assert list(gone) == ["B"] and "no sign of life for 41 s" in gone["B"] and not cancel  # A is still working
    assert watch.check() == ({}, False)  # named once
    watch.answered("A")
    assert watch.check() == ({}, True)  # only gone sites left: the task ends now
    watch.expect(["A"])  # the next task: silence counts from its start, not from before
    now[0] = 60.0
    assert watch.check() == ({}, False)
    watch.done()
    now[0] = 1000.0
    assert watch.check() == ({}, False)  # no task waits


def test_the_watch_is_off_in_a_simulator_whose_sites_take_turns(monkeypatch):
    from feduq.flare.liveness import CONCURRENT_ENV, watch_enabled

    monkeypatch.delenv(CONCURRENT_ENV, raising=False)
    assert watch_enabled(simulate_mode=False) and not watch_enabled(simulate_mode=True)
    monkeypatch.setenv(CONCURRENT_ENV, "1")
    assert watch_enabled(simulate_mode=True)


@pytest.mark.timed
def test_fedevi_survives_a_timed_out_site_and_a_nan_update(tmp_path, data_root):
    """Round 1: Kvasir-SEG sleeps past the task timeout and ClinicDB sends NaN; the surrogate goes to the two that
    answered and the failed sites keep their β. The timeout is 60 s because round 0's counts the 4 sites' start-up
    too: with the second pass's other stream beside it, all four answered round 0 30.1-30.6 s after it began."""
    faults = [{"site": "Kvasir-SEG", "round": 1, "kind": "sleep", "seconds": 75},
              {"site": "CVC-ClinicDB", "round": 1, "kind": "nan"}]
    ws = tmp_path / "ws"
    proc = run_simulator("fedevi", ws, data_root, executor="feduq.testing.faults.FaultyExecutor", min_clients=2,
                         train_timeout=60, executor_args={"faults": faults})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = (ws / "server" / "log.txt").read_text()
    assert re.search(r"rejected update: site 'CVC-ClinicDB' parameter '[^']+' has \d+ non-finite", log)
    assert "round 1 task 'train': no valid answer from ['CVC-ClinicDB', 'Kvasir-SEG']; continuing" in log
    betas = {b["round"]: b for b in map(json.loads, re.findall(r"FEDEVI_BETA (\{.*\})", log))}
    b0, b1 = betas[0]["beta"], betas[1]["beta"]
    assert sorted(betas[1]["G"]) == ["CVC-ColonDB", "ETIS-LaribPolypDB"]  # the surrogate went to who answered
    assert b1["Kvasir-SEG"] == pytest.approx(b0["Kvasir-SEG"]) and b1["CVC-ClinicDB"] == pytest.approx(b0["CVC-ClinicDB"])
    # the others shared the rest (the log rounds each β to 6 decimals: each sum of 4 is within 2e-6 of the true one)
    assert sum(b1.values()) == pytest.approx(sum(b0.values()), abs=4e-6)
    model, _ = _final_model(ws)
    assert all(np.isfinite(np.asarray(v)).all() for v in model.values())


@pytest.mark.timed  # waits on the log with a deadline and kills a job mid-round: run alone, not beside another job
def test_fedevi_resumes_after_the_server_is_killed(tmp_path, data_root):
    job = small_job("fedevi", tmp_path / "job_fedevi", num_rounds=3, sites=SITES[:2])
    ws = tmp_path / "ws"
    proc = simulator_process(job, ws, data_root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    server_log, deadline = ws / "server" / "log.txt", time.time() + 400
    try:
        while time.time() < deadline and proc.poll() is None:
            if server_log.is_file() and "FedEvi round 2 started" in server_log.read_text():
                break
            time.sleep(0.5)
        else:
            tail = server_log.read_text()[-4000:] if server_log.is_file() else "(no server log)"
            pytest.fail(f"the first run never reached round 2 (exit code {proc.poll()}); the server log ends:\n{tail}")
    finally:
        import os

        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # the whole job dies, server included, mid-round
        proc.wait()
    killed_log = server_log.read_text()
    assert "FedEvi finished" not in killed_log
    beta_at_kill = [json.loads(m) for m in re.findall(r"FEDEVI_BETA (\{.*\})", killed_log)][-1]
    assert beta_at_kill["round"] == 1

    checkpoint = ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt"
    meta = resume(job, checkpoint, tmp_path / "job_resumed")
    assert meta["feduq_last_completed_round"] == 1
    ws2 = tmp_path / "ws2"
    proc2 = simulator_process(tmp_path / "job_resumed", ws2, data_root, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE)
    out, err = proc2.communicate(timeout=400)
    log = (ws2 / "server" / "log.txt").read_text() if (ws2 / "server" / "log.txt").is_file() else "(no server log)"
    errors = "\n".join(line for line in log.splitlines() if "ERROR" in line or "FEDUQ_JOB_FAILED" in line)
    assert proc2.returncode == 0, f"stdout:\n{out[-2500:]}\nstderr:\n{err[-1500:]}\nserver log errors:\n{errors[-3000:]}"
    assert "resuming FedEvi at round 2" in log
    assert re.findall(r"FedEvi round (\d+) started", log) == ["2"]  # same total: rounds 0, 1 before; 2 now
    betas = [json.loads(m) for m in re.findall(r"FEDEVI_BETA (\{.*\})", log)]
    assert [b["round"] for b in betas] == [2]  # no β⁰ re-initialisation: β continued from the checkpoint
    model, meta2 = _final_model(ws2)
    assert meta2["feduq_last_completed_round"] == 2
    assert (ws2 / "server" / "simulate_job" / "results" / "per_client_table.csv").is_file()


def test_fedavg_resumes_from_a_checkpoint(tmp_path, data_root):
    ws = tmp_path / "ws"
    assert run_simulator("fedavg", ws, data_root, num_rounds=2, sites=SITES[:2]).returncode == 0
    job = small_job("fedavg", tmp_path / "job_fedavg3", num_rounds=3, sites=SITES[:2])
    resume(job, ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", tmp_path / "job_resumed")
    ws2 = tmp_path / "ws2"
    proc = simulator_process(tmp_path / "job_resumed", ws2, data_root, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, err = proc.communicate(timeout=400)
    assert proc.returncode == 0, err[-3000:]
    log = (ws2 / "server" / "log.txt").read_text()
    assert "resuming FedAvg at round 2" in log
    assert re.findall(r"FedAvg round (\d+) started", log) == ["2"]
    _, meta = _final_model(ws2)
    assert meta["feduq_last_completed_round"] == 2
    # the best model of the whole job: the first run's record (round 1, or 2: its last model, validated after the
    # final round; FLARE skips round 0) set the bar for the resumed rounds
    first = json.loads((ws / "server" / "simulate_job" / "app_server" / "best_model_selection.json").read_text())
    assert first["round"] in (1, 2)
    assert f"restored best global model of round {first['round']}" in log
    final = json.loads((ws2 / "server" / "simulate_job" / "app_server" / "best_model_selection.json").read_text())
    assert final["metric"] >= first["metric"]
    assert (final["round"] == first["round"]) == (final["metric"] == first["metric"])
    best1 = torch.load(ws / "server" / "simulate_job" / "app_server" / "best_FL_global_model.pt", weights_only=False)
    best2 = torch.load(ws2 / "server" / "simulate_job" / "app_server" / "best_FL_global_model.pt", weights_only=False)
    same = all(torch.equal(torch.as_tensor(best1["model"][k]), torch.as_tensor(best2["model"][k])) for k in best1["model"])
    assert same == (final["round"] == first["round"])


def test_best_model_selector_record_and_restore(tmp_path):
    """The record written at a new best is what a resumed run restores, with the best checkpoint."""
    from feduq.flare.selection import SELECTION_RECORD, BestModelSelector

    first = tmp_path / "run1" / "app_server"
    first.mkdir(parents=True)
    (first / "best_FL_global_model.pt").write_bytes(b"best-of-round-3")
    sel = BestModelSelector(key_metric="val_dice")
    sel.best_val_metric, sel.best_raw_val_metric, sel.best_round = 0.625, 0.625, 3
    sel.write_record(first)
    assert json.loads((first / SELECTION_RECORD).read_text()) == {
        "round": 3, "metric": 0.625, "raw_metric": 0.625, "key_metric": "val_dice"}

    resumed = BestModelSelector(key_metric="val_dice", resume_from=str(first))
    assert resumed.best_val_metric == -math.inf
    second = tmp_path / "run2" / "app_server"
    assert resumed.restore(second)
    assert resumed.best_val_metric == 0.625 and resumed.best_round == 3
    assert (second / "best_FL_global_model.pt").read_bytes() == b"best-of-round-3"
    assert json.loads((second / SELECTION_RECORD).read_text())["round"] == 3

    assert not BestModelSelector(key_metric="val_dice", resume_from=str(tmp_path / "nowhere")).restore(tmp_path / "r3")
    with pytest.raises(ValueError, match="key_metric='val_dice'.*'val_auc'"):
        BestModelSelector(key_metric="val_auc", resume_from=str(first)).restore(tmp_path / "r4")


def test_a_silent_site_whose_simulator_process_runs_is_busy_not_gone(tmp_path):
    """A site starved of CPU misses its heartbeats but its process runs: not named (a CT sweep once lost a run so);
    once its process has ended, it is. ``simulator_site_alive`` finds a simulator's site process by its FLARE
    arguments, and not another simulation's site of the same name."""
    import subprocess
    import sys

    from feduq.flare.liveness import SIMULATOR_WORKER, SiteWatch, simulator_site_alive

    def worker(site, root):  # a process with the arguments FLARE's simulator gives a site's worker
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "-m", SIMULATOR_WORKER, "-o",
                                 str(root / site), "--client", site, "--simulator_root", str(root)])

    mine, theirs = tmp_path / "sim", tmp_path / "other-sim"
    procs = [worker("A", mine), worker("B", theirs)]
    try:
        alive = simulator_site_alive(mine)
        deadline = time.time() + 10
        while alive("A") is not True and time.time() < deadline:
            time.sleep(0.1)
        assert alive("A") is True and alive("B") is False and alive("C") is False
        now = [0.0]
        watch = SiteWatch(lambda gone, cancel: None, silent_s=40, clock=lambda: now[0], alive=alive)
        watch.expect(["A"])
        now[0] = 41.0
        assert watch.check() == ({}, False)  # silent, but its process runs
        procs[0].kill()
        procs[0].wait()
        gone, cancel = watch.check()
        assert list(gone) == ["A"] and "its process is gone" in gone["A"] and cancel
    finally:
        for p in procs:
            p.kill()
            p.wait()
