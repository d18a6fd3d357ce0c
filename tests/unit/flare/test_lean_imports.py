"""A FedUQ FLARE process imports MONAI without the optional packages it never uses (feduq.common.lean_monai), and can
still import each of them when its own code needs one."""

import json
import subprocess
import sys

PROBE = r"""
import json, sys
import feduq.flare.executor, feduq.flare.controller
from feduq.common.lean_monai import NOT_AT_START
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
    code = ("import sys, monai; n = len(sys.meta_path); from feduq.common.lean_monai import import_monai_lean; "
            "print(import_monai_lean(), len(sys.meta_path) == n)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["False", "True"]


def test_a_tool_that_checks_a_job_loads_no_monai_and_monai_loads_lean_when_first_needed():
    """The launcher's imports (feduq.jobs.jobcheck, as feduq simulate) load neither MONAI nor its extras; the first
    ``from monai... import`` afterwards loads MONAI lean (the deferral of feduq.common.lean_monai), and works."""
    code = ("import sys, json; import feduq.jobs.jobcheck; before = 'monai' in sys.modules; "
            "from monai.losses import DiceLoss; from feduq.common.lean_monai import NOT_AT_START; "
            "import torch; x = torch.ones(1, 2, 4, 4) / 2; y = torch.zeros(1, 1, 4, 4); "
            "import monai, pydoc; once = sys.modules['monai'].transforms is sys.modules['monai.transforms']; "
            "found = pydoc.locate('monai.transforms.io.dictionary.LoadImaged') is not None; "
            "print(json.dumps([before, sorted(n for n in NOT_AT_START if n in sys.modules), "
            "round(float(DiceLoss(to_onehot_y=True)(x, y)), 4), once, found]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    before, loaded, loss, once, found = json.loads(out.stdout.strip().splitlines()[-1])
    assert once and found  # MONAI executed once (its submodules are the package's), MONAI's own locate works
    # Dice of class 0 (all pixels, p = 1/2): 2 * 8 / (8 + 16) = 2/3; class 1 (no pixels): 0 -> loss 1 - (2/3 + 0) / 2
    assert before is False and loaded == [] and loss == round(1 - (2 / 3) / 2, 4)


def test_predict_help_loads_neither_torch_nor_monai():
    code = ("import sys, contextlib, io\nsys.argv = ['predict', '--help']\nfrom feduq.commands.site.predict import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main(['--help'])\n"
            "    except SystemExit:\n        pass\nprint('torch' in sys.modules, 'monai' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["False", "False"]


def test_every_option_of_the_two_commands_says_what_it_does(capsys):
    """Issue 69: ``feduq run --help`` gave no text for --task, --network, --image-size, --num-rounds,
    --max-items; every option of feduq.run and feduq.predict now has one."""
    import argparse

    import pytest

    from feduq.commands.site.predict import main as predict
    from feduq.run import main as run

    seen = []
    original = argparse.ArgumentParser.add_argument

    def record(self, *names, **kwargs):
        if names and names[0].startswith("-") and names[0] not in ("-h", "--help"):
            seen.append((names[-1], kwargs.get("help")))
        return original(self, *names, **kwargs)

    for main in (run, predict):
        argparse.ArgumentParser.add_argument = record
        try:
            with pytest.raises(SystemExit):
                main(["--help"])
        finally:
            argparse.ArgumentParser.add_argument = original
    capsys.readouterr()
    assert len(seen) > 40 and [flag for flag, words in seen if not words] == []
