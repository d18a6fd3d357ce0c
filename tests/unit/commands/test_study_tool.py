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
    assert settings["feduq_study"] == "study_3d_vs_2d.py"  # what tells the study's record from a user's file


@pytest.mark.parametrize("n", [0, -3])
def test_max_cases_below_one_is_refused_in_one_line(tmp_path, data_root, capsys, n):
    """--max-cases 0 meant every case (a smoke run became the whole study); now only N >= 1, or none for all."""
    study = load_tool("study_3d_vs_2d")
    out = tmp_path / "study"
    assert study.main(["--data-root", str(data_root), "--out", str(out), "--max-cases", str(n)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--max-cases {n}: expected a number of cases >= 1" in err, err
    assert not out.exists()


def test_a_users_settings_json_is_not_read_as_a_study_made_with_other_settings(tmp_path, data_root, capsys,
                                                                               monkeypatch):
    study = load_tool("study_3d_vs_2d")
    monkeypatch.setattr(study, "build_sites", lambda *a, **k: pytest.fail("the study went on"))
    out = tmp_path / "study"
    out.mkdir()
    mine = json.dumps({"learning_rate": 0.01, "owner": "me"})
    (out / "settings.json").write_text(mine)
    assert study.main(["--data-root", str(data_root), "--out", str(out), "--force"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "settings.json is not a FedUQ study record; move it or choose another" in err
    assert "other settings" not in err and (out / "settings.json").read_text() == mine


def test_a_stopped_build_leaves_no_staging_folder_and_a_killed_ones_is_removed_next_time(tmp_path, data_root,
                                                                                      monkeypatch, capsys):
    """Ctrl-C kills the converter before its own clean-up: its hidden .<site>.partial-* folder was left beside the
    sites. Now the build removes it on the way out, and one a SIGKILL left is removed (and said) on the next run."""
    import subprocess

    study = load_tool("study_3d_vs_2d")
    root = tmp_path / "data"

    def stopped(cmd, **kw):  # the converter's staging folder, then the interrupt
        (root / study.NAME / ".RUNMC.partial-k3j2").mkdir(parents=True)
        raise KeyboardInterrupt

    monkeypatch.setattr(subprocess, "run", stopped)
    with pytest.raises(KeyboardInterrupt):
        study.build_sites(data_root, root, ["RUNMC", "BMC"], 1)
    assert list((root / study.NAME).iterdir()) == []
    killed = root / study.NAME / ".BMC.partial-x9"
    (killed / "imagesTr").mkdir(parents=True)

    def done(cmd, **kw):
        raise RuntimeError("converted")

    monkeypatch.setattr(subprocess, "run", done)
    with pytest.raises(RuntimeError, match="converted"):
        study.build_sites(data_root, root, ["RUNMC", "BMC"], 1)
    assert not killed.exists()
    assert f"removing an interrupted build's staging folder {killed}" in capsys.readouterr().err
