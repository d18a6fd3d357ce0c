"""FedPer (personalization layers, Arivazhagan et al. 2019): a site-side method added as one module
(feduq.methods.fedper) and one registration; which entries stay on a site, by hand on each network, bad values refused
when the job is built, and a simulator run on the real polyp centers where the output layer never reaches the server."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import REPO, run_simulator
from feduq.core.networks import build_network
from feduq.methods.fedper import FedPerSite, personal_layer_keys


def test_the_personal_layers_are_the_output_convolution_by_hand():
    """FedEvi's U-Net ends in ``head`` (a 1x1 conv, 32 -> 2), the light U-Net in ``model.2.conv``; two personal
    layers add the last decoder convolution before the head."""
    unet = build_network("fedevi_unet", 3, 2)
    assert personal_layer_keys(unet) == {"head.weight", "head.bias"}
    assert tuple(unet.state_dict()["head.weight"].shape) == (2, 32, 1, 1)
    assert personal_layer_keys(build_network("light", 3, 2)) == {"model.2.conv.weight", "model.2.conv.bias"}
    assert personal_layer_keys(unet, 2) == {"head.weight", "head.bias", "decoder.3.fuse.0.conv.weight",
                                            "decoder.3.fuse.0.conv.bias"}
    assert FedPerSite().local_keys(unet) == personal_layer_keys(unet)
    with pytest.raises(ValueError, match=r"personal_layers must be an integer in \[1, "):
        personal_layer_keys(unet, 10_000)


@pytest.mark.parametrize("value, message", [(0, "personal_layers must be finite and >= 1"),
                                            (1.5, "personal_layers must be an integer >= 1, got 1.5"),
                                            ("head", "personal_layers must be a number")])
def test_bad_settings_are_refused_when_the_job_is_built(value, message):
    from feduq.jobs.jobcheck import JobConfigError
    from feduq.recipes.recipe import FedUQRecipe

    with pytest.raises(ValueError, match=message):
        FedPerSite(personal_layers=value)
    with pytest.raises(JobConfigError, match=rf"FedUQExecutor\): FedPer: {message}"):
        FedUQRecipe("fedper", executor_args={"personal_layers": value})


def test_the_registration_is_the_whole_job():
    client = json.loads((REPO / "jobs" / "fedper" / "app" / "config" / "config_fed_client.json").read_text())
    server = json.loads((REPO / "jobs" / "fedper" / "app" / "config" / "config_fed_server.json").read_text())
    args = client["executors"][0]["executor"]["args"]
    assert client["executors"][0]["executor"]["path"] == "feduq.flare.executor.FedUQExecutor"
    assert (args["site_part"], args["personal_layers"]) == ("feduq.methods.fedper.FedPerSite", 1)
    assert server["workflows"][0]["args"]["server_part"] == "feduq.parts.server.LocalEntriesServer"


@pytest.mark.sim
def test_fedper_simulator_the_output_layer_never_reaches_the_server(tmp_path, data_root):
    """Two real polyp centers, one round: both updates are accepted, the global model keeps its full schema with
    the seeded initial output layer (no site sent it), while the base layers moved. The sites run with num_threads 0
    (the committed jobs' default): each trains with its share of the host's cores and leaves no place behind
    (feduq.core.threads)."""
    import os
    import re

    from feduq.core.threads import default_folder, host_cores

    ws, sites = tmp_path / "ws", ["Kvasir-SEG", "CVC-ClinicDB"]
    proc = run_simulator("fedper", ws, data_root, num_rounds=1, sites=sites, executor_args={"num_threads": 0})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for site in sites:
        records = [json.loads(m) for m in re.findall(r"FEDUQ_TRAIN (\{.*\})", (ws / site / "log.txt").read_text())]
        assert [r["site"] for r in records] == [site] and 1 <= records[0]["torch_threads"] <= host_cores()

    def alive(path):  # a file of a process still computing (another job on this host), not one left behind
        try:
            os.kill(int(path.suffix[1:]), 0)
            return True
        except (ValueError, ProcessLookupError):
            return False

    assert [p.name for p in default_folder().glob("simulate_job-*") if not alive(p)] == []
    server_log = (ws / "server" / "log.txt").read_text()
    assert server_log.count("aggregated 2 site(s)") == 1 and "rejected update" not in server_log
    saved = torch.load(ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False)
    state = {k: torch.as_tensor(v) for k, v in saved.get("model", saved).items()}
    init = build_network("fedevi_unet", 3, 2, init_seed=0).state_dict()  # the job's network, seeded as the server's
    assert set(state) == set(init)
    personal = personal_layer_keys(build_network("fedevi_unet", 3, 2))
    for key in personal:
        assert torch.equal(state[key], init[key]), f"{key} left a site"
    assert any(not torch.equal(state[k], init[k]) for k in init if k not in personal)
