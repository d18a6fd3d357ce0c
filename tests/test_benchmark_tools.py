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
