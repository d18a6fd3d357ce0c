"""Run outcomes (feduq.recipes.outcome) and feduq simulate: a failed or aborted run is reported as failed, with each site's
first error, and a relative or incomplete data root is caught before FLARE starts."""

import json
import os
import re
import subprocess
import sys
import time

import pytest

from conftest import REPO, load_tool, small_job
from feduq.data import DataError, get_task
from feduq.recipes.outcome import check_data_root, poc_outcome, simulator_outcome

POLYP = list(get_task("polyp").centers)
TS = "2026-11-22 13:13:54,052"
SETUP_ERROR = ("FedUQ setup failed: site 'Kvasir-SEG': data root /nonexistent (from $FEDUQ_DATA_ROOT; env var "
               "FEDUQ_DATA_ROOT) does not exist or is not a folder")
# what a site that failed at setup logs (NVFlare 2.9, trimmed): the cause, then its consequences
FAILED_SITE_LOG = f"""\
{TS} - ClientRunner - INFO - [identity=Kvasir-SEG, run=simulate_job] - synced to parent server in 0.55 seconds
{TS} - ArrayConsumer - ERROR - failed to download object with ref a2127114: download aborted after 0.10 secs
{TS} - NumpyArrayDecomposer - ERROR - failed to download from server.simulate_job for source {{'fqcn': 'server'}}
{TS} - Cell - ERROR - exception sending request: RuntimeError: failed to download from server.simulate_job
{TS} - FedAvgExecutor - ERROR - [identity=Kvasir-SEG, run=simulate_job] - {SETUP_ERROR}
Traceback (most recent call last):
  File "executor.py", line 190, in handle_event
{TS} - ClientRunner - ERROR - [identity=Kvasir-SEG, run=simulate_job] - Stopped ClientRunner due to FATAL_SYSTEM_ERROR
"""
HEALTHY_SITE_LOG = f"""\
{TS} - ClientRunner - INFO - [identity=CVC-ClinicDB, run=simulate_job] - client runner started
{TS} - FedAvgExecutor - INFO - [identity=CVC-ClinicDB, run=simulate_job] - FEDUQ_TRAIN {{"round": 0}}
{TS} - ClientRunner - INFO - [identity=CVC-ClinicDB, run=simulate_job] - started end-run events sequence
{TS} - ArrayConsumer - ERROR - failed to download object with ref 08b9343d: download aborted after 0.05 secs
{TS} - ClientRunner - ERROR - [identity=CVC-ClinicDB, run=simulate_job] - task aborted by the server
{TS} - Communicator - ERROR - Error getting task: failed to download from server.simulate_job
"""
SERVER_LOG = f"{TS} - ServerRunner - INFO - [identity=simulator_server, run=simulate_job] - Server runner finished.\n"


def _workspace(tmp_path, table=True, server_log=SERVER_LOG, sites=None):
    ws = tmp_path / "ws"
    results = ws / "server" / "simulate_job" / "results"
    results.mkdir(parents=True)
    (ws / "server" / "log.txt").write_text(server_log)
    for name in ("startup", "local"):
        (ws / name).mkdir()
    (ws / "local" / "log.txt").write_text(f"{TS} - X - ERROR - not a site\n")  # not a site: ignored
    if table:
        (results / "per_client_table.csv").write_text("client,dice\nKvasir-SEG,0.5\nAvg,0.5\nStd,0\n")
    for site, text in (sites or {"Kvasir-SEG": HEALTHY_SITE_LOG.replace("CVC-ClinicDB", "Kvasir-SEG"),
                                 "CVC-ClinicDB": HEALTHY_SITE_LOG}).items():
        (ws / site).mkdir()
        (ws / site / "log.txt").write_text(text)
    return ws


# -- reading a run's outcome -------------------------------------------------------------------------------------------
def test_run_with_table_and_clean_server_log_is_ok(tmp_path):
    ws = _workspace(tmp_path)
    outcome = simulator_outcome(ws)
    assert outcome.ok and outcome.server_error is None and outcome.site_errors == {}
    assert outcome.table == ws / "server" / "simulate_job" / "results" / "per_client_table.csv"
    assert "Results:" in outcome.summary() and str(outcome.table.parent) in outcome.summary()


