"""feduq compare-report and feduq.results.holdout: pooled figures, the held-out table, and a report of a comparison folder."""

import csv
import json
import shutil

import numpy as np
import pytest
import torch

from conftest import load_tool, small_job


def test_pooled_bins_are_the_bins_of_the_union():
    from feduq.scores.uncertainty_quality import ece_from_bins, pool_bins, reliability_bins

    rng = np.random.default_rng(0)
    conf = [rng.uniform(0.5, 1, 300), rng.uniform(0.5, 1, 50)]
    right = [rng.random(300) < 0.8, rng.random(50) < 0.3]
    pooled = pool_bins([reliability_bins(c, r) for c, r in zip(conf, right)])
    union = reliability_bins(np.concatenate(conf), np.concatenate(right))
    np.testing.assert_array_equal(pooled["count"], union["count"])
    np.testing.assert_allclose(np.nan_to_num(pooled["accuracy"]), np.nan_to_num(union["accuracy"]), atol=1e-12)
    assert ece_from_bins(pooled) == pytest.approx(ece_from_bins(union), abs=1e-12)
    with pytest.raises(ValueError):
        pool_bins([reliability_bins(conf[0], right[0], 10), reliability_bins(conf[1], right[1], 15)])


def test_holdout_rotation_arguments_and_table():
    from feduq.results import holdout

    argv = ["--task", "prostate", "--holdout", "all", "--out=/x", "--sites", "A,B,C", "--report", "--rounds", "5"]
    assert holdout._strip(argv) == ["--task", "prostate", "--rounds", "5"]
    rows = [{"held_out": "A", "method": "fedavg", "seed": s, "dice": d, "hd95_px": h, "ece15": 0.1, "auroc": 0.8,
             "aurc": 0.3, "in_federation_dice": f} for s, d, h, f in [(0, 0.5, 10.0, 0.7), (1, 0.7, 20.0, 0.9)]]
    rows.append({"held_out": "B", "method": "fedavg", "seed": 0, "dice": 0.3, "hd95_px": 40.0, "ece15": 0.4,
                 "auroc": 0.5, "aurc": 0.6, "in_federation_dice": 0.5})
    table = holdout.holdout_markdown(rows).splitlines()
    assert table[0].startswith("| Method | A Dice (HD95) | B Dice (HD95) | held-out Avg Dice | in-federation Avg Dice")
    # A: mean over seeds 60.00 (15.0); held-out Avg over all three rows (50+70+30)/3 = 50.00; in-fed (70+90+50)/3
    assert table[2] == "| fedavg | 60.00 (15.0) | 30.00 (40.0) | 50.00 | 70.00 | 0.2000 | 0.700 | 0.4000 |"


def test_report_of_a_comparison_folder(tmp_path, data_root):
    """A fake finished sweep (two methods, a light model each) on two real polyp sites' test splits: the report has
    the quality table with each method's own uncertainty, a reliability diagram per method and image grids."""
    from feduq.core.networks import build_network

    out = tmp_path / "cmp"
    for method in ("fedavg", "feduaa"):
        ws = out / "runs" / f"{method}_s0"
        app = ws / "server" / "simulate_job" / "app_server"
        job = small_job(method, tmp_path / f"job_{method}", network="light", max_items=2)
        shutil.copytree(job / "app" / "config", app / "config")
        torch.manual_seed(1)
        torch.save({"model": build_network("light", 3, 2).state_dict()}, app / "FL_global_model.pt")
        for site in ("Kvasir-SEG", "CVC-ClinicDB"):
            (ws / site / "simulate_job").mkdir(parents=True)
        (ws / "DONE").write_text("1 s\n")
    (out / "results.md").write_text("# title\n\n| Method | Kvasir-SEG |\n")
    report = load_tool("report")
    path = report.write_report(out, str(data_root), maps=1, max_items=2)
    text = path.read_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("| fedavg |") or ln.startswith("| feduaa |")]
    assert lines[-2].startswith("| fedavg | total |") and lines[-1].startswith("| feduaa | vacuity |")
    assert "| Method | Kvasir-SEG |" in text  # results.md carried over
    for name in ("reliability_fedavg.png", "reliability_feduaa.png", "risk_coverage.png", "images_Kvasir-SEG.png"):
        assert (out / "report" / name).stat().st_size > 1000, name
    rows = list(csv.DictReader(open(out / "uncertainty_quality.csv")))
    sites = {(r["method"], r["site"]) for r in rows}
    assert sites == {(m, s) for m in ("fedavg", "feduaa") for s in ("Kvasir-SEG", "CVC-ClinicDB")}
    per_site = list(csv.DictReader(open(out / "report" / "eval" / "feduaa_s0" / "per_site.csv")))
    assert [int(r["n_images"]) for r in per_site] == [2, 2] and json.dumps(per_site)


