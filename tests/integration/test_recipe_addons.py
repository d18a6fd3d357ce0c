"""FLARE's Recipe add-ons on FedUQ's Recipes: each works (written into the job, honoured by a run) or raises one line.

The tracking test is read back by MLflow itself (its client over the local file store the run wrote), the per-site
setting from the site's own log, the filter order from the job FLARE runs.
"""

import json
import warnings

import pytest
from nvflare.app_common.filters.exclude_vars import ExcludeVars
from nvflare.app_common.filters.percentile_privacy import PercentilePrivacy
from nvflare.recipe import SimEnv
from nvflare.recipe.utils import add_cross_site_evaluation, add_experiment_tracking, add_final_global_evaluation

from feduq.recipes.recipe import FedUQRecipe

SERVER, CLIENT = "app/config/config_fed_server.json", "app/config/config_fed_client.json"
SITES = ["Kvasir-SEG", "CVC-ColonDB"]


def config(recipe, name):
    return json.loads(recipe.files[name])


def test_filters_go_before_the_ledger_on_the_way_out_and_after_it_on_the_way_in():
    recipe = FedUQRecipe("fedevi")
    tasks = config(recipe, CLIENT)["task_result_filters"][0]["tasks"]
    recipe.add_client_output_filter(PercentilePrivacy(percentile=5, gamma=0.05))
    recipe.add_client_input_filter(ExcludeVars(exclude_vars=["bias"]), tasks=["train"])
    out = config(recipe, CLIENT)["task_result_filters"]
    assert [(g["tasks"], [f["path"].rsplit(".", 1)[1] for f in g["filters"]]) for g in out] == [
        (tasks, ["PercentilePrivacy", "PrivacyLedgerFilter"])]
    assert out[0]["filters"][0]["args"] == {"percentile": 5, "gamma": 0.05, "data_kinds": ["WEIGHT_DIFF", "WEIGHTS"]}
    # FLARE allows one chain per task: the ledger's group is split, the train chain gets ExcludeVars after the ledger
    inward = {tuple(g["tasks"]): [f["path"].rsplit(".", 1)[1] for f in g["filters"]]
              for g in config(recipe, CLIENT)["task_data_filters"]}
    assert inward == {("train",): ["PrivacyLedgerFilter", "ExcludeVars"],
                      tuple(t for t in tasks if t != "train"): ["PrivacyLedgerFilter"]}


def test_tracking_receivers_join_the_server_and_tensorboard_replaces_the_jobs_own():
    recipe = FedUQRecipe("fedavg")
    add_experiment_tracking(recipe, "tensorboard", {"tb_folder": "tb_user"})
    add_experiment_tracking(recipe, "mlflow", {"tracking_uri": "file:///tmp/x"})
    comps = {c["id"]: c for c in config(recipe, SERVER)["components"]}
    tb = [c for c in comps.values() if c["path"].endswith("TBAnalyticsReceiver")]
    assert len(tb) == 1 and tb[0]["id"] == "tb_receiver" and tb[0]["args"]["tb_folder"] == "tb_user"
    assert comps["receiver"]["path"] == "nvflare.app_opt.tracking.mlflow.mlflow_receiver.MLflowReceiver"
    assert comps["receiver"]["args"]["tracking_uri"] == "file:///tmp/x"


def test_what_feduq_cannot_honour_raises_one_clear_error():
    recipe = FedUQRecipe("fedavg")
    for add in (add_cross_site_evaluation, add_final_global_evaluation):
        with pytest.raises(ValueError, match="every site already tests the best global model"):
            add(recipe)
    with pytest.raises(ValueError, match="one client app to every site; ExcludeVars for site 'Kvasir-SEG' alone"):
        recipe.add_client_output_filter(ExcludeVars(), clients=["Kvasir-SEG"])
    with pytest.raises(ValueError, match="never carries a data path"):
        FedUQRecipe("fedavg").set_per_site_config({"Kvasir-SEG": {"data_root": "/data"}})
    with pytest.raises(ValueError, match="'lr' is not a setting a site owns"):
        FedUQRecipe("fedavg").set_per_site_config({"Kvasir-SEG": {"lr": 0.1}})
    with pytest.raises(ValueError, match="batch_size=0 is out of range"):
        FedUQRecipe("fedavg").set_per_site_config({"Kvasir-SEG": {"batch_size": 0}})
    with pytest.raises(ValueError, match="'Hospital-Z' is not a site of this job"):
        FedUQRecipe("fedavg").set_per_site_config({"Hospital-Z": {"batch_size": 2}})
    with pytest.raises(ValueError, match="defined in a script"):
        recipe.add_client_output_filter(type("Local", (PercentilePrivacy,), {"__module__": "__main__"})())
    with pytest.raises(ValueError, match="filter_type must be TASK_DATA or TASK_RESULT"):
        recipe._job.to_clients(ExcludeVars(), filter_type="result")
    assert config(recipe, CLIENT) == config(FedUQRecipe("fedavg"), CLIENT)  # nothing half-added


