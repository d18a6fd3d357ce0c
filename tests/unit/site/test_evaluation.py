"""feduq evaluate and feduq.site.evaluation: any model on any site folder, scored as the job's test task scores it.

Hand numbers: a constant model (foreground probability p everywhere) on synthetic 32x32 sites whose masks are squares
of known size has closed-form Dice, ECE, Brier and NLL, and a constant uncertainty has AUROC 0.5.
"""

import csv
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REPO, load_tool, small_job

SIDES = [8, 12, 4, 16, 10]  # foreground squares, one image each


def make_site(folder, sides=SIDES, size=32, spacing=None):
    """A polyp site folder in the site layout (no split file anywhere): RGB images whose red channel is the mask."""
    (folder / "images").mkdir(parents=True)
    (folder / "masks").mkdir()
    (folder / "labels.json").write_text(json.dumps({"labels": {"0": "background", "255": "polyp"}}))
    rows = []
    for i, s in enumerate(sides):
        mask = np.zeros((size, size), np.uint8)
        mask[3 : 3 + s, 5 : 5 + s] = 255
        rgb = np.stack([mask // 255 * 200 + 20, np.full_like(mask, 60), np.full_like(mask, 90)], -1)
        Image.fromarray(rgb.astype(np.uint8)).save(folder / "images" / f"case{i}.png")
        Image.fromarray(mask).save(folder / "masks" / f"case{i}.png")
        rows.append(f"images/case{i}.png,{spacing},{size * 3},{size * 3}")
    if spacing:
        (folder / "provenance.csv").write_text("image_file,spacing_mm,orig_width,orig_height\n" + "\n".join(rows) + "\n")
    return folder


class Constant(torch.nn.Module):
    """Logits [0, c]: foreground probability sigmoid(c) at every pixel, so every pixel is predicted foreground."""

    def __init__(self, c):
        super().__init__()
        self.c = c

    def forward(self, x):
        z = torch.zeros(x.shape[0], 2, *x.shape[2:])
        z[:, 1] = self.c
        return z


def constant_model(c=0.8):
    from feduq.site.evaluation import LoadedModel
    from feduq.flare.executor import FedUQExecutor

    exe = FedUQExecutor(task="polyp", image_size=32, network={"name": "light"}, device="cpu", tracking_writer_id=None)
    exe.device, exe.num_classes = torch.device("cpu"), 2
    return LoadedModel(exe, Constant(c), REPO / "jobs" / "fedavg", REPO / "none.pt", "FedAvg")


def test_constant_model_closed_forms(tmp_path):
    from feduq.site.evaluation import evaluate_site, site_dataset

    loaded = constant_model(0.8)
    site = make_site(tmp_path / "Hospital-X", spacing="0.5x0.5x3")
    name, ds, center_dir = site_dataset(loaded, site_dir=site, work_dir=tmp_path / "out")
    res = evaluate_site(loaded, ds, name, center_dir)
    p = 1 / (1 + math.exp(-0.8))
    fg = np.array(SIDES) ** 2
    n = 32 * 32
    dice = 2 * fg / (fg + n)  # everything predicted foreground (largest component: the whole image)
    assert [r["image"] for r in res["per_image"]] == [f"case{i}" for i in range(5)]
    np.testing.assert_allclose([r["dice"] for r in res["per_image"]], dice, atol=1e-6)
    s = res["summary"]
    assert s["n_images"] == 5 and s["dice"] == pytest.approx(dice.mean(), abs=1e-6)
    frac = fg.sum() / (5 * n)  # pixel accuracy of "all foreground"; one confidence bin holds every pixel
    assert s["ece15"] == pytest.approx(abs(p - frac), abs=1e-6)
    assert s["brier"] == pytest.approx(frac * 2 * (1 - p) ** 2 + (1 - frac) * 2 * p**2, abs=1e-6)
    assert s["nll"] == pytest.approx(-(frac * math.log(p) + (1 - frac) * math.log(1 - p)), abs=1e-6)
    assert s["auroc"] == pytest.approx(0.5) and s["uncertainty"] == "total"  # a constant map detects nothing
    h = -(p * math.log(p) + (1 - p) * math.log(1 - p))
    assert res["per_image"][0]["u_total"] == pytest.approx(h, abs=1e-6)
    # stored pixel = 0.5 mm x 96 px / 32 px = 1.5 mm
    for r in res["per_image"]:
        assert r["hd95_mm"] == pytest.approx(1.5 * r["hd95_px"], rel=1e-6) and r["hd95_px"] > 0


def test_a_folder_in_no_split_file_is_scored_whole_with_a_trained_jobs_model(tmp_path):
    """The CLI on a job folder + model file: every image of an unseen folder is scored, the files are written."""
    from feduq.core.networks import build_network

    job = small_job("fedevi", tmp_path / "job", network="light")
    torch.manual_seed(0)
    net = build_network("light", 3, 2)
    torch.save({"model": net.state_dict()}, tmp_path / "model.pt")
    site = make_site(tmp_path / "elsewhere" / "Hospital-Y", sides=[6, 9, 14])
    evaluate = load_tool("evaluate")
    assert evaluate.main(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--site-dir", str(site),
                          "--maps", "1", "--out", str(tmp_path / "out")]) == 0
    rows = list(csv.DictReader(open(tmp_path / "out" / "per_image.csv")))
    assert [r["image"] for r in rows] == ["case0", "case1", "case2"]
    assert {"u_total", "u_aleatoric", "u_epistemic", "u_vacuity"} <= set(rows[0])  # FedEvi's own maps
    site_row = next(csv.DictReader(open(tmp_path / "out" / "per_site.csv")))
    assert site_row["method"] == "FedEvi" and site_row["n_images"] == "3" and site_row["uncertainty"] == "total"
    assert math.isnan(float(site_row["hd95_mm"]))  # no provenance.csv: no spacing, pixels only
    assert (tmp_path / "out" / "reliability_Hospital-Y.png").is_file()
    assert (tmp_path / "out" / "maps" / "Hospital-Y" / "000_case0.png").is_file()


@pytest.mark.parametrize("case", ["keys", "labels", "unreadable", "no_model"])
def test_bad_input_is_named(tmp_path, capsys, case):
    from feduq.core.networks import build_network

    job = small_job("fedavg", tmp_path / "job", network="light")
    net = build_network("light", 3, 2)
    state = net.state_dict()
    site = make_site(tmp_path / "Hospital-Z", sides=[6, 9])
    if case == "keys":
        state = {k.replace("model.", "net.", 1): v for k, v in state.items()}
    elif case == "labels":
        (site / "labels.json").write_text(json.dumps({"labels": {"0": "bg", "128": "a", "255": "b"}}))
    elif case == "unreadable":
        (site / "images" / "case1.png").write_bytes((site / "images" / "case1.png").read_bytes()[:60])
    torch.save({"model": state}, tmp_path / "model.pt")
    args = ["--job", str(job), "--site-dir", str(site), "--maps", "0", "--out", str(tmp_path / "out")]
    if case != "no_model":
        args += ["--model", str(tmp_path / "model.pt")]
    assert load_tool("evaluate").main(args) == 2
    err = capsys.readouterr().err
    expected = {"keys": ["model.pt", "does not fit the job's network 'light'", "unknown"],
                "labels": ["Hospital-Z", "3 mask values", "2 classes"],
                "unreadable": ["Hospital-Z", "case1.png"],
                "no_model": ["pass the model file (--model)"]}[case]
    for text in expected:
        assert text in err, err


def test_per_site_csv_gives_each_structure_beside_the_mean(tmp_path, monkeypatch):
    """A task with two structures (disc, cup): feduq evaluate's per_site.csv has each one's mean Dice and HD95 (px)
    beside the means, from the per-image rows (an image without the cup's value left out of the cup's mean)."""
    from feduq.scores.tables import write_rows

    tool = load_tool("evaluate")
    images = [{"site": "A", "image": "a", "dice": 0.7, "hd95_px": 5.0, "dice_disc": 0.9, "dice_cup": 0.5,
               "hd95_px_disc": 2.0, "hd95_px_cup": 8.0},
              {"site": "A", "image": "b", "dice": 0.6, "hd95_px": 3.0, "dice_disc": 0.6, "dice_cup": float("nan"),
               "hd95_px_disc": 3.0, "hd95_px_cup": float("nan")}]
    summary = {"site": "A", "n_images": 2, "dice": 0.65, "hd95_px": 4.0, "hd95_mm": float("nan"), "ece15": 0.1}

    def fake(job, *, out, **_):
        write_rows(out / "per_site.csv", [summary])
        return [summary], {"A": {"per_image": images}}

    monkeypatch.setattr(tool, "evaluate", fake)
    assert tool.main(["--job", str(tmp_path), "--site-dir", str(tmp_path), "--out", str(tmp_path / "e")]) == 0
    row = next(csv.DictReader(open(tmp_path / "e" / "per_site.csv")))
    assert list(row) == ["site", "n_images", "dice", "dice_disc", "dice_cup", "hd95_px", "hd95_px_disc", "hd95_px_cup",
                         "hd95_mm", "ece15"]
    assert float(row["dice_disc"]) == pytest.approx(0.75) and float(row["dice_cup"]) == pytest.approx(0.5)
    assert float(row["hd95_px_disc"]) == pytest.approx(2.5) and float(row["hd95_px_cup"]) == pytest.approx(8.0)
