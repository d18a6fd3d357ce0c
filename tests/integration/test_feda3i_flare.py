"""FedA3I on FLARE: the server's estimate and frozen layer-wise weights on hand-made answers, and a short real-data
simulator run on noisy virtual sites made by feduq noisy-labels."""

import csv
import os
import json
import re

import numpy as np
import pytest

from conftest import load_tool, read_table, simulator_process, small_job
from feduq.flare.controller import FedUQController
from feduq.methods.feda3i import FedA3IServer

TOY_Q = [[.5, .2], [.45, .25], [.6, .1], [.2, .5], [.25, .4]]  # the hand toy of test_feda3i_math
SITES = ["a", "b", "c", "d", "e"]


def _controller(**kwargs):
    return FedUQController(**{"server_part": "feduq.methods.feda3i.FedA3IServer", "num_rounds": 3,
                              "warmup_rounds": 1, **kwargs})


def test_estimate_reproduces_the_methods_toy():
    est = FedA3IServer(warmup_rounds=1).estimate({s: (q, 40) for s, q in zip(SITES, TOY_Q)}, SITES)
    assert est["groups"] == {"a": "G_l", "b": "G_l", "c": "G_l", "d": "G_s", "e": "G_s"}
    assert np.allclose(est["w_bar"], [0.2, 0.3, 0.0, 0.0, 0.5], atol=1e-9)
    assert np.allclose(est["w_tilde"], [0.2] * 5) and est["excluded"] == {}


def test_sites_without_a_finite_q_are_left_out_of_the_grouping_and_named():
    answers = {s: (q, 40) for s, q in zip(SITES, TOY_Q)}
    answers["c"] = ([float("nan"), 0.1], 40)
    del answers["e"]
    est = FedA3IServer(warmup_rounds=1).estimate(answers, SITES)
    assert set(est["excluded"]) == {"c", "e"} and "no answer" in est["excluded"]["e"] and "nan" in est["excluded"]["c"]
    w_bar = np.array(est["w_bar"])
    assert w_bar[2] == 0 and w_bar[4] == 0 and w_bar.sum() == pytest.approx(1.0) and np.isfinite(w_bar).all()
    assert est["w_tilde"][4] == 0  # no answer: no count either; the four that answered share the quantity part


def test_layer_weights_go_from_quantity_at_inc_to_quality_at_outc_and_renormalise_over_the_answering_sites():
    ctl = FedA3IServer(warmup_rounds=1)
    est = ctl.estimate({s: (q, n) for s, q, n in zip(SITES, TOY_Q, [10, 20, 30, 40, 100])}, SITES)
    keys = ["inc.double_conv.0.weight", "down4.maxpool_conv.1.double_conv.0.weight", "outc.conv.weight"]
    w = ctl.layer_weights(est, keys, SITES)
    assert np.allclose(w["inc.double_conv.0.weight"], np.array([10, 20, 30, 40, 100]) / 200)
    assert np.allclose(w["outc.conv.weight"], [0.2, 0.3, 0.0, 0.0, 0.5])
    mix = 4 / 9  # layer 5 of 10
    assert np.allclose(w[keys[1]], mix * np.array([0.2, 0.3, 0, 0, 0.5]) + (1 - mix) * np.array([10, 20, 30, 40, 100]) / 200)
    only = ctl.layer_weights(est, keys, ["c", "d"])  # both have w_bar = 0: the last layer falls back to quantity
    assert np.allclose(only["outc.conv.weight"], [30 / 70, 40 / 70])


@pytest.mark.parametrize("kwargs, msg", [({"warmup_rounds": 0}, "warmup_rounds"), ({"warmup_rounds": 1.5}, "warmup_rounds"),
                                         ({"r": 1.5}, "r=1.5")])
