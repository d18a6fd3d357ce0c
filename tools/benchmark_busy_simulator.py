#!/usr/bin/env python3
"""A FLARE simulator run on an oversubscribed CPU: a small FedUQ job run ``--runs`` times beside one busy-loop
process per core, counting the runs that do not finish (not a test: outside CI, minutes to an hour).

Each run is ``feduq run <method> --env sim`` on two sites (one round, the ``light`` network, 32 px, two
images per split, one torch thread per site) in its own workspace, while ``--busy`` processes (default: one per
core) spin at full speed. A run fails when it exits non-zero or its table is missing; its reason is the last line
of its error output and, where FLARE's simulator logged it, why a site's worker process ended (``worker:`` lines).
Results go to ``<work>/runs.csv`` one row per run (resumable: rows already there are kept and not re-run); the
summary line gives the failures, their 95 % upper bound (Clopper-Pearson) and the median run time.
``--concurrent 2`` runs two simulations side by side, as two test workers do (a site worker's port can then be taken
by the other simulation: :mod:`feduq.flare.simulator`).

    python tools/benchmark_busy_simulator.py --data-root ../shared/data --runs 60 --concurrent 2 --work /tmp/busy
    python tools/benchmark_busy_simulator.py --data-root ../shared/data --runs 1 --busy 0 --work /tmp/busy1  # smoke
"""

from __future__ import annotations

import argparse
import csv
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SITES = "Kvasir-SEG,CVC-ClinicDB"
FIELDS = ["run", "rc", "seconds", "table", "reason", "worker"]
#: what FLARE's simulator logs when a site's worker process ends early (nvflare/private/fed/app/simulator)
WORKER_SIGNS = ("Could not connect to the server cell", "ClientTaskWorker run error", "Communication error with client",
                "Subprocess died for client", "Failed to create connection to the child process")


def spin() -> None:  # pragma: no cover - a busy loop, killed by the parent
    while True:
        pass


def worker_lines(ws: Path) -> str:
    """The lines of a run's logs that say why a site's worker process ended, joined (at most 3)."""
    hits = []
    for log in sorted(ws.rglob("log.txt")) + sorted(ws.rglob("*.log")):
        try:
            text = log.read_text(errors="replace")
        except OSError:
            continue
        hits += [line.strip()[-200:] for line in text.splitlines() if any(s in line for s in WORKER_SIGNS)]
    return " | ".join(list(dict.fromkeys(hits))[:3])


def one_run(i: int, a, work: Path) -> dict:
    ws_root = work / f"run{i:03d}"
    cmd = [sys.executable, "-m", "feduq.run", a.method, "--env", "sim", "--data-root", str(a.data_root),
           "--sites", SITES, "--num-rounds", "1", "--image-size", "32", "--max-items", "2", "--network", "light",
           "--set", "num_threads=1", "-w", str(ws_root)]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
        rc, err = proc.returncode, (proc.stderr or proc.stdout).strip().splitlines()
    except subprocess.TimeoutExpired:
        rc, err = 124, [f"timed out after {a.timeout} s"]
    seconds = time.perf_counter() - t0
    ws = ws_root / a.method
    table = (ws / "server" / "simulate_job" / "results" / "per_client_table.csv").is_file()
    return {"run": i, "rc": rc, "seconds": round(seconds, 1), "table": int(table),
            "reason": "" if rc == 0 and table else (err[-1][-300:] if err else "?"), "worker": worker_lines(ws)}


def upper_bound(failures: int, n: int) -> float:
    """The 95 % one-sided Clopper-Pearson upper bound of a failure rate (0 failures in 60: 4.9 %)."""
    from scipy.stats import beta

    return 1.0 if failures >= n else float(beta.ppf(0.95, failures + 1, n - failures))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, required=True, help="the folder holding polyp/<center>/")
    p.add_argument("--runs", type=int, default=60, help="runs (default 60: 0 failures bound the rate below 5 %%)")
    p.add_argument("--busy", type=int, default=os.cpu_count() or 1, help="busy-loop processes (default: one per core)")
    p.add_argument("--method", default="fedavg")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds one run may take")
    p.add_argument("--work", type=Path, required=True, help="a scratch folder (runs.csv and the workspaces)")
    p.add_argument("--concurrent", type=int, default=1,
                   help="runs at once (2: two simulations side by side, as two test workers run them)")
    a = p.parse_args(argv)
    if a.runs < 1 or a.busy < 0 or a.concurrent < 1:
        p.error("--runs and --concurrent must be >= 1 and --busy >= 0")
    from feduq.outputs import OutputFolderError, check_output_folder

    try:  # a scratch folder that is resumed (its runs.csv kept): never the data root, inside it or around it
        a.work = check_output_folder(a.work, {"data root": a.data_root}, "benchmark_busy_simulator.py", force=True)
    except OutputFolderError as e:
        print(e, file=sys.stderr)
        return 2
    a.work.mkdir(parents=True, exist_ok=True)
    path = a.work / "runs.csv"
    done = list(csv.DictReader(open(path))) if path.is_file() else []
    spinners = [mp.Process(target=spin, daemon=True) for _ in range(a.busy)]
    for s in spinners:
        s.start()
    try:
        with open(path, "a", newline="") as f:
            w = csv.DictWriter(f, FIELDS)
            if not done:
                w.writeheader()
            from concurrent.futures import ThreadPoolExecutor, as_completed

            with ThreadPoolExecutor(a.concurrent) as pool:
                for fut in as_completed([pool.submit(one_run, i, a, a.work) for i in range(len(done), a.runs)]):
                    row = fut.result()
                    w.writerow(row)
                    f.flush()
                    done.append({k: str(v) for k, v in row.items()})
                    print(f"run {row['run'] + 1}/{a.runs}: rc {row['rc']} in {row['seconds']} s"
                          + (f" FAILED: {row['reason']} {row['worker']}" if row["reason"] else ""), flush=True)
    finally:
        for s in spinners:
            s.kill()
    rows = done[: a.runs]
    failed = [r for r in rows if r["reason"]]
    print(json.dumps({"runs": len(rows), "failures": len(failed), "upper_95": round(upper_bound(len(failed), len(rows)), 4),
                      "busy": a.busy, "cores": os.cpu_count(), "median_s": statistics.median(float(r["seconds"])
                                                                                      for r in rows)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
