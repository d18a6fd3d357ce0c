"""feduq convert nnunet-raw's command line: each bad argument is one line naming it, exit 2, and nothing is left
behind (every check runs before a folder is made); a file that fails to decode while writing leaves nothing either."""

import csv
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from conftest import REPO  # noqa: E402
COMMAND = ["-m", "feduq", "convert", "nnunet-raw"]


def _center(root: Path, center: str = "RUNMC", cases: int = 2, slices: int = 2) -> Path:
    """A FedUQ-layout prostate center of ``cases`` cases of ``slices`` 8 x 8 slices (the provenance columns the
    tool reads)."""
    src = root / "prostate" / center
    (src / "images").mkdir(parents=True)
    (src / "masks").mkdir()
    rows = []
    rng = np.random.default_rng(0)
    for c in range(cases):
        for z in range(slices):
            name = f"Case{c:02d}_z{z:02d}.png"
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(src / "images" / name)
            Image.fromarray((rng.integers(0, 3, (8, 8))).astype(np.uint8)).save(src / "masks" / name)
            rows.append({"image_file": f"images/{name}", "mask_file": f"masks/{name}", "case": f"Case{c:02d}",
                         "slice_z": z, "spacing_mm": "0.6x0.6x4", "orig_width": 8, "orig_height": 8})
    with open(src / "provenance.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return root


def _run(*args, cwd: Path):
    return subprocess.run([sys.executable, *COMMAND, *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("args, says", [
    (["--cases", "-1"], "--cases -1: expected a whole number from 1 to 2"),
    (["--cases", "0"], "--cases 0: expected a whole number from 1 to 2"),
    (["--cases", "3"], "--cases 3: expected a whole number from 1 to 2"),
    (["--cases", "two"], "argument --cases: invalid int value: 'two'"),
    (["--prostate", "XYZ"], "--prostate XYZ: no such center under"),
    (["--data-root", "missing"], "--data-root missing: no such folder"),
    (["--channels", "T2", "T2"], "--channels T2 T2: expected distinct"),
    (["--missing-file"], "is listed in"),
], ids=["cases-1", "cases0", "cases-too-many", "cases-not-a-number", "unknown-center", "missing-data-root",
        "same-channel-twice", "missing-slice-file"])
def test_a_bad_argument_is_one_line_exit_2_and_nothing_is_written(tmp_path, args, says):
    data = _center(tmp_path / "data")
    if args == ["--missing-file"]:
        (data / "prostate" / "RUNMC" / "masks" / "Case01_z01.png").unlink()
        args = []
    base = {"--data-root": str(data), "--prostate": "RUNMC", "--out": "out/site"}
    base.update({k: None for k in args if k in base})
    argv = [x for k, v in base.items() if v is not None for x in (k, v)] + args
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    res = _run(*argv, cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("feduq convert nnunet-raw: error: ") and says in lines[0], res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before  # no out/, no imagesTr/


def test_a_slice_that_does_not_decode_leaves_nothing(tmp_path):
    data = _center(tmp_path / "data")
    (data / "prostate" / "RUNMC" / "images" / "Case01_z00.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    (tmp_path / "work").mkdir()
    res = _run("--data-root", data, "--prostate", "RUNMC", "--out", "out/a/site", cwd=tmp_path / "work")
    assert res.returncode == 1, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "nothing written" in lines[0] and "Case01_z00.png" in lines[0], res.stderr
    assert list((tmp_path / "work").iterdir()) == []


def test_the_cases_asked_for_are_written(tmp_path):
    data = _center(tmp_path / "data", cases=3)
    res = _run("--data-root", data, "--prostate", "RUNMC", "--out", tmp_path / "site", "--cases", "2", cwd=tmp_path)
    assert res.returncode == 0 and res.stdout.strip() == f"wrote 2 cases to {tmp_path / 'site'}", res.stderr
    assert sorted(p.name for p in (tmp_path / "site" / "labelsTr").iterdir()) == ["case00.nii.gz", "case01.nii.gz"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "site"]  # no staging folder left beside it