def test_bad_settings_are_refused(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        _controller(**kwargs)


@pytest.mark.sim
def test_feda3i_simulator_on_noisy_virtual_sites(tmp_path, data_root):
    """3 ISIC-2017 virtual sites (of 50) with N_S noise, 3 rounds, T1 = 1: the log shows the exchange, q per site,
    the groups and the frozen weights, identical in rounds 1 and 2."""
    from feduq.commands.research import noisy_labels as make_noisy_labels

    sites = ["ISIC-2017-p00of50", "ISIC-2017-p01of50", "ISIC-2017-p02of50"]
    noisy = tmp_path / "noisy"
    assert make_noisy_labels.main(["--data-root", str(data_root), "--task", "skin", "--sites", ",".join(sites),
                                   "--preset", "skin_ns", "--out", str(noisy)]) == 0
    for s in sites:
        info = json.loads((noisy / "skin_lesion" / "ISIC-2017" / "noise" / f"{s}.json").read_text())
        assert 0 < info["dice_mean"] < 1
    # the three virtual sites share ISIC-2017's test list: one of them runs the final test for all (--test-sites)
    job = small_job("feda3i", tmp_path / "job", sites=sites, workflow_args={"warmup_rounds": 1}, num_rounds=3,
                    test_sites="per-center")
    ws = tmp_path / "ws"
    proc = simulator_process(job, ws, noisy, stdout=None, stderr=None)
    assert proc.wait(timeout=600) == 0
    log = (ws / "server" / "log.txt").read_text()
    est = json.loads(re.search(r"FEDUQ_FEDA3I (\{.*\})", log).group(1))
    assert est["round"] == 0 and set(est["q"]) == set(sites) and all(len(q) == 2 for q in est["q"].values())
    assert set(est["groups"]) == set(sites) and sum(est["w_bar"]) == pytest.approx(1.0)
    rounds = [json.loads(m) for m in re.findall(r"FEDUQ_AGGREGATION (\{.*\})", log)]
    assert [r["round"] for r in rounds] == [0, 1, 2]
    assert rounds[1]["weights"] == rounds[2]["weights"]  # frozen
    assert list(rounds[1]["weights"].values()) == pytest.approx(est["w_bar"], abs=1e-6)  # outc: pure quality
    for s in sites:
        assert "FEDUQ_FEDA3I_Q" in (ws / s / "log.txt").read_text()
    table = read_table(ws)
    assert set(table) == {sites[0], "Avg", "Std"}  # the shared test list scored once, by the first site
    assert "FEDUQ_TEST" not in (ws / sites[1] / "log.txt").read_text()

    # the same job in one process (feduq virtual, for the paper's 50 sites): the same numbers
    import torch
    from feduq.commands.research import virtual as virtual_federation

    from feduq import data as fdata

    reads, get_dataset = [], fdata.get_dataset

    def recording(task, center, split, *args, **kwargs):  # which site reads its test split at set-up, and how
        reads.append((kwargs.get("site"), split, kwargs.get("cache")))
        return get_dataset(task, center, split, *args, **kwargs)

    import tempfile

    from feduq.core.threads import default_folder, host_cores, threads_for

    fdata.get_dataset = recording
    tempfile.tempdir, lines = str(tmp_path), []  # the share folder of the host's computing FedUQ processes ...
    default_folder().mkdir()
    (default_folder() / "another-sweep.1").touch()  # ... holds a live process beside this run (pid 1)
    try:
        vf = virtual_federation.run(job, noisy, tmp_path / "vf", log=lines.append)
    finally:
        fdata.get_dataset, tempfile.tempdir = get_dataset, None
    # it computes with its share of the cores (2 cores, 2 processes: 1 thread), and gives its place back at the end
    threads = {json.loads(line.split(" ", 1)[1])["torch_threads"] for line in lines if line.startswith("FEDUQ_TRAIN ")}
    assert threads == {threads_for(host_cores(), ["another-sweep.1", "virtual-job.0"], "virtual-job.0")}
    assert [p.name for p in (tmp_path / f"feduq-cores-{os.getuid()}").iterdir()] == ["another-sweep.1"]
    # only the site that scores the shared test list (the job's per-center test_sites) reads it at set-up
    assert [(s, c) for s, split, c in reads if split == "test"] == [(sites[0], "check"), (sites[1], False),
                                                                    (sites[2], False)]
    assert vf["state"]["groups"] == est["groups"]
    for s in sites:
        assert vf["state"]["q"][s] == pytest.approx(est["q"][s], rel=1e-4, abs=1e-6)
    assert set(vf["table"]) == {sites[0]}  # the job's test_sites, as in FLARE
    assert vf["table"][sites[0]]["dice"] == pytest.approx(float(table[sites[0]]["dice"]), abs=1e-4)
    assert vf["state"]["w_bar"] == pytest.approx(est["w_bar"], abs=1e-5)
    sim_model = torch.load(ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False)["model"]
    assert set(vf["model"]) == set(sim_model)
    for k, v in sim_model.items():
        np.testing.assert_allclose(np.asarray(vf["model"][k], dtype=np.float64), np.asarray(v, dtype=np.float64),
                                   atol=1e-4, err_msg=k)
    # the model file it writes is one FedUQ's tools load (tensors, weights_only): feduq evaluate scores the site's test
    # split (the job's 6 images) with it to the Dice the runner's own final test gave
    evaluate = load_tool("evaluate")
    assert evaluate.main(["--job", str(job), "--model", str(tmp_path / "vf" / "FL_global_model.pt"), "--site", sites[0],
                          "--data-root", str(noisy), "--split", "test", "--max-items", "6", "--maps", "0",
                          "--out", str(tmp_path / "ev")]) == 0
    with open(tmp_path / "ev" / "per_image.csv") as f:
        dice = [float(r["dice"]) for r in csv.DictReader(f)]
    assert np.mean(dice) == pytest.approx(vf["table"][sites[0]]["dice"], abs=1e-6)


def test_virtual_federation_refuses_other_jobs_and_names_a_site_without_data(tmp_path, capsys):
    from feduq.commands.research import virtual as virtual_federation
    from feduq.recipes.job_folders import configure

    from conftest import REPO

    stock = configure(REPO / "jobs" / "fedavg", tmp_path / "stock", image_size=32)  # hand-edited to FLARE's own FedAvg
    server_cfg = stock / "app" / "config" / "config_fed_server.json"
    cfg = json.loads(server_cfg.read_text())
    cfg["workflows"][0]["path"] = "nvflare.app_common.workflows.fedavg.FedAvg"
    server_cfg.write_text(json.dumps(cfg))
    assert virtual_federation.main([str(stock), "--data-root", str(tmp_path / "data"), "--out", str(tmp_path / "o1")]) == 2
    assert "is not a FedUQController" in capsys.readouterr().err
    job = configure(REPO / "jobs" / "feda3i", tmp_path / "feda3i", image_size=32, sites=["ISIC-2017-p00of50"])
    assert virtual_federation.main([str(job), "--data-root", str(tmp_path / "empty"), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ERROR: setup failed: site 'ISIC-2017-p00of50'"), err
