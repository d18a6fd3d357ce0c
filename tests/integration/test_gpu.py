"""FedUQ on a CUDA device (skipped where there is none; tools/gpu_check.sh runs it on a GPU machine with synthetic
data): float16 training with its scaler, the on-device validation against the CPU's, and predict's label maps on the
device against the CPU's. Data: ``FEDUQ_DATA_ROOT`` (synthetic, made by feduq synthetic), else the real data
beside the clone."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SHARED_DATA, small_job

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.fixture(scope="module")
def root() -> Path:
    path = Path(os.environ.get("FEDUQ_DATA_ROOT", SHARED_DATA))
    if not (path / "polyp" / "Kvasir-SEG").is_dir():
        pytest.skip(f"no polyp data at {path}")
    return path


def _datasets(root, size=64):
    from feduq import data as fdata

    kw = dict(data_root=root, image_size=size, max_items=16, resize="letterbox", intensity="max")
    return (fdata.get_dataset("polyp", "Kvasir-SEG", split, **kw) for split in ("train", "val"))


def test_float16_training_on_cuda_lowers_the_loss_and_keeps_float32_weights(root):
    from feduq.core.networks import build_network
    from feduq.core.training import LocalTrainer
    from feduq.site.settings import training_loader
    from monai.losses import DiceCELoss

    train, _ = _datasets(root)
    device = torch.device("cuda")
    torch.manual_seed(0)
    trainer = LocalTrainer(build_network("light", 3, 2), device)
    assert trainer.autocast_dtype == torch.float16 and trainer.scaler.is_enabled()
    loader = training_loader(train, 4, 0, device, "auto")
    loss = DiceCELoss(to_onehot_y=True, softmax=True)
    first = trainer.train_epochs(loader, 1, loss).mean_loss
    for _ in range(4):
        last = trainer.train_epochs(loader, 1, loss).mean_loss
    assert np.isfinite(last) and last < first
    assert all(p.dtype == torch.float32 and p.device.type == "cuda" for p in trainer.model.parameters())


def test_validation_on_cuda_gives_the_cpus_per_image_dice_and_loss(root):
    """The same model and images scored on the GPU and on the CPU: every image's Dice equal (the class maps agree) and
    its official validation loss to 1e-4 (float32 sums in another order)."""
    from monai.data import DataLoader

    from feduq.core.evidential import dirichlet_from_logits
    from feduq.core.networks import build_network
    from feduq.scores.scoring import validation_scores

    _, val = _datasets(root)
    torch.manual_seed(3)
    model = build_network("light", 3, 2).eval()
    prob_fn = lambda lo: dirichlet_from_logits(lo, clamp_max=80.0).prob  # noqa: E731  (FedEvi's α/S)
    cpu = validation_scores(model, DataLoader(val, batch_size=8), torch.device("cpu"), 2, None, prob_fn, per_image=True)
    gpu = validation_scores(model.cuda(), DataLoader(val, batch_size=32, pin_memory=True), torch.device("cuda"), 2,
                            None, prob_fn, per_image=True)
    np.testing.assert_allclose(gpu["val_dice"], cpu["val_dice"], atol=1e-3)
    np.testing.assert_allclose(gpu["val_loss"], cpu["val_loss"], atol=1e-4)


def test_predict_on_cuda_gives_the_cpus_label_maps(root, tmp_path):
    from PIL import Image

    from feduq.core.networks import build_network
    from feduq.predict.pipeline import predict
    from feduq.site.evaluation import client_config, load_model

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    torch.save({"model": build_network("light", 3, 2, init_seed=3).state_dict()}, tmp_path / "model.pt")
    images = sorted((root / "polyp" / "Kvasir-SEG" / "images").iterdir())[:12]
    (tmp_path / "in").mkdir()
    for image in images:
        (tmp_path / "in" / image.name).write_bytes(image.read_bytes())
    for device in ("cpu", "cuda"):
        loaded = load_model(client_config(job), tmp_path / "model.pt", device=device)
        predict(loaded, tmp_path / "in", tmp_path / device, batch_size=5, progress=False)
    agree = [np.mean(np.asarray(Image.open(tmp_path / "cpu" / i.stem / "label.png")) ==
                     np.asarray(Image.open(tmp_path / "cuda" / i.stem / "label.png"))) for i in images]
    assert min(agree) > 0.999, agree
