"""A volume site's per-case scores (Dice, HD95 in mm, mL) and the partial-label marginal loss, against closed forms."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from feduq.core.partial_labels import compact_label, marginal_logits, partial_label_loss
from feduq.scores.volume_scores import CaseCollector, case_scores_3d, summarize_case_scores


def _cube(shape, lo, hi, value=1):
    a = np.zeros(shape, np.int64)
    a[lo[0]:hi[0], lo[1]:hi[1], lo[2]:hi[2]] = value
    return a


def test_case_scores_in_mm_and_ml():
    # reference: a 4x4x2 block; prediction: the same block shifted by one slice along z (spacing 1 x 1 x 3 mm)
    label = _cube((10, 10, 6), (2, 2, 1), (6, 6, 3))
    pred = _cube((10, 10, 6), (2, 2, 2), (6, 6, 4))
    out = case_scores_3d(pred, label, (1.0, 1.0, 3.0), {"organ": (1,)})
    assert out["dice"][0] == pytest.approx(2 * 16 / (32 + 32))  # overlap: one 4x4 slice of two
    assert out["hd95_mm"][0] == pytest.approx(3.0)  # every surface point is at most one slice (3 mm) away
    assert out["volume_ml"][0] == pytest.approx(32 * 3.0 / 1000) and out["reference_ml"][0] == pytest.approx(0.096)


def test_empty_conventions_and_regions():
    shape, spacing = (4, 5, 6), (0.5, 0.5, 2.0)
    empty = np.zeros(shape, np.int64)
    one = _cube(shape, (0, 0, 0), (2, 2, 2), 2)
    diagonal = float(np.sqrt(2.0 ** 2 + 2.5 ** 2 + 12.0 ** 2))
    both = case_scores_3d(empty, empty, spacing, {"a": (1,)})
    assert both["dice"][0] == 1.0 and both["hd95_mm"][0] == 0.0
    miss = case_scores_3d(empty, one, spacing, {"a": (2,), "union": (1, 2)})
    np.testing.assert_allclose(miss["dice"], [0.0, 0.0])
    np.testing.assert_allclose(miss["hd95_mm"], [diagonal, diagonal])
    hit = case_scores_3d(np.where(one > 0, 1, 0), one, spacing, {"a": (2,), "union": (1, 2)})
    assert hit["dice"][1] == 1.0 and hit["dice"][0] == 0.0  # class 1 predicted where 2 is: only the region agrees
    with pytest.raises(ValueError, match="spacing"):
        case_scores_3d(empty, empty, (1.0, 0.0, 1.0), {"a": (1,)})


def test_collector_stacks_slices_in_order_and_rescales_spacing():
    label = _cube((8, 8, 3), (0, 0, 0), (4, 8, 3))
    collector = CaseCollector()
    for z in (2, 0, 1):  # out of order: the slice ids put them back
        lab = torch.as_tensor(label[:, :, z])[None, None]
        batch = {"case": ["c1"], "slice": torch.tensor([z]), "label": lab, "spacing": torch.tensor([[1.0, 1.0, 2.0]]),
                 "stored_shape": torch.tensor([[16.0, 16.0]])}  # scored at half the stored size: 2 mm pixels
        collector(batch, None, None, None, lab)
    names, scores = collector.scores({"x": (1,)})
    assert names == ["c1"] and collector.spacing["c1"] == (2.0, 2.0, 2.0)
    assert scores["dice"][0, 0] == 1.0 and scores["reference_ml"][0, 0] == pytest.approx(4 * 8 * 3 * 8 / 1000)
    metrics = summarize_case_scores(scores, np.array([0.1, 0.3, 0.2]), ["x"])
    assert metrics == {"dice": 1.0, "hd95_mm": 0.0, "ece": pytest.approx(0.2), "num_cases": 1, "num_images": 3}


def test_marginal_logits_sum_the_unannotated_probabilities():
    torch.manual_seed(0)
    logits = torch.randn(2, 4, 3, 3)
    p = logits.softmax(1)
    merged = marginal_logits(logits, [0, 2]).softmax(1)  # site annotates class 2 only; 1 and 3 merge into background
    torch.testing.assert_close(merged[:, 0], p[:, 0] + p[:, 1] + p[:, 3])
    torch.testing.assert_close(merged[:, 1], p[:, 2])
    # FedEvi's exp evidence: the merged background's evidence is the sum of the merged evidences
    torch.testing.assert_close(marginal_logits(logits, [0, 2])[:, 0].exp(), logits[:, [0, 1, 3]].exp().sum(1))


def test_partial_label_loss_is_the_marginal_cross_entropy():
    torch.manual_seed(1)
    logits = torch.randn(1, 3, 2, 2)
    label = torch.tensor([[[[0, 2], [2, 0]]]])
    ce = lambda lo, la, r: torch.nn.functional.cross_entropy(lo, la[:, 0].long())  # noqa: E731
    loss = partial_label_loss(ce, [0, 2], 3)(logits, label, 1)
    p = logits.softmax(1)[0]
    marginal_bg, tz = p[0] + p[1], p[2]
    expected = -(marginal_bg[0, 0].log() + tz[0, 1].log() + tz[1, 0].log() + marginal_bg[1, 1].log()) / 4
    torch.testing.assert_close(loss, expected)
    assert partial_label_loss(ce, [0, 1, 2], 3) is ce  # every class annotated: the loss itself
    torch.testing.assert_close(compact_label(label, [0, 2], 3), torch.tensor([[[[0, 1], [1, 0]]]]))
    with pytest.raises(ValueError, match="background 0"):
        partial_label_loss(ce, [1, 2], 3)


def test_collector_reduces_regions_as_predict_and_letterbox_keeps_one_scale():
    """A task scored by structures: each slice's class map is reduced per structure to its largest component before the
    case is scored (as the test table's per-slice scores and predict); a letterboxed label at the training size has
    one scale for both axes."""
    label = np.zeros((12, 12, 2), np.int64)
    label[2:6, 2:6, :] = 1
    label[7:10, 7:10, :] = 2
    pred = label.copy()
    pred[0, 11, 0] = 1  # a stray one-pixel blob of class 1 on slice 0
    for regions, dice in ((None, None), ({"a": (1,), "b": (2,)}, 1.0)):
        collector = CaseCollector(regions, keep_largest_component=True, connectivity=8)
        for z in (0, 1):
            batch = {"case": ["c"], "slice": torch.tensor([z]), "label": torch.as_tensor(label[:, :, z])[None, None],
                     "spacing": torch.tensor([[1.0, 1.0, 1.0]]), "stored_shape": torch.tensor([[12.0, 12.0]])}
            collector(batch, None, None, None, torch.as_tensor(pred[:, :, z])[None, None])
        _, scores = collector.scores({"a": (1,), "b": (2,)})
        if dice is None:
            assert scores["dice"][0, 0] < 1.0  # the raw argmax keeps the stray pixel
        else:
            np.testing.assert_array_equal(scores["dice"][0], [1.0, 1.0])
    collector = CaseCollector(letterbox=True)
    batch = {"case": ["c"], "slice": torch.tensor([0]), "label": torch.zeros(1, 1, 64, 64),
             "spacing": torch.tensor([[0.5, 0.8, 3.0]]), "stored_shape": torch.tensor([[320.0, 256.0]])}
    collector(batch, None, None, None, torch.zeros(1, 1, 64, 64))
    assert collector.spacing["c"] == pytest.approx((0.5 * 5, 0.8 * 5, 3.0))  # 320 / 64 on both axes
