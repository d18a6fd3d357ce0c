#!/usr/bin/env python3
"""Local-training throughput of one site against its limit (not a test): images/s, fraction, memory.

For each (network, image size, method) it measures, on the device ``--device`` resolves to:

* **FedUQ**: FedUQ's shared training core (``LocalTrainer`` with the method's loss, AMP on CUDA)
  over one center's training split (real, or ``feduq synthetic``'s) through FedUQ's dataset and the site's own
  training loader with the site's defaults (:func:`feduq.site.settings.training_loader`: ``--num-workers auto`` = 0
  on a CPU, ``min(4, CPUs // 2)`` with pinned memory on CUDA; the committed jobs' letterbox and x / max), without
  FLARE; then the site's validation of that model (:func:`feduq.scores.scoring.validation_scores` with the method's
  probabilities, the site's validation batch :func:`feduq.site.setup.eval_batch_size`);
* **limit**: a plain PyTorch loop over the same network, batch size, loss and optimiser on one
  batch of tensors already on the device (no dataset, no loader, no FedUQ code), with the same
  precision and memory format (``--amp``, ``--channels-last``);
* **fp32 plain**: the same plain loop in float32 and the default memory format, the reference every
  speed-up is stated against (``ratio_to_fp32_plain`` = FedUQ / fp32 plain);
* **eval limit**: a plain no-grad forward loop over the same validation images, already stacked on the device, in
  the validation's batches (``eval_fraction`` = validation / eval limit; goal >= 0.5 on a GPU, >= 0.8 on a CPU);

and prints one JSON line ``{"network", "params", "image_size", "method", "device", "amp", "feduq_images_per_s",
"limit_images_per_s", "fraction", "fp32_plain_images_per_s", "ratio_to_fp32_plain", "eval_images_per_s", "eval_limit_images_per_s", "eval_fraction",
"num_workers", "loader_ms_per_image" (one pass over the training loader in the main process, no workers, nothing
trained: the host's work per image), "eval_batch_size", "peak_gpu_mem_gib" (CUDA), "steps", "seconds"}``.
The fraction FedUQ / limit is the figure of merit (goal >= 0.9 on CPU, >= 0.8 on GPU with AMP). The
first epoch (cache fill, cuDNN autotuning) and the limit's first steps are excluded from the timing.

    python tools/benchmark_throughput.py --data-root ../shared/data --task polyp --center Kvasir-SEG \
        --networks light fedevi_unet --image-sizes 96 128 --methods fedavg fedevi
"""

from __future__ import annotations

import argparse
import sys
import json
import time

from feduq.common.lean_monai import defer_monai_lean

defer_monai_lean()  # MONAI without the optional packages no site process loads (as a site imports it)

import torch  # noqa: E402
from monai.data import DataLoader  # noqa: E402
from monai.losses import DiceCELoss  # noqa: E402

from feduq import data as fdata  # noqa: E402
from feduq.core.training import LocalTrainer, resolve_device, softmax_probs, to_device  # noqa: E402
from feduq.scores.scoring import validation_scores  # noqa: E402
from feduq.core.evidential import dirichlet_from_logits  # noqa: E402
from feduq.core.evidential_loss import FedEviLoss  # noqa: E402
from feduq.site.settings import loader_workers, training_loader  # noqa: E402
from feduq.site.setup import eval_batch_size  # noqa: E402
from feduq.core.networks import build_network, count_parameters  # noqa: E402


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


