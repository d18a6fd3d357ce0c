#!/usr/bin/env python3
"""FIVA's cost on one CT site against FedAvg's (not a test): step time, memory, bytes sent per round.

On one site's real training slices, with the job's nnU-Net plans, it times ``--steps`` training
iterations (after ``--warmup``) of nnU-Net's recipe three ways: FedAvg (no hooks), FIVA-P (Welford on
the parameters after each step) and FIVA-G (Welford on the gradients before it), and prints one JSON
line per way with the median step time and its ratio to FedAvg (goal <= 1.05), the memory FIVA adds
on the site (Welford's mean and M2 plus the variances sent, in multiples of the backbone's size;
goal <= 3x), peak GPU memory on CUDA, and the bytes a site sends per round (backbone; FIVA: backbone
+ variance).

    python tools/benchmark_fiva.py --data-root ../shared/data --center NIH-Pancreas-CT --plans ct_2d_slim
"""

from __future__ import annotations

import argparse
import sys
import json
import statistics
import tempfile
import time
from pathlib import Path

from feduq.common.lean_monai import defer_monai_lean

defer_monai_lean()  # MONAI without the optional packages no site process loads (as a site imports it)

import torch  # noqa: E402

from feduq.data import ct  # noqa: E402
from feduq.nnunet import pipeline as nc  # noqa: E402
from feduq.core.training import resolve_device  # noqa: E402
from feduq.methods.fiva import Welford  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True)
    p.add_argument("--center", default="NIH-Pancreas-CT")
    p.add_argument("--plans", default="ct_2d_slim")
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--max-items", type=int, default=40)
    p.add_argument("--device", default="auto")
    p.add_argument("--num-threads", type=int, default=0)
    a = p.parse_args(argv)
    if a.num_threads:
        torch.set_num_threads(a.num_threads)
    device = resolve_device(a.device)
    root = Path(a.data_root).resolve()
    lut, organs = ct.site_label_lut(root, a.center), ct.site_organs(root, a.center)
    items = ct.ct_items(root, a.center, "train")[: a.max_items]
    cases = [(it["name"], *ct.read_case(it, lut, a.center)) for it in items]
    props = nc.foreground_intensity_properties([(c[1], c[2]) for c in cases])
    pipe = nc.SitePipeline(nc.site_plans(nc.load_plans(a.plans), "site", props), organs)
    with tempfile.TemporaryDirectory() as tmp:
        ids = pipe.preprocess_to_folder(cases, Path(tmp))
        results = {}
        for way in ("fedavg", "fiva_p", "fiva_g"):
            torch.manual_seed(0)
            net = pipe.build_network().to(device)
            names = set(nc.backbone_names(net))
            backbone_bytes = sum(p.numel() * p.element_size() for n, p in net.named_parameters() if n in names)
            loader = pipe.make_loader(Path(tmp), ids, a.batch_size, seed=0)
            opt = nc.make_optimizer(net)
            scaler = torch.amp.GradScaler("cuda", enabled=device.type == "cuda")
            loss = pipe.build_loss()
            welford = Welford(torch.float64)  # as the job's FIVA executor accumulates
            on_step = on_grad = None
            if way == "fiva_p":
                on_step = lambda m: welford.update({n: q.detach() for n, q in m.named_parameters() if n in names})  # noqa: E731
            elif way == "fiva_g":
                on_grad = lambda m: welford.update({n: q.grad.detach() for n, q in m.named_parameters() if n in names})  # noqa: E731
            nc.train_iterations(net, loader, loss, opt, a.warmup, device, scaler, on_gradients=on_grad, on_step=on_step)
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for _ in range(a.steps):
                t0 = time.perf_counter()
                nc.train_iterations(net, loader, loss, opt, 1, device, scaler, on_gradients=on_grad, on_step=on_step)
                if device.type == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            state = sum(t.numel() * t.element_size() for d in (welford._mean, welford._m2) for t in d.values())
            sent = backbone_bytes * (2 if way != "fedavg" else 1)
            results[way] = statistics.median(times)
            out = {"way": way, "plans": a.plans, "center": a.center, "device": str(device),
                   "batch_size": a.batch_size or pipe.cm.batch_size, "patch": list(pipe.patch_size),
                   "median_step_s": round(results[way], 4), "time_ratio_to_fedavg": round(results[way] / results["fedavg"], 3),
                   "backbone_mib": round(backbone_bytes / 2**20, 2),
                   "extra_site_memory_x_backbone": round((state + (backbone_bytes if way != "fedavg" else 0)) / backbone_bytes, 2),
                   "bytes_sent_per_round_mib": round(sent / 2**20, 2)}
            if device.type == "cuda":
                out["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
            print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_fiva.py", main))
