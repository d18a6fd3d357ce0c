"""The figures of tools/benchmark_sites.py, from a hand-written server log and hand-made memory samples."""

from conftest import load_tool

LOG = """\
2026-11-26 10:00:00,000 - FedUQController - INFO - [identity=simulator_server] - FedA3I round 0 started
2026-11-26 10:00:10,000 - FedUQController - INFO - [identity=simulator_server] - FedA3I round 1 started
2026-11-26 10:00:25,500 - FedUQController - INFO - [identity=simulator_server] - FedA3I finished
2026-11-26 10:00:32,000 - FinalTestEvaluation - INFO - [identity=simulator_server] - FedUQ results written to /x/y.md
"""


def test_benchmark_sites_reads_rounds_final_test_and_peaks(tmp_path):
    bench = load_tool("benchmark_sites")
    log = tmp_path / "log.txt"
    log.write_text(LOG)
    samples = [(0.0, 1.5, 3, 20.0), (2.0, 7.25, 27, 11.5), (4.0, 6.0, 26, 12.0)]  # (time, PSS GiB, processes, free GiB)
    res = bench.summarise(samples, log, 40.04, True, "ok", 25)
    assert res["round_s"] == [10.0, 15.5] and res["final_test_s"] == 6.5
    assert (res["peak_pss_gib"], res["most_processes"], res["lowest_available_gib"]) == (7.25, 27, 11.5)
    assert res["wall_s"] == 40.0 and res["threads"] == 25
    no_test = tmp_path / "no_test.txt"
    no_test.write_text("".join(LOG.splitlines(keepends=True)[:3]))  # the run stopped before the test's table
    assert bench.summarise(samples, no_test, 1.0, False, "failed", None)["final_test_s"] is None


def test_the_samplers_count_only_processes_of_their_workspace():
    bench = load_tool("benchmark_rounds")
    assert bench.under(["python", "-m", "w", "-o", "/x/ws/Kvasir-SEG"], "/x/ws")
    assert bench.under(["python", "-m", "s", "J", "-w", "/x/ws"], "/x/ws/")
    assert not bench.under(["python", "-m", "w", "-o", "/x/ws2/Kvasir-SEG"], "/x/ws")
    assert not bench.under(None, "/x/ws") and bench.under(None, "")


def test_benchmark_rounds_figures_by_hand():
    """A round of 100 steps against a plain loop of 0.1 s per step: limit 10 s; median round 13 s -> 1.3; the first
    round started 20 s after launch -> 200 rounds projected at (20 + 200 x 13) / 3600 = 0.73 h."""
    from types import SimpleNamespace

    bench = load_tool("benchmark_rounds")
    res = {"fedevi": {"round_seconds": [30.0, 12.0, 14.0], "steps": {0: 100, 1: 100, 2: 100},
                      "first_round_start_s": 20.0, "median": 13.0}}
    plain = {"fedevi": {"seconds_per_step": 0.1, "device": "cuda", "precision": "float16", "threads": 16}}
    (rec,) = bench.figures(res, plain, SimpleNamespace(image_size=384))
    assert rec["plain_loop_round_s"] == 10.0 and rec["round_over_plain"] == 1.3
    assert rec["first_round_start_s"] == 20.0 and rec["projected_200_rounds_h"] == 0.73 and rec["rounds"] == 3


def test_benchmark_startup_reads_flare_log_times(tmp_path):
    import datetime as dt

    bench = load_tool("benchmark_startup")
    log = tmp_path / "log.txt"
    log.write_text("2026-11-27 10:00:01,250 - ClientTaskWorker - INFO - started\nno time here\n"
                   "2026-11-27 10:00:04,500 - FedUQExecutor - INFO - site 'A' center 'A': train/val/test = 4/4/4\n")
    start = dt.datetime(2026, 11, 27, 10, 0, 1, 250000).timestamp()
    times = bench.log_times(log)
    assert [round(t - start, 3) for t in times] == [0.0, 3.25]
    assert [round(t - start, 3) for t in bench.log_times(log, "train/val/test = ")] == [3.25]


# --------------------------------------------------------------------------------------------------------------------
# Smoke runs: every benchmark tool whose figures the docs quote, at a tiny size, so each figure keeps a command that runs
# --------------------------------------------------------------------------------------------------------------------

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from conftest import REPO, small_job  # noqa: E402


