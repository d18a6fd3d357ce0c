"""How a segmentation is scored: Dice and HD95 by hand, the empty-mask conventions, a test at the label's size,
validation Dice over regions, the results table."""

import csv
import math

import pytest
import torch

from feduq.core.networks import SegUNet
from feduq.scores.metrics import segmentation_scores
from feduq.scores.scoring import evaluate_test, validation_dice
from feduq.scores.tables import per_image_test_path, write_results


def _square(h, w, top, left, size):
    m = torch.zeros(1, 1, h, w)
    m[..., top : top + size, left : left + size] = 1
    return m


def test_dice_and_hd95_hand_computed():
    pred = _square(32, 32, 4, 4, 4)
    gt = _square(32, 32, 4, 5, 4)  # shifted one column: overlap 12 px
    s = segmentation_scores(pred, gt, num_classes=2)
    assert s["dice"][0, 0] == pytest.approx(2 * 12 / (16 + 16))
    assert s["hd95"][0, 0] == pytest.approx(1.0)


def test_empty_mask_conventions():
    empty, gt = torch.zeros(1, 1, 30, 40), _square(30, 40, 2, 2, 5)
    missed = segmentation_scores(empty, gt, 2)
    assert missed["dice"][0, 0] == 0.0 and missed["hd95"][0, 0] == pytest.approx(50.0)  # diagonal of 30x40
    both = segmentation_scores(empty, empty, 2)
    assert both["dice"][0, 0] == 1.0 and both["hd95"][0, 0] == 0.0
    hallucinated = segmentation_scores(gt, empty, 2)
    assert hallucinated["dice"][0, 0] == 0.0 and hallucinated["hd95"][0, 0] == pytest.approx(50.0)


def test_test_evaluation_upsamples_to_label_size():
    model = SegUNet(channels=(4, 8), strides=(2,))
    batch = {"image": torch.rand(1, 3, 16, 16), "label": _square(48, 48, 10, 10, 20)}
    out = evaluate_test(model, [batch], torch.device("cpu"), num_classes=2)
    assert out["dice"].shape == (1, 1) and out["hd95"].shape == (1, 1) and out["ece"].shape == (1,)
    assert 0.0 <= out["hd95"][0, 0] <= math.hypot(48, 48)
    assert 0.0 <= validation_dice(model, [{"image": batch["image"], "label": _square(16, 16, 2, 2, 6)}],
                                  torch.device("cpu"), 2) <= 1.0


def test_write_results_table(tmp_path):
    paths = write_results(
        {"A": {"dice": 0.8, "hd95": 10.0, "ece": 0.1, "num_images": 5},
         "B": {"dice": 0.6, "hd95": 30.0, "ece": 0.3, "num_images": 7}},
        tmp_path, method="fedavg",
    )
    rows = {r["client"]: r for r in csv.DictReader(open(paths["csv"]))}
    assert float(rows["Avg"]["dice"]) == pytest.approx(0.7) and float(rows["Std"]["dice"]) == pytest.approx(0.1)
    assert float(rows["Avg"]["hd95"]) == pytest.approx(20.0) and float(rows["Std"]["hd95"]) == pytest.approx(10.0)
    md = paths["markdown"].read_text()
    assert "| A | 80.00 | 10.00 | 10.00 |" in md and "| **Avg** | 70.00 | 20.00 | 20.00 |" in md
    tidy = list(csv.DictReader(open(paths["tidy"])))
    assert {"method": "fedavg", "client": "B", "metric": "num_images", "value": "7"} in tidy
    assert "Avg and Std are over" not in md
    # a min_clients run in which site C gave no test result: the table says over which sites it averages
    md = write_results({"A": {"dice": 0.8, "hd95": 10.0, "ece": 0.1, "num_images": 5}}, tmp_path / "q",
                       missing=["C"])["markdown"].read_text()
    assert "**Avg and Std are over 1 of the job's 2 sites**: C gave no test result." in md


def test_per_image_test_path_keeps_a_named_model_apart_and_refuses_a_path_as_a_name(tmp_path):
    from pathlib import Path

    assert per_image_test_path(tmp_path) == tmp_path / "per_image_test.csv"
    assert per_image_test_path(tmp_path, "personalised") == tmp_path / "personalised" / "per_image_test.csv"
    for bad in ("../up", "a/b", "", ".", 3):
        with pytest.raises(ValueError, match="plain name"):
            per_image_test_path(tmp_path, bad)
    assert isinstance(per_image_test_path(str(tmp_path)), Path)


def test_validation_dice_uses_regions_when_given():
    """Fundus-style nested regions: model selection scores disc (1-2) and cup (2), not rim and cup."""
    pred = torch.zeros(1, 1, 8, 8, dtype=torch.long)
    pred[..., 1:7, 1:7] = 1
    pred[..., 3:5, 3:5] = 2  # predicted disc 36 px, cup 4 px
    label = torch.zeros(1, 1, 8, 8)
    label[..., 1:7, 1:6] = 1
    label[..., 2:5, 2:5] = 2  # true disc 30 px, cup 9 px

    class Fixed(torch.nn.Module):
        def forward(self, x):
            return torch.nn.functional.one_hot(pred[:, 0], 3).permute(0, 3, 1, 2).float()

    batch = [{"image": torch.zeros(1, 3, 8, 8), "label": label}]
    by_region = validation_dice(Fixed(), batch, torch.device("cpu"), 3, regions={"disc": (1, 2), "cup": (2,)})
    # disc: 2*30/(36+30) ; cup: 2*4/(4+9)
    assert by_region == pytest.approx((60 / 66 + 8 / 13) / 2)
    by_class = validation_dice(Fixed(), batch, torch.device("cpu"), 3)
    assert by_class != pytest.approx(by_region)