def test_holdout_table_gives_each_structure_beside_the_mean():
    """Held-out rows of a task with two structures (disc, cup; rows as run_holdout makes them with
    feduq.scores.tables.structure_means): each held-out site's Dice (HD95) per structure beside the mean, and each
    structure's held-out Avg; a site without a structure's figures (partial labels) shows "–" there."""
    from feduq.results import holdout

    common = {"method": "fedavg", "ece15": 0.1, "auroc": 0.8, "aurc": 0.3, "in_federation_dice": 0.7}
    rows = [{**common, "held_out": "A", "seed": s, "dice": d, "hd95_px": 10.0, "dice_disc": disc, "dice_cup": cup,
             "hd95_px_disc": 4.0 * (s + 1), "hd95_px_cup": 16.0} for s, d, disc, cup in [(0, 0.6, 0.8, 0.4),
                                                                                       (1, 0.7, 0.9, 0.5)]]
    rows.append({**common, "held_out": "B", "seed": 0, "dice": 0.5, "hd95_px": 20.0})
    table = holdout.holdout_markdown(rows).splitlines()
    assert table[0] == ("| Method | A Dice (HD95) | A disc Dice (HD95) | A cup Dice (HD95) | B Dice (HD95) | "
                        "B disc Dice (HD95) | B cup Dice (HD95) | held-out Avg Dice | held-out Avg Dice disc | "
                        "held-out Avg Dice cup | in-federation Avg Dice | held-out ECE | held-out AUROC errors | "
                        "held-out AURC |")
    # A: disc (80 + 90) / 2 = 85.00 with HD95 (4 + 8) / 2 = 6.0, cup 45.00 (16.0); B has neither; Avg (60+70+50)/3
    assert table[2] == ("| fedavg | 65.00 (10.0) | 85.00 (6.0) | 45.00 (16.0) | 50.00 (20.0) | – | – | 60.00 | 85.00 | "
                        "45.00 | 70.00 | 0.1000 | 0.800 | 0.3000 |")


def test_holdout_row_keeps_each_structure_of_the_evaluated_site():
    from feduq.results.holdout import holdout_row

    summary = {"site": "H", "method": "FedAvg", "n_images": 2, "dice": 0.65, "dice_std": 0.05, "hd95_px": 5.0,
               "hd95_mm": float("nan"), "ece15": 0.1, "auroc": 0.8, "aurc": 0.3, "uncertainty": "entropy"}
    images = [{"dice": 0.7, "hd95_px": 4.0, "dice_disc": 0.9, "dice_cup": 0.5, "hd95_px_disc": 2.0, "hd95_px_cup": 6.0},
              {"dice": 0.6, "hd95_px": 6.0, "dice_disc": 0.8, "dice_cup": 0.4, "hd95_px_disc": 4.0, "hd95_px_cup": 8.0}]
    row = holdout_row("H", "fedavg", 0, summary, {"H": {"per_image": images}}, 0.7)
    assert list(row) == ["held_out", "method", "seed", "n_images", "dice", "dice_disc", "dice_cup", "hd95_px",
                         "hd95_px_disc", "hd95_px_cup", "ece15", "auroc", "aurc", "uncertainty", "in_federation_dice"]
    assert (row["dice_disc"], row["dice_cup"], row["hd95_px_disc"], row["hd95_px_cup"]) == pytest.approx(
        (0.85, 0.45, 3.0, 7.0))
    volume = {**summary, "n_cases": 1, "hd95_mm": 2.5}
    assert "dice_disc" not in holdout_row("H", "fedavg", 0, volume, {}, 0.7)  # a volume's row is per case
