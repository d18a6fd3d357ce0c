"""A plans file is checked where it is read (feduq.nnunet.pipeline.load_plans, every job and site): a JSON list, a
patch size or spacing nnU-Net cannot use are one line naming the key, before a job is written or a site starts."""

import json
import math

import pytest

from conftest import load_tool


def _plan(**cfg):
    base = {"patch_size": [16, 64, 64], "spacing": [3.0, 0.6, 0.6], "batch_size": 2}
    return {"plans_name": "p", "configurations": {"3d_fullres": {**base, **cfg}}}


@pytest.mark.parametrize("cfg, key", [
    ({"patch_size": [-8, 64, 64]}, "patch_size"), ({"patch_size": [16.5, 64, 64]}, "patch_size"),
    ({"patch_size": []}, "patch_size"), ({"spacing": [math.nan, 0.6, 0.6]}, "spacing"),
    ({"spacing": [0.0, 0.6, 0.6]}, "spacing"), ({"spacing": [3.0, -0.6, 0.6]}, "spacing"),
])
def test_a_configuration_nnunet_cannot_use_is_refused_naming_the_key(cfg, key, tmp_path):
    from feduq.nnunet.pipeline import load_plans

    with pytest.raises(ValueError, match=rf"configurations\.3d_fullres\.{key} = "):
        load_plans(_plan(**cfg), "3d_fullres")
    path = tmp_path / "plans.json"
    path.write_text(json.dumps(_plan(**cfg)))  # NaN written as JSON's NaN, read back as one
    with pytest.raises(ValueError, match=rf"{path}: configurations\.3d_fullres\.{key}"):
        load_plans(path, "3d_fullres")
    assert load_plans(_plan(), "3d_fullres")["configurations"]["3d_fullres"]["patch_size"] == [16, 64, 64]


def test_plans_given_as_a_json_list_stop_configure_with_one_line(tmp_path, capsys):
    from nnunet_sites import task_declaration

    task = tmp_path / "task.json"
    task.write_text(json.dumps(task_declaration("Dataset973_ListPlans", ["A", "B"])))
    plans = tmp_path / "plans.json"
    plans.write_text(json.dumps([_plan()]))
    with pytest.raises(SystemExit) as stop:  # argparse's exit, one line on stderr
        load_tool("configure_job").main(["fedavg", "-o", str(tmp_path / "job"), "--task", str(task),
                                         "--configuration", "3d_fullres", "--plans", str(plans)])
    code = stop.value.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "a JSON list, not nnU-Net's plans" in err[0] and str(plans) in err[0], err
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("value", ["-5", "nan", "0", "inf"])
def test_a_foreground_voxel_count_that_is_no_count_is_refused_before_any_job(value, tmp_path, capsys):
    from nnunet_sites import task_declaration

    task = tmp_path / "task.json"
    task.write_text(json.dumps(task_declaration("Dataset975_Voxels", ["A", "B"])))
    assert load_tool("plan_federation").main(["--task", str(task), "--foreground-voxels", value, "--export-to",
                                              str(tmp_path / "job")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--foreground-voxels {float(value)!r}: expected a number of voxels >= 1" in err[0], err
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize("pattern, says", [("(", "not a regular expression"), ("patient", "needs a group")])
def test_a_unit_pattern_that_cannot_name_a_patient_is_refused_before_any_case_is_scored(pattern, says):
    from feduq.predict.calibrate import calibrate
    from feduq.predict.files import PredictError

    with pytest.raises(PredictError, match=says):  # object(): no model is touched before the refusal
        calibrate(object(), target_dice=0.8, site_dirs=["/nonexistent"], unit_pattern=pattern)