def test_run_without_table_is_not_ok(tmp_path):
    server = SERVER_LOG + f"{TS} - ScatterAndGather - INFO - [x] - Abort signal received. Exiting at round 0.\n"
    outcome = simulator_outcome(_workspace(tmp_path, table=False, server_log=server))
    assert not outcome.ok and outcome.table is None
    assert "per_client_table.csv" in outcome.server_error and "Exiting at round 0" in outcome.server_error
    assert outcome.summary().startswith("FAILED:")
    assert not simulator_outcome(tmp_path / "absent").ok


def test_job_failed_marker_fails_a_run_that_wrote_a_table(tmp_path):
    record = {"reason": "quorum lost: 1 of 3 required sites left", "sites": {"CVC-ColonDB": "train timed out"}}
    server = SERVER_LOG + f"{TS} - FedEviController - ERROR - [x] - FEDUQ_JOB_FAILED {json.dumps(record)}\n"
    outcome = simulator_outcome(_workspace(tmp_path, server_log=server))
    assert not outcome.ok and outcome.table is not None
    assert outcome.server_error == record["reason"]
    assert outcome.site_errors == {"CVC-ColonDB": "train timed out"}  # the sites of the record are reported
    assert record["reason"] in outcome.summary() and "CVC-ColonDB: train timed out" in outcome.summary()


@pytest.mark.parametrize("line", ["Stopped ClientRunner due to FATAL_SYSTEM_ERROR: boom",
                                  "Exception in ScatterAndGather control_flow: ValueError('x')"])
def test_flare_fatal_errors_fail_the_run(tmp_path, line):
    server = SERVER_LOG + f"{TS} - ServerRunner - ERROR - {line}\n"
    outcome = simulator_outcome(_workspace(tmp_path, server_log=server))
    assert not outcome.ok and outcome.server_error == line


def test_site_error_is_the_cause_not_the_noise(tmp_path):
    ws = _workspace(tmp_path, table=False, sites={"Kvasir-SEG": FAILED_SITE_LOG, "CVC-ClinicDB": HEALTHY_SITE_LOG})
    outcome = simulator_outcome(ws)
    # the setup error, without timestamp/logger/context; the download noise before it and the
    # errors after the end of the run (the healthy site) are skipped
    assert outcome.site_errors == {"Kvasir-SEG": SETUP_ERROR}
    assert f"  Kvasir-SEG: {SETUP_ERROR}" in outcome.summary().splitlines()


def test_a_logged_traceback_is_reported_by_its_exception_line(tmp_path):
    """A site that cannot even build its executor (a hand-edited job) logs a bare traceback (NVFlare 2.9)."""
    log = (f"{TS} - JsonScanner - ERROR - Traceback (most recent call last):\n"
           '  File "class_utils.py", line 41, in instantiate_class\n'
           "TypeError: FedUQExecutor.__init__() got an unexpected keyword argument 'klweight'\n"
           "\nDuring handling of the above exception, another exception occurred:\n")
    outcome = simulator_outcome(_workspace(tmp_path, table=False, sites={"Kvasir-SEG": log}))
    assert outcome.site_errors == {
        "Kvasir-SEG": "TypeError: FedUQExecutor.__init__() got an unexpected keyword argument 'klweight'"}


def test_the_summary_shows_the_servers_first_error(tmp_path):
    """The CPython 3.11.7 AST race: the server fails decoding an update, and writes no table. The summary says why."""
    server = SERVER_LOG + (
        f"{TS} - NumpyArrayDecomposer - ERROR - [identity=simulator_server, run=simulate_job] - Traceback (most "
        f"recent call last):\n  File \"format.py\", line 647, in _read_array_header\n"
        f"SystemError: AST constructor recursion depth mismatch (before=43, after=41)\n")
    outcome = simulator_outcome(_workspace(tmp_path, table=False, server_log=server))
    assert not outcome.ok
    assert outcome.server_first_error == "SystemError: AST constructor recursion depth mismatch (before=43, after=41)"
    lines = outcome.summary().splitlines()
    assert lines[0].startswith("FAILED: no per-client table")
    assert lines[1] == "  server's first error: " + outcome.server_first_error


