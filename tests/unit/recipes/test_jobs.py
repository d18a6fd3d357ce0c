"""The committed job folders: generated from one spec, loadable, and configurable."""

import importlib
import json

import pytest

from conftest import REPO, load_tool
from feduq.jobs.jobcheck import JobConfigError
from feduq.recipes.job_folders import configure
from feduq.registry import all_methods
from make_jobs import main as make_jobs_main


def _paths(obj):
    if isinstance(obj, dict):
        if "path" in obj and isinstance(obj["path"], str):
            yield obj["path"]
        for v in obj.values():
            yield from _paths(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _paths(v)


def test_committed_jobs_match_the_generator():
    assert make_jobs_main(["--check"]) == 0


@pytest.mark.parametrize("method", all_methods())
def test_every_component_class_imports(method):
    job = REPO / "jobs" / method
    for name in ("config_fed_server.json", "config_fed_client.json"):
        cfg = json.loads((job / "app" / "config" / name).read_text())
        for path in _paths(cfg):
            module, _, cls = path.rpartition(".")
            assert hasattr(importlib.import_module(module), cls), path
    meta = json.loads((job / "meta.json").read_text())
    from feduq.registry import method_sites

    n_sites = len(method_sites(method))  # 4 for the polyp jobs, 2 for breast, 50 virtual ISIC-2017 sites for FedA3I
    assert meta["deploy_map"]["app"][0] == "server" and len(meta["deploy_map"]["app"]) == 1 + n_sites
    assert "data_root" not in json.dumps(cfg), "a job must never carry a site's data path"


def test_configure_job_overrides_and_byoc(tmp_path):
    out = configure(REPO / "jobs" / "fedevi", tmp_path / "fedevi-small", image_size=128, num_rounds=3,
                    sites=["site-a", "site-b"], executor_args={"kl_weight": 0.05}, byoc=True, any_site_names=True)
    meta = json.loads((out / "meta.json").read_text())
    server = json.loads((out / "app" / "config" / "config_fed_server.json").read_text())
    client = json.loads((out / "app" / "config" / "config_fed_client.json").read_text())
    assert meta["deploy_map"] == {"app": ["server", "site-a", "site-b"]} and meta["min_clients"] == 2
    assert server["workflows"][0]["args"]["num_rounds"] == 3
    args = client["executors"][0]["executor"]["args"]
    assert args["image_size"] == 128 and args["kl_weight"] == 0.05 and args["local_epochs"] == 2
    assert (out / "app" / "custom" / "feduq" / "flare" / "executor.py").is_file()
    committed = json.loads((REPO / "jobs" / "fedevi" / "app" / "config" / "config_fed_client.json").read_text())
    assert committed["executors"][0]["executor"]["args"]["image_size"] == 384  # source untouched


def test_configure_task_sets_the_papers_per_task_executor_defaults(tmp_path):
    """FedEvi's λ is 1e-5 for fundus (paper) and stays 0.01 for prostate; --set still wins."""

    def exe_args(method, name, **kw):
        out = configure(REPO / "jobs" / method, tmp_path / name, **kw)
        return json.loads((out / "app" / "config" / "config_fed_client.json").read_text())["executors"][0]["executor"]["args"]

    assert exe_args("fedevi", "a", task="fundus")["kl_weight"] == 1e-5
    assert exe_args("fedevi", "b", task="prostate")["kl_weight"] == 0.01
    assert exe_args("fedevi", "c", task="fundus", executor_args={"kl_weight": 0.05})["kl_weight"] == 0.05
    assert "kl_weight" not in exe_args("fedavg", "d", task="fundus")


def test_configure_refuses_a_binary_method_on_a_multi_class_task(tmp_path):
    """FedA3I is registered for one foreground class (MethodSpec.foreground_classes): fundus (disc, cup) is refused by
    feduq configure's configure whatever the network; its own skin task and FedAvg on fundus are not."""
    from feduq.data import get_task

    names = ", ".join(get_task("fundus").class_names[1:])  # its trained classes (the disc's rim or disc, the cup)
    for network in (None, "light"):
        with pytest.raises(JobConfigError) as info:
            configure(REPO / "jobs" / "feda3i", tmp_path / f"f{network}", task="fundus", network=network)
        assert str(info.value) == (f"method 'feda3i' needs a binary task (1 foreground class); task 'fundus' has 2: "
                                   f"{names} (refused whatever the network)")
    assert not (tmp_path / "fNone").exists()
    configure(REPO / "jobs" / "feda3i", tmp_path / "skin", task="skin", network="light")


def test_per_center_test_sites_score_each_shared_test_list_once(tmp_path):
    """Virtual sites of one center and one K share its test list: the first of each group tests, real sites all."""
    from feduq.recipes.settings import per_center_test_sites

    assert per_center_test_sites(["A-p0of3", "A-p1of3", "B", "A-p2of3", "A-p0of2", "C"]) == ["A-p0of3", "B", "A-p0of2", "C"]
    sites = [f"ISIC-2017-p{k:02d}of50" for k in range(50)]

    def final_test_args(name, **kw):
        out = configure(REPO / "jobs" / "feda3i", tmp_path / name, **kw)
        server = json.loads((out / "app" / "config" / "config_fed_server.json").read_text())
        return next(w["args"] for w in server["workflows"] if w["id"] == "final_test")

    assert final_test_args("a", sites=sites, test_sites="per-center")["test_sites"] == ["ISIC-2017-p00of50"]
    assert final_test_args("b", sites=sites, test_sites=sites[3:5])["test_sites"] == sites[3:5]
    assert "test_sites" not in final_test_args("c", sites=sites)
    # every site scores a test list of its own: all test, as by default
    assert "test_sites" not in final_test_args("e", sites=["ISIC-2017", "ISIC-2017-p00of10"], test_sites="per-center")
    # a configured job configured again with new sites: its test sites reset to all of them unless named again
    per_center = configure(REPO / "jobs" / "feda3i", tmp_path / "g", sites=sites, test_sites="per-center")
    again = configure(per_center, tmp_path / "h", sites=sites[:3])
    server = json.loads((again / "app" / "config" / "config_fed_server.json").read_text())
    assert "test_sites" not in next(w["args"] for w in server["workflows"] if w["id"] == "final_test")
    with pytest.raises(JobConfigError, match=r"test_sites \['ISIC-2017-p01of50'\] are listed more than once"):
        configure(REPO / "jobs" / "feda3i", tmp_path / "i", sites=sites, test_sites=[sites[1], sites[1]])
    with pytest.raises(JobConfigError, match=r"test_sites \['ISIC-2017-p07of50'\] are not sites of this job "
                                             r"\(sites: ISIC-2017-p00of50, .*, \.\.\. \(49 sites\)\)"):
        configure(REPO / "jobs" / "feda3i", tmp_path / "j", sites=sites[:7] + sites[8:], test_sites=[sites[7]])
    # a hand-edited config is checked with the job (validate_job; the running app checks the connected sites)
    from feduq.jobs.jobcheck import validate_job

    cfg = per_center / "app" / "config" / "config_fed_server.json"
    edited = json.loads(cfg.read_text())
    next(w for w in edited["workflows"] if w["id"] == "final_test")["args"]["test_sites"] = ["ISIC-2017-p99of100"]
    cfg.write_text(json.dumps(edited))
    with pytest.raises(JobConfigError, match=r"server workflow 'final_test'.*test_sites \['ISIC-2017-p99of100'\]"):
        validate_job(per_center)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--image-size", "100"], "image_size=100 is not a multiple of 16, the total stride of network FedEviUNet; use 96 or 112"),
        (["--sites", "Foo,Bar"], "site 'Foo' is not a center of task 'polyp'"),
        (["--set", "klweight=1"], "unknown argument 'klweight'; did you mean 'kl_weight'?"),
        (["--set", "kl_weight=-1"], "kl_weight must be finite and >= 0, got -1"),
        (["--min-clients", "5"], "min_clients=5 must be an integer in [1, 4]"),
        (["--network", "unet3"], "unknown network 'unet3'; known networks: ['feda3i_unet', 'fedevi_unet', 'light', 'resnet_tweu']"),
        (["--set", "network={\"name\": \"fedevi_unet\", \"channels\": [8, 16]}"], "(feduq.core.networks.FedEviUNet): unknown argument 'channels'"),
        # values that once passed the check and failed at run time
        (["--sites", "Kvasir-SEG,Kvasir-SEG"], "sites ['Kvasir-SEG'] are listed more than once"),
        (["--train-timeout", "-5"], "train_timeout must be an integer number of seconds >= 0 (0: no limit), got -5"),
        (["--num-rounds", "-1"], "num_rounds must be an integer >= 1, got -1"),
        (["--set-workflow", "delta=-1"], "delta"),
        (["--test-sites", "Kvasir-SEG,Foo"], "test_sites ['Foo'] are not sites of this job (sites: Kvasir-SEG, "),
    ],
)
def test_configure_job_rejects_what_cannot_run(tmp_path, capsys, argv, message):  # noqa: D103
    """Each setting is refused with exit status 2 and a message naming the key or value; nothing is written."""
    configure_job = load_tool("configure_job")
    out = tmp_path / "job"
    with pytest.raises(SystemExit) as exit_info:
        configure_job.main([str(REPO / "jobs" / "fedevi"), "-o", str(out), *argv])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not out.exists()


