#!/usr/bin/env python3
"""Prediction throughput against its limit (not a test): images/s of ``feduq.predict`` and of a plain forward loop.

On one center's real images (the first ``--images`` of its folder, at their original sizes) and a committed job
(default ``jobs/fedevi``: the paper's network and image size), with a seeded model of the job's network:

* **FedUQ**: :func:`feduq.predict.predict` end to end: decoding every file, the job's test-stage transforms, the
  network, the method's probabilities and uncertainty maps mapped back to each image's own size, the label map's
  post-processing, and every output file written (label, probability, uncertainty maps, overlay, CSV);
* **limit**: a plain PyTorch loop over the same network and batch size in eval mode: the same images already
  decoded, resized and stacked as one tensor on the device, forward + softmax + class map, nothing written.

One JSON line: ``{"job", "network", "image_size", "images", "batch_size", "device", "threads",
"feduq_images_per_s", "limit_images_per_s", "fraction"}``; the fraction FedUQ / limit is the figure of merit
(goal >= 0.8). Both are timed after a warm-up pass over the first batch.

    python tools/benchmark_predict.py --data-root ../shared/data --center Kvasir-SEG --images 48 --threads 2
"""

from __future__ import annotations

import argparse
import sys
import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]


def plain_images_per_s(model: torch.nn.Module, batch: torch.Tensor, batch_size: int, device: torch.device) -> float:
    """Images/s of forward + softmax + argmax over ``batch [N, C, S, S]`` (already on ``device``) in chunks."""
    def one_pass():
        for start in range(0, len(batch), batch_size):
            torch.softmax(model(batch[start:start + batch_size]).float(), dim=1).max(1).indices.cpu()

    with torch.no_grad():
        model(batch[:batch_size])  # warm-up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        one_pass()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return len(batch) / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True, help="FedUQ data root (the task's center folders)")
    p.add_argument("--center", default="Kvasir-SEG", help="center whose images are predicted")
    p.add_argument("--job", default=str(REPO / "jobs" / "fedevi"), help="a committed job folder")
    p.add_argument("--images", type=int, default=48, help="number of images")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from feduq.site.evaluation import client_config, load_model
    from feduq.core.networks import build_network
    from feduq.predict import Predictor, predict
    from feduq.inference.files import read_plane

    work = Path(tempfile.mkdtemp(prefix="feduq_bench_predict_"))
    config = client_config(args.job)
    spec = json.loads(config.read_text())["executors"][0]["executor"]["args"]
    from feduq.data import get_task

    task = get_task(spec["task"])
    images = sorted(p for p in (Path(args.data_root) / spec["task"] / args.center / "images").iterdir())[:args.images]
    try:
        (work / "in").mkdir()
        for image in images:
            shutil.copy(image, work / "in")
        net = build_network(spec["network"]["name"], task.in_channels, len(task.class_names))
        torch.save({"model": net.state_dict()}, work / "model.pt")
        loaded = load_model(config, work / "model.pt", device=args.device)
        device = torch.device(args.device)
        # warm-up through predict (first batch), then the timed run
        warm = work / "warm"
        warm.mkdir()
        for image in images[:args.batch_size]:
            shutil.copy(image, warm)
        predict(loaded, warm, work / "out_warm", batch_size=args.batch_size, progress=False)
        t0 = time.perf_counter()
        predict(loaded, work / "in", work / "out", batch_size=args.batch_size, progress=False)
        feduq = len(images) / (time.perf_counter() - t0)
        # the limit: the same images decoded and preprocessed outside the timing
        pre = Predictor(loaded, args.batch_size)
        from monai.data import MetaTensor

        batch = torch.stack([torch.as_tensor(pre.transform({"image": MetaTensor(torch.from_numpy(
            read_plane(i, task.in_channels)[0]))})["image"]).as_subclass(torch.Tensor) for i in images]).to(device)
        limit = plain_images_per_s(loaded.model, batch, args.batch_size, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"job": Path(args.job).name, "network": spec["network"]["name"],
                      "image_size": int(spec["image_size"]), "images": len(images), "batch_size": args.batch_size,
                      "device": str(device), "threads": args.threads, "feduq_images_per_s": round(feduq, 3),
                      "limit_images_per_s": round(limit, 3), "fraction": round(feduq / limit, 3)}))
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_predict.py", main))
