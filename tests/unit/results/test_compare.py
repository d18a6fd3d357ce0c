"""The comparison harness: the papers' table from tidy rows, and resuming a sweep."""

import argparse

import pytest

from feduq.commands.research.compare import collect, markdown_table, run_one


def _rows(method, seed, dice):
    return [{"method": method, "seed": seed, "client": c, "metric": "dice", "value": v} for c, v in dice.items()]


def _deploy(job, ws):
    """What FLARE's simulator keeps of the job it ran in its workspace: the app (both config files) as the server's
    ``app_server`` and the job's meta.json (a run of before RUN.json is checked against them)."""
    import shutil

    app = ws / "server" / "simulate_job" / "app_server"
    shutil.copytree(job / "app" / "config", app / "config", dirs_exist_ok=True)
    shutil.copyfile(job / "meta.json", ws / "server" / "simulate_job" / "meta.json")


#: feduq compare's defaults, as its main passes them to sweep_job
SWEEP_DEFAULTS = dict(task="polyp", image_size=128, rounds=20, local_epochs=2, max_items=None, num_threads=0,
                      amp="auto", network=None, sites=None, workflow_args={}, official_protocol=False, select_on=None,
                      plans="ct_2d", iterations=None, samples=10)


def _ran_as(ws, method, seed, **settings):
    """Give the fake finished run ``ws`` the job configuration a sweep with ``settings`` (over feduq compare's defaults)
    ran, as FLARE keeps it (a run made before RUN.json existed)."""
    import tempfile
    from pathlib import Path

    from feduq.commands.research.compare import sweep_job

    with tempfile.TemporaryDirectory() as tmp:
        _deploy(sweep_job(method, seed, argparse.Namespace(**{**SWEEP_DEFAULTS, **settings}), None, Path(tmp)), ws)


def test_markdown_table_mean_and_std_over_seeds_and_clients():
    tidy = _rows("fedavg", 0, {"A": 0.8, "B": 0.6}) + _rows("fedavg", 1, {"A": 0.6, "B": 0.4})
    table = markdown_table(tidy, ["fedavg", "absent"], "dice", 100.0)
    # A: mean(80, 60) = 70, sample std 14.14; B: 50 ± 14.14
    # Avg over clients per seed: 70, 50 -> 60 ± 14.14; Std over clients (ddof 0) per seed: 10, 10 -> 10 ± 0
    assert table.splitlines()[0] == "| Method | A | B | Avg | Std |"
    assert table.splitlines()[2] == "| fedavg | 70.00 ± 14.14 | 50.00 ± 14.14 | 60.00 ± 14.14 | 10.00 ± 0.00 |"
    assert "absent" not in table


def test_finished_runs_are_skipped_and_collected(tmp_path):
    ws = tmp_path / "runs" / "fedevi_s3"
    (ws / "server" / "simulate_job" / "results").mkdir(parents=True)
    (ws / "site-a").mkdir()
    (ws / "DONE").write_text("1 s\n")
    (ws / "server" / "simulate_job" / "results" / "per_client_table.csv").write_text(
        "client,dice,hd95,ece,num_images\nsite-a,0.5,10.0,0.1,4\nAvg,0.5,10.0,0.1,\nStd,0,0,0,\n")
    (ws / "site-a" / "log.txt").write_text(
        'x - FEDUQ_TRAIN {"site": "site-a", "round": 0, "val_dice_global": 0.2}\n'
        'x - FEDUQ_TRAIN {"site": "site-a", "round": 1, "val_dice_global": 0.4}\n'
        'x - FEDUQ_VALIDATE {"site": "site-a", "round": 2, "val_dice_global": 0.5, "val_loss_global": 0.3, '
        '"test_dice_global": 0.45}\n')
    (ws / "server" / "log.txt").write_text(
        'x - FEDUQ_AGGREGATION {"round": 0, "weights": {"site-a": 1.0}, "missing": [], "rejected": []}\n')
    args = argparse.Namespace(out=tmp_path, task="polyp", image_size=32, rounds=2, local_epochs=1, max_items=None,
                              network=None, sites=None, workflow_args={}, num_threads=0, data_root=str(tmp_path / "d"))
    _ran_as(ws, "fedevi", 3, image_size=32, rounds=2, local_epochs=1)
    # DONE (a run of before records: checked against the job it holds): no simulator is started
    assert run_one("fedevi", 3, args) == ws
    tidy, curves, weights = collect("fedevi", 3, ws)
    assert {"method": "fedevi", "seed": 3, "client": "site-a", "metric": "dice", "value": 0.5} in tidy
    assert all(r["client"] not in ("Avg", "Std") for r in tidy)
    assert [(c["round"], c["metric"], c["value"]) for c in curves] == [
        (0, "val_dice_global", 0.2), (1, "val_dice_global", 0.4),  # the model received at rounds 0 and 1
        (2, "val_dice_global", 0.5), (2, "val_loss_global", 0.3), (2, "test_dice_global", 0.45)]  # the last model
    assert weights == [{"method": "fedevi", "seed": 3, "round": 0, "client": "site-a", "weight": 1.0}]


