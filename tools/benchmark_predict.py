#!/usr/bin/env python3
"""Prediction throughput against its limit (not a test): images/s of ``feduq.predict`` and of a plain forward loop,
and the host's work per case.

On one center's images (the first ``--images`` of its folder, at their original sizes; real or made by
``feduq synthetic``) and a committed job (default ``jobs/fedevi``: the paper's network and image size), with a
seeded model of the job's network:

* **FedUQ**: :func:`feduq.predict.pipeline.predict` end to end with ``--outputs`` (default predict's own: the label map and the
  method's uncertainty map, and the CSV): decoding every file, the job's test-stage transforms, the network, the
  method's probabilities and uncertainty mapped back to each image's own size, the label map's post-processing, and
  the files written;
* **limit**: a plain PyTorch loop over the same network and batch size in eval mode: the same images already
  decoded, resized and stacked as one tensor on the device, forward + softmax + class map, nothing written.

One JSON line: ``{"job", "network", "image_size", "images", "batch_size", "device", "threads", "outputs",
"feduq_images_per_s", "limit_images_per_s", "fraction", "host_ms_per_case"}``; the fraction FedUQ / limit is the figure
of merit (goal >= 0.8 with ``--outputs label``). ``host_ms_per_case`` is everything but the network, per case:
:func:`feduq.predict.pipeline.predict` timed once more with the network replaced by :class:`StandIn` (logits of the same shape
from the image's channel mean: a few elementwise operations, no convolution), in ms (goal on a CPU: <= 25 ms at 384 px with the default outputs).
All are timed after a warm-up pass over the first batch.

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

from feduq.common.lean_monai import defer_monai_lean

defer_monai_lean()  # MONAI without the optional packages no site process loads (as a site imports it)

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


class StandIn(torch.nn.Module):
    """A network of no cost: logits ``[B, C, S, S]`` from the channel mean m of the input, class 0 scored -z and every
    other class +z with z = 20 (m - mean of m), so the label map has foreground and background to post-process."""

    def __init__(self, num_classes: int):
        super().__init__()
        self.num_classes = num_classes

    def forward(self, x):
        m = x.float().mean(dim=1, keepdim=True)
        z = 20 * (m - m.mean())
        return torch.cat([-z] + [z] * (self.num_classes - 1), dim=1)


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
    p.add_argument("--outputs", default=None, help="predict's --outputs (default: its own default)")
    p.add_argument("--task", default=None, help="the task folder under --data-root (default: the job's task)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    from feduq.site.evaluation import client_config, load_model
    from feduq.core.networks import build_network
    from feduq.predict.pipeline import predict
    from feduq.predict.planes import Predictor
    from feduq.predict.planes import parse_outputs
    from feduq.predict.files import read_plane

    work = Path(tempfile.mkdtemp(prefix="feduq_bench_predict_"))
    config = client_config(args.job)
    spec = json.loads(config.read_text())["executors"][0]["executor"]["args"]
    from feduq.data import job_task

    task = job_task(spec["task"])
    folder = Path(args.data_root) / (args.task or spec["task"]) / args.center / "images"
    if not folder.is_dir():
        raise ValueError(f"--data-root/--center: {folder} is not a folder of images")
    images = sorted(p for p in folder.iterdir())[:args.images]
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
        predict(loaded, warm, work / "out_warm", batch_size=args.batch_size, progress=False, outputs=args.outputs)
        t0 = time.perf_counter()
        predict(loaded, work / "in", work / "out", batch_size=args.batch_size, progress=False, outputs=args.outputs)
        feduq = len(images) / (time.perf_counter() - t0)
        network = loaded.model
        loaded.model = StandIn(len(task.class_names))
        t0 = time.perf_counter()
        predict(loaded, work / "in", work / "out_host", batch_size=args.batch_size, progress=False,
                outputs=args.outputs)
        host_ms = (time.perf_counter() - t0) / len(images) * 1000
        loaded.model = network
        # the limit: the same images decoded and preprocessed outside the timing
        pre = Predictor(loaded, args.batch_size)
        batch = pre.inputs([read_plane(i, task.in_channels)[0] for i in images]).to(device)
        limit = plain_images_per_s(loaded.model, batch, args.batch_size, device)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps({"job": Path(args.job).name, "network": spec["network"]["name"],
                      "image_size": int(spec["image_size"]), "images": len(images), "batch_size": args.batch_size,
                      "device": str(device), "threads": args.threads,
                      "outputs": ",".join(parse_outputs(args.outputs)), "feduq_images_per_s": round(feduq, 3),
                      "limit_images_per_s": round(limit, 3), "fraction": round(feduq / limit, 3),
                      "host_ms_per_case": round(host_ms, 2)}))
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_predict.py", main))
