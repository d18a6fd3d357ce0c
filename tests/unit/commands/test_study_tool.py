"""tools/study_3d_vs_2d.py's bookkeeping (the study itself is a long run, not a test)."""

import json

import pytest

from conftest import load_tool


def test_a_new_study_folder_records_its_settings_before_the_sites_are_built(tmp_path, data_root, monkeypatch):
    """A fresh --out (its parent new too) was refused with a traceback: settings.json was written before the folder
    was made."""
    study = load_tool("study_3d_vs_2d")

    class Built(Exception):
        pass

    def build_sites(*args, **kwargs):
        raise Built

    monkeypatch.setattr(study, "build_sites", build_sites)
    out = tmp_path / "new" / "study"
    with pytest.raises(Built):
        study.main(["--data-root", str(data_root), "--out", str(out), "--seed", "3"])
    settings = json.loads((out / "settings.json").read_text())
    assert settings["seed"] == 3 and settings["centers"] == ["RUNMC", "BMC"]
