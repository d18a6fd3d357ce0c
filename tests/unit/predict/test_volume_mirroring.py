"""Test-time mirroring of a 3D network (feduq.nnunet.volume_inference.Mirrored) against nnU-Net's own predictor
code, the flip equivariance it gives (with a negative control: the plain network lacks it), and predict's refusal of
--mirror for a job that predicts 2D planes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from feduq.nnunet.volume_inference import Mirrored


def _net(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv3d(1, 4, 3, padding=1), torch.nn.ReLU(),
                               torch.nn.Conv3d(4, 3, (1, 3, 5), padding=(0, 1, 2))).eval()


@pytest.mark.parametrize("axes", [(0, 1, 2), (1, 2)])
def test_mirroring_averages_the_logits_as_nnunets_predictor_does(axes):
    """The mean over the input and its 2^k - 1 flips equals ``nnUNetPredictor._internal_maybe_mirror_and_predict``
    on the same network and axes (nnU-Net's code run on a stand-in predictor)."""
    from nnunetv2.inference.predict_from_raw_data import nnUNetPredictor

    net, x = _net(), torch.randn(2, 1, 6, 8, 10)
    with torch.no_grad():
        ours = Mirrored(net, axes)(x)
        theirs = nnUNetPredictor._internal_maybe_mirror_and_predict(
            SimpleNamespace(network=net, allowed_mirroring_axes=axes, use_mirroring=True), x.clone())
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    assert torch.equal(Mirrored(net, ())(x), net(x))  # no axes: the network itself


def test_the_mirrored_network_is_flip_equivariant_and_the_plain_one_is_not():
    net, x = _net(1), torch.randn(1, 1, 6, 8, 10)
    mirrored = Mirrored(net, (0, 1, 2))
    with torch.no_grad():
        for axis in (2, 3, 4):
            torch.testing.assert_close(mirrored(torch.flip(x, [axis])), torch.flip(mirrored(x), [axis]),
                                       rtol=1e-5, atol=1e-6)
            # negative control: the plain network's kernel (1 x 3 x 5, asymmetric weights) is not flip-equivariant
            assert (net(torch.flip(x, [axis])) - torch.flip(net(x), [axis])).abs().max() > 1e-3


def test_predict_refuses_mirror_for_a_job_that_predicts_2d_planes(tmp_path, data_root, capsys):
    from conftest import small_job
    from feduq.commands.site.predict import main as predict
    from helpers import light_model

    job = small_job("fedavg", tmp_path / "job", task="polyp", network="light")
    model = light_model(tmp_path / "model.pt")
    image = next((data_root / "polyp" / "Kvasir-SEG" / "images").iterdir())
    assert predict(["--job", str(job), "--model", str(model), "--input", str(image), "--out", str(tmp_path / "o"),
                    "--mirror", "--no-progress"]) == 2
    assert "--mirror: test-time mirroring is built for a 3D job's sliding window" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