def test_ast_construction_is_serialised_in_flare_processes():
    """feduq.flare guards ``ast.parse`` on CPython < 3.13: a probe that records how many threads are inside at once
    sees 1 when guarded (and more than 1 without the guard, so the probe can tell); numpy decodes concurrently."""
    import ast
    import io
    import threading

    import numpy as np

    import feduq.flare  # noqa: F401  (installs the guard)
    from feduq.flare.ast_guard import GUARDED_ATTR, guarded, install

    assert getattr(ast.parse, GUARDED_ATTR, False) == (sys.version_info < (3, 13))
    assert install((3, 13, 0)) is False and install((3, 11, 7)) is True

    def peak_concurrency(function):
        state = {"inside": 0, "peak": 0}
        lock = threading.Lock()

        def probe():
            with lock:
                state["inside"] += 1
                state["peak"] = max(state["peak"], state["inside"])
            time.sleep(0.01)
            with lock:
                state["inside"] -= 1

        call = function(probe)
        threads = [threading.Thread(target=lambda: [call() for _ in range(5)]) for _ in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return state["peak"]

    assert peak_concurrency(lambda f: f) > 1 and peak_concurrency(guarded) == 1
    buf = io.BytesIO()
    np.save(buf, np.arange(12, dtype=np.float32).reshape(3, 4))
    errors = []

    def decode():
        try:
            for _ in range(300):
                assert np.load(io.BytesIO(buf.getvalue())).sum() == 66.0
        except Exception as e:  # noqa: BLE001  (collected and asserted below)
            errors.append(repr(e))

    threads = [threading.Thread(target=decode) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert errors == []


def test_failure_marker_at_any_level_is_a_site_error(tmp_path):
    log = f"{TS} - FedAvgExecutor - WARNING - [identity=ETIS] - site 'ETIS': task 'test' failed: out of memory\n"
    outcome = simulator_outcome(_workspace(tmp_path, sites={"ETIS": log}))
    assert outcome.ok and outcome.site_errors == {"ETIS": "site 'ETIS': task 'test' failed: out of memory"}


def test_poc_outcome_reads_the_downloaded_result_and_the_site_logs(tmp_path):
    result = tmp_path / "dl" / "job1"
    (result / "workspace" / "results").mkdir(parents=True)
    (result / "workspace" / "log.txt").write_text(SERVER_LOG)
    (result / "workspace" / "results" / "per_client_table.csv").write_text("client,dice\n")
    (tmp_path / "site.txt").write_text(FAILED_SITE_LOG)
    logs = {"Kvasir-SEG": tmp_path / "site.txt", "CVC-ClinicDB": tmp_path / "absent.txt"}
    assert poc_outcome(result, logs, status="FINISHED:COMPLETED").ok
    aborted = poc_outcome(result, logs, status="FINISHED:ABORTED")
    assert not aborted.ok and "FINISHED:ABORTED" in aborted.server_error
    assert aborted.site_errors == {"Kvasir-SEG": SETUP_ERROR}
    (result / "workspace" / "results" / "per_client_table.csv").unlink()
    assert not poc_outcome(result, logs, status="FINISHED:COMPLETED").ok
    assert not poc_outcome(None, logs).ok


def test_poc_outcome_names_a_site_whose_job_process_vanished(tmp_path):
    """Issue 53: a site's job process killed by SIGKILL logs nothing; FLARE's parent processes do (NVFlare 2.9 lines,
    from a POC run whose ETIS job process was killed). The site is named with the exit code; another job's lines, a
    clean exit (RC 0) and a site with its own logged error are left as they are."""
    job, other = "94e75344-cfb4", "11111111-aaaa"
    kits = {"server": f"{TS} - FederatedServer - INFO - Failing job {job} due to reported failure from ETIS: exception\n"
                      f"{TS} - FederatedServer - INFO - Failing job {other} due to reported failure from Kvasir-SEG: x\n",
            "ETIS": f"{TS} - JobExecutor - INFO - run ({job}): child worker process finished with RC 101\n",
            "CVC-ClinicDB": f"{TS} - JobExecutor - INFO - run ({job}): child worker process finished with RC 0\n"
                            f"{TS} - JobExecutor - INFO - run ({other}): child worker process finished with RC 9\n",
            "Kvasir-SEG": f"{TS} - JobExecutor - INFO - run ({job}): child worker process finished with RC 1\n"}
    parents = {}
    for name, text in kits.items():
        parents[name] = tmp_path / name / "log.txt"
        parents[name].parent.mkdir()
        parents[name].write_text(text)
    (tmp_path / "site.txt").write_text(FAILED_SITE_LOG)
    outcome = poc_outcome(None, {"Kvasir-SEG": tmp_path / "site.txt"}, status="FINISHED:EXECUTION_EXCEPTION",
                          job_id=job, parent_logs=parents)
    assert not outcome.ok and sorted(outcome.site_errors) == ["ETIS", "Kvasir-SEG"]
    assert outcome.site_errors["Kvasir-SEG"] == SETUP_ERROR
    assert outcome.site_errors["ETIS"].startswith("its job process ended with exit code 101 without logging an error")
    assert "  ETIS: its job process ended with exit code 101" in outcome.summary()
    assert poc_outcome(None, {}, job_id=job, parent_logs={"server": parents["server"]}).site_errors == {
        "ETIS": "FLARE's server failed the job on this site's report (exception): its job process ended without "
                "logging an error"}


# -- the data root -----------------------------------------------------------------------------------------------------
def _fake_root(base, centers):
    for c in centers:
        (base / "data" / "polyp" / c).mkdir(parents=True)
    return base / "data"


def test_relative_data_root_resolves_to_the_absolute_folder(tmp_path, monkeypatch):
    root = _fake_root(tmp_path, POLYP)
    monkeypatch.chdir(tmp_path / "data" / "polyp")
    resolved = check_data_root("..", "polyp")
    assert resolved.is_absolute() and resolved == root.resolve()


def test_missing_centers_are_named(tmp_path):
    root = _fake_root(tmp_path, POLYP[:2])
    with pytest.raises(DataError) as e:
        check_data_root(root, "polyp")
    msg = str(e.value)
    assert str(root.resolve()) in msg and "polyp" in msg
    missing = msg.split("missing ", 1)[1]
    assert missing == ", ".join(POLYP[2:])  # exactly the missing centers
    assert check_data_root(root, "polyp", centers=POLYP[:2]) == root.resolve()  # a subset of the centers
    with pytest.raises(DataError, match="does not exist"):
        check_data_root(tmp_path / "nowhere", "polyp")


# -- feduq simulate -------------------------------------------------------------------------------------------------
FAKE_NVFLARE = """#!/bin/sh
# simulator JOB -w WS -t N: records its arguments and data root, writes a table only when asked, exits 0
echo "$FEDUQ_DATA_ROOT $5 $6" > "$4/fake_nvflare.txt"
if [ -n "${FAKE_TABLE:-}" ]; then
  mkdir -p "$4/server/simulate_job/results" && echo "client,dice" > "$4/server/simulate_job/results/per_client_table.csv"
fi
exit 0
"""


@pytest.mark.parametrize("table", [False, True])
def test_simulate_exit_code_follows_the_outcome_not_the_simulator(tmp_path, monkeypatch, capsys, table):
    """FLARE's simulator exits 0 also for an aborted job: feduq simulate returns 1 unless the table was written."""
    simulate = load_tool("simulate")
    fake = tmp_path / "nvflare"
    fake.write_text(FAKE_NVFLARE)
    fake.chmod(0o755)
    import feduq.recipes.simulation

    monkeypatch.setattr(feduq.recipes.simulation, "simulator_command",  # the fake takes the simulator's arguments
                        lambda job, ws, threads: [str(fake), "simulator", str(job), "-w", str(ws), "-t", str(threads)])
    monkeypatch.setenv("FAKE_TABLE", "1" if table else "")
    monkeypatch.setenv("FEDUQ_DATA_ROOT", "data")  # relative: resolved here, not in the sites' folders
    root = _fake_root(tmp_path, POLYP)
    monkeypatch.chdir(tmp_path)
    ws = tmp_path / "ws"
    (ws / "stale").mkdir(parents=True)  # an earlier feduq simulate workspace (it holds the marker) is removed first
    from feduq.outputs import write_marker

    write_marker(ws, "feduq simulate")
    rc = simulate.main([str(REPO / "jobs" / "fedavg"), "-w", "ws"])
    out = capsys.readouterr().out
    assert (ws / "fake_nvflare.txt").read_text().split() == [str(root.resolve()), "-t", "4"]
    assert json.loads((ws / "local" / "feduq_site.json").read_text())["data_root"] == str(root.resolve())
    assert not (ws / "stale").exists()
    if table:
        assert rc == 0 and "Results:" in out
    else:
        assert rc == 1 and out.startswith("FAILED: no per-client table")


def _simulate(args, cwd, timeout):
    env = {k: v for k, v in os.environ.items() if k != "FEDUQ_DATA_ROOT"}
    cmd = [sys.executable, "-m", "feduq", "simulate", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.sim
@pytest.mark.timed
def test_simulate_interrupted_keeps_a_resumable_workspace(tmp_path, data_root):
    """Ctrl-C during ``feduq simulate`` (a relative data root) after round 1 of 3 is saved: exit 130, one line
    naming the rounds saved and the command that goes on, no simulator process left; that command
    (``feduq resume``) accepts the workspace's job and checkpoint (a resumed job's run:
    tests/integration/test_faults.py). The round line (round r/R, mean validation Dice, the aggregation weights, elapsed, ETA)
    is printed instead of FLARE's log, which goes to WS/simulator.log."""
    import signal

    import psutil

    job = small_job("fedavg", tmp_path / "job", num_rounds=3)
    ws = tmp_path / "ws"
    env = {k: v for k, v in os.environ.items() if k != "FEDUQ_DATA_ROOT"}
    cmd = [sys.executable, "-m", "feduq", "simulate", str(job), "-w", str(ws), "--data-root", "shared/data"]
    # SIGINT as a terminal delivers it: a suite started in the background of a non-interactive shell ignores SIGINT,
    # and a child inherits that (Python then installs no KeyboardInterrupt handler); restore the default for the tool
    tool = subprocess.Popen(cmd, cwd=data_root.parent.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    # the interrupt follows round 1's saved global model, not the round line on stdout (which may come later)
    checkpoint = ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt"
    deadline, group = time.time() + 300, []
    while not checkpoint.is_file():
        assert tool.poll() is None, "the run ended before round 1's global model was saved: " + tool.stderr.read()[-3000:]
        assert time.time() < deadline, "no global model saved after round 1"
        group = psutil.Process(tool.pid).children(recursive=True) or group
        time.sleep(0.1)
    group = psutil.Process(tool.pid).children(recursive=True) or group
    assert group  # the simulator's server and sites
    time.sleep(0.5)  # the checkpoint written whole
    tool.send_signal(signal.SIGINT)
    out, err = tool.communicate(timeout=60)
    first = out.splitlines()[0] if out.strip() else ""
    assert first.startswith("round 1/3 | "), out
    assert tool.returncode == 130, err[-3000:]
    line, = err.strip().splitlines()
    assert line.startswith("feduq simulate: interrupted (SIGINT); the simulator's processes are stopped ("), line
    assert f"{ws} is kept; continue with: feduq resume {ws / 'job'} --checkpoint {checkpoint} -o " in line
    psutil.wait_procs(group, timeout=10)
    assert not [p for p in group if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    done = int(line.split("(")[2].split(" of ")[0])  # rounds saved: 1, or 2 if round 2 ended meanwhile
    proc = subprocess.run([sys.executable, "-m", "feduq", "resume", str(ws / "job"), "--checkpoint",
                           str(checkpoint), "-o", str(tmp_path / "resumed")], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and f"resumes after round {done - 1}" in proc.stdout, proc.stderr

    fields = first.strip().split(" | ")
    assert re.fullmatch(r"val Dice 0\.\d{3} \(4 sites\)", fields[1]), first
    weights = dict(zip(fields[2].split()[1::2], map(float, fields[2].split()[2::2])))
    assert set(weights) == set(POLYP) and sum(weights.values()) == pytest.approx(1.0, abs=0.02)
    assert re.fullmatch(r"\d+(m\d\ds|s), ETA \d+(m\d\ds|s)", fields[3]), first
    log = (ws / "simulator.log").read_text()
    assert "FEDUQ_TRAIN" in log and "FEDUQ_TRAIN" not in out
    site_cfg = json.loads((ws / "local" / "feduq_site.json").read_text())
    assert site_cfg["data_root"] == str(data_root.resolve())


@pytest.mark.sim
@pytest.mark.timed
def test_simulate_stops_before_flare_when_centers_are_missing(tmp_path, data_root):
    job = small_job("fedavg", tmp_path / "job")
    root = _fake_root(tmp_path, POLYP[1:3])
    ws = tmp_path / "ws"
    t0 = time.time()
    proc = _simulate([job, "-w", ws, "--data-root", root.name], cwd=root.parent, timeout=60)
    assert proc.returncode == 1
    assert time.time() - t0 < 30 and not ws.exists()  # FLARE never started
    for c in (POLYP[0], POLYP[3]):
        assert c in proc.stderr
    assert POLYP[1] not in proc.stderr.split("missing ", 1)[1]


def test_a_terminated_tool_takes_its_simulator_process_group_with_it(tmp_path):
    """tools/simulate.run_process_group: SIGTERM to the tool (a stopped sweep) kills the child's whole group, so no
    simulator server or site outlives it (a grandchild sleeping 60 s stands for them)."""
    import signal

    import psutil

    marker = tmp_path / "grandchild.pid"
    child = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
             f"open({str(marker)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    script = (f"import sys; sys.path.insert(0, {str(REPO / 'tools')!r}); from feduq.recipes.simulation import run_process_group; "
              f"run_process_group([sys.executable, '-c', {child!r}], dict(__import__('os').environ))")
    tool = subprocess.Popen([sys.executable, "-c", script])
    deadline = time.time() + 60
    while not marker.is_file() or not marker.read_text():
        assert time.time() < deadline, "the child never started"
        time.sleep(0.2)
    grandchild = psutil.Process(int(marker.read_text()))
    tool.send_signal(signal.SIGTERM)
    tool.wait(timeout=30)
    assert tool.returncode != 0
    psutil.wait_procs([grandchild], timeout=10)
    assert not grandchild.is_running() or grandchild.status() == psutil.STATUS_ZOMBIE


def test_round_progress_line_from_the_feduq_records():
    """A 4-round run whose clock starts at 60 s: round 1 closes at 75 s, round 2 (sites' Dice 0.5 and 0.7, weights
    0.25 / 0.75) at 90 s, so 15 s per round and 2 rounds left: ETA 30 s."""
    from feduq.recipes.progress import RoundProgress, format_seconds

    now = [60.0]
    progress = RoundProgress(4, label="fedevi s0", clock=lambda: now[0])
    assert progress.feed(f'{TS} - X - INFO - FEDUQ_TRAIN {{"site": "A", "round": 0, "val_dice_global": 0.1}}') is None
    now[0] = 75.0
    first = progress.feed(f'{TS} - S - INFO - FEDUQ_AGGREGATION {{"round": 0, "weights": {{"A": 1.0}}}}')
    assert first == "fedevi s0 | round 1/4 | val Dice 0.100 (1 sites) | weights A 1.00 | 15s, ETA 45s"
    for site, dice in (("A", 0.5), ("B", 0.7)):
        progress.feed(f'FEDUQ_TRAIN {{"site": "{site}", "round": 1, "val_dice_global": {dice}, "train_loss": 0.3}}')
    now[0] = 90.0
    line = progress.feed('FEDUQ_AGGREGATION {"round": 1, "weights": {"A": 0.25, "B": 0.75}}')
    assert line == "fedevi s0 | round 2/4 | val Dice 0.600 (2 sites) | weights B 0.75 A 0.25 | 30s, ETA 30s"
    assert progress.feed("FEDUQ_AGGREGATION {not json}") is None and progress.feed("plain line") is None
    assert [format_seconds(x) for x in (9.4, 125, 3725)] == ["9s", "2m05s", "1h02m05s"]


def test_run_main_ends_an_interrupt_or_a_failed_write_with_one_line(capsys):
    """feduq.cli.run_main: Ctrl-C -> 130 and the tool's own line; SIGTERM -> 143 (raised as an interrupt, so staged
    outputs are cleaned up as for Ctrl-C); a full disk -> 1 naming the file; any other error is not hidden."""
    import errno
    import signal

    from feduq.cli import Interrupted, run_main

    def interrupted(argv):
        raise Interrupted("3 of 5 rounds saved")

    def terminated(argv):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)
        return 0

    def disk_full(argv):
        raise OSError(errno.ENOSPC, "No space left on device", "/out/model.pt")

    def bug(argv):
        raise OSError(errno.ENOENT, "No such file or directory", "/in/x.png")

    assert run_main("t.py", interrupted) == 130
    assert capsys.readouterr().err == "t.py: interrupted (SIGINT); 3 of 5 rounds saved\n"
    before = signal.getsignal(signal.SIGTERM)
    assert run_main("t.py", terminated) == 143
    assert capsys.readouterr().err == "t.py: interrupted (SIGTERM); nothing it started is left running\n"
    assert signal.getsignal(signal.SIGTERM) is before
    assert run_main("t.py", disk_full) == 1
    assert capsys.readouterr().err == "t.py: /out/model.pt: No space left on device; nothing half-written was kept\n"
    with pytest.raises(FileNotFoundError):
        run_main("t.py", bug)
    assert run_main("t.py", lambda argv: None) == 0