def _json_lines(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _light_job(method: str, tmp: Path, **kw) -> Path:
    """``jobs/<method>`` with the light network at 32 px, one Kvasir-SEG site of 4 images per split, one round."""
    return small_job(method, tmp / f"job_{method}", network="light", image_size=32, num_rounds=1, max_items=4,
                     sites=["Kvasir-SEG"], **kw)


def _volumes(tmp, data):
    return (["--data-root", data, "--center", "RUNMC", "--cases", "1", "--image-size", "32", "--epochs", "1",
             "--repeats", "1", "--limit", "100"],
            lambda out, tmp: {"ratio", "round_s_volumes", "round_s_png"} <= set(_json_lines(out)[-1])
            and _json_lines(out)[-1]["slices"] > 0)


def _predict(tmp, data):
    return (["--data-root", data, "--center", "Kvasir-SEG", "--images", "2", "--batch-size", "2", "--threads", "1",
             "--job", _light_job("fedevi", tmp)],
            lambda out, tmp: _json_lines(out)[-1]["images"] == 2 and _json_lines(out)[-1]["fraction"] > 0)


def _throughput(tmp, data):
    return (["--data-root", data, "--networks", "light", "--image-sizes", "32", "--methods", "fedavg", "--max-items",
             "8", "--epochs", "1", "--limit-steps", "2", "--num-threads", "1", "--device", "cpu"],
            lambda out, tmp: _json_lines(out)[-1]["fraction"] > 0 and _json_lines(out)[-1]["network"] == "light")


def _fiva(tmp, data):
    return (["--data-root", data, "--center", "NIH-Pancreas-CT", "--max-items", "2", "--batch-size", "2", "--steps",
             "1", "--warmup", "1", "--num-threads", "1", "--device", "cpu"],
            lambda out, tmp: [r["way"] for r in _json_lines(out)] == ["fedavg", "fiva_p", "fiva_g"])


def _memory(tmp, data):
    return (["--network", "light", "--image-size", "32", "--batch-size", "2", "--steps", "1"],
            lambda out, tmp: out.splitlines()[-1].startswith("after cleanup_memory") and len(out.splitlines()) == 7)


def _startup(tmp, data):
    return (["--data-root", data, "--repeats", "1"],
            lambda out, tmp: {r["figure"] for r in _json_lines(out)} == {
                "predict_help_s", "site_imports_s", "site_first_log_s", "site_start_line_s", "run_s"})


def _rounds(tmp, data):
    return (["--data-root", data, "--methods", "fedavg", "--rounds", "1", "--image-size", "32", "--max-items", "4",
             "--sites", "Kvasir-SEG", "--network", "light", "--out", tmp / "rounds"],
            lambda out, tmp: _json_lines(out)[-1]["figure"] == "round" and _json_lines(out)[-1]["rounds"] == 1
            and (tmp / "rounds" / "benchmark.md").is_file())


def _sites(tmp, data):
    return ([_light_job("fedavg", tmp), "--data-root", data, "--out", tmp / "sites"],
            lambda out, tmp: json.loads((tmp / "sites" / "sites.json").read_text())["round_s"]
            and "peak PSS" in (tmp / "sites" / "sites.md").read_text())


def _busy(tmp, data):
    return (["--data-root", data, "--runs", "1", "--busy", "0", "--work", tmp / "busy"],
            lambda out, tmp: _json_lines(out)[-1]["runs"] == 1 and _json_lines(out)[-1]["failures"] == 0)


def _bench3d(tmp, data):
    return (["--data-root", data, "--cases", "2", "--iterations", "1", "--warmup", "0", "--predict-repeats", "1",
             "--threads", "1", "--foreground-voxels", "1e4"],
            lambda out, tmp: [r["figure"] for r in _json_lines(out)] == ["iteration", "predict", "peak_rss_mib"])


#: tool -> (tmp folder, data root) -> (its smallest arguments, (stdout, tmp folder) -> it printed/wrote its figure)
SMOKE = {"benchmark_volumes": _volumes, "benchmark_predict": _predict, "benchmark_throughput": _throughput,
         "benchmark_fiva": _fiva, "memory_breakdown": _memory, "benchmark_startup": _startup,
         "benchmark_rounds": _rounds, "benchmark_sites": _sites, "benchmark_busy_simulator": _busy,
         "benchmark_3d": _bench3d}
#: the ones that run FLARE's simulator: smoke-run together on one recorded simulation (below)
SIMULATED = {"benchmark_startup", "benchmark_rounds", "benchmark_sites", "benchmark_busy_simulator"}


def test_every_benchmark_tool_has_a_smoke_run():
    tools = {p.stem for p in (REPO / "tools").glob("*.py") if "bench" in p.stem} | {"memory_breakdown"}
    assert tools <= set(SMOKE), f"give each benchmark tool a smoke run in SMOKE: {sorted(tools - set(SMOKE))}"


def _env() -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("FEDUQ_DATA_ROOT", None)
    return env


@pytest.mark.parametrize("tool", [t for t in SMOKE if t not in SIMULATED])
def test_a_benchmark_tool_runs_at_a_tiny_size(tool, tmp_path, data_root):
    """The tool at its smallest arguments (a subprocess, as the docs run it): exit 0 and its figure printed or
    written. Its numbers are no figure."""
    args, printed = SMOKE[tool](tmp_path, data_root)
    res = subprocess.run([sys.executable, str(REPO / "tools" / f"{tool}.py"), *map(str, args)], cwd=tmp_path,
                         env=_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, (tool, res.stdout[-1500:], res.stderr[-3000:])
    assert printed(res.stdout, tmp_path), (tool, res.stdout[-3000:])


@pytest.mark.sim
def test_the_simulator_benchmark_tools_run_on_one_recorded_simulation(tmp_path, data_root, monkeypatch, capsys):
    """The four tools that run FLARE's simulator, each at its smallest arguments, in-process: everything of theirs
    runs (arguments, job configuration, data check, their other subprocesses, reading FLARE's logs and workspace,
    their figures), but each simulation is the copy of ONE real tiny run made here (FLARE's simulator itself is run
    by the suite's simulator tests); the command lines they give ``feduq.run`` and ``feduq simulate`` are parsed
    by those tools' own parsers, so a renamed option fails here. One simulation instead of four (~4 min of the suite)."""
    import shutil
    import time as _time

    from feduq import run as feduq_run
    from feduq.recipes import simulation
    from feduq.recipes.outcome import simulator_outcome

    import importlib

    from conftest import VERB_MODULES

    for module in VERB_MODULES.values():  # imported before simulate() is patched: a verb binding it at import
        importlib.import_module(module)    # (feduq simulate) keeps the real one for the tests after this one
    recorded = tmp_path / "recorded"
    outcome = simulation.simulate(_light_job("fedavg", tmp_path), recorded, data_root, echo=lambda s: None)
    assert outcome.ok, outcome.summary()
    calls = []

    def replay(job, ws, data_root_, *a, **kw):  # simulate()'s data check runs; FLARE's run is the recorded copy
        calls.append(job)
        if job is not None:
            assert Path(simulation.resolve_and_check(job, data_root_)) == Path(data_root).resolve()
        if Path(ws).exists():
            shutil.rmtree(ws)
        shutil.copytree(recorded, ws)
        return simulator_outcome(Path(ws))

    monkeypatch.setattr(simulation, "simulate", replay)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("FEDUQ_DATA_ROOT", raising=False)
    monkeypatch.chdir(tmp_path)

    # benchmark_sites and benchmark_rounds call simulate() themselves
    for tool in ("benchmark_sites", "benchmark_rounds"):
        bench = load_tool(tool)
        monkeypatch.setattr(bench, "simulate", replay)
        args, printed = SMOKE[tool](tmp_path, data_root)
        assert bench.main(list(map(str, args))) == 0, tool
        assert printed(capsys.readouterr().out, tmp_path), tool

    # benchmark_startup times ``feduq simulate JOB -w WS --data-root ROOT`` as a command: run that tool's main
    startup, sim_tool = load_tool("benchmark_startup"), load_tool("simulate")
    monkeypatch.setattr(sim_tool, "simulate", replay)
    real_wall = startup.wall

    def wall(command, timeout=600):
        if command[1:4] != ["-m", "feduq", "simulate"]:
            return real_wall(command, timeout)
        t0 = _time.perf_counter()
        assert sim_tool.main(command[4:]) == 0, command
        return _time.perf_counter() - t0

    monkeypatch.setattr(startup, "wall", wall)
    args, printed = SMOKE["benchmark_startup"](tmp_path, data_root)
    assert startup.main(list(map(str, args))) == 0
    assert printed(capsys.readouterr().out, tmp_path)

    # benchmark_busy_simulator runs ``feduq run ...``: parsed by feduq.run's parser, the recorded run copied
    busy = load_tool("benchmark_busy_simulator")

    def run(cmd, **kw):
        assert cmd[1:3] == ["-m", "feduq.run"], cmd
        opts = feduq_run.parser().parse_args(cmd[3:])
        assert (opts.env, opts.num_rounds, opts.network) == ("sim", 1, "light"), opts
        replay(None, opts.workspace_root / (opts.name or opts.method), opts.data_root)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(busy.subprocess, "run", run)
    args, printed = SMOKE["benchmark_busy_simulator"](tmp_path, data_root)
    assert busy.main(list(map(str, args))) == 0
    assert printed(capsys.readouterr().out, tmp_path)
    assert len(calls) == 4
