"""A declared task's CT window from its sites' intensity fingerprints (feduq fingerprint): FLARE's own
federated statistics workflow with FedUQ's generator; the sites send count, sum, mean, standard deviation and a
t-digest only, and the window, mean and standard deviation the server combines are the pooled samples' own."""

from __future__ import annotations

import json

import numpy as np
import pytest

import nnunet_sites
from conftest import load_tool
from feduq.data import DataError, get_dataset, get_task, job_task
from feduq.sites.nnunet_raw import foreground_intensities

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
    assert spec.missing_windows == (0,)  # "CT" without a window: to be fingerprinted
    from feduq.jobs.jobcheck import JobConfigError
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
    ds = get_dataset(job_task(raw), "North", "train", data_root=root, image_size=32, resize="stretch", cache=False)
    x = np.concatenate([np.asarray(ds[i]["image"]).ravel() for i in range(len(ds))])
    lo, hi = ((np.array(entry["window"]) - entry["mean"]) / entry["std"])
    assert x.min() >= lo - 1e-4 and x.max() <= hi + 1e-4  # clipped (the resize only averages inside the window)
    assert x.max() > hi - 0.05  # and the bright tissue reaches the window's top


def test_nothing_to_fingerprint_is_refused(tmp_path, capsys):
    task = tmp_path / "t.json"
    task.write_text(json.dumps(nnunet_sites.task_declaration("Dataset953_T2only", ["A", "B"])))
    assert load_tool("intensity_fingerprint").main(["--task", str(task), "--out", str(tmp_path / "o.json")]) == 2
    assert ("feduq fingerprint: error: task 'Dataset953_T2only' has no CT channel without a window: nothing to "
            "fingerprint") in capsys.readouterr().err


def _put_nan(volume):
    import nibabel as nib

    img = nib.load(volume)
    a = np.asarray(img.dataobj).astype(np.float32)
    a[0, 0, 0] = np.nan
    header = img.header.copy()
    header.set_data_dtype(np.float32)
    nib.save(nib.Nifti1Image(a, img.affine, header), volume)


