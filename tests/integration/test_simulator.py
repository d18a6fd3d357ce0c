"""Short real-data simulator runs of each job (2 rounds, 32 px, 6 images per split).

FedAvg runs on the 4 polyp sites; every other method runs on one other task's real centers, so each
task of ../shared/data runs once: FedEvi on fundus (3 classes, disc and cup), FedProx on prostate (6
centers, 1 channel), FedBN on skin (a center without test images), FedUAA on breast (2 centers).
"""

import csv
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import read_table, run_simulator, small_job

pytestmark = pytest.mark.sim
SITES = ["Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"]


def _centers(task, data_root, split="test"):
    """The task's centers with at least one image in ``split`` (6 per split at most, as the runs use)."""
    from feduq.data import get_dataset, get_task

    spec = get_task(task)
    if not (data_root / spec.folder).is_dir():
        pytest.skip(f"no {spec.folder} data under {data_root}")
    return {c: len(get_dataset(task, c, split, data_root=data_root, cache=False, max_items=6)) for c in spec.centers}


def _check_table(ws, data_root, task="polyp", printed=None, sites=None):
    """The per-client table: every center (of ``sites``, default all) with test images, Dice in [0, 1], finite HD95,
    Avg = mean.

    ``printed``: the run's output, which must show the table too (not only write it)."""
    tested = [c for c, n in _centers(task, data_root).items() if n and (sites is None or c in sites)]
    assert len(tested) >= 2
    table = read_table(ws)
    assert set(table) == set(tested) | {"Avg", "Std"}
    dice = [float(table[c]["dice"]) for c in tested]
    assert all(0.0 <= d <= 1.0 for d in dice)
    assert all(math.isfinite(float(table[c]["hd95"])) and float(table[c]["hd95"]) >= 0.0 for c in tested)
    assert float(table["Avg"]["dice"]) == pytest.approx(sum(dice) / len(dice), abs=1e-5)
    for center in tested:
        assert int(table[center]["num_images"]) == _centers(task, data_root)[center]
        if printed is not None:
            assert center in printed, f"{center} missing from the printed per-client table"
    if task == "polyp":
        assert all(float(table[s]["hd95"]) <= math.hypot(384, 384) + 1e-6 for s in tested)
    if task == "fundus":  # disc and cup reported separately; dice is their mean
        for center in tested:
            row = table[center]
            assert float(row["dice"]) == pytest.approx((float(row["dice_disc"]) + float(row["dice_cup"])) / 2, abs=1e-5)
    return tested