def test_the_server_model_must_fit_the_task(tmp_path):
    """A hand-edited job whose persistor model has 3 input channels cannot train prostate (1 channel)."""
    from feduq.jobs.jobcheck import JobConfigError, validate_job

    out = configure(REPO / "jobs" / "fedavg", tmp_path / "prostate", task="prostate")
    server_path = out / "app" / "config" / "config_fed_server.json"
    server = json.loads(server_path.read_text())
    server["components"][0]["args"]["model"]["args"]["in_channels"] = 3
    server_path.write_text(json.dumps(server))
    with pytest.raises(JobConfigError, match=r"server component 'persistor' model .* does not fit the sites' network "
                                             r"for task 'prostate': 'encoder.0.0.conv.weight' is \[16, 3, 3, 3\] on the server, "
                                             r"\[16, 1, 3, 3\] at the sites"):
        validate_job(out)


def test_amp_and_channels_last_are_checked_job_switches(tmp_path):
    from feduq.jobs.jobcheck import JobConfigError

    configure(REPO / "jobs" / "fedavg", tmp_path / "ok", executor_args={"amp": False, "channels_last": True})
    with pytest.raises(JobConfigError, match="executor argument amp='fp16' is out of range"):
        configure(REPO / "jobs" / "fedavg", tmp_path / "bad", executor_args={"amp": "fp16"})