def test_an_initial_checkpoint_is_checked_against_the_network_before_anything_runs(tmp_path):
    import torch

    from feduq.core.networks import build_network

    good = build_network("light", 3, 2).state_dict()
    torch.save({"model": good}, tmp_path / "good.pt")
    torch.save({**{k: v for k, v in good.items() if k != "model.0.conv.bias"}, "head.extra": torch.zeros(1)},
               tmp_path / "wrong_key.pt")
    torch.save({k: (torch.zeros(3, *v.shape[1:]) if k == "model.0.conv.weight" else v) for k, v in good.items()},
               tmp_path / "wrong_shape.pt")
    with pytest.raises(ValueError, match=r"does not fit the job's network \(SegUNet\): missing keys \['model.0.conv.bias'\]"):
        FedUQRecipe("fedavg", network="light", initial_ckpt=str(tmp_path / "wrong_key.pt"))
    with pytest.raises(ValueError, match="'model.0.conv.weight' is \\[3, "):
        FedUQRecipe("fedavg", network="light", initial_ckpt=str(tmp_path / "wrong_shape.pt"))
    with pytest.raises(ValueError, match="no such file"):
        FedUQRecipe("fedavg", network="light", initial_ckpt="missing.pt")
    recipe = FedUQRecipe("fedavg", network="light", initial_ckpt=str(tmp_path / "good.pt"))
    persistor = next(c for c in config(recipe, SERVER)["components"] if c["id"] == "persistor")
    assert persistor["args"]["source_ckpt_file_full_name"] == str(tmp_path / "good.pt")  # absolute: the server reads it


def test_resource_spec_per_site_is_what_flares_validator_and_resource_manager_read(tmp_path):
    """A GPU site and a CPU-only site: FLARE's job-meta validator accepts the exported job, and FLARE's GPU resource
    manager of a one-GPU 16 GiB site admits the GPU site's request while a CPU-only site's manager refuses it."""
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.resource_managers.gpu_resource_manager import GPUResourceManager
    from nvflare.fuel.utils.zip_utils import zip_directory_to_bytes
    from nvflare.private.fed.server.job_meta_validator import JobMetaValidator

    from feduq.jobs.jobcheck import JobConfigError

    recipe = FedUQRecipe("fedavg", sites=SITES, resource_spec={"Kvasir-SEG": {"num_of_gpus": 1, "mem_per_gpu_in_GiB": 8},
                                                                "CVC-ColonDB": {"num_of_gpus": 0}})
    recipe.export(str(tmp_path))
    meta = json.loads((tmp_path / "fedavg" / "meta.json").read_text())
    valid, error, _ = JobMetaValidator().validate("fedavg", zip_directory_to_bytes(str(tmp_path), "fedavg"))
    assert valid, error
    gpu_site = GPUResourceManager(num_of_gpus=1, mem_per_gpu_in_GiB=16, ignore_host=True)
    cpu_site = GPUResourceManager(num_of_gpus=0, mem_per_gpu_in_GiB=0, ignore_host=True)
    assert gpu_site.check_resources(meta["resource_spec"]["Kvasir-SEG"], FLContext())[0]
    assert not cpu_site.check_resources(meta["resource_spec"]["Kvasir-SEG"], FLContext())[0]
    assert cpu_site.check_resources(meta["resource_spec"]["CVC-ColonDB"], FLContext())[0]
    with pytest.raises(JobConfigError, match="'Hospital-Z' is not a site of this job"):
        FedUQRecipe("fedavg", sites=SITES, resource_spec={"Hospital-Z": {"num_of_gpus": 1}})
    with pytest.raises(JobConfigError, match="num_of_gpus=-1 is out of range"):
        FedUQRecipe("fedavg", sites=SITES, resource_spec={"Kvasir-SEG": {"num_of_gpus": -1}})


def _train_records(ws, site):
    return [json.loads(line.split("FEDUQ_TRAIN ", 1)[1]) for line in (ws / site / "log.txt").read_text().splitlines()
            if "FEDUQ_TRAIN " in line]


