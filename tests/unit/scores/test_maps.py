"""Uncertainty maps (feduq.scores.maps): closed forms, and what a site writes at the final test."""

import csv
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from feduq.data import make_transforms
from feduq.scores.maps import dirichlet_uncertainty, save_uncertainty_maps, softmax_entropy


def test_softmax_entropy_closed_forms():
    logits = torch.tensor([[0.0, 0.0], [100.0, -100.0]]).T.reshape(1, 2, 2)  # [B=1, C=2, 2 positions]
    h = softmax_entropy(logits)["total"]
    assert h.shape == (1, 2)
    assert h[0, 0].item() == pytest.approx(math.log(2), abs=1e-6)  # uniform: ln C
    assert h[0, 1].item() == pytest.approx(0.0, abs=1e-6)  # certain


def test_dirichlet_maps_closed_forms_and_decomposition():
    # exp evidence of logit -inf is 0 -> alpha = (1, 1): total ln 2, aleatoric 1/2 (psi(3) - psi(2) = 1/2), epistemic
    # ln 2 - 1/2 = 0.193147
    logits = torch.full((1, 2, 1, 1), -200.0)
    maps = dirichlet_uncertainty("exp")(logits)
    assert maps["total"].item() == pytest.approx(math.log(2), abs=1e-9)
    assert maps["aleatoric"].item() == pytest.approx(0.5, abs=1e-9)
    assert maps["epistemic"].item() == pytest.approx(math.log(2) - 0.5, abs=1e-9)
    # softplus(0) = ln 2 evidence per class -> alpha = 1 + ln 2; the parts always add up to the total
    z = torch.randn(2, 3, 4, 5, generator=torch.Generator().manual_seed(0)) * 3
    m = dirichlet_uncertainty("softplus")(z)
    assert torch.allclose(m["aleatoric"] + m["epistemic"], m["total"], atol=1e-12)
    assert m["total"].shape == (2, 4, 5) and float(m["epistemic"].min()) >= 0.0


def test_save_uncertainty_maps_writes_arrays_panels_and_summary(tmp_path):
    """A model that thresholds the red channel (the mask) is right up to resampling at the box edge; the maps
    come back on the stored 40x30 grid, the summary has one row per image written."""
    w, h = 40, 30
    mask = np.zeros((h, w), np.uint8)
    mask[5:20, 10:30] = 255
    rgb = np.stack([mask // 255 * 200 + 20, np.full_like(mask, 60), np.full_like(mask, 90)], -1).astype(np.uint8)
    Image.fromarray(rgb).save(tmp_path / "case7.png")
    Image.fromarray(mask).save(tmp_path / "case7_mask.png")
    item = {"image": str(tmp_path / "case7.png"), "label": str(tmp_path / "case7_mask.png")}
    from monai.data import DataLoader, Dataset

    class RedThreshold(torch.nn.Module):
        def forward(self, x):
            return torch.cat([0.5 - x[:, :1], x[:, :1] - 0.5], dim=1) * 20.0

    loader = DataLoader(Dataset([item, item], transform=make_transforms("test", 32, 3, [0, 255])), batch_size=1)
    out = tmp_path / "maps"
    summary = save_uncertainty_maps(RedThreshold(), loader, torch.device("cpu"), lambda lo: torch.softmax(lo, 1),
                                    dirichlet_uncertainty("exp"), out, max_images=1, title="site-a FedEvi")
    rows = list(csv.DictReader(open(summary)))
    assert len(rows) == 1 and rows[0]["image"] == "000_case7"  # max_images respected, stem from the file name
    saved = np.load(out / "000_case7.npz")
    assert saved["label"].shape == (w, h) and saved["prediction"].shape == (w, h)  # stored grid (PIL axes)
    assert set(np.unique(saved["label"]).tolist()) == {0, 1}
    error = float((saved["prediction"] != saved["label"]).mean())
    assert error < 0.02 and float(rows[0]["error_rate"]) == pytest.approx(error)
    np.testing.assert_allclose(saved["aleatoric"] + saved["epistemic"], saved["total"], atol=1e-6)
    assert (out / "000_case7.png").stat().st_size > 1000
    assert json.dumps(rows[0])  # plain numbers
