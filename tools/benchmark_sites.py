#!/usr/bin/env python3
"""Memory and time of one configured job in FLARE's simulator with a given number of site processes (not a test):
does a federation of many sites fit this machine, and what does a round cost?

The job runs as ``feduq simulate JOB -w WS -t THREADS`` does. Every ``--period`` seconds the PSS (proportional set
size, psutil) of every process whose command line names the workspace (the simulator, its server and its site
processes) is summed. Reported:

* **peak PSS** of that process tree (GiB) and the most of its processes alive at once (the simulator's own included);
* the machine's **lowest available memory** during the run (GiB; psutil ``virtual_memory().available``);
* **round times** from the server log (round 0 includes start-up), and the **final test**: from the end of training to
  the server's ``FedUQ results written`` line (s; the last model's validation included);
* the whole run's wall time (s) and the simulator's outcome (a failed run exits 1 after writing what it measured).

    feduq configure jobs/feda3i -o /tmp/feda3i-50 --image-size 64 --num-rounds 3 \\
        --set-workflow warmup_rounds=1 --test-sites per-center
    python tools/benchmark_sites.py /tmp/feda3i-50 --data-root ../shared/data -t 25 --out workspaces/sites-50

Writes ``sites.json`` and ``sites.md`` in ``--out`` (the workspace is ``--out``/ws, the simulator's log ws/simulator.log;
a workspace no FedUQ tool made is refused, never replaced).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from pathlib import Path

from benchmark_rounds import RUN_END, _ts, round_times, under

from feduq.data import DataError
from feduq.recipes.simulation import simulate


#: the final test's last server line (feduq.flare.workflows.FinalTestEvaluation)
RESULTS_WRITTEN = re.compile(r"^(\S+ \S+) - .*FedUQ results written to ")


class TreeSampler(threading.Thread):
    """Every ``period`` s: the summed PSS (GiB) of the processes whose command line names the folder ``marker`` or a
    path in it, their count, and the machine's available memory (GiB)."""

    def __init__(self, marker: str, period: float = 2.0):
        super().__init__(daemon=True)
        self.marker, self.period, self.samples, self._halt = marker, period, [], threading.Event()

    def run(self) -> None:
        import psutil

        while not self._halt.is_set():
            total, count = 0.0, 0
            for proc in psutil.process_iter(["cmdline"]):
                if under(proc.info["cmdline"], self.marker):
                    try:
                        total += proc.memory_full_info().pss / 2**30
                        count += 1
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        continue
            self.samples.append((time.time(), total, count, psutil.virtual_memory().available / 2**30))
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def summarise(samples: list, server_log: Path, wall_s: float, ok: bool, summary: str, threads: int | None) -> dict:
    """The figures of one run (see the module docstring); times from the server log's timestamps."""
    lines = server_log.read_text().splitlines() if server_log.is_file() else []
    ends = [_ts(m.group(1)) for line in lines if (m := RUN_END.match(line))]
    written = [_ts(m.group(1)) for line in lines if (m := RESULTS_WRITTEN.match(line))]
    rounds = round_times(server_log) if server_log.is_file() else []
    test_s = round(written[-1] - ends[-1], 1) if ends and written and written[-1] >= ends[-1] else None
    return {
        "threads": threads, "ok": ok, "outcome": summary, "wall_s": round(wall_s, 1),
        "peak_pss_gib": round(max((s[1] for s in samples), default=0.0), 2),
        "most_processes": max((s[2] for s in samples), default=0),
        "lowest_available_gib": round(min((s[3] for s in samples), default=0.0), 2),
        "round_s": [round(r, 1) for r in rounds], "final_test_s": test_s,
    }


def markdown(job: Path, res: dict) -> str:
    return "\n".join([
        f"# `{job.name}` in FLARE's simulator, -t {res['threads'] or 'one per site'}", "",
        "| figure | value |", "|---|---|",
        f"| outcome | {'ok' if res['ok'] else 'FAILED'}: {res['outcome']} |",
        f"| peak PSS of the simulator's processes | {res['peak_pss_gib']} GiB |",
        f"| most processes alive at once | {res['most_processes']} |",
        f"| lowest available memory on the machine | {res['lowest_available_gib']} GiB |",
        f"| round times (s; round 0 includes start-up) | {', '.join(map(str, res['round_s'])) or '-'} |",
        f"| final test (s) | {res['final_test_s'] if res['final_test_s'] is not None else '-'} |",
        f"| whole run (s) | {res['wall_s']} |", ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", type=Path, help="a configured job folder (feduq configure)")
    p.add_argument("--data-root", default=os.environ.get("FEDUQ_DATA_ROOT"))
    p.add_argument("-t", "--threads", type=int, help="simulator site processes (default: one per site)")
    p.add_argument("--period", type=float, default=2.0, help="seconds between memory samples")
    p.add_argument("--out", type=Path, default=Path("workspaces") / "benchmark-sites")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (they are kept)")
    a = p.parse_args(argv)
    from feduq.outputs import OutputFolderError, claim_output_folder, write_marker

    try:
        a.out, keep = claim_output_folder(a.out, {"job": a.job, "data root": a.data_root}, "benchmark_sites.py",
                                          writes=("sites.json", "sites.md", "ws/*"),
                                          force=a.force)
    except OutputFolderError as e:
        print(e, file=sys.stderr)  # "<tool>: <why>", one line
        return 2
    ws = (a.out / "ws").resolve()
    sampler = TreeSampler(str(ws), a.period)
    sampler.start()
    t0 = time.time()
    try:
        outcome = simulate(a.job, ws, a.data_root, threads=a.threads)  # log: WS/simulator.log; replaces only a FedUQ workspace
    except DataError as e:
        sampler.stop()
        print(f"benchmark_sites.py: {e}", file=sys.stderr)
        return 2
    finally:
        wall = time.time() - t0
    sampler.stop()
    res = summarise(sampler.samples, ws / "server" / "log.txt", wall, outcome.ok, outcome.summary(), a.threads)
    (a.out / "sites.json").write_text(json.dumps(res, indent=2))
    (a.out / "sites.md").write_text(markdown(a.job, res))
    write_marker(a.out, "benchmark_sites.py", exclude=keep)
    print(markdown(a.job, res))
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_sites.py", main))
