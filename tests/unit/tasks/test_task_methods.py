"""Methods checked against the task before FLARE starts (issue 69, item 4): a method registered for one foreground
class (FedA3I) is refused on a task with more, whatever the network, by the Recipe, ``python -m feduq.run`` and the
job-folder check; a task file's ``feduq.hyperparameters`` are applied after the method's settings and before
``--set``, and what the task set is printed with where each value came from. No FLARE run, no data."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import feduq.tasks
from feduq.jobs.jobcheck import JobConfigError, validate_job
from feduq.recipes.recipe import FedUQRecipe
from feduq.run import main as run_main

CLIENT = "app/config/config_fed_client.json"
REFUSED = ("method 'feda3i' needs a binary task (1 foreground class); task '{name}' has 2: optic_disc, optic_cup "
           "(refused whatever the network)")


def region_task(tmp_path: Path, name: str, **feduq) -> Path:
    """A 3-class fundus region task file (disc = values 1 and 2, cup = 2), as feduq convert nnunet-raw writes it."""
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps({
        "name": name, "channel_names": {"0": "R", "1": "G", "2": "B"},
        "labels": {"background": 0, "optic_disc": [1, 2], "optic_cup": 2}, "regions_class_order": [1, 2],
        "file_ending": ".png", "feduq": {"sites": ["EyeClinic-A", "EyeClinic-B"], **feduq}}))
    return path


def executor_args(recipe) -> dict:
    return json.loads(recipe.files[CLIENT])["executors"][0]["executor"]["args"]


@pytest.mark.parametrize("network", [None, "light", "fedevi_unet"])
def test_feda3i_refused_on_a_three_class_task_whatever_the_network(tmp_path, network):
    task = region_task(tmp_path, "Dataset960_Regions")
    for _ in range(2):  # the first call imports the job check (torch, MONAI: seconds); the check itself is timed
        t0 = time.perf_counter()
        with pytest.raises(JobConfigError) as info:
            FedUQRecipe("feda3i", task=str(task), **({"network": network} if network else {}))
    assert str(info.value) == REFUSED.format(name="Dataset960_Regions")
    assert time.perf_counter() - t0 < 0.5  # refused before any network is built or FLARE starts
    FedUQRecipe("fedavg_ce", task=str(task), network="light")  # FedA3I's baseline never estimates noise: any classes


def test_feda3i_job_folder_on_a_three_class_task_refused_by_the_job_check(tmp_path):
    """An exported job folder edited to another task (what `nvflare simulator` would run) is refused by the job
    check every FedUQ workflow runs at start-up."""
    task = region_task(tmp_path, "Dataset961_Regions")
    skin = FedUQRecipe("feda3i", num_rounds=1, network="light")  # its own binary task: accepted
    skin.export(str(tmp_path / "jobs"))
    job = tmp_path / "jobs" / "feda3i"
    validate_job(job)
    client = json.loads((job / CLIENT).read_text())
    client["executors"][0]["executor"]["args"]["task"] = json.loads(task.read_text())  # the declaration, as jobs carry it
    (job / CLIENT).write_text(json.dumps(client))
    with pytest.raises(JobConfigError) as info:
        validate_job(job, any_site_names=True)
    assert str(info.value) == ("client executor 'executor' (feduq.flare.executor.FedUQExecutor): "
                               + REFUSED.format(name="Dataset961_Regions"))


def test_feduq_run_refuses_feda3i_with_exit_2(tmp_path, capsys):
    task = region_task(tmp_path, "Dataset962_Regions")
    assert run_main(["feda3i", "--task", str(task), "--network", "light", "--export-to", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == "feduq run: " + REFUSED.format(name="Dataset962_Regions")
    assert not (tmp_path / "out").exists()


def test_task_file_hyperparameters_applied_before_set_and_printed(tmp_path, capsys):
    """FedEvi on a declared task: the polyp λ 0.01 unless the task file sets it (said in one line), the file's value
    over the registration's, --set over both."""
    plain = region_task(tmp_path, "Dataset963_Plain")
    assert run_main(["fedevi", "--task", str(plain), "--network", "light", "--export-to", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        "fedevi on task Dataset963_Plain: kl_weight=0.01 (fedevi's default; the task file sets no "
        "feduq.hyperparameters.fedevi.kl_weight (built-in tasks: fundus 1e-05))")

    own = region_task(tmp_path, "Dataset964_Own",
                      hyperparameters={"fedevi": {"kl_weight": 1e-5, "annealing_step": 5}, "fedprox": {"mu": 0.1}})
    record: list = []
    recipe = FedUQRecipe("fedevi", task=str(own), network="light", record=record)
    args = executor_args(recipe)
    assert (args["kl_weight"], args["annealing_step"]) == (1e-5, 5)
    assert record == [("kl_weight", 1e-5, f"task file {own}: feduq.hyperparameters.fedevi.kl_weight"),
                      ("annealing_step", 5, f"task file {own}: feduq.hyperparameters.fedevi.annealing_step")]
    assert executor_args(FedUQRecipe("fedprox", task=str(own), network="light"))["mu"] == 0.1
    record = []
    args = executor_args(FedUQRecipe("fedevi", task=str(own), network="light", executor_args={"kl_weight": 0.5},
                                     record=record))
    assert args["kl_weight"] == 0.5
    assert record[0] == ("kl_weight", 0.5, f"--set, over task file {own}: feduq.hyperparameters.fedevi.kl_weight")
    record = []  # a built-in task's setting: its shipped task file's
    assert executor_args(FedUQRecipe("fedevi", task="fundus", network="light", record=record))["kl_weight"] == 1e-5
    shipped = Path(feduq.tasks.__file__).resolve().parent / "task_files" / "fundus.json"
    assert record == [("kl_weight", 1e-5, f"task file {shipped}: feduq.hyperparameters.fedevi.kl_weight")]


@pytest.mark.parametrize("hyperparameters, message", [
    ({"fedevy": {"kl_weight": 1}}, "feduq.hyperparameters.fedevy: 'fedevy' is not a registered method; did you mean "
                                   "'fedevi'?"),
    ({"fedevi": {"klweight": 1}}, "feduq.hyperparameters.fedevi.klweight: fedevi's executor takes no argument "
                                  "'klweight'; did you mean 'kl_weight'?"),
    ({"fedavg": {"task": "polyp"}}, "feduq.hyperparameters.fedavg.task: fedavg's executor takes no argument 'task'; "
                                    "the task is the file itself"),
])
def test_task_file_hyperparameters_names_checked(tmp_path, hyperparameters, message):
    """Every method and argument the task file names is checked when a job is configured, whatever its method."""
    task = region_task(tmp_path, f"Dataset965_Bad{len(message)}", hyperparameters=hyperparameters)
    with pytest.raises(JobConfigError) as info:
        FedUQRecipe("fedavg", task=str(task), network="light")
    assert str(info.value) == f"task file {task}: {message}"
