"""Loading a model file never runs code (feduq.core.checkpoints): a crafted .pt is refused by feduq evaluate and
feduq resume, alone or hidden inside a real checkpoint, and FedUQ's own checkpoints still load."""

from __future__ import annotations

import pathlib

import pytest
import torch

from conftest import REPO, load_tool, one_image_site
from feduq.core.checkpoints import CheckpointError, arrays_of, load_checkpoint, tensors_of


class Payload:
    """Unpickling this calls ``Path.touch(marker)``: the stand-in for any code a crafted file could run."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (pathlib.Path.touch, (pathlib.Path(self.marker),))


def _network_state(job="fedavg"):
    """The state dict of a committed job's network (its server persistor's model)."""
    import json

    from feduq.jobs.jobcheck import instantiate

    server = json.loads((REPO / "jobs" / job / "app" / "config" / "config_fed_server.json").read_text())
    spec = next(c for c in server["components"] if c["id"] == "persistor")["args"]["model"]
    return instantiate(spec, "persistor model").state_dict()


def _checkpoint(path, extra=None, round_done=1, model=None, meta=None):
    """A checkpoint as FLARE's PT persistor writes it for FedUQ (model, meta_props, train_conf); the model is the
    committed jobs' network unless given."""
    state = {"model": _network_state() if model is None else model,
             "meta_props": {"feduq_last_completed_round": round_done, "fedevi_beta": {"A": 0.25, "B": 0.75},
                            **(meta or {})},
             "train_conf": {"train": {"model": "x"}}}
    torch.save({**state, **(extra or {})}, path)
    return path


@pytest.fixture
def crafted(tmp_path):
    marker = tmp_path / "PAYLOAD_RAN"
    (tmp_path / "given").mkdir()
    alone = tmp_path / "given" / "payload.pt"
    torch.save(Payload(marker), alone)
    hidden = _checkpoint(tmp_path / "given" / "FL_global_model.pt", extra={"extra": Payload(marker)})
    return marker, alone, hidden


def test_the_loader_refuses_a_payload_and_loads_real_checkpoints(tmp_path, crafted):
    marker, alone, hidden = crafted
    for path in (alone, hidden):
        with pytest.raises(CheckpointError, match=rf"{path.name}: refused: it needs code to load \(\w"):
            load_checkpoint(path)
    assert not marker.exists()
    real = load_checkpoint(_checkpoint(tmp_path / "real.pt", model={"w": torch.arange(6.0).reshape(2, 3)}))
    torch.testing.assert_close(real["model"]["w"], torch.arange(6.0).reshape(2, 3))
    assert real["meta_props"]["fedevi_beta"] == {"A": 0.25, "B": 0.75}
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes((tmp_path / "real.pt").read_bytes()[:100])
    with pytest.raises(CheckpointError, match="cut.pt cannot be read as a torch file"):
        load_checkpoint(truncated)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent.pt")
    # a plain pickle is named as what it is, not as "needs code to load (149)" (its opcode read as a global's name)
    import pickle

    (tmp_path / "plain.pt").write_bytes(pickle.dumps({"a": 1}))
    with pytest.raises(CheckpointError, match=r"plain.pt is not a torch file \(a pickle torch.save did not write: "
                                              r"opcode \d+\); nothing of it was run"):
        load_checkpoint(tmp_path / "plain.pt")
    (tmp_path / "notes.pt").write_text("hello, not a model")
    with pytest.raises(CheckpointError, match="notes.pt cannot be read as a torch file \\(neither torch.save's zip "
                                              "archive nor its older format"):
        load_checkpoint(tmp_path / "notes.pt")
    # FedUAA's numpy heads are saved as tensors, so they load with weights_only and come back as arrays
    import numpy as np

    heads = {"current": {"head.w": np.ones((2, 2), np.float32)}, "by_model": {"abc": {"head.w": np.zeros(2)}}}
    torch.save(tensors_of(heads), tmp_path / "heads.pt")
    back = arrays_of(load_checkpoint(tmp_path / "heads.pt"))
    np.testing.assert_array_equal(back["current"]["head.w"], heads["current"]["head.w"])
    assert isinstance(back["by_model"]["abc"]["head.w"], np.ndarray)
    counter = tensors_of({"bn.num_batches_tracked": np.array(7)})["bn.num_batches_tracked"]  # a 0-d entry stays 0-d
    assert counter.shape == () and int(counter) == 7


