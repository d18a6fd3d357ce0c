"""The official FedEvi code's protocol as switches (feduq.site.protocol, feduq.core.training): its validation loss, the test at
the training resolution with 4-connected components, its empty-prediction quirk, a test every round, selection on
the validation loss; numbers by hand."""

from __future__ import annotations

import json
import re

import pytest
import torch

from conftest import REPO, read_table, run_simulator
from feduq.scores.scoring import evaluate_test, validation_dice_loss, validation_scores
from feduq.site.protocol import OFFICIAL_FEDEVI, TestProtocol


def test_validation_dice_loss_is_the_official_dice_loss_val():
    """2 images of 2 x 2 pixels, probabilities of class 1: [.9 .1; .2 .8] and [.5 .5; 0 1], labels [1 0; 0 1] and
    [0 0; 0 1]. Pooled over the batch: class 1: I = .9 + .8 + 1 = 2.7, U = (2.0 + 2.0) + 3 = 7, Dice = 5.4/7;
    class 0: p0 = 1 - p1, I = .9 + .8 + .5 + .5 + 1 = 3.7, U = (2.0 + 2.0) + 5 = 9, Dice = 7.4/9."""
    p1 = torch.tensor([[[0.9, 0.1], [0.2, 0.8]], [[0.5, 0.5], [0.0, 1.0]]])
    probs = torch.stack([1 - p1, p1], dim=1)
    label = torch.tensor([[[1, 0], [0, 1]], [[0, 0], [0, 1]]]).unsqueeze(1).float()
    s = 1e-5
    expected = 1 - ((5.4 + s) / (7.0 + s) + (7.4 + s) / (9.0 + s)) / 2
    assert float(validation_dice_loss()(probs, label)) == pytest.approx(expected, rel=1e-6)


class Fixed(torch.nn.Module):
    """A 'network' whose logits are given: class 1 where ``mask`` is set (logit +4), else class 0 (logit -4)."""

    def __init__(self, mask: torch.Tensor):
        super().__init__()
        self.mask = mask.float()

    def forward(self, x):
        z = (self.mask * 8 - 4).expand(x.shape[0], 1, *self.mask.shape)
        return torch.cat([-z, z], dim=1)


def _batch(label):
    return [{"image": torch.zeros(1, 1, *label.shape), "label": label.float()[None, None]}]


def test_validation_scores_give_dice_and_loss_from_one_pass():
    label = torch.zeros(4, 4)
    label[1:3, 1:3] = 1
    pred = torch.zeros(4, 4)
    pred[1:3, 1:2] = 1  # half the square
    res = validation_scores(Fixed(pred), _batch(label), torch.device("cpu"), 2)
    assert res["val_dice"] == pytest.approx(2 * 2 / (2 + 4))
    probs = torch.softmax(Fixed(pred)(torch.zeros(1, 1, 4, 4)), dim=1)
    assert res["val_loss"] == pytest.approx(float(validation_dice_loss()(probs, label[None, None])), rel=1e-6)


def test_validation_scores_are_per_image_whatever_the_batch():
    """Two images in one batch score as the same two images one at a time (the sites validate in training-size
    batches): val_dice = mean of 2/3 and 1; val_loss = mean of the two single-image losses, not the loss pooled over
    the batch (which differs)."""
    label = torch.zeros(2, 1, 4, 4)
    label[0, 0, 1:3, 1:3] = 1
    label[1, 0, 0, :2] = 1
    pred = torch.zeros(2, 4, 4)
    pred[0, 1:3, 1:2] = 1  # half of image 0's square
    pred[1, 0, :2] = 1  # image 1 predicted exactly

    class PerImage(torch.nn.Module):
        def forward(self, x):
            z = (pred[x[:, 0, 0, 0].long()] * 8 - 4).unsqueeze(1)
            return torch.cat([-z, z], dim=1)

    one_by_one = [{"image": torch.full((1, 1, 4, 4), float(i)), "label": label[i:i + 1]} for i in range(2)]
    batched = [{"image": torch.stack([torch.full((1, 4, 4), float(i)) for i in range(2)]), "label": label}]
    a, b = (validation_scores(PerImage(), loader, torch.device("cpu"), 2) for loader in (one_by_one, batched))
    assert a["val_dice"] == b["val_dice"] == pytest.approx((2 * 2 / (2 + 4) + 1.0) / 2)
    assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-12)
    probs = torch.softmax(PerImage()(batched[0]["image"]), dim=1)
    pooled = float(validation_dice_loss()(probs, label))
    assert abs(pooled - b["val_loss"]) > 1e-3  # what a batch-pooled loss would have given instead


