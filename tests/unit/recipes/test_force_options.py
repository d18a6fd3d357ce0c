"""A command whose refusal says "pass --force" takes --force: feduq run --export-to, feduq plan --export-to and
feduq convert nnunet-raw refuse a folder holding a user's file, name --force, and with it write and keep the file."""

import pytest

from conftest import load_tool


def _users_folder(path):
    path.mkdir(parents=True)
    (path / "my_notes.txt").write_text("mine\n")
    return path


def _plan_task(tmp_path):
    import json

    task = tmp_path / "task.json"
    task.write_text(json.dumps({"name": "Dataset971_Force", "channel_names": {"0": "MRI"}, "labels": {
        "background": 0, "gland": 1}, "file_ending": ".nii.gz", "feduq": {"sites": ["A", "B"]}}))
    return task


@pytest.mark.parametrize("command", ["run", "plan", "nnunet-raw"])
def test_a_refusal_that_names_force_is_lifted_by_force_and_keeps_the_users_file(command, tmp_path, data_root, capsys):
    if command == "run":
        from feduq.run import main

        out = _users_folder(tmp_path / "exp" / "fedavg")
        argv, written = ["fedavg", "--export-to", str(tmp_path / "exp")], out / "meta.json"
    elif command == "plan":
        main = load_tool("plan_federation").main
        out = _users_folder(tmp_path / "job")
        argv, written = ["--task", str(_plan_task(tmp_path)), "--export-to", str(out)], None
    else:
        main = load_tool("make_nnunet_sites").main
        out = _users_folder(tmp_path / "site")
        argv, written = ["--data-root", str(data_root), "--prostate", "BMC", "--cases", "1", "--out", str(out)], \
            out / "dataset.json"
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--force" in err[0] and str(out) in err[0], err
    assert sorted(p.name for p in out.iterdir()) == ["my_notes.txt"]
    assert main([*argv, "--force"]) == 0
    assert (out / "my_notes.txt").read_text() == "mine\n"
    assert written is None or written.is_file()
    assert len([p for p in out.rglob("*") if p.is_file()]) > 1