def test_resume_job_refuses_a_payload_checkpoint(tmp_path, crafted, capsys):
    marker, alone, hidden = crafted
    resume_job = load_tool("resume_job")
    for path in (alone, hidden):
        assert resume_job.main([str(REPO / "jobs" / "fedavg"), "--checkpoint", str(path), "-o", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and str(path) in err and "refused" in err
    assert not marker.exists() and not (tmp_path / "o").exists()
    # a missing, a truncated and a foreign (no FedUQ round) checkpoint: one line each
    foreign = tmp_path / "given" / "foreign.pt"
    torch.save({"model": {"w": torch.zeros(1)}}, foreign)
    truncated = tmp_path / "given" / "cut.pt"
    truncated.write_bytes(b"PK\x03\x04 not really")
    for path, words in ((tmp_path / "given" / "none.pt", "does not exist"), (truncated, "cannot be read"),
                        (foreign, "not a FedUQ checkpoint")):
        assert resume_job.main([str(REPO / "jobs" / "fedavg"), "--checkpoint", str(path), "-o", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err
    # a real checkpoint resumes; the checkpoint's own folder is never the output
    ws = tmp_path / "ws" / "server" / "simulate_job" / "app_server"
    ws.mkdir(parents=True)
    real = _checkpoint(ws / "FL_global_model.pt", round_done=3)
    assert resume_job.main([str(REPO / "jobs" / "fedavg"), "--checkpoint", str(real), "-o", str(tmp_path / "ws")]) == 2
    assert "contains the checkpoint's folder" in capsys.readouterr().err and real.is_file()
    assert resume_job.main([str(REPO / "jobs" / "fedavg"), "--checkpoint", str(real), "-o", str(tmp_path / "r")]) == 0
    assert "resumes after round 3" in capsys.readouterr().out


def test_resume_job_refuses_another_methods_or_networks_checkpoint(tmp_path, capsys):
    """A FedEvi checkpoint for a FedAvg job (recorded server part), an older FedAvg checkpoint without β for a
    FedEvi job, and a checkpoint of another network: one line each, exit 2, nothing written."""
    from feduq.core.networks import build_network

    resume_job = load_tool("resume_job")
    (tmp_path / "c").mkdir()
    fedevi = _checkpoint(tmp_path / "c" / "fedevi.pt", meta={"feduq_server_part": "feduq.methods.fedevi.FedEviServer"})
    old_fedavg = tmp_path / "c" / "old_fedavg.pt"
    torch.save({"model": _network_state(), "meta_props": {"feduq_last_completed_round": 2}}, old_fedavg)
    light = _checkpoint(tmp_path / "c" / "light.pt", model=build_network("light", 3, 2).state_dict())
    for job, path, words in (
            ("fedavg", fedevi, "was written by feduq.methods.fedevi.FedEviServer; the job"),
            ("fedevi", old_fedavg, "has no 'fedevi_beta' in its meta: not a checkpoint of the job's method"),
            ("fedavg", light, "does not fit the job's network (FedEviUNet): missing keys")):
        assert resume_job.main([str(REPO / "jobs" / job), "--checkpoint", str(path), "-o", str(tmp_path / "o")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and words in err, err
    assert not (tmp_path / "o").exists()


def test_evaluate_refuses_a_payload_model(tmp_path, crafted, capsys, data_root):
    marker, alone, hidden = crafted
    evaluate = load_tool("evaluate")
    site, _ = one_image_site(data_root, tmp_path / "site")
    for path in (alone, hidden):
        rc = evaluate.main(["--job", str(REPO / "jobs" / "fedavg"), "--model", str(path), "--site-dir", str(site),
                            "--out", str(tmp_path / "eval"), "--maps", "0"])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.count("\n") == 0 and str(path) in err and "refused" in err
    assert not marker.exists()


def test_a_checkpoint_from_before_the_folders_resumes_its_job(tmp_path, capsys):
    """Checkpoints record their server part's class path; one written before the package was arranged in folders
    (``feduq.methods.server.LocalEntriesServer``, FedBN's) still resumes FedBN's job, and the class resolves."""
    from feduq.common.classpath import current_path, resolve_class
    from feduq.core.networks import build_network
    from feduq.parts.server import LocalEntriesServer

    assert resolve_class("feduq.methods.server.LocalEntriesServer") is LocalEntriesServer
    assert current_path("feduq.ct_server.CTServer") == "feduq.parts.ct_server.CTServer"
    assert current_path("feduq.methods.fedevi.FedEviServer") == "feduq.methods.fedevi.FedEviServer"
    resume_job = load_tool("resume_job")
    (tmp_path / "c").mkdir()
    old = _checkpoint(tmp_path / "c" / "fedbn.pt", round_done=2, model=build_network("fedevi_unet", 3, 2, norm="batch").state_dict(),
                      meta={"feduq_server_part": "feduq.methods.server.LocalEntriesServer"})
    assert resume_job.main([str(REPO / "jobs" / "fedbn"), "--checkpoint", str(old), "-o", str(tmp_path / "r")]) == 0
    assert "resumes after round 2" in capsys.readouterr().out


def test_resume_job_checks_the_best_model_beside_the_checkpoint_too(tmp_path, capsys):
    """Issue 53: the best model so far (best_FL_global_model.pt beside the checkpoint) is carried into the resumed run;
    one of another network is refused in one line, nothing written."""
    from feduq.core.networks import build_network

    resume_job = load_tool("resume_job")
    folder = tmp_path / "app_server"
    folder.mkdir()
    real = _checkpoint(folder / "FL_global_model.pt", round_done=3)
    torch.save({"model": build_network("light", 3, 2).state_dict()}, folder / "best_FL_global_model.pt")
    assert resume_job.main([str(REPO / "jobs" / "fedavg"), "--checkpoint", str(real), "-o", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "best_FL_global_model.pt" in err and "does not fit the job's network" in err, err
    assert not (tmp_path / "r").exists()


def test_a_diverged_checkpoint_is_refused_for_resume_and_as_a_start(tmp_path, capsys):
    """Issue 53: a checkpoint whose model holds NaN/Inf (a diverged run) is refused by feduq resume in one line naming
    the parameter and its counts; the loader's check counts NaN and Inf separately and skips integer buffers."""
    from feduq.core.checkpoints import check_finite

    state = _network_state()
    name = next(k for k, v in state.items() if v.is_floating_point() and v.numel() > 3)
    state[name].view(-1)[:3] = torch.tensor([float("nan"), float("nan"), float("-inf")])
    resume_job = load_tool("resume_job")
    (tmp_path / "c").mkdir()
    bad = _checkpoint(tmp_path / "c" / "FL_global_model.pt", model=state)
    assert resume_job.main([str(REPO / "jobs" / "fedavg"), "--checkpoint", str(bad), "-o", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"parameter {name!r} holds 2 NaN and 1 Inf of {state[name].numel()} values" in err
    assert "(1 of" in err and not (tmp_path / "o").exists()
    check_finite({"n": torch.tensor([2**62]), "w": torch.zeros(3)}, "x.pt")  # integers and finite floats pass
    with pytest.raises(CheckpointError, match=r"'w' holds 0 NaN and 1 Inf of 2 values \(1 of 2 parameters"):
        check_finite({"n": torch.tensor([1]), "w": torch.tensor([1.0, float("inf")])}, "x.pt")
