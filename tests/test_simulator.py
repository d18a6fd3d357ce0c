"""Short real-data simulator runs of each job (4 polyp sites, 2 rounds, 64 px, 8 images/split)."""

import json
import math
import re

import pytest

from conftest import read_table, run_simulator

pytestmark = pytest.mark.sim
SITES = ["Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"]


def _check_table(ws):
    table = read_table(ws)
    assert set(table) == set(SITES) | {"Avg", "Std"}
    dice = [float(table[s]["dice"]) for s in SITES]
    hd95 = [float(table[s]["hd95"]) for s in SITES]
    assert all(0.0 <= d <= 1.0 for d in dice)
    assert all(math.isfinite(h) and 0.0 <= h <= math.hypot(384, 384) + 1e-6 for h in hd95)
    assert float(table["Avg"]["dice"]) == pytest.approx(sum(dice) / 4, abs=1e-5)
    assert int(table["Kvasir-SEG"]["num_images"]) == 8


def test_fedavg_simulator(tmp_path, data_root):
    ws = tmp_path / "ws"
    proc = run_simulator("fedavg", ws, data_root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_table(ws)
    assert "FedUQ results written to" in proc.stdout + proc.stderr
    assert (ws / "server" / "simulate_job" / "app_server" / "best_FL_global_model.pt").is_file()
    server_log = (ws / "server" / "log.txt").read_text()
    assert server_log.count("aggregated 4 site(s)") == 2


def test_fedevi_simulator_every_site_evaluates_the_surrogate_each_round(tmp_path, data_root):
    ws = tmp_path / "ws"
    proc = run_simulator("fedevi", ws, data_root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    _check_table(ws)
    for site in SITES:
        log = (ws / site / "log.txt").read_text()
        rounds = [json.loads(m)["round"] for m in re.findall(r"FEDEVI_SURROGATE (\{.*\})", log)]
        assert rounds == [0, 1], f"{site} surrogate evaluations: {rounds}"
    server_log = (ws / "server" / "log.txt").read_text()
    betas = [json.loads(m) for m in re.findall(r"FEDEVI_BETA (\{.*\})", server_log)]
    assert [b["round"] for b in betas] == ["initial", 0, 1]
    for b in betas:
        assert set(b["beta"]) == set(SITES)
        assert sum(b["beta"].values()) == pytest.approx(1.0, abs=4 * 1e-3)  # clip may add up to K*1e-3
