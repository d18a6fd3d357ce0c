#!/usr/bin/env python3
"""Round-time benchmark on real data (not a test): FedEvi vs FedAvg, and FLARE's overhead.

Measures, at the same image size, data and local epochs:

1. the median wall time of a FedEvi round divided by that of a FedAvg round (target <= 1.3x);
   FedEvi's round includes its second exchange (surrogate evaluation) and uncertainty passes;
2. the median wall time of a FedAvg simulator round divided by the same sites' pure local
   training of the same epochs, run as parallel processes without FLARE and synchronised per
   round (target <= 1.15x); the simulator round also validates the received global model.

Round 0 is excluded from the medians (it includes each site's start-up and data caching).

    python tools/benchmark_rounds.py --data-root ../shared/data --image-size 128 --rounds 4 --network fedevi_unet
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

from configure_job import configure  # noqa: E402
from simulate import simulate  # noqa: E402

from feduq.data import DataError  # noqa: E402

ROUND_START = re.compile(r"^(\S+ \S+) - .*(?:- Round (\d+) started\.|FedEvi round (\d+) started)")
RUN_END = re.compile(r"^(\S+ \S+) - .*(?:Finished ScatterAndGather Training|FedEvi finished)")


def _ts(text: str) -> float:
    return datetime.strptime(text, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def round_times(server_log: Path) -> list[float]:
    """Seconds per round from a server log (start of round r to start of r+1 / end of training)."""
    starts, end = [], None
    for line in server_log.read_text().splitlines():
        if m := ROUND_START.match(line):
            starts.append(_ts(m.group(1)))
        elif m := RUN_END.match(line):
            end = _ts(m.group(1))
    marks = starts + ([end] if end else [])
    return [b - a for a, b in zip(marks, marks[1:])]


def run_simulator(method: str, out: Path, data_root: str, image_size: int, rounds: int, epochs: int,
                  network: str) -> list[float]:
    job = configure(REPO / "jobs" / method, out / f"job_{method}", image_size=image_size, num_rounds=rounds,
                    local_epochs=epochs, executor_args={"num_threads": 1}, network=network)
    ws = out / f"ws_{method}"
    try:
        outcome = simulate(job, ws, data_root, log=out / f"{method}.log")  # data root resolved and checked first
    except DataError as e:
        raise SystemExit(f"benchmark_rounds.py: {e}") from None
    if not outcome.ok:
        raise SystemExit(f"{method} simulator run failed: {outcome.summary()}")
    return round_times(ws / "server" / "log.txt")


def _local_worker(center, data_root, image_size, epochs, rounds, network, barrier, queue):
    import torch
    from monai.data import DataLoader
    from monai.losses import DiceCELoss

    from feduq import data as fdata
    from feduq.engine import LocalTrainer
    from feduq.networks import build_network

    torch.set_num_threads(1)
    torch.manual_seed(0)
    ds = fdata.get_dataset("polyp", center, "train", data_root=data_root, image_size=image_size)
    loader = DataLoader(ds, batch_size=8, shuffle=True, drop_last=len(ds) > 8)
    trainer = LocalTrainer(build_network(network, 3, 2), torch.device("cpu"))
    loss = DiceCELoss(to_onehot_y=True, softmax=True)
    for _ in range(rounds):
        barrier.wait()
        stats = trainer.train_epochs(loader, epochs, loss)
        queue.put((center, stats.seconds))
        barrier.wait()


def run_local(data_root: str, image_size: int, rounds: int, epochs: int, network: str) -> list[float]:
    """Per-round wall time of the 4 sites training in parallel processes, no FLARE."""
    from feduq.data import get_task

    centers = get_task("polyp").centers
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(len(centers) + 1), ctx.Queue()
    procs = [ctx.Process(target=_local_worker, args=(c, data_root, image_size, epochs, rounds, network, barrier, queue))
             for c in centers]
    for p in procs:
        p.start()
    times = []
    for _ in range(rounds):
        barrier.wait()
        t0 = time.perf_counter()
        barrier.wait()
        times.append(time.perf_counter() - t0)
    for p in procs:
        p.join()
    return times


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default=os.environ.get("FEDUQ_DATA_ROOT", str(REPO.parent / "shared" / "data")))
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--out", type=Path, default=REPO / "workspaces" / "benchmark")
    p.add_argument("--network", default="fedevi_unet", help="network name (default %(default)s, the jobs')")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    res = {
        "fedavg": run_simulator("fedavg", a.out, a.data_root, a.image_size, a.rounds, a.local_epochs, a.network),
        "fedevi": run_simulator("fedevi", a.out, a.data_root, a.image_size, a.rounds, a.local_epochs, a.network),
        "local": run_local(a.data_root, a.image_size, a.rounds, a.local_epochs, a.network),
    }
    med = {k: statistics.median(v[1:]) for k, v in res.items()}
    print(f"polyp, 4 sites, network {a.network}, {a.image_size} px, {a.local_epochs} local epochs, rounds 1..{a.rounds - 1} (round 0 excluded)")
    for k, v in res.items():
        print(f"  {k:7s} round seconds: {[round(x, 1) for x in v]}  median {med[k]:.1f}")
    print(f"FedEvi / FedAvg round time:           {med['fedevi'] / med['fedavg']:.3f}  (target <= 1.3)")
    print(f"FedAvg simulator / pure local training: {med['fedavg'] / med['local']:.3f}  (target <= 1.15)")
    (a.out / "benchmark.json").write_text(json.dumps({"rounds": res, "median": med}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
