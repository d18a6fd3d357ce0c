#!/usr/bin/env python3
"""Make the shared nnU-Net v2 2D plans of the CT task from one reference site (run once; the result is committed).

FIVA forces one architecture, patch size and batch settings on every client (it copies them from the
TotalSegmentator plans). FedUQ does the same with a plan made by nnU-Net's own planner on one reference
site's *training* slices and shipped with the CT jobs (``custom/nnunet/plans/``); every site then builds the
same backbone from it and preprocesses its own data (nnunet-fl.md §2). This tool:

1. writes the reference site's training split as an nnU-Net raw dataset in a scratch folder (masks
   remapped to the site's local labels, as the sites train);
2. runs ``nnUNetv2_extract_fingerprint`` and ``nnUNetv2_plan_experiment`` there (the only place FedUQ
   sets nnU-Net's path variables: per command, in the scratch folder);
3. keeps the ``2d`` configuration and writes it as ``ct_2d.json`` (the paper's plan: nnU-Net's own
   choice) and ``ct_2d_slim.json`` (the same plan with a slimmer architecture: fewer stages and
   features, for tests and CPU demos; every output that uses it says so).

    python tools/make_ct_plans.py --data-root ../shared/data --center NIH-Pancreas-CT
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
PLANS_DIR = REPO / "custom" / "nnunet" / "plans"

#: The slim architecture for tests and CPU demos: 4 stages of 16..128 features on a 128x128 patch.
SLIM = {"n_stages": 4, "features": (16, 32, 64, 128), "patch_size": [128, 128], "batch_size": 4}


def slim_plans(plans: dict) -> dict:
    """``plans`` with a slimmer 2D architecture (:data:`SLIM`): fewer stages and features, a smaller patch."""
    out = copy.deepcopy(plans)
    out["plans_name"] = plans["plans_name"] + "_slim"
    cfg = out["configurations"]["2d"]
    arch = cfg["architecture"]["arch_kwargs"]
    n = SLIM["n_stages"]
    arch["n_stages"] = n
    arch["features_per_stage"] = list(SLIM["features"])
    for key in ("kernel_sizes", "strides", "n_conv_per_stage"):
        arch[key] = arch[key][:n]
    arch["n_conv_per_stage_decoder"] = arch["n_conv_per_stage_decoder"][: n - 1]
    cfg["pool_op_kernel_sizes"] = arch["strides"]
    cfg["conv_kernel_sizes"] = arch["kernel_sizes"]
    cfg["patch_size"] = list(SLIM["patch_size"])
    cfg["batch_size"] = SLIM["batch_size"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", required=True)
    p.add_argument("--center", default="NIH-Pancreas-CT", help="reference site (its training split is planned on)")
    p.add_argument("--out", default=str(PLANS_DIR))
    p.add_argument("--force", action="store_true", help="replace ct_2d.json / ct_2d_slim.json in an --out folder other "
                                                        "than the package's plans")
    a = p.parse_args(argv)
    if Path(a.out).resolve() != Path(PLANS_DIR).resolve():  # the package's own plans are FedUQ's to regenerate
        from feduq.outputs import OutputFolderError, check_output_file

        try:
            for name in ("ct_2d.json", "ct_2d_slim.json"):
                check_output_file(Path(a.out) / name, {"data root": a.data_root}, "make_ct_plans.py", force=a.force)
        except OutputFolderError as e:
            print(e, file=sys.stderr)  # "<tool>: <why>", one line
            return 2

    from feduq.data import ct

    root = Path(a.data_root).resolve()
    lut = ct.site_label_lut(root, a.center)
    organs = ct.site_organs(root, a.center)
    items = ct.ct_items(root, a.center, "train")
    with tempfile.TemporaryDirectory(prefix="feduq-plans-") as tmp:
        tmp = Path(tmp)
        raw = tmp / "raw" / "Dataset900_FedUQCT"
        (raw / "imagesTr").mkdir(parents=True)
        (raw / "labelsTr").mkdir()
        for item in items:
            image, mask, _ = ct.read_case(item, lut, a.center)
            Image.fromarray(np.clip(image, 0, 255).astype(np.uint8)).save(raw / "imagesTr" / f"{item['name']}_0000.png")
            Image.fromarray(mask.astype(np.uint8)).save(raw / "labelsTr" / f"{item['name']}.png")
        labels = {"background": 0, **{o: i + 1 for i, o in enumerate(organs)}}
        (raw / "dataset.json").write_text(json.dumps({"channel_names": {"0": "CT"}, "labels": labels,
                                                       "numTraining": len(items), "file_ending": ".png"}))
        env = dict(os.environ, nnUNet_raw=str(tmp / "raw"), nnUNet_preprocessed=str(tmp / "pre"),
                   nnUNet_results=str(tmp / "res"))
        bindir = Path(sys.executable).parent
        for cmd in (["nnUNetv2_extract_fingerprint", "-d", "900", "-np", "1"], ["nnUNetv2_plan_experiment", "-d", "900"]):
            subprocess.run([str(bindir / cmd[0]), *cmd[1:]], env=env, check=True, stdout=subprocess.DEVNULL)
        plans = json.loads((tmp / "pre" / "Dataset900_FedUQCT" / "nnUNetPlans.json").read_text())
    plans["dataset_name"] = "FedUQ_CT"
    plans["plans_name"] = "FedUQ_CT_2d"
    plans["configurations"] = {"2d": plans["configurations"]["2d"]}
    plans["feduq_note"] = (f"nnU-Net v2 2D plan made by tools/make_ct_plans.py on the training split of {a.center} "
                           f"({len(items)} slices); its intensity properties are the reference site's (used only "
                           "with intensity='reference')")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "ct_2d.json").write_text(json.dumps(plans, indent=1) + "\n")
    slim = slim_plans(plans)
    slim["feduq_note"] = plans["feduq_note"] + "; SLIM architecture for tests and CPU demos (not the paper's)"
    (out / "ct_2d_slim.json").write_text(json.dumps(slim, indent=1) + "\n")
    arch = plans["configurations"]["2d"]["architecture"]["arch_kwargs"]
    print(f"wrote {out}/ct_2d.json ({arch['n_stages']} stages {arch['features_per_stage']}, patch "
          f"{plans['configurations']['2d']['patch_size']}, batch {plans['configurations']['2d']['batch_size']}) "
          f"and ct_2d_slim.json")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("make_ct_plans.py", main))
