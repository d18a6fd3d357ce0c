#!/usr/bin/env python3
"""Local-training throughput of one site (not a test): images per second and peak memory.

Runs FedUQ's shared training core (``LocalTrainer`` with the method's loss) on one center's real
training split, without FLARE, on the device ``--device`` resolves to (CUDA when available), and
prints one JSON line per (method, image size):

    {"method", "image_size", "device", "train_images_per_s", "eval_images_per_s",
     "peak_gpu_mem_gib" (CUDA only), "steps", "seconds"}

The first epoch (CacheDataset fill, cuDNN autotuning) is excluded from the timing.

    python tools/benchmark_throughput.py --data-root ../shared/data --task polyp \
        --center Kvasir-SEG --image-sizes 128 384 --methods fedavg fedevi
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from monai.data import DataLoader
from monai.losses import DiceCELoss

from feduq import data as fdata
from feduq.engine import LocalTrainer, resolve_device, validation_dice
from feduq.evidential import FedEviLoss
from feduq.networks import SegUNet


def method_loss(method: str):
    """``(logits, label) -> loss`` of ``method`` as its executor builds it (round 1 annealing)."""
    if method == "fedevi":
        loss = FedEviLoss()
        return lambda logits, label: loss(logits, label, 1)
    if method == "fedavg":
        return DiceCELoss(to_onehot_y=True, softmax=True)
    raise ValueError(f"--methods: unknown method {method!r} (expected fedavg or fedevi)")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args, method: str, image_size: int) -> dict:
    spec = fdata.get_task(args.task)
    device = resolve_device(args.device)
    common = dict(data_root=args.data_root, image_size=image_size, max_items=args.max_items)
    train = fdata.get_dataset(args.task, args.center, "train", **common)
    val = fdata.get_dataset(args.task, args.center, "val", **common)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        num_workers=args.num_workers)
    torch.manual_seed(0)
    trainer = LocalTrainer(SegUNet(in_channels=spec.in_channels, out_channels=len(spec.class_names)), device)
    loss = method_loss(method)
    trainer.train_epochs(loader, 1, loss)  # warm-up: cache fill, cuDNN autotuning
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    stats = trainer.train_epochs(loader, args.epochs, loss)
    sync(device)
    train_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    validation_dice(trainer.model, DataLoader(val, batch_size=1), device, len(spec.class_names))
    sync(device)
    eval_s = time.perf_counter() - t0
    out = {
        "method": method,
        "image_size": image_size,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "train_images_per_s": round(stats.num_samples / train_s, 1),
        "eval_images_per_s": round(len(val) / eval_s, 1),
        "steps": stats.num_steps,
        "seconds": round(train_s, 2),
    }
    if device.type == "cuda":
        out["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return out


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True)
    p.add_argument("--task", default="polyp")
    p.add_argument("--center", default="Kvasir-SEG")
    p.add_argument("--image-sizes", type=int, nargs="+", default=[128, 384])
    p.add_argument("--methods", nargs="+", default=["fedavg", "fedevi"])
    p.add_argument("--epochs", type=int, default=2, help="timed local epochs (after one warm-up epoch)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--max-items", type=int, default=None)
    p.add_argument("--device", default="auto")
    args = p.parse_args(argv)
    for size in args.image_sizes:
        for method in args.methods:
            print(json.dumps(run(args, method, size)), flush=True)


if __name__ == "__main__":
    main()