def test_four_connected_components_split_what_eight_connected_join():
    """Prediction: a 2 x 2 block and a 3-pixel diagonal tail touching it at a corner; label = the block. With
    8-connectivity the tail joins the block (Dice 8/11); with 4-connectivity the tail is its own components and the
    block alone survives (Dice 1)."""
    label = torch.zeros(8, 8)
    label[1:3, 1:3] = 1
    pred = label.clone()
    for i in (3, 4, 5):
        pred[i, i] = 1
    scores = {c: evaluate_test(Fixed(pred), _batch(label), torch.device("cpu"), 2, connectivity=c)["dice"][0, 0]
              for c in (8, 4)}
    assert scores[8] == pytest.approx(2 * 4 / (7 + 4)) and scores[4] == pytest.approx(1.0)


def test_the_official_empty_prediction_quirk_is_a_switch():
    """An empty prediction on an 8 x 8 image with a 4-pixel polyp: Dice 0 and HD95 the diagonal as it is; the
    official quirk makes the whole image foreground: Dice 2*4 / (64 + 4)."""
    label = torch.zeros(8, 8)
    label[2:4, 2:4] = 1
    empty = torch.zeros(8, 8)
    as_is = evaluate_test(Fixed(empty), _batch(label), torch.device("cpu"), 2)
    quirk = evaluate_test(Fixed(empty), _batch(label), torch.device("cpu"), 2, empty_prediction="whole_image")
    assert as_is["dice"][0, 0] == 0.0 and as_is["hd95"][0, 0] == pytest.approx((8 ** 2 + 8 ** 2) ** 0.5)
    assert quirk["dice"][0, 0] == pytest.approx(8 / 68) and quirk["hd95"][0, 0] < as_is["hd95"][0, 0]


def test_test_protocol_from_json_names_the_bad_key():
    assert TestProtocol.from_json(None) == TestProtocol()
    assert TestProtocol.from_json(OFFICIAL_FEDEVI.to_json()) == OFFICIAL_FEDEVI
    for value, words in (({"resolution": "native"}, "test_protocol.resolution='native'"),
                         ({"connectivity": 6}, "test_protocol.connectivity=6"),
                         ({"every_round": "yes"}, "test_protocol.every_round"),
                         ({"resolutoin": "training"}, "test_protocol.resolutoin is unknown"), ([1], "JSON object")):
        with pytest.raises(ValueError, match=re.escape(words)):
            TestProtocol.from_json(value)


