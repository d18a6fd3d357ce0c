#!/usr/bin/env python3
"""A 3D site's training iteration and sliding-window predict against nnU-Net's own, same plan, data and device (not
a test).

One prostate center of ``--data-root`` is restacked into NIfTI volumes (``feduq convert nnunet-raw``, in a scratch
folder), its federated plan made (:mod:`feduq.nnunet.federated_plans`; the slim plan unless ``--full-plan``) and its
cases preprocessed by nnU-Net's preprocessor. Then, interleaved, ``--warmup`` + ``--iterations`` times each:

* **iteration**: FedUQ's (:class:`feduq.core.training.LocalTrainer` as :class:`feduq.site.site3d.Site3D` sets it up:
  nnU-Net's SGD, its Dice + CE with deep supervision, clipping at 12, one batch of nnU-Net's loader) against
  ``nnUNetTrainer.train_step`` itself on the same plan's network (the same initial weights), optimiser and loss, each
  with its own loader of the same kind; each time includes drawing the batch (``next(loader)``, augmentation in this
  process on both sides: ``nnUNet_n_proc_DA`` 0);
* **predict**: :func:`feduq.nnunet.volume_inference.sliding_window_logits` (MONAI, overlap 0.5, Gaussian) against
  ``nnUNetPredictor.predict_sliding_window_return_logits`` (tile step 0.5, Gaussian) on the same preprocessed volume,
  both without test-time mirroring (as the sites' test task predicts), or both with it over the plan's mirror axes
  with ``--mirror`` (nnU-Net's default, ``predict --mirror``).

Reported (one JSON line each): the medians after warm-up, the ratio FedUQ / nnU-Net with a bootstrap 95 % interval
over the interleaved pairs, against the limit 1.1; torch threads, batch, AMP (float16 on CUDA on both sides, none on
a CPU), neither side compiled; the process's peak resident memory (MiB).

    python tools/benchmark_3d.py --data-root ../shared/data --center RUNMC --cases 6 --iterations 20 [--mirror]
    python tools/benchmark_3d.py --synthetic --cases 6 --device cuda --full-plan    # the GPU check's 3D step
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
LIMIT = 1.1
NAME = "Dataset994_Benchmark3D"


def ratio_ci(a: list[float], b: list[float], seed: int = 0, n_boot: int = 2000) -> tuple[float, float]:
    """Bootstrap 95 % interval of median(a) / median(b) over paired draws."""
    rng = np.random.default_rng(seed)
    a, b = np.asarray(a), np.asarray(b)
    idx = rng.integers(0, len(a), size=(n_boot, len(a)))
    r = np.median(a[idx], axis=1) / np.median(b[idx], axis=1)
    return float(np.quantile(r, 0.025)), float(np.quantile(r, 0.975))


def synthetic_site(site: Path, cases: int, seed: int = 0) -> None:
    """``cases`` synthetic MR-like volumes (nnU-Net's raw layout, 24 x 160 x 160 voxels of 0.5 x 0.5 x 3 mm): a
    noisy background with an ellipsoid gland whose inner half is the second label (the GPU check's data: the real data
    does not travel)."""
    import nibabel as nib

    rng = np.random.default_rng(seed)
    (site / "imagesTr").mkdir(parents=True, exist_ok=True)
    (site / "labelsTr").mkdir(exist_ok=True)
    x, y, z = np.meshgrid(np.arange(160), np.arange(160), np.arange(24), indexing="ij")
    for i in range(cases):
        c = rng.uniform([60, 60, 8], [100, 100, 16])
        r = rng.uniform([20, 20, 4], [35, 35, 7])
        d = ((x - c[0]) / r[0]) ** 2 + ((y - c[1]) / r[1]) ** 2 + ((z - c[2]) / r[2]) ** 2
        label = np.where(d < 0.35, 2, np.where(d < 1, 1, 0)).astype(np.uint8)
        image = (rng.normal(100, 20, label.shape) + 60 * (label > 0) + 30 * (label == 2)).astype(np.float32)
        affine = np.diag([0.5, 0.5, 3.0, 1.0])
        nib.save(nib.Nifti1Image(image, affine), str(site / "imagesTr" / f"case{i:02d}_0000.nii.gz"))
        nib.save(nib.Nifti1Image(label, affine), str(site / "labelsTr" / f"case{i:02d}.nii.gz"))
    (site / "dataset.json").write_text(json.dumps({"channel_names": {"0": "T2"}, "labels": {
        "background": 0, "PZ": 1, "TZ": 2}, "numTraining": cases, "file_ending": ".nii.gz"}))


def setup(a, work: Path):
    """The site, its plan and its preprocessed cases: ``(pipeline, plans, folder, case ids, declaration)``."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from feduq.data import job_task
    from feduq.nnunet import federated_plans as fpl
    from feduq.nnunet.pipeline import SitePipeline

    site = work / NAME / a.center
    if a.synthetic:
        synthetic_site(site, a.cases)
    else:
        subprocess.run([sys.executable, "-m", "feduq", "convert", "nnunet-raw", "--data-root",
                        str(a.data_root), "--prostate", a.center, "--out", str(site), "--cases", str(a.cases)],
                       check=True, capture_output=True)
    decl = {"name": NAME, "channel_names": {"0": "T2"}, "labels": {"background": 0, "PZ": 1, "TZ": 2},
            "file_ending": ".nii.gz", "feduq": {"sites": [a.center]}}
    cases = sorted(p.name[: -len("_0000.nii.gz")] for p in (site / "imagesTr").iterdir())
    files = [([site / "imagesTr" / f"{c}_0000.nii.gz"], site / "labelsTr" / f"{c}.nii.gz") for c in cases]
    fp = fpl.site_fingerprint(files, SimpleITKIO, fpl.samples_per_case(len(files), a.foreground_voxels), a.center)
    plans = fpl.plan_from_fingerprint(decl, fpl.merge_fingerprints({a.center: fp}), "SimpleITKIO")
    plans = plans if a.full_plan else fpl.slim_plan_3d(plans)
    spec = job_task(decl)
    pipe = SitePipeline(plans, spec.class_names[1:], configuration="3d_fullres", dataset_json={
        "channel_names": {0: "T2"}, "labels": {n: i for i, n in enumerate(spec.class_names)},
        "file_ending": ".nii.gz"})
    folder = work / "preprocessed"
    pipe.preprocess_files_to_folder([(c, f[0], f[1]) for c, f in zip(cases, files)], folder)
    return pipe, plans, folder, cases, spec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, help="the FedUQ-layout data root holding prostate/<center>/")
    p.add_argument("--synthetic", action="store_true", help="synthetic volumes instead (the GPU check's data)")
    p.add_argument("--center", default="RUNMC")
    p.add_argument("--cases", type=int, default=6)
    p.add_argument("--iterations", type=int, default=20, help="timed iterations per side (after the warm-up)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--predict-repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--full-plan", action="store_true", help="nnU-Net's own network (default: the slim plan)")
    p.add_argument("--mirror", action="store_true", help="predict with test-time mirroring on both sides")
    p.add_argument("--foreground-voxels", type=float, default=1e6, help="fingerprint samples (nnU-Net: 10e7)")
    a = p.parse_args(argv)
    if a.data_root is None and not a.synthetic:
        p.error("give --data-root, or --synthetic")
    if min(a.cases, a.iterations, a.warmup + 1, a.predict_repeats) < 1:
        p.error("--cases, --iterations and --predict-repeats must be >= 1, --warmup >= 0")
    import copy
    from types import SimpleNamespace

    import torch
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor
    from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer
    from nnunetv2.training.dataloading.nnunet_dataset import nnUNetDatasetBlosc2

    from feduq.core.training import LocalTrainer
    from feduq.nnunet.pipeline import make_optimizer
    from feduq.nnunet.planned import PlannedNetwork
    from feduq.nnunet.volume_inference import sliding_window_logits
    from feduq.site.site3d import _Iterations

    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory(prefix="feduq-bench3d-") as tmp:
        pipe, plans, folder, cases, spec = setup(a, Path(tmp))
        ours = PlannedNetwork(plans, "3d_fullres", 1, len(spec.class_names))
        theirs = copy.deepcopy(ours.net)  # the same initial weights
        trainer = LocalTrainer(ours, device, lr=0.01, weight_decay=3e-5, amp=bool(cuda))
        sgd = make_optimizer(trainer.model)  # nnU-Net's SGD; the schedule is constant over the benchmark
        trainer.set_optimizer(sgd, torch.optim.lr_scheduler.LambdaLR(sgd, lambda r: 1.0))
        trainer.clip_grad_norm = 12.0
        loss_ours = pipe.build_loss()
        loader_ours = _Iterations(pipe.make_loader(folder, cases, seed=0), 1)
        theirs = theirs.to(device)
        stand_in = SimpleNamespace(network=theirs, optimizer=make_optimizer(theirs), loss=pipe.build_loss(),
                                   grad_scaler=torch.amp.GradScaler("cuda") if cuda else None, device=device)
        loader_theirs = pipe.make_loader(folder, cases, seed=1)
        t_ours, t_theirs = [], []
        for i in range(a.warmup + a.iterations):
            t0 = time.perf_counter()
            trainer.train_epochs(loader_ours, 1, lambda lo, la: loss_ours(lo, la))
            if cuda:
                torch.cuda.synchronize()
            t1 = time.perf_counter()
            theirs.train()
            nnUNetTrainer.train_step(stand_in, next(loader_theirs))
            if cuda:
                torch.cuda.synchronize()
            t2 = time.perf_counter()
            if i >= a.warmup:
                t_ours.append(t1 - t0)
                t_theirs.append(t2 - t1)
        common = {"threads": torch.get_num_threads(), "batch": int(pipe.cm.batch_size), "amp": "float16" if cuda else
                  "none", "compiled": False, "device": str(device), "patch": list(pipe.patch_size),
                  "plan": plans["plans_name"], "n_proc_DA": 0}
        lo, hi = ratio_ci(t_ours, t_theirs)
        r = statistics.median(t_ours) / statistics.median(t_theirs)
        print(json.dumps({"figure": "iteration", "feduq_s": round(statistics.median(t_ours), 4),
                          "nnunet_s": round(statistics.median(t_theirs), 4), "ratio": round(r, 3),
                          "ci95": [round(lo, 3), round(hi, 3)], "limit": LIMIT, "within": hi <= LIMIT,
                          "n": len(t_ours), **common}), flush=True)
        data, _, _, _ = nnUNetDatasetBlosc2(str(folder), cases[:1]).load_case(cases[0])
        data = np.asarray(data[:], dtype=np.float32)
        theirs.decoder.deep_supervision = False
        axes = tuple(pipe.augmentation()[3]) if a.mirror else ()
        predictor = nnUNetPredictor(tile_step_size=0.5, use_gaussian=True, use_mirroring=bool(a.mirror),
                                    perform_everything_on_device=cuda, device=device, allow_tqdm=False)
        predictor.manual_initialization(theirs, pipe.pm, pipe.cm, [theirs.state_dict()], pipe.dataset_json,
                                        "nnUNetTrainer", axes or None)
        ours.eval()
        p_ours, p_theirs = [], []
        for _ in range(a.predict_repeats + 1):
            t0 = time.perf_counter()
            sliding_window_logits(ours, data, pipe.patch_size, device, mirror_axes=axes)
            t1 = time.perf_counter()
            predictor.predict_sliding_window_return_logits(torch.from_numpy(data))
            t2 = time.perf_counter()
            p_ours.append(t1 - t0)
            p_theirs.append(t2 - t1)
        p_ours, p_theirs = p_ours[1:], p_theirs[1:]  # the first is a warm-up
        lo, hi = ratio_ci(p_ours, p_theirs)
        r = statistics.median(p_ours) / statistics.median(p_theirs)
        print(json.dumps({"figure": "predict", "feduq_s": round(statistics.median(p_ours), 4),
                          "nnunet_s": round(statistics.median(p_theirs), 4), "ratio": round(r, 3),
                          "ci95": [round(lo, 3), round(hi, 3)], "limit": LIMIT, "within": hi <= LIMIT,
                          "n": len(p_ours), "volume": list(data.shape[1:]), "mirroring": list(axes), **common}), flush=True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"figure": "peak_rss_mib", "value": round(peak, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("benchmark_3d.py", main))
