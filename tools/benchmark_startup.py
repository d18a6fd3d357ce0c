#!/usr/bin/env python3
"""Start-up of FedUQ's processes (not a test): seconds until a command or a site is ready, each in a fresh process.

One JSON line per figure, the best of ``--repeats`` tries:

* ``predict_help_s``: ``feduq predict --help`` to its exit (what a user waits before anything is read);
* ``site_imports_s``: ``python -c "import feduq.flare.executor"``, the imports of a FLARE site process of FedUQ
  (its executor module, MONAI without the packages no site uses: :mod:`feduq.common.lean_monai`), to its exit;
* with ``--data-root``: a one-site, one-round simulator run of the committed FedAvg job, ``light`` network, 32 px, 4
  images per split (``feduq configure`` + ``feduq simulate``): ``site_first_log_s`` (launch to the site's
  first log line), ``site_start_line_s`` (to FedUQ's start line ``site ... train/val/test = ...``: imports, data,
  network), ``run_s`` (to the tool's exit). Log times have millisecond resolution, in the machine's local time.

    python tools/benchmark_startup.py --data-root ../shared/data
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOG_TIME = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")


def wall(command: list[str], timeout: float = 600) -> float:
    """Seconds ``command`` took to exit (its output discarded).

    Raises:
        RuntimeError: it exited non-zero (its last output lines in the message).
    """
    t0 = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    if out.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} exited {out.returncode}: {(out.stderr or out.stdout)[-800:]}")
    return time.perf_counter() - t0


def log_times(path: Path, pattern: str | None = None) -> list[float]:
    """POSIX times of the lines of a FLARE log (``YYYY-MM-DD HH:MM:SS,mmm`` at the start, local time) that contain
    ``pattern`` (every timed line when None)."""
    times = []
    for line in path.read_text(errors="replace").splitlines():
        m = LOG_TIME.match(line)
        if m and (pattern is None or pattern in line):
            times.append(dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp())
    return times


def site_start(data_root: str, work: Path) -> dict:
    """Launch-to-log-line seconds of one site of a one-round simulator run (see the module doc)."""
    py = sys.executable
    job, ws = work / "job", work / "ws"
    subprocess.run([py, "-m", "feduq", "configure", str(REPO / "jobs" / "fedavg"), "-o", str(job),
                    "--sites", "Kvasir-SEG", "--image-size", "32", "--num-rounds", "1", "--local-epochs", "1",
                    "--max-items", "4", "--network", "light"], check=True, capture_output=True)
    launched = time.time()
    run_s = wall([py, "-m", "feduq", "simulate", str(job), "-w", str(ws), "--data-root", data_root])
    site_log = next(ws.rglob("Kvasir-SEG/log.txt"))
    first = log_times(site_log)[0]
    start_line = log_times(site_log, "train/val/test = ")[0]
    return {"site_first_log_s": round(first - launched, 2), "site_start_line_s": round(start_line - launched, 2),
            "run_s": round(run_s, 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", help="time a one-site simulator run on this data root too")
    p.add_argument("--repeats", type=int, default=3, help="tries per figure (the best is reported)")
    args = p.parse_args(argv)
    if args.repeats < 1:
        raise ValueError(f"--repeats {args.repeats}: expected an integer >= 1")
    py = sys.executable
    figures = {
        "predict_help_s": min(wall([py, "-m", "feduq", "predict", "--help"]) for _ in range(args.repeats)),
        "site_imports_s": min(wall([py, "-c", "import feduq.flare.executor"]) for _ in range(args.repeats)),
    }
    for name, seconds in figures.items():
        print(json.dumps({"figure": name, "seconds": round(seconds, 2)}), flush=True)
    if args.data_root:
        runs = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix="feduq_startup_") as work:
                runs.append(site_start(args.data_root, Path(work)))
        best = min(runs, key=lambda r: r["site_start_line_s"])
        for name, seconds in best.items():
            print(json.dumps({"figure": name, "seconds": seconds}), flush=True)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_startup.py", main))