def test_references_run_through_the_harness(tmp_path, data_root):
    """``--methods pooled`` runs feduq reference with the sweep's settings (``local`` takes the same path;
    both modes are tested in test_baselines.py); its table and its per-block validation Dice (shifted by one:
    block r = a federation's model after round r + 1) are collected."""
    from feduq.commands.research.compare import main

    out = tmp_path / "cmp"
    rc = main(["--task", "polyp", "--methods", "pooled", "--seeds", "0", "--rounds", "1",
               "--local-epochs", "1", "--image-size", "32", "--max-items", "4", "--data-root", str(data_root),
               "--out", str(out)])
    assert rc == 0
    sites = {"Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"}
    for ref in ("pooled",):
        ws = out / "runs" / f"{ref}_s0"
        assert (ws / "DONE").is_file()
        tidy, curves, weights = collect(ref, 0, ws)
        assert {r["client"] for r in tidy if r["metric"] == "dice"} == sites
        assert {(c["client"], c["round"]) for c in curves} == {(s, 1) for s in sites} and weights == []
    table = (out / "results.md").read_text()
    assert "| pooled |" in table


def test_ct_table_has_fivas_layout_naive_and_un_rows_training_and_held_out_means():
    from feduq.commands.research.compare import ct_markdown, is_ct

    assert is_ct("fiva_p") and is_ct("funavg") and not is_ct("fedevi")

    def row(seed, client, metric, value, held=0):
        return {"method": "fiva_p", "seed": seed, "client": client, "metric": metric, "value": value, "held_out": held}

    tidy = [row(0, "A/liver", "dice", 0.5), row(1, "A/liver", "dice", 0.7), row(0, "B/spleen", "dice", 0.2),
            row(0, "A/liver", "dice_un", 0.6), row(0, "B/spleen", "dice_un", 0.4),
            row(0, "H/liver", "dice", 0.3, 1), row(0, "H/liver", "dice_un", 0.1, 1),
            row(0, "A", "ece", 0.05), row(0, "H", "ece", 0.07, 1)]
    lines = ct_markdown(tidy, ["fiva_p"]).splitlines()
    assert lines[0] == "| Method | A/liver | B/spleen | Mean | H/liver | Held-out mean | ECE per image (%, 15 bins) |"
    # A/liver: mean over seeds (50, 70) = 60; training mean (60 + 20) / 2 = 40; ECE mean over sites 6
    assert lines[2] == "| fiva_p | 60.00 | 20.00 | **40.00** | 30.00 | **30.00** | 6.00 |"
    assert lines[3] == "| fiva_p+UN | 60.00 | 40.00 | **50.00** | 10.00 | **10.00** | 6.00 |"


def test_graphfedseg_graphs_are_read_from_the_log_and_drawn(tmp_path):
    import json

    from feduq.commands.research.compare import graph_records, plot_graphs

    (tmp_path / "server").mkdir()
    recs = [{"round": r, "sites": ["a", "b"], "W": [[0.6, 0.4], [0.3, 0.7]]} for r in range(3)]
    (tmp_path / "server" / "log.txt").write_text(
        "\n".join(f"2026 - GraphFedSegController - INFO - FEDUQ_GRAPHFEDSEG {json.dumps(r)}" for r in recs) + "\nother\n")
    assert graph_records(tmp_path) == recs
    plot_graphs(recs, tmp_path / "W.png", max_panels=2)
    assert (tmp_path / "W.png").stat().st_size > 1000


def test_dp_sweep_rows_name_each_budget_and_average_over_clients(tmp_path):
    from feduq.commands.research.compare import dp_label, dp_sweep_rows, plot_dp_sweep

    assert dp_label("fedavg", 10.0, True) == "fedavg (ε=10)" and dp_label("fedavg", None, True) == "fedavg (no DP)"
    assert dp_label("fedavg", None, False) == "fedavg"
    tidy = (_rows("fedavg (ε=1)", 0, {"A": 0.2, "B": 0.4}) + _rows("fedavg (no DP)", 0, {"A": 0.6, "B": 0.8})
            + [{"method": "fedavg (ε=1)", "seed": 0, "client": c, "metric": "dp_epsilon", "value": v}
               for c, v in (("A", 0.995), ("B", 0.999))])
    rows = dp_sweep_rows(tidy, ["fedavg"], [1.0, None])
    assert [(r["target_epsilon"], round(r["avg_dice"], 6), r["max_spent_epsilon"]) for r in rows] == [
        (1.0, 0.3, 0.999), ("none", 0.7, "")]
    plot_dp_sweep(rows, tmp_path / "dice_vs_epsilon.png")
    assert (tmp_path / "dice_vs_epsilon.png").stat().st_size > 1000


