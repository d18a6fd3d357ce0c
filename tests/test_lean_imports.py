"""A FedUQ FLARE process imports MONAI without the optional packages it never uses (feduq.flare.lean_monai), and can
still import each of them when its own code needs one."""

import json
import subprocess
import sys

PROBE = r"""
import json, sys
import feduq.flare.executor, feduq.flare.controller
from feduq.flare.lean_monai import NOT_AT_START
at_start = sorted(n for n in NOT_AT_START if n in sys.modules)
finders = [type(f).__name__ for f in sys.meta_path]
import torch
from monai.losses import DiceCELoss
from monai.metrics import compute_hausdorff_distance
logits, label = torch.zeros(1, 2, 8, 8), torch.zeros(1, 1, 8, 8)
label[..., 2:5, 2:5] = 1
logits[:, 1] = label[:, 0] * 8 - 4
loss = float(DiceCELoss(to_onehot_y=True, softmax=True)(logits, label))
onehot = torch.cat([1 - label, label], 1)
hd = float(compute_hausdorff_distance(onehot, onehot, include_background=False, percentile=95)[0, 0])
import sklearn.metrics, matplotlib
print(json.dumps({"at_start": at_start, "finders": finders, "loss": loss, "hd": hd,
                  "later": [n in sys.modules for n in ("sklearn", "matplotlib")]}))
"""


def test_a_flare_process_loads_monai_without_its_unused_extras():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["at_start"] == []  # none of MLflow, Ignite, pandas, TensorBoard, torchvision, Matplotlib, scikit-learn
    assert "_RefuseWhileMonaiLoads" not in got["finders"]  # refused only while MONAI loaded
    assert got["hd"] == 0.0 and 0.0 < got["loss"] < 0.1  # MONAI's loss and metric work as usual
    assert got["later"] == [True, True]  # FedUQ's own code imports them when it needs them


def test_nothing_changes_when_monai_is_already_imported():
    code = ("import sys, monai; n = len(sys.meta_path); from feduq.flare.lean_monai import import_monai_lean; "
            "print(import_monai_lean(), len(sys.meta_path) == n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["False", "True"]
