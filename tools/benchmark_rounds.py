#!/usr/bin/env python3
"""Round-time and memory benchmark of the committed jobs on real data (not a test): how close a simulated round gets
to what the cores can do.

For each method (default FedEvi and FedAvg) the committed job is configured with only ``--image-size`` and
``--rounds`` (every other setting the job's own: no thread setting) and run in the NVFlare simulator. Reported:

* **round time**: median of rounds 1.. (round 0 includes start-up and data caching) from the server log;
* **the plain-loop limit**: the round's Adam steps (summed over sites, from the sites' ``FEDUQ_TRAIN`` lines) times
  the seconds per step of a plain PyTorch loop (the job's network, batch size and image size, Adam, the method's loss:
  FedEvi's, else Dice + CE, at the sites' precision) on the sites' device (``--device auto``: the GPU when there is
  one; on a CPU all cores in one process), measured in the same run; ``limit / round time`` is the fraction of the
  machine's training speed a round achieves (1.0: as fast as one plain loop over all the round's steps);
* one JSON line per method (:func:`figures`): the median round over the plain-loop time of its steps, the first
  round's start after launch and the paper's 200 rounds projected from them;
* ``--authors-round-s``: the authors' code's round time on the same machine and setting, and the ratio to it;
* FedEvi / FedAvg round time, and FedAvg's simulator round against pure local training (the same sites as parallel
  processes without FLARE, sharing the cores the same way, synchronised per round);
* **per-site PSS** (proportional set size, MB; psutil), sampled every second: peak while
  training, and the lowest after round 0 (a site waiting for the server).

    python tools/benchmark_rounds.py --data-root REF --image-size 128 --rounds 3 --authors-round-s 289.5 \\
        --out workspaces/benchmark-128

Tiny mode (the suite's smoke run, tests/repository/test_benchmark_tools.py; its numbers are no figure):
``--methods fedavg --rounds 1 --image-size 32 --max-items 4 --sites Kvasir-SEG --network light``.

``REF``: the FedEvi reference setting (``feduq split --stems split_seed0.json --site-local``); any polyp data
root works. Writes ``benchmark.json`` and ``benchmark.md`` in ``--out``.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from feduq.data import DataError
from feduq.recipes.job_folders import configure
from feduq.recipes.simulation import simulate

REPO = Path(__file__).resolve().parents[1]

ROUND_START = re.compile(r"^(\S+ \S+) - .*(?:- Round (\d+) started\.|\w+ round (\d+) started)")
RUN_END = re.compile(r"^(\S+ \S+) - .*(?:Finished ScatterAndGather Training|\w+ finished$)")
TRAIN_RECORD = re.compile(r"FEDUQ_TRAIN (\{.*\})")
CLIENT_ARG = re.compile(r"--client (\S+)")

PLAIN_LOOP = """
import json, sys, time, torch
from feduq.core.networks import build_network
from feduq.core.threads import host_cores
from feduq.core.training import autocast_dtype, resolve_device
network, size, batch, steps, method, device = sys.argv[1:7]
size, batch, steps, device = int(size), int(batch), int(steps), resolve_device(device)
if device.type == "cpu":
    torch.set_num_threads(host_cores())
torch.manual_seed(0)
model = build_network(network, 3, 2).to(device)
dtype = autocast_dtype("auto", device, model)  # the sites' own precision (float16 + GradScaler on CUDA)
opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-5, fused=device.type == "cuda")
scaler = torch.amp.GradScaler("cuda", enabled=dtype == torch.float16)
if method == "fedevi":
    from feduq.core.evidential_loss import FedEviLoss
    fedevi = FedEviLoss()
    loss_fn = lambda logits, label: fedevi(logits, label, 1)
else:
    from monai.losses import DiceCELoss
    loss_fn = DiceCELoss(to_onehot_y=True, softmax=True)
