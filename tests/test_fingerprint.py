"""A declared task's CT window from its sites' intensity fingerprints (tools/intensity_fingerprint.py): FLARE's own
federated statistics workflow with FedUQ's generator; the sites send count, sum, mean, standard deviation and a
t-digest only, and the window, mean and standard deviation the server combines are the pooled samples' own."""

from __future__ import annotations

import json

import numpy as np
import pytest

import nnunet_sites
from conftest import load_tool
from feduq.data import DataError, get_dataset, get_task
from feduq.data.nnunet_raw import foreground_intensities

SITES = {"North": "RUNMC", "South": "BMC"}


def _sites(tmp_path, data_root, name):
    root = tmp_path / "data"
    for site, center in SITES.items():
        nnunet_sites.prostate_site(data_root, center, root / name / site, max_cases=3, channels=("CT",))
    task = tmp_path / f"{name}.json"
    task.write_text(json.dumps(nnunet_sites.task_declaration(name, list(SITES), channels=("CT",))))
    return root, task


@pytest.mark.sim
def test_the_federated_fingerprint_gives_the_pooled_window_mean_and_std(tmp_path, data_root):
    root, task = _sites(tmp_path, data_root, "Dataset951_CTFingerprint")
    spec = get_task(str(task))
    assert spec.declaration.missing_windows == (0,)  # "CT" without a window: to be fingerprinted
    from feduq.flare.jobcheck import JobConfigError
    from feduq.recipes.recipe import FedUQRecipe

    with pytest.raises(JobConfigError, match=r"channel_names.0 is CT without a window: declare it, or compute it from "
                                             r"the sites' intensity fingerprints"):
        FedUQRecipe("fedavg", task=str(task), data_root=str(root))
    with pytest.raises(DataError, match="a CT channel has no window yet"):
        get_dataset(str(task), "North", "train", data_root=root, image_size=32)

    tool = load_tool("intensity_fingerprint")
    out = tmp_path / "fingerprinted.json"
    assert tool.main(["--task", str(task), "--data-root", str(root), "--out", str(out), "-w",
                      str(tmp_path / "ws"), "--voxels-per-case", "2000"]) == 0
    entry = json.loads(out.read_text())["feduq"]["normalization"]["0"]

    pooled = np.concatenate([foreground_intensities(spec.name, root, s, voxels_per_case=2000)[0] for s in SITES])
    assert entry["scheme"] == "CT"
    assert entry["mean"] == pytest.approx(pooled.mean(), abs=1e-3)
    assert entry["std"] == pytest.approx(pooled.std(ddof=1), abs=1e-3)
    low, high = np.quantile(pooled, [0.005, 0.995])
    assert entry["window"][0] == pytest.approx(low, abs=1.0) and entry["window"][1] == pytest.approx(high, abs=1.0)

    # what the sites sent: FLARE's statistics of the declared numbers, through its privacy filter, no histogram
    client = json.loads(next((tmp_path / "ws" / "job").rglob("config_fed_client.json")).read_text())
    server = json.loads(next((tmp_path / "ws" / "job").rglob("config_fed_server.json")).read_text())
    assert set(server["workflows"][0]["args"]["statistic_configs"]) == {"count", "sum", "mean", "stddev", "quantile"}
    assert client["task_result_filters"][0]["filters"][0]["path"].endswith("StatisticsPrivacyFilter")

    # the fingerprinted task trains: its CT channel clipped to the window, then z-scored with the pooled numbers
    raw = json.loads(out.read_text())
    raw["name"] = "Dataset952_CTFingerprinted"
    (root / "Dataset952_CTFingerprinted").symlink_to(root / spec.name, target_is_directory=True)
    ds = get_dataset(raw, "North", "train", data_root=root, image_size=32, resize="stretch", cache=False)
    x = np.concatenate([np.asarray(ds[i]["image"]).ravel() for i in range(len(ds))])
    lo, hi = ((np.array(entry["window"]) - entry["mean"]) / entry["std"])
    assert x.min() >= lo - 1e-4 and x.max() <= hi + 1e-4  # clipped (the resize only averages inside the window)
    assert x.max() > hi - 0.05  # and the bright tissue reaches the window's top


def test_nothing_to_fingerprint_is_refused(tmp_path, capsys):
    task = tmp_path / "t.json"
    task.write_text(json.dumps(nnunet_sites.task_declaration("Dataset953_T2only", ["A", "B"])))
    assert load_tool("intensity_fingerprint").main(["--task", str(task), "--out", str(tmp_path / "o.json")]) == 2
    assert ("intensity_fingerprint.py: error: task 'Dataset953_T2only' has no CT channel without a window: nothing to "
            "fingerprint") in capsys.readouterr().err