def test_threads_per_site_and_loader_workers_are_checked_job_switches(tmp_path):
    from feduq.site.settings import loader_workers
    from feduq.jobs.jobcheck import JobConfigError

    configure(REPO / "jobs" / "fedavg", tmp_path / "ok",
              executor_args={"num_threads": {"Kvasir-SEG": 2, "default": 1}, "num_workers": 2})
    with pytest.raises(JobConfigError, match="executor argument num_threads=.*out of range"):
        configure(REPO / "jobs" / "fedavg", tmp_path / "bad", executor_args={"num_threads": {"Kvasir-SEG": -1}})
    with pytest.raises(JobConfigError, match="executor argument num_workers='many' is out of range"):
        configure(REPO / "jobs" / "fedavg", tmp_path / "bad2", executor_args={"num_workers": "many"})
    import os
    import torch

    assert loader_workers("auto", torch.device("cpu")) == 0
    assert loader_workers("auto", torch.device("cuda")) == min(4, (os.cpu_count() or 1) // 2)
    assert loader_workers(3, torch.device("cpu")) == 3


@pytest.mark.parametrize("where", ["executor", "server component", "persistor model", "workflow"])
def test_checking_a_crafted_job_runs_none_of_its_code(tmp_path, where):
    """A job naming ``subprocess.Popen(["touch", FILE])`` (as its executor, a server component, the persistor's model,
    or a workflow) is refused by name by feduq configure before anything is imported or constructed: no file."""
    import shutil
    import subprocess
    import sys

    job = tmp_path / "crafted"
    shutil.copytree(REPO / "jobs" / "fedavg", job)
    marker = tmp_path / "ran"
    popen = {"path": "subprocess.Popen", "args": {"args": ["touch", str(marker)]}}
    client_path, server_path = (job / "app" / "config" / f for f in ("config_fed_client.json", "config_fed_server.json"))
    client, server = json.loads(client_path.read_text()), json.loads(server_path.read_text())
    if where == "executor":
        client["executors"][0]["executor"] = popen
    elif where == "server component":
        server["components"].append({"id": "x", **popen})
    elif where == "persistor model":
        server["components"][0]["args"]["model"] = popen
    else:
        server["workflows"][0] = {"id": "controller", **popen}
    client_path.write_text(json.dumps(client))
    server_path.write_text(json.dumps(server))
    proc = subprocess.run([sys.executable, "-m", "feduq", "configure", str(job), "-o", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "'subprocess.Popen' is not" in proc.stderr and "(feduq.*)" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not marker.exists() and not (tmp_path / "out").exists()