@pytest.mark.sim
def test_official_protocol_tests_every_round_and_selects_on_the_validation_loss(tmp_path, data_root):
    """FedAvg on two polyp sites with --official-protocol: each round's FEDUQ_TRAIN line carries the test Dice of
    the received model, the selection record is on val_loss, and the final table is at the training size (HD95
    below the 32-px image's diagonal)."""
    sites = ["CVC-ColonDB", "ETIS-LaribPolypDB"]
    ws = tmp_path / "ws"
    proc = run_simulator("fedavg", ws, data_root, sites=sites, num_rounds=3, official_protocol=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    val_loss = {}  # round -> site -> val_loss of the global model that round received
    for site in sites:
        log = (ws / site / "log.txt").read_text()
        records = [json.loads(m) for m in re.findall(r"FEDUQ_TRAIN (\{.*\})", log)]
        assert [r["round"] for r in records] == [0, 1, 2]
        last = [json.loads(m) for m in re.findall(r"FEDUQ_VALIDATE (\{.*\})", log)]
        assert [r["round"] for r in last] == [3]  # the last global model, validated and tested after round 2
        assert all(0.0 <= r["test_dice_global"] <= 1.0 and 0.0 <= r["val_loss_global"] <= 1.0 for r in records + last)
        for r in records + last:
            val_loss.setdefault(r["round"], {})[site] = r["val_loss_global"]
    record = json.loads((ws / "server" / "simulate_job" / "app_server" / "best_model_selection.json").read_text())
    assert record["key_metric"] == "val_loss" and record["metric"] == pytest.approx(-record["raw_metric"])
    # the selected round is the one of lowest mean validation loss over sites, the last model included (round 0 is the
    # initial model, never selected)
    mean_loss = {r: sum(v.values()) / len(v) for r, v in val_loss.items() if r > 0}
    assert record["round"] == min(mean_loss, key=mean_loss.get)
    assert record["raw_metric"] == pytest.approx(mean_loss[record["round"]], abs=1e-4)
    if record["round"] == 3:  # the last model was selected: the best checkpoint is the last one
        app = ws / "server" / "simulate_job" / "app_server"
        best, last = (torch.load(app / f, weights_only=True)["model"] for f in ("best_FL_global_model.pt",
                                                                               "FL_global_model.pt"))
        assert all(torch.equal(best[k], last[k]) for k in last)
    table = read_table(ws)
    assert all(float(table[s]["hd95"]) <= (2 * 32 ** 2) ** 0.5 + 1e-6 for s in sites)
    assert (REPO / "jobs" / "fedavg").is_dir()


def _validation_before_51(model, loader, num_classes, prob_fn):
    """The validation of 2ae8218, per image: logits to the host, the official loss applied to each image alone
    (MONAI DiceLoss, batch=True on one image), MONAI's Dice with both-empty = 1 in numpy."""
    import numpy as np
    from monai.metrics import compute_dice
    from monai.networks.utils import one_hot

    loss_fn, dice, losses = validation_dice_loss(), [], []
    with torch.no_grad():
        for batch in loader:
            logits = model(batch["image"]).float()
            pred, label, probs = logits.argmax(dim=1, keepdim=True), batch["label"], prob_fn(logits)
            losses += [float(loss_fn(probs[i:i + 1], label[i:i + 1])) for i in range(probs.shape[0])]
            p, t = one_hot(pred.long(), num_classes), one_hot(label.long(), num_classes)
            d = compute_dice(p, t, include_background=False, ignore_empty=False).double().numpy()
            empty = ~p[:, 1:].flatten(2).any(-1).numpy() & ~t[:, 1:].flatten(2).any(-1).numpy()
            dice += list(np.where(empty, 1.0, d).mean(axis=1))
    return dice, losses


@pytest.mark.parametrize("method", ["fedavg", "fedevi"])
def test_validation_on_the_device_gives_the_per_image_values_of_before(data_root, method):
    """Real Kvasir-SEG validation images through a seeded network: every image's official validation loss and Dice
    from the batched, on-device validation (one host transfer at the end) equal the per-image values of the code
    before issue 51 (each image alone through MONAI's batch-pooled DiceLoss and its Dice on the host), and the means
    equal their means. FedEvi's probabilities are the Dirichlet mean α/S."""
    import numpy as np
    from monai.data import DataLoader

    from feduq import data as fdata
    from feduq.core.evidential import dirichlet_from_logits
    from feduq.core.networks import build_network
    from feduq.core.training import softmax_probs

    prob_fn = softmax_probs if method == "fedavg" else (lambda lo: dirichlet_from_logits(lo, clamp_max=80.0).prob)
    ds = fdata.get_dataset("polyp", "Kvasir-SEG", "val", data_root=data_root, image_size=64, max_items=12,
                           resize="letterbox", intensity="max")
    torch.manual_seed(3)
    model = build_network("light", 3, 2).eval()
    dice, losses = _validation_before_51(model, DataLoader(ds, batch_size=5), 2, prob_fn)
    assert 0 < min(losses) and 0 < max(dice) < 1 and len(set(dice)) > 3  # not a degenerate model
    cpu = torch.device("cpu")
    new = validation_scores(model, DataLoader(ds, batch_size=5), cpu, 2, None, prob_fn, per_image=True)
    assert list(new["val_dice"]) == dice and list(new["val_loss"]) == losses  # bit for bit
    means = validation_scores(model, DataLoader(ds, batch_size=5), cpu, 2, None, prob_fn)
    assert means == {"val_dice": float(np.mean(dice)), "val_loss": float(np.mean(losses))}
