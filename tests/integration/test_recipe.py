"""FedUQ jobs as FLARE 2.9 Recipes (feduq.recipes.recipe, feduq.recipes.jobspec, python -m feduq.run): the committed jobs are the
Recipes' exports, configured Recipes are checked before they run, and a Recipe runs in SimEnv with the same numbers
as the committed job in the simulator (tests/golden/golden_runs.json, recorded before the Recipes existed)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from nvflare.recipe import SimEnv
from nvflare.recipe.spec import Recipe

from conftest import REPO, load_tool
from feduq.recipes import jobspec
from feduq.jobs.jobcheck import JobConfigError
from feduq.recipes.recipe import FedUQRecipe
from feduq.registry import all_methods


def _files(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*") if p.is_file()}


@pytest.mark.parametrize("method", all_methods())
def test_the_committed_job_is_the_recipes_export(tmp_path, method):
    recipe = FedUQRecipe(method)
    assert isinstance(recipe, Recipe) and recipe.name == method
    recipe.export(str(tmp_path))
    exported, committed = _files(tmp_path / method), _files(REPO / "jobs" / method)
    assert set(committed) - set(exported) == {"README.md"}  # the job's README is written by hand
    assert {rel: committed[rel] for rel in exported} == exported


def _workflow_args(recipe: FedUQRecipe) -> dict:
    return json.loads(recipe.files[jobspec.SERVER])["workflows"][0]["args"]


def test_train_timeout_sets_every_timeout_the_training_workflow_declares():
    assert {k: v for k, v in _workflow_args(FedUQRecipe("fedevi", train_timeout=30)).items() if "timeout" in k} == {
        "train_timeout": 30, "surrogate_timeout": 30}
    assert {k: v for k, v in _workflow_args(FedUQRecipe("fiva_p", train_timeout=7)).items() if "timeout" in k} == {
        "train_timeout": 7, "test_timeout": 7}
    fedavg = _workflow_args(FedUQRecipe("fedavg", train_timeout=5, min_clients=3))
    assert fedavg["train_timeout"] == 5 and fedavg["min_clients"] == 3


def test_a_configured_recipe_is_checked_and_named():
    recipe = FedUQRecipe("fedevi", name="fedevi-128", image_size=128, num_rounds=3, sites=["Kvasir-SEG", "CVC-ColonDB"])
    meta = json.loads(recipe.files[jobspec.META])
    client = json.loads(recipe.files[jobspec.CLIENT])["executors"][0]["executor"]["args"]
    assert recipe.name == meta["name"] == "fedevi-128" and recipe.sites == ["Kvasir-SEG", "CVC-ColonDB"]
    assert meta["min_clients"] == 2 and client["image_size"] == 128 and _workflow_args(recipe)["num_rounds"] == 3
    with pytest.raises(JobConfigError, match="image_size"):
        FedUQRecipe("fedavg", image_size=0)
    with pytest.raises(JobConfigError, match="did you mean"):
        FedUQRecipe("fedavg", executor_args={"lr_gama": 0.1})
    with pytest.raises(TypeError, match="rounds"):
        FedUQRecipe("fedavg", rounds=3)
    with pytest.raises(ValueError, match="unknown method 'fedave'"):
        FedUQRecipe("fedave")
    # a server part's values are checked when the job is built, not at round 0 (one line naming the value)
    with pytest.raises(JobConfigError, match=r"FedUQController\): GraphFedSeg: need .*lam=5"):
        FedUQRecipe("graphfedseg", workflow_args={"lam": 5})
    with pytest.raises(JobConfigError, match=r"FedUQController\): delta must be finite and >= 0.0, got -1"):
        FedUQRecipe("fedevi", workflow_args={"delta": -1})


def test_flares_job_api_adds_new_config_keys_and_refuses_feduqs_own():
    recipe = FedUQRecipe("fedavg")
    recipe.add_server_config({"some_setting": 1})
    assert json.loads(recipe.files["app/config/config_fed_server.json"])["some_setting"] == 1
    with pytest.raises(ValueError, match=r"config keys \['workflows'\] of the server are FedUQ's own"):
        recipe.add_server_config({"workflows": []})


def test_simenv_clients_must_be_the_jobs_sites(tmp_path):
    recipe = FedUQRecipe("fedavg", data_root=str(tmp_path))
    with pytest.raises(ValueError, match="not the job's sites"):
        recipe.run(SimEnv(clients=["site-1", "site-2"], workspace_root=str(tmp_path / "ws")))


def _feduq_run(args, cwd, env_extra=None, timeout=120):
    env = {k: v for k, v in os.environ.items() if k != "FEDUQ_DATA_ROOT"}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "feduq.run", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_feduq_run_exports_the_committed_job_and_stops_without_a_data_root(tmp_path):
    proc = _feduq_run(["fedevi", "--export-to", tmp_path / "out"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    exported = _files(tmp_path / "out" / "fedevi")
    assert json.loads(exported.pop(".feduq-output.json"))["files"] == sorted(exported)  # the manifest of the export
    assert exported == {rel: text for rel, text in _files(REPO / "jobs" / "fedevi").items() if rel != "README.md"}
    proc = _feduq_run(["fedavg", "-w", tmp_path / "ws"], tmp_path)  # no --data-root, no $FEDUQ_DATA_ROOT
    assert proc.returncode == 1 and "FEDUQ_DATA_ROOT" in proc.stderr and "Traceback" not in proc.stderr
    proc = _feduq_run(["fedavg", "--image-size", "30", "--export-to", tmp_path / "bad"], tmp_path)
    assert proc.returncode == 2 and "image_size" in proc.stderr and not (tmp_path / "bad").exists()


@pytest.mark.sim
def test_feduq_run_in_simenv_gives_the_recorded_fedavg_run(tmp_path, data_root):
    """``feduq run fedavg --env sim`` with the golden configuration (tools/golden_runs.py): the final global
    model and the results table of the run recorded with ``nvflare simulator`` before the Recipes existed."""
    golden = load_tool("golden_runs")
    proc = _feduq_run(["fedavg", "--env", "sim", "--data-root", data_root, "-w", tmp_path, "--sites",
                       "Kvasir-SEG,CVC-ColonDB", "--network", "light", "--image-size", "32", "--num-rounds", "2",
                       "--local-epochs", "1", "--max-items", "4", "--seed", "0", "--set", "num_threads=1"],
                      tmp_path, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Results:" in proc.stdout
    from feduq.core.checkpoints import load_checkpoint

    run = tmp_path / "fedavg" / "server" / "simulate_job"
    got = {"model": golden.fingerprint(load_checkpoint(run / "app_server" / "FL_global_model.pt")["model"]),
           "tables": golden.read_tables(run / "results")}
    if golden.record_of("fedavg") is None:  # the run itself passed; its numbers have no record on this kind of CPU
        pytest.skip(f"no golden record of fedavg for this kind of CPU ({golden.cpu_kind()})")
    lines = golden.check(got, "fedavg")
    assert lines == [], "\n".join(lines)
