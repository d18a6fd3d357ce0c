"""Every structure's numbers kept (issue 69, item 3): a task with several scored structures (disc rim and cup; a
region task's disc and cup) keeps every structure's Dice and HD95 in every table, also where a site with partial
labels does not annotate one (blank there, its annotated set said once). Pure functions on synthetic numbers."""

from __future__ import annotations

import csv

import numpy as np
import pytest

from feduq.scores.tables import (annotated_note, per_image_test_rows, structure_means, structure_names,
                               write_results)

#: three sites of a plain-label task (disc_rim, optic_cup); B annotates the cup only, so it sends no disc_rim numbers
SITES = {
    "A": {"dice": 0.8, "hd95": 10.0, "ece": 0.1, "num_images": 5, "dice_disc_rim": 0.7, "dice_optic_cup": 0.9,
          "hd95_disc_rim": 12.0, "hd95_optic_cup": 8.0},
    "B": {"dice": 0.6, "hd95": 20.0, "ece": 0.2, "num_images": 4, "dice_optic_cup": 0.6, "hd95_optic_cup": 20.0},
    "C": {"dice": 0.5, "hd95": 30.0, "ece": 0.3, "num_images": 3, "dice_disc_rim": 0.4, "dice_optic_cup": 0.6,
          "hd95_disc_rim": 40.0, "hd95_optic_cup": 20.0},
}