def test_the_sweep_tests_each_method_against_the_baseline_on_the_same_images(tmp_path):
    """Two finished runs with their cached per-image test Dice: results.md and paired_tests.csv get the Wilcoxon rows
    over independent units (FedEvi is 0.1 better on Kvasir's 3 independent images and 0.05 worse on ClinicDB's 2
    frames of one sequence: 4 units, Δ mean (0.3 - 0.05) / 4, |d| ranks 1 (ClinicDB) and 3 x3: W+ = 9, W- = 1); the
    per-image test is kept for Kvasir only (paired_tests_per_image.csv: Δ +0.1 on 3 images, r = 1)."""
    import csv

    from feduq.commands.research.compare import main

    root = _polyp_root(tmp_path)
    _finished_runs(tmp_path / "out")
    assert main(["--methods", "fedavg", "fedevi", "--seeds", "0", "--data-root", str(root),
                 "--out", str(tmp_path / "out")]) == 0
    tests = {r["scope"]: r for r in csv.DictReader(open(tmp_path / "out" / "paired_tests.csv"))}
    assert set(tests) == {"all", "Kvasir-SEG", "CVC-ClinicDB"}
    assert float(tests["all"]["mean_diff"]) == pytest.approx((3 * 0.1 - 0.05) / 4)
    assert (int(tests["all"]["n"]), int(tests["all"]["n_images"]), tests["all"]["unit"]) == (4, 5, "image / sequence")
    assert (int(tests["all"]["wins"]), int(tests["all"]["losses"])) == (3, 1)
    assert float(tests["all"]["r"]) == pytest.approx((9 - 1) / 10)
    assert float(tests["Kvasir-SEG"]["r"]) == 1.0 and tests["Kvasir-SEG"]["unit"] == "image"
    assert (int(tests["CVC-ClinicDB"]["n"]), tests["CVC-ClinicDB"]["unit"]) == (1, "sequence")
    per_image = {r["scope"]: r for r in csv.DictReader(open(tmp_path / "out" / "paired_tests_per_image.csv"))}
    assert set(per_image) == {"all", "Kvasir-SEG"} and float(per_image["all"]["mean_diff"]) == pytest.approx(0.1)
    # q: the three p-values adjusted together (Benjamini-Hochberg): none below the smallest p; the largest p is its own q
    ps = sorted(float(t["p_value"]) for t in tests.values())
    assert min(float(t["q_value"]) for t in tests.values()) >= ps[0]
    assert max(float(t["q_value"]) for t in tests.values()) == pytest.approx(ps[-1])
    md = (tmp_path / "out" / "results.md").read_text()
    assert "Paired against fedavg" in md and "| fedevi vs fedavg (all) | 0 | image / sequence | 4 (5) | +6.25 [" in md
    assert "q (BH)" in md and "| fedevi vs fedavg (Kvasir-SEG) | 0 | 3 | +10.00 |" in md


def _polyp_root(tmp_path):
    root = tmp_path / "data"
    for center in ("Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"):
        (root / "polyp" / center).mkdir(parents=True)
    for center in ("CVC-ClinicDB", "CVC-ColonDB"):  # video frames: the sequence is the independent unit
        (root / "polyp" / center / "provenance.csv").write_text(
            "image_file,sequence\n" + "".join(f"images/{center}-{i}.jpg,seq0\n" for i in range(2)))
    return root


