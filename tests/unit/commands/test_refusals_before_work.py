"""Bad input stops before anything runs, in one line naming the file and the cause (a site without its dataset.json,
a run without test cases, a damaged checkpoint, a NIfTI header that lies, mixed endings, another task's site)."""

from __future__ import annotations

import json
import shutil
import time

import pytest

import nnunet_sites
from feduq.data import DataError, get_dataset, get_task, job_task


@pytest.fixture(scope="module")
def region_sites(tmp_path_factory, data_root):
    root = tmp_path_factory.mktemp("faults4")
    task = nnunet_sites.fundus_region_task(data_root, root, disc_only=(), max_items=5)
    return root, task


def test_an_nnunet_site_without_its_dataset_json_is_named_as_that(region_sites, tmp_path):
    """It was reported as "folder .../images is missing" (read as FedUQ's own layout)."""
    root, task = region_sites
    spec = get_task(str(task))
    data = tmp_path / "data"
    shutil.copytree(root / spec.folder, data / spec.folder)
    site = data / spec.folder / "EyeClinic-A"
    (site / "dataset.json").unlink()
    with pytest.raises(DataError) as e:
        get_dataset(str(task), "EyeClinic-A", "train", data_root=data, image_size=32, cache=False)
    assert str(e.value) == (f"site 'EyeClinic-A': {site} has imagesTr/ but no dataset.json: an nnU-Net raw dataset "
                            "needs the site's own dataset.json (channel_names, labels, file_ending)")


def test_a_run_whose_sites_have_no_test_cases_is_refused_before_flare_starts(region_sites, tmp_path):
    """It trained, then failed with "no site returned test metrics", the reason only in the sites' logs."""
    from nvflare.recipe import SimEnv

    from feduq.recipes.recipe import FedUQRecipe

    root, task = region_sites
    spec = get_task(str(task))
    data = tmp_path / "data"
    shutil.copytree(root / spec.folder, data / spec.folder)
    for site in spec.centers:
        cases = sorted(p.name[: -len("_0000.png")] for p in (data / spec.folder / site / "imagesTr").iterdir())
        (data / spec.folder / site / "split.json").write_text(json.dumps(
            {"training": cases[:-1], "validation": cases[-1:], "testing": []}))
    recipe = FedUQRecipe("fedavg", task=str(task), data_root=str(data), image_size=32, num_rounds=1,
                         executor_args={"network": {"name": "light"}})
    t0 = time.perf_counter()
    with pytest.raises(DataError) as e:
        recipe.run(SimEnv(clients=recipe.sites, workspace_root=str(tmp_path / "ws")))
    assert time.perf_counter() - t0 < 10
    assert str(e.value) == ("no site has test cases (EyeClinic-A: 0, EyeClinic-B: 0, EyeClinic-C: 0, EyeClinic-D: 0): "
                            "the run would train and then have nothing to test; give a site a 'testing' split (its "
                            "split.json, or feduq split)")


@pytest.mark.parametrize("kind, words", [("truncated", "is truncated or damaged"),
                                         ("pickle", "is not a torch checkpoint (it is a plain pickle, not read)")])