def test_nvflare_simulator_runs_a_committed_job_as_typed(tmp_path, data_root):
    """``FEDUQ_DATA_ROOT=<relative> nvflare simulator fedevi -w ws -t 2`` on a tiny 2-site copy of jobs/fedevi and a bare workspace
    (no feduq prepare-site, no allow-list): the job's app/custom/ makes it bring-your-own-code, so FLARE 2.9's
    default class allow-list does not apply; the table is printed at the end. Without a data root the run stops at
    once, each site saying so in one line, with no traceback and a non-zero exit."""
    job = small_job("fedevi", tmp_path / "fedevi", num_rounds=1, sites=["Kvasir-SEG", "ETIS-LaribPolypDB"])
    assert (job / "app" / "custom" / "README.md").is_file()
    nvflare = Path(sys.executable).with_name("nvflare")
    env = {k: v for k, v in os.environ.items() if k != "FEDUQ_DATA_ROOT"}
    env["PATH"] = f"{nvflare.parent}{os.pathsep}{env.get('PATH', '')}"

    def simulate(ws: str, **extra_env):
        return subprocess.run(["nvflare", "simulator", "fedevi", "-w", ws, "-t", "2"], cwd=tmp_path, text=True,
                              env={**env, **extra_env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=600)

    # as the README types it: a data root relative to the folder the command starts from (issue 53: every site said
    # "give an absolute path"); the sites run in their own workspace folders, so FedUQ resolves it against $PWD
    relative = os.path.relpath(data_root, tmp_path)
    assert not Path(relative).is_absolute() and relative.startswith("..")
    proc = simulate("ws", FEDUQ_DATA_ROOT=relative, PWD=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert not list((tmp_path / "ws").rglob("resources.json"))  # no site policy: FLARE's default allow-list
    assert not list((tmp_path / "ws").rglob("feduq_site.json"))
    assert "not in allow_list" not in proc.stdout and "| **Avg** |" in proc.stdout.rsplit("# Test results", 1)[-1]
    _check_table(tmp_path / "ws", data_root, printed=proc.stdout.rsplit("# Test results", 1)[-1],
                 sites=["Kvasir-SEG", "ETIS-LaribPolypDB"])

    proc = simulate("ws_no_data")
    assert proc.returncode != 0
    assert len(re.findall(r"FedUQ setup failed: site '[^']+': no data root: .*FEDUQ_DATA_ROOT", proc.stdout)) == 2
    assert "Traceback" not in proc.stdout


def test_fedavg_simulator(tmp_path, data_root):
    ws = tmp_path / "ws"
    proc = run_simulator("fedavg", ws, data_root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_table(ws, data_root, printed=proc.stdout + proc.stderr)
    assert "FedUQ results written to" in proc.stdout + proc.stderr
    table_md = (ws / "server" / "simulate_job" / "results" / "per_client_table.md").read_text()
    assert "Trained network fedevi_unet (FedEviUNet, 3,179,890 parameters)." in table_md  # the paper's network
    assert (ws / "server" / "simulate_job" / "app_server" / "best_FL_global_model.pt").is_file()
    tb = ws / "server" / "simulate_job" / "tb_events"
    assert {p.name for p in tb.iterdir() if any(p.glob("events.out.tfevents.*"))} == set(SITES)  # streamed per site
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tb / "Kvasir-SEG"))
    events.Reload()
    assert [e.step for e in events.Scalars("val_dice_global")] == [0, 1]
    server_log = (ws / "server" / "log.txt").read_text()
    assert server_log.count("aggregated 4 site(s)") == 2
    # each site's own per-image test scores (what feduq compare pairs): the table's Dice is their mean, and they are
    # what feduq evaluate gives for the same best global model off the federation
    from feduq.commands.research.compare import per_image_scores, sites_per_image
    from feduq.commands.site.evaluate import evaluate

    files = sites_per_image(ws)
    assert set(files) == set(SITES)
    table = read_table(ws)
    rows = {}
    for site, path in files.items():
        site_rows = list(csv.DictReader(open(path)))
        assert len(site_rows) == int(float(table[site]["num_images"])) > 0
        assert float(table[site]["dice"]) == pytest.approx(sum(float(r["dice"]) for r in site_rows) / len(site_rows), abs=1e-4)
        rows.update({(site, r["image"]): float(r["dice"]) for r in site_rows})
    _, results = evaluate(ws, out=tmp_path / "eval", sites=SITES, data_root=data_root, split="test", which="best",
                          max_items=6, maps=0)
    off_site = {(r["site"], r["image"]): r["dice"] for res in results.values() for r in res["per_image"]}
    assert set(off_site) == set(rows)
    # the same model and images: equal up to float32 summation order (1-thread site vs this process; up to 1e-6 on
    # an AVX-512 FP16/AMX Xeon, whose oneDNN kernels differ by thread count)
    assert all(off_site[k] == pytest.approx(v, abs=1e-5) for k, v in rows.items())
    paired = per_image_scores("fedavg", "fedavg", 0, ws, None)  # read from the sites' files, nothing re-run
    assert {(r["site"], r["image"]): r["dice"] for r in paired} == rows


def test_fedevi_simulator_on_fundus_every_site_evaluates_the_surrogate_each_round(tmp_path, data_root):
    ws = tmp_path / "ws"
    proc = run_simulator("fedevi", ws, data_root, task="fundus", executor_args={"save_maps": 2})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sites = _check_table(ws, data_root, "fundus", printed=proc.stdout + proc.stderr)
    n_test = _centers("fundus", data_root)
    for site in sites:  # uncertainty maps of (at most) 2 test images, written on the site only
        maps = ws / site / "simulate_job" / "uncertainty_maps"
        rows = list(csv.DictReader(open(maps / "maps_summary.csv")))
        n = min(2, n_test[site])
        assert len(rows) == n and {"mean_epistemic", "mean_aleatoric", "mean_total"} <= set(rows[0])
        assert len(list(maps.glob("*.png"))) == n and len(list(maps.glob("*.npz"))) == n
    assert not list((ws / "server").rglob("uncertainty_maps"))
    for site in sites:
        log = (ws / site / "log.txt").read_text()
        rounds = [json.loads(m)["round"] for m in re.findall(r"FEDEVI_SURROGATE (\{.*\})", log)]
        assert rounds == [0, 1], f"{site} surrogate evaluations: {rounds}"
    server_log = (ws / "server" / "log.txt").read_text()
    betas = [json.loads(m) for m in re.findall(r"FEDEVI_BETA (\{.*\})", server_log)]
    assert [b["round"] for b in betas] == ["initial", 0, 1]
    for b in betas:
        assert set(b["beta"]) == set(sites)
        assert sum(b["beta"].values()) == pytest.approx(1.0, abs=4 * 1e-3)  # clip may add up to K*1e-3


def test_feduaa_simulator_on_breast_softmax_threshold_weights_and_local_heads(tmp_path, data_root):
    import numpy as np
    import torch

    from feduq.core.networks import FedEviUNet

    ws = tmp_path / "ws"
    proc = run_simulator("feduaa", ws, data_root, task="breast")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sites = _check_table(ws, data_root, "breast", printed=proc.stdout + proc.stderr)
    server_log = (ws / "server" / "log.txt").read_text()
    rounds = [json.loads(m) for m in re.findall(r"FEDUAA_WEIGHTS (\{.*\})", server_log)]
    assert [r["round"] for r in rounds] == [0, 1]
    for r in rounds:
        assert set(r["weight"]) == set(r["threshold"]) == set(sites)
        assert all(0.0 <= t <= 1.0 for t in r["threshold"].values())
        theta = np.array([r["threshold"][s] for s in sites])
        softmax = np.exp(theta) / np.exp(theta).sum()
        np.testing.assert_allclose([r["weight"][s] for s in sites], softmax, atol=2e-6)
    for site in sites:
        log = (ws / site / "log.txt").read_text()
        train = [json.loads(m) for m in re.findall(r"FEDUQ_TRAIN (\{.*\})", log)]
        assert [t["round"] for t in train] == [0, 1]
        assert all("feduaa_youden_threshold" in t for t in train)
        heads = [json.loads(m)["local"] for m in re.findall(r"FEDUQ_TEST_LOCAL (\{.*\})", log)]
        assert heads == ["matched"], f"{site}: the best global model was not scored with its round's head"
    # the heads never reached the server: the global model's head is still the seeded initial one
    saved = torch.load(ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False)
    state = saved.get("model", saved)
    init = FedEviUNet(in_channels=1, init_seed=0).state_dict()  # breast ultrasound: 1 channel
    for key in ("head.weight", "head.bias"):
        torch.testing.assert_close(torch.as_tensor(state[key]), init[key])
    first = "encoder.0.0.conv.weight"
    assert not torch.equal(torch.as_tensor(state[first]), init[first])


def _train_records(ws, site):
    return [json.loads(m) for m in re.findall(r"FEDUQ_TRAIN (\{.*\})", (ws / site / "log.txt").read_text())]


def test_fedprox_simulator_on_prostate_every_site_applies_the_proximal_term(tmp_path, data_root):
    ws = tmp_path / "ws"
    # batch 1: one step per training image (2 or 6 here); the term is 0 at a round's first step (θ = θ_global)
    proc = run_simulator("fedprox", ws, data_root, task="prostate", batch_size=1)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_table(ws, data_root, "prostate", printed=proc.stdout + proc.stderr)
    n_train = _centers("prostate", data_root, "train")
    assert (ws / "server" / "log.txt").read_text().count(f"aggregated {len(n_train)} site(s)") == 2
    for site, n in n_train.items():
        records = {r["round"]: r for r in _train_records(ws, site)}
        assert sorted(records) == [0, 1], site
        assert records[1]["mu"] == 0.01 and records[1]["steps"] == n, site
        assert records[1]["prox_term"] > 0, f"{site}: proximal term {records[1]['prox_term']} in round 1"


def test_fedbn_simulator_on_skin_normalisation_layers_never_reach_the_server(tmp_path, data_root):
    import torch

    from feduq.core.networks import FedEviUNet, normalisation_keys

    ws = tmp_path / "ws"
    proc = run_simulator("fedbn", ws, data_root, task="skin")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    # HAM10000-vienna_dias has no test images (README): it trains but is not in the table
    _check_table(ws, data_root, "skin", printed=proc.stdout + proc.stderr)
    centers = _centers("skin", data_root, "train")
    server_log = (ws / "server" / "log.txt").read_text()
    assert server_log.count(f"aggregated {len(centers)} site(s)") == 2 and "rejected update" not in server_log
    for site in centers:
        assert [r["round"] for r in _train_records(ws, site)] == [0, 1], site
    # the global model keeps its full schema; its BN entries are still the seeded initial ones
    saved = torch.load(ws / "server" / "simulate_job" / "app_server" / "FL_global_model.pt", weights_only=False)
    state = {k: torch.as_tensor(v) for k, v in saved.get("model", saved).items()}
    init_model = FedEviUNet(norm="batch", init_seed=0)
    init = init_model.state_dict()
    norm = normalisation_keys(list(init), init_model)
    assert set(state) == set(init) and norm
    for key in norm:
        assert torch.equal(state[key], init[key]), f"{key} left a site"
    shared = [k for k in init if k not in norm]
    assert any(not torch.equal(state[k], init[k]) for k in shared)