def _rows(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_structure_names_need_an_hd95_beside_the_dice():
    assert structure_names(["dice", "dice_disc", "dice_cup", "hd95_disc", "hd95_cup"]) == ["disc", "cup"]
    assert structure_names(["dice_std", "dice_un", "hd95_px", "dice_cup", "hd95_px_cup"]) == ["cup"]
    assert structure_names(["dice_liver", "hd95_mm_liver"]) == ["liver"]


def test_per_client_table_keeps_a_structure_one_site_does_not_annotate(tmp_path):
    paths = write_results(SITES, tmp_path, method="fedavg")
    table = {r["client"]: r for r in _rows(paths["csv"])}
    assert list(table["A"]) == ["client", "dice", "hd95", "ece", "dice_disc_rim", "dice_optic_cup", "hd95_disc_rim",
                                "hd95_optic_cup", "num_images"]
    assert table["B"]["dice_disc_rim"] == "" and table["B"]["hd95_disc_rim"] == ""  # blank where not annotated
    assert float(table["A"]["dice_disc_rim"]) == 0.7 and float(table["C"]["hd95_disc_rim"]) == 40.0
    # a structure's Avg and Std over the sites that annotate it: disc rim over A and C, the cup over all three
    assert float(table["Avg"]["dice_disc_rim"]) == pytest.approx(0.55)
    assert float(table["Std"]["dice_disc_rim"]) == pytest.approx(0.15)
    assert float(table["Avg"]["hd95_disc_rim"]) == pytest.approx(26.0)
    assert float(table["Avg"]["dice_optic_cup"]) == pytest.approx(0.7)
    assert float(table["Std"]["hd95_optic_cup"]) == pytest.approx(np.std([8.0, 20.0, 20.0]))
    tidy = _rows(paths["tidy"])
    rim = {(r["client"], r["metric"]): float(r["value"]) for r in tidy if r["metric"].endswith("disc_rim")}
    assert rim == {("A", "dice_disc_rim"): 0.7, ("A", "hd95_disc_rim"): 12.0, ("C", "dice_disc_rim"): 0.4,
                   ("C", "hd95_disc_rim"): 40.0}
    md = paths["markdown"].read_text()
    assert md.count("site B annotates only: optic_cup") == 1 and "site A" not in md and "site C" not in md
    line = next(line for line in md.splitlines() if line.startswith("| B |"))
    assert line == "| B | 60.00 | 20.00 | 20.00 |  | 60.00 |  | 20.00 |"
    assert "| **Avg** | 63.33 | 20.00 | 20.00 | 55.00 | 70.00 | 26.00 | 16.00 |" in md


def test_every_site_annotating_everything_has_no_note(tmp_path):
    full = {s: m for s, m in SITES.items() if s != "B"}
    assert annotated_note(full) == ""
    assert "annotates only" not in write_results(full, tmp_path)["markdown"].read_text()


def test_per_image_rows_carry_each_structure():
    scores = {"dice": np.array([[0.5, 1.0], [0.25, 0.75]]), "hd95": np.array([[4.0, 2.0], [6.0, 0.0]])}
    rows = per_image_test_rows("A", ["x", "y"], scores, ["disc", "cup"])
    assert rows[1] == {"site": "A", "image": "y", "dice": 0.5, "hd95_px": 3.0, "dice_disc": 0.25, "dice_cup": 0.75,
                       "hd95_px_disc": 6.0, "hd95_px_cup": 0.0}
    assert per_image_test_rows("A", ["x", "y"], scores)[0] == {"site": "A", "image": "x", "dice": 0.75, "hd95_px": 3.0}
    with pytest.raises(ValueError, match="3 structures"):
        per_image_test_rows("A", ["x"], scores, ["a", "b", "c"])


def test_structure_means_sit_beside_the_mean():
    rows = [{"dice": 0.6, "dice_disc": 0.8, "dice_cup": 0.4, "hd95_px": 5.0, "hd95_px_disc": 4.0, "hd95_px_cup": 6.0},
            {"dice": 0.9, "dice_disc": 1.0, "dice_cup": float("nan"), "hd95_px": 1.0, "hd95_px_disc": 1.0,
             "hd95_px_cup": float("nan")}]
    out = structure_means({"site": "A", "dice": 0.75, "hd95_px": 3.0, "ece15": 0.1}, rows)
    assert list(out) == ["site", "dice", "dice_disc", "dice_cup", "hd95_px", "hd95_px_disc", "hd95_px_cup", "ece15"]
    assert out["dice_disc"] == pytest.approx(0.9) and out["dice_cup"] == pytest.approx(0.4)  # NaN left out
    assert out["hd95_px_disc"] == pytest.approx(2.5) and out["hd95_px_cup"] == pytest.approx(6.0)
    single = [{"dice": 0.5, "dice_polyp": 0.5, "hd95_px": 2.0, "hd95_px_polyp": 2.0}]
    assert structure_means({"dice": 0.5, "hd95_px": 2.0}, single) == {"dice": 0.5, "hd95_px": 2.0}


def _tidy(tmp_path, method, seed, sites):
    """results_tidy.csv rows of one run, as feduq compare reads them from the run's per-client table."""
    from feduq.results.sweeps import collect_table

    return collect_table(write_results(sites, tmp_path / f"{method}{seed}")["csv"], method, seed)


def test_results_md_gives_each_structure_beside_the_mean(tmp_path):
    from feduq.results.structures import structure_summary, structure_tables

    other = {s: dict(m) for s, m in SITES.items()}
    other["A"]["dice_disc_rim"], other["C"]["dice_disc_rim"] = 0.9, 0.5  # disc rim Avg 70 % in seed 0, 55 % in seed 1
    tidy = (_tidy(tmp_path, "fedavg", 0, SITES) + _tidy(tmp_path, "fedevi", 0, other)
            + _tidy(tmp_path, "fedevi", 1, SITES))
    lines = structure_summary(tidy, ["fedavg", "fedevi"]).splitlines()
    assert lines[0] == ("| Method | Dice (%) mean | Dice disc_rim | Dice optic_cup | HD95 (px) mean | HD95 disc_rim | "
                        "HD95 optic_cup |")
    assert lines[2] == "| fedavg | 63.33 | 55.00 | 70.00 | 20.00 | 26.00 | 16.00 |"
    assert lines[3].startswith(f"| fedevi | 63.33 ± 0.00 | 62.50 ± {np.std([70, 55], ddof=1):.2f} | 70.00 ± 0.00 |")
    md = "\n".join(structure_tables(tidy, ["fedavg", "fedevi"]))
    # the per-client disc-rim table has the sites that annotate it (B does not), the cup's all three
    rim = md.split("disc_rim: Dice (%) per client:")[1].split("\n\n")[1]
    assert rim.splitlines()[0] == "| Method | A | C | Avg | Std |"
    assert rim.splitlines()[2] == "| fedavg | 70.00 | 40.00 | 55.00 | 15.00 |"
    cup = md.split("optic_cup: HD95 (px) per client:")[1].split("\n\n")[1]
    assert cup.splitlines()[2] == "| fedavg | 8.00 | 20.00 | 20.00 | 16.00 | 5.66 |"
    single = [r for r in tidy if not r["metric"].endswith(("disc_rim", "optic_cup"))]
    assert structure_tables(single, ["fedavg"]) == []  # one structure: the mean is the structure


def test_paired_tests_per_structure_with_q_over_structures_and_pairs():
    from feduq.results.structures import structure_tests, structure_values

    rows = []
    for i in range(6):  # site A annotates both: fedevi better by distinct margins on every image
        base = {"site": "A", "image": f"a{i}", "seed": 0}
        rows += [{**base, "method": "fedavg", "dice_disc": 0.5, "dice_cup": 0.4},
                 {**base, "method": "fedevi", "dice_disc": 0.5 + 0.01 * (i + 1), "dice_cup": 0.4 + 0.02 * (i + 1)}]
    for i in range(2):  # site B annotates the cup only
        base = {"site": "B", "image": f"b{i}", "seed": 0}
        rows += [{**base, "method": "fedavg", "dice_cup": 0.3},
                 {**base, "method": "fedevi", "dice_cup": 0.45 + 0.1 * i}]
    tests = structure_tests(rows, "fedavg", ["disc", "cup"], n_boot=200)
    got = {(t["structure"], t["scope"]): t for t in tests}
    assert list(got) == [("disc", "all"), ("disc", "A"), ("cup", "all"), ("cup", "A"), ("cup", "B")]
    # exact Wilcoxon, every difference positive: p = 2 / 2^n (n = 6, 8 and 2 images)
    assert got[("disc", "all")]["n"] == 6 and got[("disc", "all")]["p_value"] == pytest.approx(2 / 64)
    assert got[("cup", "all")]["n"] == 8 and got[("cup", "all")]["p_value"] == pytest.approx(2 / 256)
    assert got[("cup", "B")]["p_value"] == pytest.approx(0.5)
    assert got[("disc", "A")]["mean_diff"] == pytest.approx(0.035)
    assert got[("cup", "B")]["mean_diff"] == pytest.approx(0.2)
    # Benjamini–Hochberg over the five tests: p (1/128, 1/32 x 3, 1/2) -> q 5/128 for the first four, 1/2
    assert [t["q_value"] for t in tests] == pytest.approx([5 / 128] * 4 + [0.5])
    assert structure_values({"dice": "0.5", "dice_cup": "0.25", "hd95_px_cup": "3", "dice_disc": "",
                             "hd95_px_disc": "nan"}) == {"dice_cup": 0.25, "hd95_px_cup": 3.0}