x = torch.rand(batch, 3, size, size, device=device)
y = (torch.rand(batch, 1, size, size, device=device) > 0.7).float()
def step():
    with torch.autocast(device_type=device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        logits = model(x)
    loss = loss_fn(logits.float(), y)
    opt.zero_grad(set_to_none=True)
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
for _ in range(3):
    step()
if device.type == "cuda":
    torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(steps):
    step()
if device.type == "cuda":
    torch.cuda.synchronize()
print(json.dumps({"threads": torch.get_num_threads(), "device": str(device),
                  "precision": str(dtype).replace("torch.", "") if dtype else "float32",
                  "seconds_per_step": (time.perf_counter() - t0) / steps}))
"""


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


def steps_per_round(ws: Path) -> dict[int, int]:
    """Round -> Adam steps summed over the sites (their ``FEDUQ_TRAIN`` lines)."""
    steps: dict[int, int] = {}
    for log in ws.glob("*/log.txt"):
        for m in TRAIN_RECORD.finditer(log.read_text()):
            rec = json.loads(m.group(1))
            steps[rec["round"]] = steps.get(rec["round"], 0) + int(rec["steps"])
    return steps


def plain_loop_seconds(network: str, image_size: int, batch_size: int, steps: int = 12, method: str = "fedavg",
                       device: str = "auto") -> dict:
    """Seconds per Adam step of a plain PyTorch loop (a fresh process): the method's loss (FedEvi's, else Dice + CE)
    on ``device`` (``auto``: CUDA when there is one, as the sites) at the sites' precision, on all cores of a CPU."""
    out = subprocess.run([sys.executable, "-c", PLAIN_LOOP, network, str(image_size), str(batch_size), str(steps),
                          method, device], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def under(cmdline: list[str] | None, folder: str) -> bool:
    """Whether a command line names ``folder`` or a path inside it (``/x/ws`` matches ``/x/ws/site``, not ``/x/ws2``);
    an empty ``folder`` matches every command line."""
    folder = folder.rstrip(os.sep)
    return not folder or any(arg == folder or arg.startswith(folder + os.sep) for arg in cmdline or [])


class PssSampler(threading.Thread):
    """Every ``period`` s, the PSS (MB, psutil) of each simulator site process (``simulator_worker ... --client <site>``)
    whose command line names ``marker`` (the run's workspace: another simulator on the machine is not counted)."""

    def __init__(self, marker: str = "", period: float = 1.0):
        super().__init__(daemon=True)
        self.marker, self.period, self.samples, self._halt = marker, period, {}, threading.Event()

    def run(self) -> None:
        import psutil

        while not self._halt.is_set():
            now = time.time()
            for proc in psutil.process_iter(["cmdline"]):
                cmd = " ".join(proc.info["cmdline"] or [])
                if "simulator_worker" in cmd and under(proc.info["cmdline"], self.marker) and (m := CLIENT_ARG.search(cmd)):
                    try:
                        pss = proc.memory_full_info().pss / 2**20
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        continue
                    self.samples.setdefault(m.group(1), []).append((now, pss))
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def pss_summary(samples: dict[str, list], after: float | None) -> dict[str, dict]:
    """Per site: peak PSS, and the lowest PSS after time ``after`` (round 1 started: a site waiting between tasks)."""
    out = {}
    for site, points in sorted(samples.items()):
        later = [p for t, p in points if after is None or t >= after]
        out[site] = {"peak_mb": round(max(p for _, p in points), 1), "idle_mb": round(min(later or [0.0]), 1)}
    return out


def run_simulator(method: str, out: Path, data_root: str, image_size: int, rounds: int, *, max_items: int | None = None,
                  sites: list[str] | None = None, network: str | None = None) -> dict:
    """One method's committed job in the simulator (``max_items``, ``sites``, ``network``: the tiny mode's settings;
    None: the job's own)."""
    job = configure(REPO / "jobs" / method, out / f"job_{method}", image_size=image_size, num_rounds=rounds,
                    max_items=max_items, sites=sites, network=network)
    ws = out / f"ws_{method}"
    sampler = PssSampler(str(ws.resolve()))
    sampler.start()
    launched = time.time()
    try:
        outcome = simulate(job, ws, data_root, log=out / f"{method}.log", label=method, force=True)
    except DataError as e:
        raise SystemExit(f"benchmark_rounds.py: {e}") from None
    finally:
        sampler.stop()
    if not outcome.ok:
        raise SystemExit(f"{method} simulator run failed: {outcome.summary()}")
    server_log = ws / "server" / "log.txt"
    starts = [_ts(m.group(1)) for line in server_log.read_text().splitlines() if (m := ROUND_START.match(line))]
    return {"round_seconds": round_times(server_log), "steps": steps_per_round(ws),
            "first_round_start_s": round(starts[0] - launched, 2) if starts else None,
            "pss": pss_summary(sampler.samples, starts[1] if len(starts) > 1 else None)}


def _local_worker(center, data_root, image_size, epochs, rounds, network, barrier, queue):
    import torch
    from monai.data import DataLoader
    from monai.losses import DiceCELoss

    from feduq import data as fdata
    from feduq.core.training import LocalTrainer
    from feduq.core.networks import build_network
    from feduq.core.threads import HostCoreShare

    torch.manual_seed(0)
    ds = fdata.get_dataset("polyp", center, "train", data_root=data_root, image_size=image_size)
    loader = DataLoader(ds, batch_size=8, shuffle=True)
    trainer = LocalTrainer(build_network(network, 3, 2), torch.device("cpu"))
    share = HostCoreShare(member=f"local-{center}")  # the cores shared as the simulator's sites share them
    trainer.step_hook = share.refresh
    loss = DiceCELoss(to_onehot_y=True, softmax=True)
    for _ in range(rounds):
        barrier.wait()
        with share.computing():
            stats = trainer.train_epochs(loader, epochs, loss)
        queue.put((center, stats.seconds))
        barrier.wait()


def run_local(data_root: str, image_size: int, rounds: int, epochs: int, network: str) -> list[float]:
    """Per-round wall time of the 4 polyp sites training in parallel processes, no FLARE."""
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


def round_steps(run: dict) -> float:
    """Median Adam steps per round over the sites (rounds 1..; round 0 when it is the only one)."""
    steps = run["steps"]
    return statistics.median(steps[k] for k in sorted(steps) if k > 0 or len(steps) == 1)


def figures(res: dict, plain: dict, a) -> list[dict]:
    """One JSON-ready record per simulated method: its median round against the plain-loop time of the round's steps
    (the issue-51 limit: <= 1.5), the first round's start after launch (<= 30 s), and the paper's 200 rounds projected
    from them (first start + 200 x median round), in hours."""
    out = []
    for name, r in res.items():
        if name == "local":
            continue
        limit = round_steps(r) * plain[name]["seconds_per_step"]
        out.append({"figure": "round", "method": name, "image_size": a.image_size, "device": plain[name]["device"],
                    "rounds": len(r["round_seconds"]), "round_s_median": round(r["median"], 2),
                    "plain_loop_round_s": round(limit, 2), "round_over_plain": round(r["median"] / limit, 3),
                    "first_round_start_s": r.get("first_round_start_s"),
                    "projected_200_rounds_h": round(((r.get("first_round_start_s") or 0) + 200 * r["median"]) / 3600,
                                                    2)})
    return out


def markdown(res: dict, plain: dict, a) -> str:
    first = next(iter(plain.values()))
    sites = len(a.sites) if getattr(a, "sites", None) else 4
    lines = [f"polyp, {sites} sites, committed jobs at {a.image_size} px, {a.rounds} rounds (round 0 excluded from the "
             f"medians); plain loop of each method's loss on {first['device']} ({first['precision']}, "
             f"{first['threads']} threads): " + ", ".join(f"{m} {v['seconds_per_step']:.3f} s per step"
                                                          for m, v in plain.items()), "",
             "| run | round seconds | median (rounds 1..) | steps per round | plain-loop limit (s) | limit / round |"
             + (" round / authors' |" if a.authors_round_s else ""),
             "|---|---|---|---|---|---|" + ("---|" if a.authors_round_s else "")]
    for name, r in res.items():
        if name == "local":
            lines.append(f"| pure local (no FLARE) | {' '.join(f'{x:.1f}' for x in r['round_seconds'])} | "
                         f"{r['median']:.1f} | | | |" + (" |" if a.authors_round_s else ""))
            continue
        steps = round_steps(r)
        limit = steps * plain[name]["seconds_per_step"]
        lines.append(f"| {name} | {' '.join(f'{x:.1f}' for x in r['round_seconds'])} | {r['median']:.1f} | {steps:.0f} "
                     f"| {limit:.1f} | {limit / r['median']:.2f} |"
                     + (f" {r['median'] / a.authors_round_s:.2f} |" if a.authors_round_s else ""))
        r["limit_fraction"] = limit / r["median"]
    if "fedevi" in res and "fedavg" in res:
        lines += ["", f"FedEvi / FedAvg round time: {res['fedevi']['median'] / res['fedavg']['median']:.2f}"]
    if "local" in res and "fedavg" in res:
        lines += [f"FedAvg simulator / pure local training: {res['fedavg']['median'] / res['local']['median']:.2f}"]
    lines += ["", "| run | site | PSS peak (MB) | PSS idle (MB) |", "|---|---|---|---|"]
    for name, r in res.items():
        for site, p in r.get("pss", {}).items():
            lines.append(f"| {name} | {site} | {p['peak_mb']:.0f} | {p['idle_mb']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", default=os.environ.get("FEDUQ_DATA_ROOT", str(REPO.parent / "shared" / "data")))
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--methods", nargs="+", default=["fedevi", "fedavg"])
    p.add_argument("--local", action="store_true", help="also time pure local training (FedAvg's sites, no FLARE)")
    p.add_argument("--device", default="auto", help="where the plain loop runs: auto (CUDA when there is one, as the "
                                                   "sites' device auto), cpu or cuda")
    p.add_argument("--authors-round-s", type=float, help="the authors' code's round time on this machine (s)")
    p.add_argument("--out", type=Path, default=REPO / "workspaces" / "benchmark")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (they are kept)")
    tiny = p.add_argument_group("tiny mode (the suite's smoke run; not a figure): the jobs otherwise as committed")
    tiny.add_argument("--max-items", type=int, help="the first N images of each split")
    tiny.add_argument("--sites", nargs="+", help="these polyp sites only")
    tiny.add_argument("--network", help="this network instead of the job's")
    a = p.parse_args(argv)
    from feduq.outputs import OutputFolderError, claim_output_folder, write_marker

    try:
        a.out, keep = claim_output_folder(a.out, {"data root": a.data_root}, "benchmark_rounds.py", force=a.force)
    except OutputFolderError as e:
        print(e, file=sys.stderr)  # "<tool>: <why>", one line
        return 2
    spec = json.loads((REPO / "jobs" / a.methods[0] / "app" / "config" / "config_fed_client.json").read_text())
    args = spec["executors"][0]["executor"]["args"]
    network = a.network or (args["network"]["name"] if isinstance(args["network"], dict) else args["network"])
    plain = {m: plain_loop_seconds(network, a.image_size, args["batch_size"], method=m, device=a.device)
             for m in a.methods}
    res = {m: run_simulator(m, a.out, a.data_root, a.image_size, a.rounds, max_items=a.max_items, sites=a.sites,
                            network=a.network) for m in a.methods}
    if a.local:
        res["local"] = {"round_seconds": run_local(a.data_root, a.image_size, a.rounds, args["local_epochs"], network)}
    for r in res.values():
        r["median"] = statistics.median(r["round_seconds"][1:] or r["round_seconds"])
    text = markdown(res, plain, a)
    print(text)
    for record in figures(res, plain, a):
        print(json.dumps(record), flush=True)
    (a.out / "benchmark.md").write_text(text)
    (a.out / "benchmark.json").write_text(json.dumps({"plain_loop": plain, "runs": res, "args": {
        k: str(v) for k, v in vars(a).items()}}, indent=2))
    write_marker(a.out, "benchmark_rounds.py", exclude=keep)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_rounds.py", main))
