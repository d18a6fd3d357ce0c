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