def limit_images_per_s(network: str, spec, image_size: int, method: str, batch_size: int, steps: int,
                       device: torch.device, autocast_dtype: torch.dtype | None = None,
                       channels_last: bool = False) -> float:
    """Images/s of a plain PyTorch loop: the same network, loss and Adam on one in-memory batch, with the forward
    pass autocast to ``autocast_dtype`` (None: float32; float16 adds a GradScaler)."""
    torch.manual_seed(0)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    model = build_network(network, spec.in_channels, len(spec.class_names)).to(device, memory_format=fmt).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=1e-5)
    scaler = torch.amp.GradScaler("cuda", enabled=autocast_dtype == torch.float16)
    loss_fn = method_loss(method)
    x = torch.rand(batch_size, spec.in_channels, image_size, image_size, device=device).to(memory_format=fmt)
    y = torch.randint(0, len(spec.class_names), (batch_size, 1, image_size, image_size), device=device)

    def step():
        with torch.autocast(device_type=device.type, dtype=autocast_dtype or torch.bfloat16,
                            enabled=autocast_dtype is not None):
            logits = model(x)
        loss = loss_fn(logits.float(), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for _ in range(3):  # warm-up
        step()
    sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync(device)
    return steps * batch_size / (time.perf_counter() - t0)


def method_probabilities(method: str):
    """``logits -> probabilities`` of ``method`` as its site scores validation (FedEvi: the Dirichlet mean α/S)."""
    if method == "fedevi":
        return lambda logits: dirichlet_from_logits(logits, clamp_max=80.0).prob
    return softmax_probs


@torch.no_grad()
def eval_limit_images_per_s(model: torch.nn.Module, images: torch.Tensor, batch_size: int,
                            device: torch.device) -> float:
    """Images/s of a plain no-grad forward pass over ``images [N, C, S, S]`` already on ``device``, in batches."""
    model.eval()
    model(images[:batch_size])
    sync(device)
    t0 = time.perf_counter()
    for start in range(0, len(images), batch_size):
        model(images[start:start + batch_size])
    sync(device)
    return len(images) / (time.perf_counter() - t0)


def run(args, network: str, method: str, image_size: int) -> dict:
    spec = fdata.get_task(args.task)
    device = resolve_device(args.device)
    common = dict(data_root=args.data_root, image_size=image_size, max_items=args.max_items, resize=args.resize,
                  intensity=args.intensity)
    train = fdata.get_dataset(args.task, args.center, "train", **common)
    val = fdata.get_dataset(args.task, args.center, "val", **common)
    loader = training_loader(train, args.batch_size, 0, device, args.num_workers)
    torch.manual_seed(0)
    model = build_network(network, spec.in_channels, len(spec.class_names))
    trainer = LocalTrainer(model, device, amp=args.amp, channels_last=args.channels_last)
    loss = method_loss(method)
    trainer.train_epochs(loader, 1, loss)  # warm-up: cache fill, cuDNN autotuning
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    t0 = time.perf_counter()
    stats = trainer.train_epochs(loader, args.epochs, loss)
    sync(device)
    train_s = time.perf_counter() - t0
    eval_batch = eval_batch_size(args.batch_size, device)
    val_loader = DataLoader(val, batch_size=eval_batch, pin_memory=device.type == "cuda")
    prob_fn = method_probabilities(method)
    validation_scores(trainer.model, val_loader, device, len(spec.class_names), None, prob_fn)  # warm-up
    sync(device)
    t0 = time.perf_counter()
    validation_scores(trainer.model, val_loader, device, len(spec.class_names), None, prob_fn)
    sync(device)
    eval_s = time.perf_counter() - t0
    stacked = to_device(torch.stack([torch.as_tensor(val[i]["image"]) for i in range(len(val))]), device)
    eval_limit = eval_limit_images_per_s(trainer.model, stacked, eval_batch, device)
    feduq = stats.num_samples / train_s
    # the host's work per training image: one pass over the site's loader in this process, nothing trained
    t0 = time.perf_counter()
    seen = sum(int(b["image"].shape[0]) for b in training_loader(train, args.batch_size, 0, device, 0))
    loader_ms = (time.perf_counter() - t0) / max(seen, 1) * 1000
    limit_steps = max(5, min(stats.num_steps, args.limit_steps))
    limit = limit_images_per_s(network, spec, image_size, method, args.batch_size, limit_steps, device,
                               autocast_dtype=trainer.autocast_dtype, channels_last=args.channels_last)
    fp32 = limit_images_per_s(network, spec, image_size, method, args.batch_size, limit_steps, device)
    out = {
        "network": network,
        "params": count_parameters(model),
        "image_size": image_size,
        "method": method,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu x{torch.get_num_threads()}",
        "torch": torch.__version__,
        "amp": str(trainer.autocast_dtype).replace("torch.", "") if trainer.amp else "float32",
        "channels_last": args.channels_last,
        "feduq_images_per_s": round(feduq, 1),
        "limit_images_per_s": round(limit, 1),
        "fraction": round(feduq / limit, 3),
        "fp32_plain_images_per_s": round(fp32, 1),
        "ratio_to_fp32_plain": round(feduq / fp32, 3),
        "eval_images_per_s": round(len(val) / eval_s, 1),
        "eval_limit_images_per_s": round(eval_limit, 1),
        "eval_fraction": round(len(val) / eval_s / eval_limit, 3),
        "num_workers": loader_workers(args.num_workers, device),
        "loader_ms_per_image": round(loader_ms, 2),
        "eval_batch_size": eval_batch,
        "steps": stats.num_steps,
        "seconds": round(train_s, 2),
    }
    if device.type == "cuda":
        out["peak_gpu_mem_gib"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    return out


def _amp_arg(value: str):
    return {"auto": "auto", "true": True, "on": True, "false": False, "off": False, "bf16": "bf16"}[value.lower()]


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True)
    p.add_argument("--task", default="polyp")
    p.add_argument("--center", default="Kvasir-SEG")
    p.add_argument("--networks", nargs="+", default=["fedevi_unet", "light"])
    p.add_argument("--image-sizes", type=int, nargs="+", default=[128, 384])
    p.add_argument("--methods", nargs="+", default=["fedavg", "fedevi"])
    p.add_argument("--epochs", type=int, default=1, help="timed local epochs (after one warm-up epoch)")
    p.add_argument("--limit-steps", type=int, default=30, help="timed steps of the plain loop")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", default="auto",
                   help="training-loader workers: auto (the site's default: 0 on a CPU, min(4, CPUs // 2) on CUDA) or N")
    p.add_argument("--resize", default="letterbox", help="the committed jobs' letterbox (or stretch)")
    p.add_argument("--intensity", default="max", help="the committed jobs' x / max (or minmax)")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--max-items", type=int, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument("--amp", type=_amp_arg, default="auto",
                   help="auto (float16 autocast + GradScaler on CUDA; on a CPU with bfloat16 hardware bfloat16 for a "
                        "network without BatchNorm; else float32), true, false, or bf16 (bfloat16 on either device)")
    p.add_argument("--channels-last", action="store_true", help="channels_last memory format")
    args = p.parse_args(argv)
    if args.num_workers != "auto":
        args.num_workers = int(args.num_workers)
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    for network in args.networks:
        for size in args.image_sizes:
            for method in args.methods:
                print(json.dumps(run(args, network, method, size)), flush=True)


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_throughput.py", main))