@pytest.mark.sim
def test_flare_add_ons_in_one_simenv_run(tmp_path, data_root, monkeypatch):
    """One tiny FedAvg run with every add-on FedUQ honours, each checked against what the run itself recorded:

    * initial_ckpt (relative: bundled into the job): the seeded network with its last layer zeroed, so every site's
      validation of the round-0 model predicts background only (Dice 0);
    * set_per_site_config: Kvasir-SEG trains in batches of 2 (2 steps over its 4 images), CVC-ColonDB at the job's 8;
    * add_client_output_filter(PercentilePrivacy) before the ledger: the ledger lets FLARE's filter record through;
    * early stopping (patience 2, min_delta 0.01): the run ends where the sites' own validation records say;
    * add_experiment_tracking(MLflow, a local file store): read back by MLflow's client, every site's run holds its
      per-round metrics, one value per round that ran, and the server's aggregation weight of that site per round,
      equal to the server's FEDUQ_AGGREGATION record.
    """
    import torch

    from feduq.core.networks import build_network

    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 keeps the file store behind this switch
    monkeypatch.chdir(tmp_path)
    state = build_network("light", 3, 2).state_dict()
    last = [k for k in state if k.endswith(".conv.weight")][-1].rsplit(".", 1)[0]
    torch.save({k: torch.zeros_like(v) if k.startswith(last) else v for k, v in state.items()}, "start.pt")
    store = (tmp_path / "mlruns").as_uri()
    recipe = FedUQRecipe("fedavg", sites=SITES, image_size=32, num_rounds=6, local_epochs=1, max_items=4,
                         network="light", data_root=str(data_root), executor_args={"num_threads": 1, "lr": 0.01},
                         workflow_args={"patience": 2, "min_delta": 0.01}, initial_ckpt="start.pt")
    recipe.set_per_site_config({"Kvasir-SEG": {"batch_size": 2, "num_workers": 0}})
    add_experiment_tracking(recipe, "mlflow", {"tracking_uri": store})
    recipe.add_client_output_filter(PercentilePrivacy(percentile=5, gamma=0.05))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recipe.run(SimEnv(clients=recipe.sites, workspace_root=str(tmp_path / "ws")))
    assert recipe.outcome.ok
    ws = tmp_path / "ws" / "fedavg"
    records = {site: _train_records(ws, site) for site in SITES}
    assert all(recs[0]["val_dice_global"] == 0.0 for recs in records.values())  # the initial checkpoint
    assert {s: {r["steps"] for r in recs} for s, recs in records.items()} == {"Kvasir-SEG": {2}, "CVC-ColonDB": {1}}
    assert "FEDUQ_PER_SITE" in (ws / "Kvasir-SEG" / "log.txt").read_text()
    # early stopping by hand: the validation-weighted mean per round, best beaten by more than 0.01 or not
    rounds = len(records[SITES[0]])
    means = [sum(records[s][r]["val_dice_global"] * records[s][r]["feduq_num_val_samples"] for s in SITES)
             / sum(records[s][r]["feduq_num_val_samples"] for s in SITES) for r in range(rounds)]
    best, best_round, expected = -1.0, 0, None
    for r, m in enumerate(means):
        if m > best + 0.01:
            best, best_round = m, r
        if r - best_round >= 2:
            expected = r
            break
    assert expected is not None and expected < 5 and rounds == expected + 1  # no site trained after the stop
    assert "FEDUQ_EARLY_STOP" in (ws / "server" / "log.txt").read_text()
    client = mlflow.tracking.MlflowClient(tracking_uri=store)
    experiment = client.get_experiment_by_name("fedavg-experiment")
    runs = {next(s for s in SITES if r.info.run_name.startswith(s)): r for r in client.search_runs([experiment.experiment_id])}
    assert sorted(runs) == sorted(SITES)
    for run in runs.values():
        assert {"val_dice_global", "train_loss", "train_seconds"} <= set(run.data.metrics)
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")] == list(range(rounds))
    recorded = [json.loads(line.split("FEDUQ_AGGREGATION ", 1)[1])
                for line in (ws / "server" / "log.txt").read_text().splitlines() if "FEDUQ_AGGREGATION " in line]
    assert len(recorded) == rounds
    for site, run in runs.items():
        history = sorted(client.get_metric_history(run.info.run_id, "aggregation_weight"), key=lambda m: m.step)
        assert [(m.step, round(m.value, 6)) for m in history] == [(r["round"], r["weights"][site]) for r in recorded]
