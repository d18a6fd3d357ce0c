#!/usr/bin/env python3
"""What a site process holds, one piece at a time (not a test): PSS after Python, torch, the 2D executor's imports,
the network, Adam, a few training steps and FLARE's ``cleanup_memory`` (gc + glibc's ``malloc_trim``, what a site
runs after every task), in one process without FLARE's runtime or a data cache.

    python tools/memory_breakdown.py --image-size 128 --batch-size 8 --amp off
    python tools/memory_breakdown.py --image-size 128 --batch-size 8 --amp bf16

Prints one line per stage: ``stage  PSS (MB)``, read from ``/proc/self/smaps_rollup`` (Linux).
"""

from __future__ import annotations

import argparse
import os
import sys


def pss_mb() -> float:
    """This process's proportional set size (MB)."""
    with open(f"/proc/{os.getpid()}/smaps_rollup") as f:
        for line in f:
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no Pss line in /proc/self/smaps_rollup")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--network", default="fedevi_unet")
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--amp", choices=["off", "bf16"], default="off", help="bfloat16 autocast for the training steps")
    a = p.parse_args(argv)
    stages = [("python", pss_mb())]
    import torch

    stages.append(("+ torch", pss_mb()))
    import feduq.flare.executor  # noqa: F401  the 2D site's imports (MONAI, FLARE, SciPy, scikit-image, ...)

    stages.append(("+ the 2D executor's imports", pss_mb()))
    from nvflare.fuel.utils.memory_utils import cleanup_memory

    from feduq.core.networks import build_network

    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = build_network(a.network, 3, 2)
    stages.append((f"+ the network ({a.network})", pss_mb()))
    opt = torch.optim.Adam(model.parameters())
    stages.append(("+ Adam (imports torch._dynamo)", pss_mb()))
    peak = 0.0
    for _ in range(a.steps):
        x = torch.rand(a.batch_size, 3, a.image_size, a.image_size)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=a.amp == "bf16"):
            loss = model(x).float().square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        peak = max(peak, pss_mb())
    del loss, x
    stages.append((f"after {a.steps} steps ({a.amp}; highest after a step: {peak:.0f})", pss_mb()))
    cleanup_memory()
    stages.append(("after cleanup_memory (between tasks)", pss_mb()))
    for name, mb in stages:
        print(f"{name:60s} {mb:7.0f}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("memory_breakdown.py", main))
