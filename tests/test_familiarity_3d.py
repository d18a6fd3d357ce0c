"""The review rule's familiarity part for a 3D job's network: each volume's pooled bottleneck features
(``feduq.nnunet.volume_inference.volume_features``) are its windows' encoder output, pooled; a volume unlike the
calibration volumes lies farther than they do. Real prostate volumes from ../shared/data (the 3D fixture's sites)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from test_site3d import NAME, volume_federation  # noqa: F401  (the module's fixture, shared)


def _network(slim):
    from feduq.nnunet.planned import PlannedNetwork

    return PlannedNetwork(slim, "3d_fullres", 1, 3, init_seed=3).eval()


def test_a_volumes_features_are_the_mean_of_its_windows_bottleneck(volume_federation):
    """Against nnU-Net's own window steps and the encoder's last stage taken by hand, on a volume larger than the
    patch along two axes and smaller along the third (zero-padded evenly, as MONAI's sliding window pads)."""
    from nnunetv2.inference.sliding_window_prediction import compute_steps_for_sliding_window

    from feduq.nnunet.volume_inference import volume_features

    _, _, slim = volume_federation
    net = _network(slim)
    patch = slim["configurations"]["3d_fullres"]["patch_size"]
    rng = np.random.default_rng(0)
    data = rng.normal(size=(1, patch[0] - 4, patch[1] + 21, patch[2] + 40)).astype(np.float32)
    got = volume_features(net.bottleneck, data, patch, torch.device("cpu"))
    padded = np.pad(data, ((0, 0), (2, 2), (0, 0), (0, 0)))
    steps = compute_steps_for_sliding_window(padded.shape[1:], patch, 0.5)
    assert [len(s) for s in steps] == [1, 2, 3]
    pooled = []
    with torch.no_grad():
        for z in steps[0]:
            for y in steps[1]:
                for x in steps[2]:
                    w = torch.from_numpy(padded[None, :, z:z + patch[0], y:y + patch[1], x:x + patch[2]].copy())
                    deepest = net.net.encoder(w)[-1]
                    assert deepest.shape[1] == 64  # the slim plan's last stage
                    pooled.append(deepest.mean(dim=(2, 3, 4))[0].double().numpy())
    assert got.shape == (64,) and got.dtype == np.float64
    assert np.allclose(got, np.mean(pooled, axis=0), rtol=1e-5, atol=1e-6)
    assert np.abs(np.std(pooled, axis=0)).max() > 1e-3  # the windows differ: the mean is not any one window's


def test_a_blank_volume_lies_beyond_the_threshold_and_a_held_out_real_one_within(volume_federation, tmp_path,
                                                                                data_root):
    """Familiarity fitted on ten real RUNMC volumes' features (a seeded, untrained network: what it measures is the
    input, not what a model learned): another RUNMC volume lies within the threshold; the same volume blanked (one
    intensity, as a failed acquisition or a wrongly scaled export reads after nnU-Net's z-score) lies far beyond it.
    Whether a trained model's features tell a new scanner apart is the held-out-site measurement's question, not a
    unit test's."""
    import SimpleITK as sitk

    import nnunet_sites
    from feduq.data import get_task
    from feduq.inference.review import Familiarity
    from feduq.nnunet.volume_inference import volume_features
    from feduq.site.site3d import Site3D

    _, task, slim = volume_federation
    site_dir = tmp_path / NAME / "RUNMC"
    nnunet_sites.prostate_site(Path(data_root), "RUNMC", site_dir, max_cases=11)
    net = _network(slim)
    site = Site3D(slim, iterations=1, task=task, num_threads=1, device="cpu", amp=False)
    pipe = site.make_pipeline(get_task(site.task_name))

    def features(path):
        data, _, _ = pipe.preprocess_files([path], None)
        return volume_features(net.bottleneck, data, pipe.patch_size, torch.device("cpu"))

    images = sorted((site_dir / "imagesTr").iterdir())
    rule = Familiarity.fit(np.stack([features(p) for p in images[:10]]))
    held_out = rule.distance(features(images[10])[None])[0]
    assert held_out <= rule.threshold, (held_out, rule.threshold)
    real = sitk.ReadImage(str(images[10]))
    blank = sitk.GetImageFromArray(np.full(sitk.GetArrayFromImage(real).shape, 100.0, np.float32))
    blank.CopyInformation(real)
    sitk.WriteImage(blank, str(tmp_path / "blank_0000.nii.gz"))
    d = rule.distance(features(tmp_path / "blank_0000.nii.gz")[None])[0]
    assert d > 5 * rule.threshold, (d, rule.threshold)
