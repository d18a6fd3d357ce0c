"""One path for every task (issue 69): the six built-in tasks are task files shipped in the package (nnU-Net's
dataset.json keys plus the "feduq" object), read by the same code as a user's task file; nothing in a TaskSpec tells a
built-in task from a declared one."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from feduq.data import BUILT_IN, PACKAGE_TASKS_DIR, TASKS, TaskSpec, get_task, task_reference
from feduq.tasks.declared import read_task_file

from conftest import REPO  # noqa: E402

#: what the built-in tasks were when they were written in Python (before the task files), field by field
BEFORE = {
    "polyp": dict(centers=("Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"), in_channels=3,
                  group_column={"CVC-ColonDB": "sequence", "CVC-ClinicDB": "sequence"}, folder="polyp"),
    "prostate": dict(centers=("BIDMC", "BMC", "HK", "I2CVB", "RUNMC", "UCL"), in_channels=1, merge_foreground=True,
                     group_column={"BMC": "case", "RUNMC": "case"},
                     group_pattern={c: r"(.+)_z?\d+" for c in ("BIDMC", "HK", "I2CVB", "UCL")}),
    "fundus": dict(centers=("Drishti-GS", "RIM-ONE-r3", "REFUGE-train", "REFUGE-val"), in_channels=3,
                   eval_regions={"disc": (1, 2), "cup": (2,)}, num_classes=3),
    "skin": dict(in_channels=3, folder="skin_lesion", partition_centers=("ISIC-2017",),
                 group_column_if_present={c: "lesion_id" for c in TASKS["skin"].centers}),
    "breast": dict(centers=("BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"), in_channels=1, folder="breast_us",
                   group_pattern={"BUS-BRA-INCa-Brazil": r"\D*(\d+)-[A-Za-z]+"}),
    "ct": dict(class_names=("background", "liver", "kidney", "spleen", "pancreas"), folder="abdominal_ct",
               centers=("NIH-Pancreas-CT", "KiTS19", "MSD-Task09-Spleen", "3D-IRCADb-01", "CHAOS-CT",
                        "CURVAS-Erlangen")),
}


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_shipped_task_file_is_read_by_the_task_file_reader(name):
    path = PACKAGE_TASKS_DIR / f"{name}.json"
    spec = read_task_file(path)
    assert spec == TASKS[name] == get_task(name)
    for key, value in BEFORE[name].items():
        assert getattr(spec, key) == value, key
    assert spec.kind == "2d" and spec.layout == "feduq"
    assert task_reference(spec) == name  # a shipped task travels by name, every site's package has its file


def test_a_users_copy_of_a_shipped_task_is_the_same_task(tmp_path):
    """Nothing but the name and the task file (its text and where it was read from) tells the built-in polyp task from a user's copy of its file:
    no field of a TaskSpec marks a task as built in."""
    raw = json.loads((PACKAGE_TASKS_DIR / "polyp.json").read_text())
    raw["name"], raw["feduq"]["folder"] = "Dataset950_MyPolyp", "polyp"
    (tmp_path / "mine.json").write_text(json.dumps(raw))
    mine = get_task(str(tmp_path / "mine.json"))
    differ = [f.name for f in dataclasses.fields(TaskSpec) if getattr(mine, f.name) != getattr(TASKS["polyp"], f.name)]
    assert differ == ["name", "source", "raw", "data_dir"]  # its text and where it came from; the same folder:
    assert mine.folder == TASKS["polyp"].folder == "polyp"
    assert task_reference(mine) == raw  # a user's task travels as its declaration: the job is self-contained
    assert not {"declared", "builtin", "built_in"} & {f.name for f in dataclasses.fields(TaskSpec)}


def test_no_code_branches_on_a_declared_task():
    """The two paths are gone: no module tests ``spec.declared`` (48 references in 16 files before)."""
    hits = [f"{p.relative_to(REPO)}:{i}" for folder in ("custom", "tools") for p in sorted((REPO / folder).rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"\.declared\b(?!_)", line)
            and "feduq.tasks.declared" not in line and not re.match(r"\s*from \.*(tasks\.)?declared import", line)]
    assert hits == []