@pytest.mark.sim
def test_a_site_that_cannot_read_its_data_stops_the_fingerprint_job_naming_it(tmp_path, data_root):
    """FLARE's StatisticsExecutor panicked at the first task on a generator that did not start, its reply never sent,
    and FLARE's StatisticsController waited for it for ever; the site now answers with its error and the server stops
    the job at once (a silent site: within FedUQ's liveness window), one line naming the site and its error."""
    import re
    import subprocess
    import sys
    from datetime import datetime
    from pathlib import Path

    from feduq.flare.liveness import SILENT_S

    root, task = _sites(tmp_path, data_root, "Dataset954_CTFingerprintNaN")
    volume = sorted((root / "Dataset954_CTFingerprintNaN" / "South" / "imagesTr").glob("*.nii.gz"))[0]
    _put_nan(volume)
    out, ws = tmp_path / "fingerprinted.json", tmp_path / "ws"
    proc = subprocess.Popen([sys.executable, "-m", "feduq", "fingerprint", "--task", str(task), "--data-root", str(root), "--out",
                             str(out), "-w", str(ws), "--voxels-per-case", "500"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = proc.communicate(timeout=150)  # the old job never ended
    except subprocess.TimeoutExpired:
        proc.terminate()  # the tool takes the simulator's process group with it
        proc.communicate(timeout=30)
        pytest.fail("the fingerprint job with a failing site did not end in 150 s")
    assert proc.returncode == 2 and not out.exists()
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("feduq fingerprint: error: the fingerprint job failed: ")
    assert f"site 'South': setup failed: case '{volume.name.split('_')[0]}': its image holds NaN or infinite values " \
           f"({volume.name})" in lines[0]
    assert "'North'" not in lines[0] and f"logs under {ws / 'simulate'}" in lines[0]

    # the server stopped the job within the liveness window after its statistics task started
    server = (ws / "simulate" / "server" / "log.txt").read_text().splitlines()

    def at(marker):
        line = next(line for line in server if marker in line)
        return datetime.strptime(re.match(r"\S+ \S+", line).group(0), "%Y-%m-%d %H:%M:%S,%f")

    assert (at("FEDUQ_JOB_FAILED") - at("control flow started")).total_seconds() < SILENT_S


def test_a_missing_data_root_is_one_line_before_flare_starts(tmp_path, capsys):
    task = tmp_path / "t.json"
    task.write_text(json.dumps(nnunet_sites.task_declaration("Dataset955_CTRoot", list(SITES), channels=("CT",))))
    args = ["--task", str(task), "--data-root", str(tmp_path / "nowhere"), "--out", str(tmp_path / "o.json"),
            "-w", str(tmp_path / "ws")]
    assert load_tool("intensity_fingerprint").main(args) == 2
    err = capsys.readouterr().err
    assert err == f"feduq fingerprint: error: data root {tmp_path / 'nowhere'} does not exist or is not a folder\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.json"]  # nothing written


def test_a_statistics_file_that_is_not_json_is_named(tmp_path, capsys):
    task = tmp_path / "t.json"
    task.write_text(json.dumps(nnunet_sites.task_declaration("Dataset956_CTStats", list(SITES), channels=("CT",))))
    stats = tmp_path / "intensity_fingerprint.txt"
    stats.write_text("count mean stddev\n")
    tool = load_tool("intensity_fingerprint")
    assert tool.main(["--task", str(task), "--from-stats", str(stats), "--out", str(tmp_path / "o.json")]) == 2
    err = capsys.readouterr().err
    assert err == (f"feduq fingerprint: error: --from-stats {stats}: not FLARE's JSON statistics file (invalid "
                   "JSON: Expecting value: line 1 column 1 (char 0))\n")
    stats.write_text("[]")
    assert tool.main(["--task", str(task), "--from-stats", str(stats), "--out", str(tmp_path / "o.json")]) == 2
    assert f"--from-stats {stats}: not FLARE's statistics file (a JSON list" in capsys.readouterr().err
    assert not (tmp_path / "o.json").exists()


def test_the_fingerprint_server_names_a_failed_or_silent_site_once(caplog):
    """FingerprintController: a site's error reply (its reason in FedUQ's header) or the site watch's report of a
    silent site fails the job at once with FEDUQ_JOB_FAILED naming it; later replies add no second failure."""
    from types import SimpleNamespace

    from nvflare.apis.fl_constant import ReturnCode
    from nvflare.apis.fl_context import FLContext

    from feduq.flare.fingerprint import FingerprintController
    from feduq.flare.quorum import error_reply
    from feduq.recipes.outcome import server_failure

    def controller():
        c = FingerprintController(statistic_configs={"count": {}}, writer_id="w")
        c.fl_ctx, c.panics, c.cancelled = FLContext(), [], []
        c.system_panic = lambda reason, fl_ctx: c.panics.append(reason)
        c.cancel_all_tasks = lambda **kw: c.cancelled.append(True)
        return c

    def reply(site, result):
        return SimpleNamespace(client=SimpleNamespace(name=site), result=result, task=SimpleNamespace(props={}))

    c = controller()
    with caplog.at_level("ERROR"):
        c.results_cb(reply("South", error_reply(ReturnCode.EXECUTION_EXCEPTION, "site 'South': setup failed: NaN")),
                     c.fl_ctx)
        c.results_cb(reply("North", error_reply(ReturnCode.TASK_ABORTED, "aborted")), c.fl_ctx)
    assert c.panics == ["the intensity fingerprint needs every site's statistics; site 'South': setup failed: NaN"]
    assert c.cancelled == [True] and c.client_statistics == {}
    reason, sites = server_failure([r.getMessage() for r in caplog.records])
    assert reason == c.panics[0] and sites == {"South": "site 'South': setup failed: NaN"}

    c = controller()
    c._sites_gone({"North": "no sign of life for 41 s while the server waited for it: its process is gone"}, True)
    assert c.panics == ["the intensity fingerprint needs every site's statistics; site 'North': no sign of life for "
                        "41 s while the server waited for it: its process is gone"]
