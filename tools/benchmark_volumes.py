#!/usr/bin/env python3
"""A site given as NIfTI volumes (nnU-Net's raw layout) against the same slices given as PNG files (FedUQ's layout):
the seconds of one site round, and their ratio against the limit 1.1 (not a test).

Both sites hold the same cases of one prostate center (``feduq convert nnunet-raw`` stacks its slices into
volumes), the same split (every case trains), the same task (one T2 channel, ``noNorm``, so both go through the
job's own intensity step) and so the same samples. One "round" is what a site does in a round from a cold start:
reading and caching its training split (:func:`feduq.data.get_dataset`; the volumes are read and sliced once), then
``--epochs`` local epochs of FedUQ's training core (``LocalTrainer``, Dice + CE, the site's loader). The two layouts
run alternately ``--repeats`` times in this process; the medians and ``ratio = volumes / png`` are printed as one
JSON line, with ``ok`` (ratio <= 1.1) and the two reading times alone.

    python tools/benchmark_volumes.py --data-root ../shared/data --center RUNMC --cases 12 --image-size 64

The PNG side is the volume task declared as a 2D task (``file_ending`` ``.png``, the name
``Dataset991_BenchmarkMRSlices``; channel, labels and normalisation the same) in FedUQ's own layout (``images/``,
``masks/``, ``labels.json``, ``split.json``): FedUQ reads a task that declares 3D volumes from nnU-Net's layout only.
So the figure compares reading volumes (nnU-Net layout) with reading the same slices as PNG files (FedUQ's layout),
the training after it being the same. The suite's smoke run (tests/repository/test_benchmark_tools.py):
``--cases 1 --image-size 32 --epochs 1 --repeats 1 --limit 100``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

LIMIT = 1.1
NAME = "Dataset990_BenchmarkMR"
#: the PNG side's task: NAME's declaration as a 2D task (file ending ``.png``), the only difference between the two
SLICES_NAME = "Dataset991_BenchmarkMRSlices"


def build(data_root: Path, center: str, cases: int, work: Path) -> tuple[Path, Path, dict, dict]:
    """``(NIfTI data root, PNG data root, volume task declaration, slice task declaration)`` of the same cases: the
    slice task is the volume task declared as 2D (``file_ending`` ``.png``), read from FedUQ's own layout (``images/``,
    ``masks/``, ``labels.json``, ``split.json``), since FedUQ reads a 3D task from nnU-Net's layout only."""
    from feduq.data.convert import nnunet_raw as mk

    nifti, png = work / "nifti", work / "png"
    names = mk.prostate_site(data_root, center, nifti / NAME / "Site", max_cases=cases)
    split = {"training": names, "validation": [], "testing": []}
    (nifti / NAME / "Site" / "split.json").write_text(json.dumps(split))
    site = png / SLICES_NAME / "Site"
    (site / "images").mkdir(parents=True)
    (site / "masks").mkdir()
    rows = {c.lower(): r for c, r in mk.prostate_cases(data_root, center).items()}
    items = []
    for case in names:
        for r in rows[case]:
            for key, sub in (("image_file", "images"), ("mask_file", "masks")):
                shutil.copy(data_root / "prostate" / center / r[key], site / sub / Path(r[key]).name)
            items.append({"image": r["image_file"], "label": r["mask_file"]})
    (site / "labels.json").write_text(json.dumps({"labels": {"0": "background", "1": "PZ", "2": "TZ"}}))
    (site / "split.json").write_text(json.dumps({"training": items, "validation": [], "testing": []}))
    task = {"name": NAME, "channel_names": {"0": "T2"}, "labels": dict(mk.PROSTATE_LABELS), "file_ending": ".nii.gz",
            "feduq": {"sites": ["Site"], "normalization": {"0": "noNorm"}}}
    return nifti, png, task, {**task, "name": SLICES_NAME, "file_ending": ".png"}


def one_round(task, root: Path, image_size: int, epochs: int, batch_size: int, seed: int) -> tuple[float, float, int]:
    """``(seconds of the round, seconds of reading the split, samples)`` from a cold start."""
    import torch
    from monai.losses import DiceCELoss

    from feduq import data as fdata
    from feduq.core.networks import build_network
    from feduq.core.training import LocalTrainer
    from feduq.site.settings import training_loader

    start = time.perf_counter()
    ds = fdata.get_dataset(task, "Site", "train", data_root=root, image_size=image_size, resize="letterbox",
                           intensity="max", seed=seed)
    read = time.perf_counter() - start
    torch.manual_seed(seed)
    device = torch.device("cpu")
    trainer = LocalTrainer(build_network("light", 1, 3), device, amp=False)
    trainer.train_epochs(training_loader(ds, batch_size, seed, device, 0), epochs,
                         DiceCELoss(to_onehot_y=True, softmax=True))
    return time.perf_counter() - start, read, len(ds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, required=True, help="FedUQ-layout data root holding prostate/<center>/")
    p.add_argument("--center", default="RUNMC")
    p.add_argument("--cases", type=int, default=12)
    p.add_argument("--image-size", type=int, default=64)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1: both layouts alike)")
    p.add_argument("--limit", type=float, default=LIMIT, help=f"the ratio volumes / PNG above which it exits 1 "
                   f"(default {LIMIT}; the suite's smoke run, one tiny round, passes a large one)")
    a = p.parse_args(argv)
    from feduq.common.lean_monai import defer_monai_lean

    defer_monai_lean()  # MONAI without the optional packages no site process loads (as a site imports it)
    import torch

    torch.set_num_threads(a.threads)
    from feduq.data import job_task

    work = Path(tempfile.mkdtemp(prefix="feduq-bench-volumes-"))
    try:
        nifti, png, task, slices = build(a.data_root, a.center, a.cases, work)
        specs = {"volumes": job_task(task), "png": job_task(slices)}
        times = {"volumes": [], "png": []}
        reads = {"volumes": [], "png": []}
        n = {}
        for _ in range(a.repeats):
            for kind, root in (("volumes", nifti), ("png", png)):
                seconds, read, n[kind] = one_round(specs[kind].name, root, a.image_size, a.epochs, a.batch_size, 0)
                times[kind].append(seconds)
                reads[kind].append(read)
        if n["volumes"] != n["png"]:
            raise RuntimeError(f"the layouts gave {n['volumes']} and {n['png']} samples; they must be the same slices")
        med = {k: statistics.median(v) for k, v in times.items()}
        ratio = med["volumes"] / med["png"]
        print(json.dumps({"center": a.center, "cases": a.cases, "slices": n["png"], "image_size": a.image_size,
                          "epochs": a.epochs, "repeats": a.repeats, "round_s_volumes": round(med["volumes"], 3),
                          "round_s_png": round(med["png"], 3),
                          "read_s_volumes": round(statistics.median(reads["volumes"]), 3),
                          "read_s_png": round(statistics.median(reads["png"]), 3),
                          "ratio": round(ratio, 4), "limit": a.limit, "ok": ratio <= a.limit}))
        return 0 if ratio <= a.limit else 1
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
