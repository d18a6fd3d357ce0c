"""The committed job folders: generated from one spec, loadable, and configurable."""

import importlib
import json

import pytest

from conftest import REPO
from configure_job import configure
from make_jobs import METHODS, main as make_jobs_main


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


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_component_class_imports(method):
    job = REPO / "jobs" / method
    for name in ("config_fed_server.json", "config_fed_client.json"):
        cfg = json.loads((job / "app" / "config" / name).read_text())
        for path in _paths(cfg):
            module, _, cls = path.rpartition(".")
            assert hasattr(importlib.import_module(module), cls), path
    meta = json.loads((job / "meta.json").read_text())
    from make_jobs import method_task, task_settings

    n_sites = len(task_settings(method_task(method))["sites"])  # 4 for the segmentation jobs, 2 for breast
    assert meta["deploy_map"]["app"][0] == "server" and len(meta["deploy_map"]["app"]) == 1 + n_sites
    assert "data_root" not in json.dumps(cfg), "a job must never carry a site's data path"


def test_configure_job_overrides_and_byoc(tmp_path):
    out = configure(REPO / "jobs" / "fedevi", tmp_path / "fedevi-small", image_size=128, num_rounds=3,
                    sites=["site-a", "site-b"], executor_args={"kl_weight": 0.05}, byoc=True)
    meta = json.loads((out / "meta.json").read_text())
    server = json.loads((out / "app" / "config" / "config_fed_server.json").read_text())
    client = json.loads((out / "app" / "config" / "config_fed_client.json").read_text())
    assert meta["deploy_map"] == {"app": ["server", "site-a", "site-b"]} and meta["min_clients"] == 2
    assert server["workflows"][0]["args"]["num_rounds"] == 3
    args = client["executors"][0]["executor"]["args"]
    assert args["image_size"] == 128 and args["kl_weight"] == 0.05 and args["local_epochs"] == 2
    assert (out / "app" / "custom" / "feduq" / "flare" / "executors.py").is_file()
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