def _finished_runs(out, runs=(("fedavg", 0), ("fedevi", 0))):
    """Finished runs with cached per-image test Dice: FedEvi 0.1 better on Kvasir's 3 images, 0.05 worse on
    ClinicDB's 2; a FedAvg seed s > 0 is seed 0 plus 0.01 s."""
    import csv

    for method, seed in runs:
        delta = {"Kvasir-SEG": 0.1, "CVC-ClinicDB": -0.05} if method == "fedevi" else {"Kvasir-SEG": 0.0, "CVC-ClinicDB": 0.0}
        ws = out / "runs" / f"{method}_s{seed}"
        (ws / "server" / "simulate_job" / "results").mkdir(parents=True)
        (ws / "per_image_test").mkdir()
        (ws / "DONE").write_text("1 s\n")
        (ws / "server" / "log.txt").write_text("")
        (ws / "server" / "simulate_job" / "results" / "per_client_table.csv").write_text(
            "client,dice,hd95,ece,num_images\nKvasir-SEG,0.5,10.0,0.1,3\nCVC-ClinicDB,0.5,10.0,0.1,2\n")
        with open(ws / "per_image_test" / "per_image.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["site", "image", "dice", "hd95_px"])
            for site, n in (("Kvasir-SEG", 3), ("CVC-ClinicDB", 2)):
                for i in range(n):
                    w.writerow([site, f"{site}-{i}", 0.5 + i / 10 + delta[site] + 0.01 * seed, 10.0])
        (ws / "site-a").mkdir()
        (ws / "site-a" / "log.txt").write_text(
            'x - INFO - noise\nx - FEDUQ_TRAIN {"site": "site-a", "round": 0, "val_dice_global": 0.2}\n')
        _ran_as(ws, method, seed)  # feduq compare's defaults (a run of before RUN.json)


def test_methods_with_their_own_seeds_and_an_archive_that_a_later_sweep_continues(tmp_path):
    """``--methods fedavg:0,1 fedevi`` runs FedAvg with seeds 0 and 1 and FedEvi with --seeds; ``--archive`` keeps each
    run's summary (no models, logs cut to FedUQ's records), and a sweep with ``--out`` there reports the same."""
    import csv

    from feduq.commands.research.compare import main

    root = _polyp_root(tmp_path)
    _finished_runs(tmp_path / "out", (("fedavg", 0), ("fedavg", 1), ("fedevi", 0)))
    args = ["--methods", "fedavg:0,1", "fedevi", "--seeds", "0", "--data-root", str(root)]
    assert main([*args, "--out", str(tmp_path / "out"), "--archive", str(tmp_path / "kept")]) == 0
    tidy = list(csv.DictReader(open(tmp_path / "out" / "results_tidy.csv")))
    assert sorted({(r["method"], r["seed"]) for r in tidy}) == [("fedavg", "0"), ("fedavg", "1"), ("fedevi", "0")]
    assert "seeds [0, 1]; fedevi: seeds [0]" in (tmp_path / "out" / "results.md").read_text()
    kept = tmp_path / "kept" / "runs" / "fedavg_s1"
    assert (kept / "DONE").is_file() and (kept / "per_image_test" / "per_image.csv").is_file()
    assert (kept / "site-a" / "log.txt").read_text().startswith("x - FEDUQ_TRAIN")  # the noise line is cut
    assert main([*args, "--out", str(tmp_path / "kept")]) == 0  # nothing to run: every run is DONE there
    for name in ("results_tidy.csv", "paired_tests.csv", "curves.csv"):
        assert (tmp_path / "kept" / name).read_text() == (tmp_path / "out" / name).read_text()


def test_a_ct_sweep_is_archived_and_pairs_its_slices_over_patients(tmp_path, data_root):
    """Two finished CT runs (FedAvg-CT, FIVA-P): ``--archive`` keeps their per-organ tables and the sites' per-slice
    files, results.md pairs FIVA-P with FedAvg-CT over patients (KiTS19: patient 7 has two slices, +0.2 and 0.0 ->
    +0.1; patient 8 one, -0.1; CURVAS: patient 10001, three annotations, +0.3 each), and a sweep with ``--out`` on
    the archive reports the same."""
    import csv

    from feduq.commands.research.compare import main

    slices = {"KiTS19": [("7_1", "7"), ("7_2", "7"), ("8_1", "8")],
              "CURVAS-Erlangen": [(f"r{k}_10001_5", "10001") for k in (1, 2, 3)]}
    gain = {"7_1": 0.2, "7_2": 0.0, "8_1": -0.1}
    for method in ("fedavg_ct", "fiva_p"):
        ws = tmp_path / "out" / "runs" / f"{method}_s0"
        results = ws / "server" / "simulate_job" / "results"
        results.mkdir(parents=True)
        (ws / "DONE").write_text("1 s\n")
        (results / "per_organ_table.csv").write_text("method,site,held_out,organ,dice,dice_un,hd95\n"
                                                     f"{method},KiTS19,0,kidney,0.5,0.5,9.0\n"
                                                     f"{method},CURVAS-Erlangen,1,liver,0.5,0.5,9.0\n")
        (results / "per_client_table.csv").write_text("client,dice,ece,held_out\nKiTS19,0.5,0.1,0\n"
                                                      "CURVAS-Erlangen,0.5,0.1,1\n")
        _ran_as(ws, method, 0, task="ct", plans="ct_2d_slim")
        for site, rows in slices.items():
            (ws / site / "simulate_job").mkdir(parents=True)
            with open(ws / site / "simulate_job" / "per_image_test.csv", "w") as f:
                f.write("site,image,case,dice,dice_un\n")
                for image, case in rows:
                    d = 0.5 + (gain.get(image, 0.3) if method == "fiva_p" else 0.0)
                    f.write(f"{site},{image},{case},{d},{d}\n")
    args = ["--task", "ct", "--methods", "fedavg_ct", "fiva_p", "--plans", "ct_2d_slim", "--data-root", str(data_root)]
    assert main([*args, "--out", str(tmp_path / "out"), "--archive", str(tmp_path / "kept")]) == 0
    kept = tmp_path / "kept" / "runs" / "fiva_p_s0"
    assert (kept / "server" / "simulate_job" / "results" / "per_organ_table.csv").is_file()
    assert (kept / "CURVAS-Erlangen" / "simulate_job" / "per_image_test.csv").is_file()
    tests = {(r["scope"], r["metric"]): r for r in csv.DictReader(open(tmp_path / "out" / "paired_tests.csv"))}
    assert {k[0] for k in tests} == {"all", "training sites", "KiTS19", "CURVAS-Erlangen"}
    every = tests[("all", "dice")]
    assert (every["n"], every["n_images"], every["unit"]) == ("3", "6", "patient")
    assert float(every["mean_diff"]) == pytest.approx((0.1 - 0.1 + 0.3) / 3)
    assert "Paired over patients" in (tmp_path / "out" / "results.md").read_text()
    assert main([*args, "--out", str(tmp_path / "kept")]) == 0  # the archive alone gives the same report
    for name in ("results_tidy.csv", "paired_tests.csv", "results.md"):
        assert (tmp_path / "kept" / name).read_text() == (tmp_path / "out" / name).read_text()


def test_a_method_whose_sites_keep_entries_is_paired_on_what_its_sites_scored(tmp_path, capsys):
    """FedBN's and FedUAA's global model, scored off the sites, lacks the entries the sites test it with: the paired
    test reads the sites' own per-image scores, and leaves such a run out when its sites wrote none."""
    from feduq.commands.research.compare import global_model_is_what_sites_test, per_image_scores

    assert [global_model_is_what_sites_test(m) for m in ("fedavg", "fedevi", "graphfedseg", "fedbn", "feduaa")] == [
        True, True, True, False, False]
    ws = tmp_path / "fedbn_s0"
    ws.mkdir()
    assert per_image_scores("fedbn", "fedbn", 0, ws, None) == []  # no files, and feduq evaluate is not asked
    assert "left out of the paired test" in capsys.readouterr().out
    for site, scores in (("Kvasir-SEG", (0.5, 0.25)), ("CVC-ClinicDB", (1.0,))):
        (ws / site / "simulate_job").mkdir(parents=True)
        with open(ws / site / "simulate_job" / "per_image_test.csv", "w") as f:
            f.write("site,image,dice,hd95_px\n" + "".join(f"{site},img{i},{d},3.0\n" for i, d in enumerate(scores)))
    rows = per_image_scores("fedbn", "fedbn", 0, ws, None)
    assert [(r["site"], r["image"], r["dice"]) for r in rows] == [
        ("CVC-ClinicDB", "img0", 1.0), ("Kvasir-SEG", "img0", 0.5), ("Kvasir-SEG", "img1", 0.25)]


@pytest.mark.parametrize("amp, expected", [("off", False), ("bf16", "bf16"), ("auto", None)])
def test_the_sweeps_precision_reaches_every_2d_jobs_sites(tmp_path, monkeypatch, amp, expected):
    """--amp off / bf16 is written into the job's executor arguments (off: float32, as the archived polyp-96 runs);
    auto leaves the job's own default (no "amp" key)."""
    import json

    from feduq.commands.research import compare

    class Stop(Exception):
        pass

    def stop(*args, **kwargs):
        raise Stop

    monkeypatch.setattr(compare, "simulate", stop)
    args = argparse.Namespace(out=tmp_path, amp=amp, num_threads=0, task="polyp", image_size=32, rounds=1,
                              local_epochs=1, max_items=2, network=None, sites=None, workflow_args={},
                              data_root=str(tmp_path))
    with pytest.raises(Stop):
        run_one("fedavg", 0, args)
    config = json.loads((tmp_path / "jobs" / "fedavg_s0" / "app" / "config" / "config_fed_client.json").read_text())
    assert config["executors"][0]["executor"]["args"].get("amp") == expected


def test_the_official_protocol_trains_in_float32_and_its_references_too(tmp_path, monkeypatch):
    """--official-protocol writes amp=false into the job (the authors' float32) and runs the local/pooled references
    with --amp off; without it the references get the sweep's --amp."""
    import json

    from feduq.commands.research import compare

    class Stop(Exception):
        pass

    calls = []

    def stop(*args, **kwargs):
        calls.append(args[0] if args else kwargs.get("args"))
        raise Stop

    monkeypatch.setattr(compare, "simulate", stop)
    monkeypatch.setattr(compare.subprocess, "run", stop)
    common = dict(num_threads=0, task="polyp", image_size=32, rounds=1, local_epochs=1, max_items=2, network=None,
                  sites=None, workflow_args={}, data_root=str(tmp_path))
    args = argparse.Namespace(out=tmp_path / "a", amp="auto", official_protocol=True, **common)
    with pytest.raises(Stop):
        run_one("fedevi", 0, args)
    config = json.loads((tmp_path / "a" / "jobs" / "fedevi_s0" / "app" / "config" / "config_fed_client.json").read_text())
    assert config["executors"][0]["executor"]["args"]["amp"] is False
    for official, amp, expected in ((True, "auto", "off"), (False, "bf16", "bf16"), (False, "auto", "auto")):
        args = argparse.Namespace(out=tmp_path / f"{official}{amp}", amp=amp, official_protocol=official, **common)
        with pytest.raises(Stop):
            run_one("local", 0, args)
        cmd = calls[-1]
        assert cmd[cmd.index("--amp") + 1] == expected


def test_classification_runs_are_paired_on_accuracy_and_auc_over_the_test_images(tmp_path):
    """Two finished image-level runs (fedavg_cls, feduaa_cls) whose sites wrote their per-image files: results.md and
    paired_tests.csv get the McNemar and AUC row over the 4 pooled test images (FedUAA right on all, FedAvg wrong on
    one positive: 1 / 0 discordant, p = 1; AUC 1 against 3/4)."""
    import csv

    from feduq.commands.research.compare import main

    root = tmp_path / "data"
    for center in ("BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"):
        (root / "breast_us" / center).mkdir(parents=True)
    probs = {"fedavg_cls": {"BUSI-Baheya-Cairo": [(0, 0.2), (1, 0.15)], "BUS-BRA-INCa-Brazil": [(0, 0.1), (1, 0.9)]},
             "feduaa_cls": {"BUSI-Baheya-Cairo": [(0, 0.2), (1, 0.6)], "BUS-BRA-INCa-Brazil": [(0, 0.1), (1, 0.9)]}}
    for method, sites in probs.items():
        ws = tmp_path / "out" / "runs" / f"{method}_s0"
        (ws / "server" / "simulate_job" / "results").mkdir(parents=True)
        (ws / "DONE").write_text("1 s\n")
        (ws / "server" / "log.txt").write_text("")
        (ws / "server" / "simulate_job" / "results" / "per_client_table.csv").write_text(
            "client,auc,accuracy,num_images\nBUSI-Baheya-Cairo,1.0,1.0,2\nBUS-BRA-INCa-Brazil,1.0,1.0,2\n")
        _ran_as(ws, method, 0, task="breast")
        for site, items in sites.items():
            (ws / site / "simulate_job").mkdir(parents=True)
            with open(ws / site / "simulate_job" / "per_image_test.csv", "w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["site", "image", "label", "predicted", "correct", "p_0", "p_1"])
                for i, (y, p) in enumerate(items):
                    w.writerow([site, f"img{i}", y, int(p >= 0.5), int((p >= 0.5) == (y == 1)), 1 - p, p])
    assert main(["--task", "breast", "--methods", "fedavg_cls", "feduaa_cls", "--seeds", "0", "--paired-baseline",
                 "fedavg_cls", "--data-root", str(root), "--out", str(tmp_path / "out")]) == 0
    (t,) = list(csv.DictReader(open(tmp_path / "out" / "paired_tests.csv")))
    assert (t["method"], t["baseline"], int(t["images"])) == ("feduaa_cls", "fedavg_cls", 4)
    assert (int(t["method_only_right"]), int(t["baseline_only_right"])) == (1, 0) and float(t["p_accuracy"]) == 1.0
    assert float(t["auc"]) == 1.0 and float(t["auc_baseline"]) == pytest.approx(0.75)
    assert "| feduaa_cls vs fedavg_cls | 0 | 4 | 100.0 (75.0) | 1 / 0 |" in (tmp_path / "out" / "results.md").read_text()


def _fake_simulate(job, ws, data_root, **kw):
    """What feduq compare reads of a finished run, written without FLARE (site Kvasir-SEG, Dice 0.5), and what the
    simulator keeps of the job it ran and its data root."""
    import json
    from pathlib import Path

    from feduq.recipes.outcome import RunOutcome

    table = ws / "server" / "simulate_job" / "results" / "per_client_table.csv"
    table.parent.mkdir(parents=True, exist_ok=True)
    table.write_text("client,dice,hd95,ece,num_images\nKvasir-SEG,0.5,10.0,0.1,3\n")
    (ws / "server" / "log.txt").write_text("")
    _deploy(job, ws)
    (ws / "local").mkdir(exist_ok=True)  # the site configuration simulate() writes: the run's data root
    (ws / "local" / "feduq_site.json").write_text(json.dumps({"data_root": str(Path(data_root).resolve())}))
    return RunOutcome(ok=True, table=table)


def test_a_finished_run_is_skipped_only_when_the_same_settings_would_run_it_on_the_same_data(tmp_path, monkeypatch,
                                                                                             capsys):
    """Issue 65 item 2: a 32 px run, then the same --out at 64 px: the sweep stops at once naming image_size (it
    reported the 32 px numbers under a 64 px header); another data root is named too; --rerun-changed runs it again;
    the report's header comes from the runs' records."""
    import json

    from feduq.commands.research import compare

    monkeypatch.setattr(compare, "simulate", _fake_simulate)
    root, other = _polyp_root(tmp_path), _polyp_root(tmp_path / "elsewhere")
    out = tmp_path / "out"
    args = ["--methods", "fedavg", "--rounds", "2", "--local-epochs", "1", "--paired-baseline", "none", "--out", str(out)]
    assert compare.main([*args, "--image-size", "32", "--data-root", str(root)]) == 0
    record = json.loads((out / "runs" / "fedavg_s0" / "RUN.json").read_text())
    assert record["settings"]["image_size"] == 32 and record["data_root"] == str(root.resolve())
    assert set(record["splits"]) == {"Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"}
    assert "32 px" in (out / "results.md").read_text()
    before = (out / "results.md").read_text()
    capsys.readouterr()

    def digest():
        return {f.relative_to(out).as_posix(): (f.read_bytes(), f.stat().st_mtime_ns) for f in out.rglob("*")
                if f.is_file()}

    assert compare.main([*args, "--image-size", "32", "--data-root", str(root)]) == 0  # same: skipped
    assert "finished earlier with the same settings and data" in capsys.readouterr().out
    files = digest()
    assert compare.main([*args, "--image-size", "64", "--data-root", str(root)]) == 2
    assert digest() == files  # refused before anything is written (its job too)
    err = capsys.readouterr().err
    assert "finished with other settings: image_size = 32 there, 64 now; use another --out, or --rerun-changed" in err
    assert (out / "results.md").read_text() == before  # nothing reported as the 64 px sweep's
    assert compare.main([*args, "--image-size", "32", "--data-root", str(other)]) == 2
    assert f"data root = {root.resolve()} there, {other.resolve()} now" in capsys.readouterr().err
    assert compare.main([*args, "--image-size", "64", "--data-root", str(root), "--rerun-changed"]) == 0
    assert "[rerun] fedavg seed 0: image_size = 32 there, 64 now" in capsys.readouterr().out
    assert json.loads((out / "runs" / "fedavg_s0" / "RUN.json").read_text())["settings"]["image_size"] == 64
    assert "# FedUQ comparison: task polyp, 64 px, 2 rounds x 1 local epochs" in (out / "results.md").read_text()


def test_a_changed_split_file_or_job_is_a_difference():
    from feduq.results.run_records import record_difference

    old = {"settings": {"image_size": 32}, "data_root": "/d", "splits": {"A": "aa" * 32}, "job_sha256": "j1"}
    assert record_difference(old, dict(old)) is None
    assert record_difference(old, {**old, "splits": {"A": "bb" * 32}}).startswith("site A's split file differs")
    assert record_difference(old, {**old, "job_sha256": "j2"}).startswith("the job's configuration files differ")


def test_the_archive_folder_is_checked_before_the_sweep(tmp_path, monkeypatch, capsys):
    """Issue 65 item 5: --archive had no output guard (a user's runs/fedavg_s0/DONE overwritten, a file as the archive
    failing after the whole sweep, the data root written into); now each is refused before anything runs."""
    from feduq.commands.research import compare

    ran = []
    monkeypatch.setattr(compare, "simulate", lambda *a, **k: ran.append(a) or _fake_simulate(*a, **k))
    root = _polyp_root(tmp_path)
    args = ["--methods", "fedavg", "--rounds", "2", "--paired-baseline", "none", "--data-root", str(root),
            "--out", str(tmp_path / "out")]
    theirs = tmp_path / "theirs"
    (theirs / "runs" / "fedavg_s0").mkdir(parents=True)
    (theirs / "runs" / "fedavg_s0" / "DONE").write_text("the user's")
    for archive, words in ((theirs, "holds files no FedUQ tool wrote there"), (root, "is the data root"),
                           (tmp_path / "a_file", "exists and is not a folder")):
        if archive.name == "a_file":
            archive.write_text("x")
        assert compare.main([*args, "--archive", str(archive)]) == 2
        assert words in capsys.readouterr().err and not ran
    assert compare.main([*args, "--archive", str(theirs), "--force"]) == 2  # --force keeps it: refused by name
    assert "runs/fedavg_s0/DONE is not FedUQ's and the new output writes the same name" in capsys.readouterr().err
    assert (theirs / "runs" / "fedavg_s0" / "DONE").read_text() == "the user's" and not ran
    assert compare.main([*args, "--archive", str(tmp_path / "kept")]) == 0 and len(ran) == 1
    assert (tmp_path / "kept" / "runs" / "fedavg_s0" / "RUN.json").is_file()
    assert compare.main([*args, "--archive", str(tmp_path / "kept")]) == 0  # its own archive again: fine


def test_a_sweep_that_failed_midway_continues_in_its_own_folder(tmp_path, monkeypatch, capsys):
    """A sweep whose second run failed left files its manifest did not list, and the next sweep refused its own folder
    ("holds files no FedUQ tool wrote there"); the sweep now marks its folder as running first, so the same command
    continues (the finished run skipped, the failed one run again)."""
    from feduq.commands.research import compare

    root = _polyp_root(tmp_path)
    ran = []

    def failing(job, ws, data_root, **kw):
        ran.append(ws.name)
        if ws.name == "fedavg_s1" and ran.count("fedavg_s1") == 1:
            (ws / "server").mkdir(parents=True, exist_ok=True)
            (ws / "server" / "log.txt").write_text("a partial run")
            raise RuntimeError("killed")
        return _fake_simulate(job, ws, data_root, **kw)

    monkeypatch.setattr(compare, "simulate", failing)
    args = ["--methods", "fedavg", "--rounds", "2", "--paired-baseline", "none", "--data-root", str(root), "--out",
            str(tmp_path / "out")]
    assert compare.main([*args, "--seeds", "0"]) == 0
    assert compare.main([*args, "--seeds", "0", "1"]) == 1
    assert compare.main([*args, "--seeds", "0", "1"]) == 0
    assert ran == ["fedavg_s0", "fedavg_s1", "fedavg_s1"]


def test_results_md_keeps_every_structure_and_tests_each_one(tmp_path):
    """Runs of a task with two structures (disc, cup) whose ClinicDB site annotates the cup only: results.md gives
    each structure's Dice and HD95 beside the mean (disc over Kvasir alone) and the paired tests per structure (FedEvi
    +0.1 on Kvasir's 3 cups and discs, +0.2 on ClinicDB's 2 cup frames of one sequence), q over structures and pairs."""
    import csv

    from feduq.commands.research.compare import main

    root = _polyp_root(tmp_path)
    for method in ("fedavg", "fedevi"):
        up = 0.1 if method == "fedevi" else 0.0
        ws = tmp_path / "out" / "runs" / f"{method}_s0"
        (ws / "server" / "simulate_job" / "results").mkdir(parents=True)
        (ws / "per_image_test").mkdir()
        (ws / "DONE").write_text("1 s\n")
        _ran_as(ws, method, 0)
        (ws / "server" / "log.txt").write_text("")
        (ws / "server" / "simulate_job" / "results" / "per_client_table.csv").write_text(
            "client,dice,hd95,ece,dice_disc,dice_cup,hd95_disc,hd95_cup,num_images\n"
            f"Kvasir-SEG,{0.6 + up},10.0,0.1,{0.8 + up},{0.4 + up},8.0,12.0,3\n"
            f"CVC-ClinicDB,{0.5 + up},20.0,0.1,,{0.5 + up},,20.0,2\n")
        with open(ws / "per_image_test" / "per_image.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["site", "image", "dice", "hd95_px", "dice_disc", "dice_cup", "hd95_px_disc", "hd95_px_cup"])
            for i in range(3):
                w.writerow(["Kvasir-SEG", f"k{i}", 0.5 + up, 9.0, 0.6 + i / 10 + up, 0.4 + i / 10 + up * (i + 1), 8.0,
                            10.0])
            for i in range(2):
                w.writerow(["CVC-ClinicDB", f"CVC-ClinicDB-{i}", 0.5, 9.0, "", 0.3 + 2 * up, "", 10.0])
    assert main(["--methods", "fedavg", "fedevi", "--seeds", "0", "--data-root", str(root),
                 "--out", str(tmp_path / "out")]) == 0
    md = (tmp_path / "out" / "results.md").read_text()
    assert "| Method | Dice (%) mean | Dice disc | Dice cup | HD95 (px) mean | HD95 disc | HD95 cup |" in md
    assert "| fedevi | 65.00 | 90.00 | 55.00 | 15.00 | 8.00 | 16.00 |" in md  # disc: Kvasir only
    tidy = list(csv.DictReader(open(tmp_path / "out" / "results_tidy.csv")))
    assert {(r["client"], r["metric"]) for r in tidy if r["metric"].endswith("disc")} == {
        ("Kvasir-SEG", "dice_disc"), ("Kvasir-SEG", "hd95_disc")}
    tests = {(r["structure"], r["scope"]): r for r in csv.DictReader(open(tmp_path / "out" / "paired_tests_per_structure.csv"))}
    assert set(tests) == {("disc", "all"), ("disc", "Kvasir-SEG"), ("cup", "all"), ("cup", "Kvasir-SEG"),
                          ("cup", "CVC-ClinicDB")}
    # cup: Kvasir differences 0.1, 0.2, 0.3 (3 units) and ClinicDB's sequence 0.2 (1 unit): Δ = 0.8 / 4
    assert float(tests[("cup", "all")]["mean_diff"]) == pytest.approx(0.2)
    assert (int(tests[("cup", "all")]["n"]), int(tests[("cup", "all")]["n_images"])) == (4, 5)
    assert float(tests[("disc", "all")]["mean_diff"]) == pytest.approx(0.1) and tests[("disc", "all")]["n"] == "3"
    from scipy.stats import false_discovery_control

    ps = [float(t["p_value"]) for t in tests.values()]
    assert [float(t["q_value"]) for t in tests.values()] == pytest.approx(list(false_discovery_control(ps)))
    assert "Paired against fedavg per structure" in md and "| fedevi vs fedavg (all) | 0 | image | 3 (3) | +10.00 [" in md


@pytest.mark.parametrize("record", ["deleted", "unreadable"])
def test_a_run_without_a_readable_record_is_checked_against_the_job_it_holds(tmp_path, monkeypatch, capsys, record):
    """Issue 70 item 3: with runs/<run>/RUN.json deleted (a sweep of before records) or unreadable, a 64 px run was
    skipped unchecked under a 32 px sweep ("settings were not recorded: not checked", rc 0), results.md reported its
    numbers as the 32 px sweep's and jobs/<run> was rewritten to 32 px. Now the run is checked against the job
    configuration it holds (as FLARE deployed it): a difference is refused in one line naming it (exit 2, nothing
    written), a match is reused; a run holding no configuration is refused naming the run and what to do."""
    import json
    import shutil

    from feduq.commands.research import compare

    monkeypatch.setattr(compare, "simulate", _fake_simulate)
    root, out = _polyp_root(tmp_path), tmp_path / "out"
    args = ["--methods", "fedavg", "--rounds", "2", "--local-epochs", "1", "--paired-baseline", "none", "--data-root",
            str(root), "--out", str(out)]
    assert compare.main([*args, "--image-size", "64"]) == 0
    run = out / "runs" / "fedavg_s0"
    if record == "deleted":
        (run / "RUN.json").unlink()
    else:
        (run / "RUN.json").write_text('{"settings": {"image_si')  # cut short
    capsys.readouterr()

    def digest():
        return {f.relative_to(out).as_posix(): (f.read_bytes(), f.stat().st_mtime_ns) for f in out.rglob("*")
                if f.is_file()}

    files = digest()
    assert compare.main([*args, "--image-size", "32"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"feduq compare: {run} finished with other settings")
    assert "executor.args.image_size = 64 there, 32 now" in err and "--rerun-changed" in err
    assert ("missing" if record == "deleted" else "unreadable") in err
    assert digest() == files  # nothing written: results.md and jobs/fedavg_s0 (64 px) as they were
    client = json.loads((out / "jobs" / "fedavg_s0" / "app" / "config" / "config_fed_client.json").read_text())
    assert client["executors"][0]["executor"]["args"]["image_size"] == 64
    assert compare.main([*args, "--image-size", "64"]) == 0  # the same settings: reused
    assert "the job configuration it holds and its data root match this sweep's" in capsys.readouterr().out
    header = (out / "results.md").read_text().splitlines()[0]
    assert "64 px" in header and "checked against the job configuration each holds" in header
    site = (run / "local" / "feduq_site.json").read_text()
    (run / "local" / "feduq_site.json").write_text(json.dumps({"data_root": "/elsewhere"}))
    assert compare.main([*args, "--image-size", "64"]) == 2
    assert f"data root = /elsewhere there, {root.resolve()} now" in capsys.readouterr().err
    (run / "local" / "feduq_site.json").write_text(site)
    shutil.rmtree(run / "server" / "simulate_job" / "app_server")  # no configuration of its own either
    assert compare.main([*args, "--image-size", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(run) in err and "holds no job configuration of its own" in err
    assert "--rerun-changed" in err and "move it away" in err
    assert compare.main([*args, "--image-size", "64", "--rerun-changed"]) == 0  # run again, recorded
    assert json.loads((run / "RUN.json").read_text())["settings"]["image_size"] == 64


def test_a_bad_task_file_is_one_line_and_exit_2(tmp_path, capsys):
    """Issue 70 (weak): ``feduq compare --task <bad task file>`` exited 1; it is bad input: one line naming the file and
    the key, exit 2, nothing written."""
    from feduq.commands.research import compare

    bad = tmp_path / "dataset.json"
    bad.write_text('{"name": "Dataset901_Bad", "bogus": 1}')
    assert compare.main(["--task", str(bad), "--methods", "fedavg", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(bad) in err and "bogus" in err
    assert not (tmp_path / "out").exists()