def test_resume_names_a_checkpoint_damaged_after_the_run_wrote_it(tmp_path, data_root, capsys, kind, words):
    """feduq virtual --resume on a checkpoint.pt changed after the run's marker (truncated by a full disk, or
    replaced by a plain pickle) said "... is not FedUQ's ... move it away"; it names the truncation or the pickle."""
    import os
    import pickle

    import torch

    from conftest import REPO, load_tool
    from feduq.outputs import OUTPUT_MARKER, write_marker

    out = tmp_path / "run"
    out.mkdir()
    torch.save({"model": {"w": torch.zeros(64)}, "meta": {"feduq_last_completed_round": 0}}, out / "checkpoint.pt")
    write_marker(out, "feduq virtual")
    whole = (out / "checkpoint.pt").read_bytes()
    (out / "checkpoint.pt").write_bytes(whole[:100] if kind == "truncated" else pickle.dumps({"a": 1}))
    later = (out / OUTPUT_MARKER).stat().st_mtime_ns + 1_000_000_000
    os.utime(out / "checkpoint.pt", ns=(later, later))
    code = load_tool("virtual_federation").main([str(REPO / "jobs" / "fedavg"), "--data-root", str(data_root),
                                                 "--out", str(out), "--resume"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and str(out / "checkpoint.pt") in err and words in err, err


def test_a_nifti_header_claiming_more_voxels_than_fit_is_one_line(tmp_path):
    """A header claiming 30000 x 30000 x 5000 voxels gave a 57-line MemoryError traceback."""
    import struct

    import nibabel as nib
    import numpy as np

    from feduq.io.volumes import MAX_VOXELS, VolumeError, read_volume

    path = tmp_path / "huge.nii"
    nib.save(nib.Nifti1Image(np.zeros((2, 2, 2), np.int16), np.diag([1.0, 1.0, 1.0, 1.0])), path)
    raw = bytearray(path.read_bytes())
    raw[40:48] = struct.pack("<4h", 3, 30000, 30000, 5000)  # dim[0..3] of the NIfTI-1 header
    path.write_bytes(bytes(raw))
    with pytest.raises(VolumeError) as e:
        read_volume(path)
    assert str(e.value) == (f"{path}: its header claims 30000 x 30000 x 5000 = 4,500,000,000,000 voxels, more than "
                            f"FedUQ reads ({MAX_VOXELS:,}, a 1024^3 volume); a damaged header, or a volume to crop first")
    raw[40:48] = struct.pack("<4h", 3, 200, 200, 50)  # fewer than the cap, more than the file holds
    path.write_bytes(bytes(raw))
    with pytest.raises(VolumeError, match=r"huge\.nii: cannot read its voxels \(") as e:
        read_volume(path)
    assert "\n" not in str(e.value)


def test_mixed_nifti_endings_in_predicts_input_name_the_tasks_ending_not_a_missing_dataset_json(tmp_path, data_root):
    """Mixed .nii/.nii.gz inputs were refused naming a dataset.json that does not exist (predict's input folder has
    none)."""
    import nibabel as nib

    from feduq.predict.declared_cases import find_declared_cases
    from feduq.predict.files import PredictError

    name = "Dataset975_MixedEndings"
    spec = job_task(nnunet_sites.task_declaration(name, ["A"]))
    cases = tmp_path / "new"
    nnunet_sites.prostate_site(data_root, "RUNMC", tmp_path / "site", max_cases=1)
    (f,) = sorted((tmp_path / "site" / "imagesTr").iterdir())
    cases.mkdir()
    (cases / "a_0000.nii.gz").write_bytes(f.read_bytes())
    nib.save(nib.load(f), cases / "b_0000.nii")
    with pytest.raises(PredictError) as e:
        find_declared_cases(cases, spec.name)
    assert str(e.value) == (f"input {cases}: new/b_0000.nii does not end in the task's file_ending '.nii.gz'; one file "
                            "ending per dataset")


def test_a_site_of_another_task_is_refused_naming_the_folder_given(region_sites, tmp_path, capsys):
    """predict --calibrate --site-dir on another task's site named the temporary link FedUQ makes for a folder outside
    a data root, not the --site-dir given."""
    import torch

    from conftest import small_job
    from feduq.core.networks import build_network
    from feduq.commands.site.predict import main as predict

    root, task = region_sites
    given = tmp_path / "elsewhere" / "EyeClinic-A"
    shutil.copytree(root / get_task(str(task)).folder / "EyeClinic-A", given)
    job = small_job("fedavg", tmp_path / "job", network="light")  # the polyp task
    torch.save({"model": build_network("light", 3, 2, init_seed=0).state_dict()}, tmp_path / "model.pt")
    capsys.readouterr()
    assert predict(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--calibrate", "--site-dir", str(given),
                    "--target-dice", "0.5", "--units", "images", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{given}/dataset.json: label 'optic_disc' is not a label or region of task " \
        "'polyp'" in err and "feduq-calibrate-" not in err, err


def test_a_site_workers_port_is_drawn_below_the_ephemeral_range_and_free(tmp_path):
    """Issue 70 item 7: FLARE's simulator handed each site worker a port from the kernel's ephemeral range (bind port
    0, close it) that the worker bound seconds later; on a busy host another listener could take it in between, and the
    site died ("Communication error with client ...: [Errno 104] Connection reset by peer", then "no sign of life ...
    its process is gone": reproduced by handing the worker a port another listener holds). FedUQ's simulator entry
    draws the port below the ephemeral range, where nothing is handed out automatically, and checks it is free."""
    import random
    import socket
    import types

    from feduq.flare import simulator as fs

    low, high = fs.ephemeral_range()
    assert 1024 < low < high
    ports = {fs.worker_port(random.Random(s), claims=None) for s in range(20)}
    assert all(max(1024, low - fs.WORKER_PORTS) <= p < low for p in ports) and len(ports) > 10
    # a port a listener holds is never handed out: the draw moves on
    first = random.Random(7).randrange(max(1024, low - fs.WORKER_PORTS), low)
    with socket.socket() as held:
        held.bind(("localhost", first))
        held.listen(1)
        assert fs.worker_port(random.Random(7), claims=None) != first
    # two simulations on one host: a port one drew (free until its worker binds it) is not drawn by the other
    claims = tmp_path / "claims"
    mine = fs.worker_port(random.Random(7), claims=claims)
    assert mine == first and (claims / str(first)).is_file()
    assert fs.worker_port(random.Random(7), claims=claims) != first  # same draw: claimed, so the next port
    assert fs.worker_port(random.Random(7), claims=None) == first  # without claims the same draw repeats
    import os
    import time

    old = time.time() - fs.CLAIM_S - 1
    os.utime(claims / str(first), (old, old))  # a claim left by a simulation long gone
    assert fs.worker_port(random.Random(7), claims=claims) == first
    assert fs.ephemeral_range("/nonexistent") == fs.EPHEMERAL_DEFAULT
    with pytest.raises(OSError, match="no room below it"):
        fs.worker_port(ephemeral=(1030, 60999))
    module = types.SimpleNamespace(get_open_ports=lambda n: [low + 1] * n)
    fs.reserve_worker_ports(module)
    fs.reserve_worker_ports(module)  # idempotent
    (port,) = module.get_open_ports(1)
    assert port < low and module.get_open_ports.__name__ == "_worker_ports"
