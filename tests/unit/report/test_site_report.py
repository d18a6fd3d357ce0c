"""The site acceptance report (issue 64 item 2, feduq.report.site_report): written by predict on a site's
labelled cases, its page's structure and every picture it references present and decodable; a report folder
holding a user's file is refused before anything is scored or stored. Issue 68 part 5, the page a clinical team
signs: the verdict at the top (certified, or why not and how many more units), every scored structure's Dice and
HD95 per case with a gallery per structure, training cases refused (or named as optimistic), one model file for the
SHA-256 and the test Dice, the certificate's unit named among what it does not promise."""

from __future__ import annotations

import csv
import json
from html.parser import HTMLParser

import pytest
from PIL import Image

from conftest import REPO, small_job
from helpers import cropped_site, light_model


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.images, self.figures, self.links, self.order = set(), [], 0, [], []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
            self.order.append(a["id"])
        if tag == "img":
            self.images.append(a["src"])
        if tag == "a":
            self.links.append(a.get("href"))
        self.figures += tag == "figure"


def test_the_report_has_its_sections_and_every_picture_decodes(tmp_path, data_root, capsys):
    from feduq.review.rule import review_file
    from feduq.commands.site.predict import main as predict

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-R", per_center=4)
    n = len(list((site / "images").iterdir()))
    out = tmp_path / "report"
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--uncertified", "--target-dice", "0.05",
                    "--report", "--site-dir", str(site), "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "review rule:" in said and f"wrote the site acceptance report {out / 'report.html'}" in said
    page = _Page()
    text = (out / "report.html").read_text()
    page.feed(text)
    assert {"model", "cases", "worst", "rule", "limits", "per-case"} <= page.ids
    assert page.figures == min(6, n) and "Not certified" in text and f"{n} labelled cases of Hospital-R" in text
    assert str(tmp_path) not in text and "Hospital-R:all" in text  # the page a team signs holds no machine path
    # a job folder has no run table: none is borrowed from a folder beside it
    sibling = tmp_path / "someone_elses_run" / "results"
    sibling.mkdir(parents=True)
    (sibling / "per_client_table.csv").write_text("client,dice,num_images\nHospital-Z,0.91,99\n")
    from feduq.report.site_report import _training

    assert _training(job / "app" / "config" / "config_fed_client.json") == []
    assert "The run folder holds no per-site table" in text
    assert {"distribution.png", "risk_coverage.png"} <= set(page.images)
    for src in page.images:  # self-contained: every picture beside the page, and a real PNG
        with Image.open(out / src) as im:
            im.load()
            assert im.size[0] > 50
    rows = list(csv.DictReader(open(out / "cases.csv")))
    assert len(rows) == n and all(r["review"] in ("yes", "no") for r in rows)
    stored = json.loads(review_file(model).read_text())
    assert sum(r["review"] == "no" for r in rows) == round(stored["coverage"] * n)  # the rule's own decisions


def test_a_report_folder_holding_a_users_file_is_refused_before_anything_is_done(tmp_path, data_root, capsys):
    from feduq.review.rule import review_file
    from feduq.commands.site.predict import main as predict

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-R", per_center=1)
    out = tmp_path / "report"
    out.mkdir()
    (out / "report.html").write_text("mine")
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--uncertified", "--target-dice", "0.05",
                    "--report", "--site-dir", str(site), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "holds files no FedUQ tool wrote there" in err and err.count("\n") == 1
    assert (out / "report.html").read_text() == "mine" and sorted(p.name for p in out.iterdir()) == ["report.html"]
    assert not review_file(model).exists()  # the rule was not chosen either
    # --force keeps a user's files, so it never writes over their report.html: refused before the rule is chosen
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--uncertified", "--target-dice", "0.05",
                    "--report", "--site-dir", str(site), "--out", str(out), "--force"]) == 2
    assert "report.html is not FedUQ's and the new output writes the same name" in capsys.readouterr().err
    assert (out / "report.html").read_text() == "mine" and not review_file(model).exists()
    assert predict(["--job", str(job), "--model", str(model), "--report", "--out", str(tmp_path / "r2")]) == 2
    assert "--report needs the site's labelled cases" in capsys.readouterr().err
    for flag in (["--delta", "0.05"], ["--uncertified"]):  # options of --calibrate, not silently ignored without it
        assert predict(["--job", str(job), "--model", str(model), *flag, "--report", "--site-dir", str(site),
                        "--out", str(tmp_path / "r3")]) == 2
        assert "give --calibrate" in capsys.readouterr().err and not (tmp_path / "r3").exists()


def test_predict_prints_no_monai_notice_that_says_nothing_of_the_data(tmp_path, data_root):
    """Issue 65: every predict --calibrate printed nvImageCodec's absence (twice) and a get_mask_edges deprecation."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-Q", per_center=1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO / "tests"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-m", "feduq", "predict", "--job", str(job), "--model", str(model),
                           "--calibrate", "--uncertified", "--target-dice", "0.05", "--site-dir", str(site)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert "review rule:" in proc.stdout
    assert "nvImageCodec" not in said and "always_return_as_numpy" not in said, said[-2000:]


@pytest.mark.parametrize("case", ["another_task", "mask_size"])
def test_labelled_cases_that_do_not_fit_are_named_and_no_rule_is_stored(tmp_path, data_root, capsys, case):
    """Issue 64's bad input: labelled cases of another task (a prostate site's 3-class masks for a polyp job), or a
    mask whose size is not its image's: one line naming the site, exit 2, no rule stored and no report written."""
    import shutil

    from feduq.review.rule import review_file
    from feduq.commands.site.predict import main as predict

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    if case == "another_task":
        site = tmp_path / "data" / "Hospital-P"
        (site / "images").mkdir(parents=True)
        (site / "masks").mkdir()
        src = data_root / "prostate" / "BMC"
        shutil.copy(src / "labels.json", site / "labels.json")
        for mask in sorted((src / "masks").iterdir())[40:43]:
            shutil.copy(mask, site / "masks" / mask.name)
            image = next((src / "images").glob(mask.stem + ".*"))
            shutil.copy(image, site / "images" / image.name)
        words = ["Hospital-P", "mask values"]
    else:
        site = cropped_site(data_root, tmp_path / "data" / "Hospital-M", per_center=2)
        mask = sorted((site / "masks").iterdir())[0]
        Image.open(mask).resize((17, 13)).save(mask)
        words = ["Hospital-M", mask.stem]
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--uncertified", "--target-dice", "0.05",
                    "--report", "--site-dir", str(site), "--out", str(tmp_path / "report")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and all(w in err for w in words), err
    assert not review_file(model).exists() and not (tmp_path / "report").exists()


def _text(html_text: str) -> str:
    """The page's words, tags dropped and spaces collapsed (what a reader sees)."""
    import re
    from html import unescape

    return " ".join(unescape(re.sub(r"<[^>]+>", " ", html_text)).split())


def _section(html_text: str, start: str, end: str | None = None) -> str:
    """The words of the page from the element with id ``start`` to the one with id ``end`` (or the end)."""
    a = html_text.index(">", html_text.index(f"id='{start}'")) + 1
    b = html_text.rindex("<", 0, html_text.index(f"id='{end}'")) if end else len(html_text)
    return _text(html_text[a:b])


def test_the_verdict_is_at_the_top_and_a_region_task_shows_every_structure(tmp_path, data_root, capsys):
    """Fundus (disc and cup): each case's Dice and HD95 of both structures on the page and in the linked cases.csv,
    a gallery per structure (the worst by that structure's Dice); the verdict paragraph first (no rule stored: every
    case must be reviewed); predict names the model file it uses."""
    import torch

    from feduq.core.networks import build_network
    from feduq.review.rule import file_sha256
    from feduq.commands.site.predict import main as predict

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64, task="fundus")
    model = tmp_path / "model.pt"
    torch.save({"model": build_network("light", 3, 3, init_seed=3).state_dict()}, model)
    site = tmp_path / "data" / "Hospital-F"
    (site / "images").mkdir(parents=True)
    (site / "masks").mkdir()
    src = data_root / "fundus" / "Drishti-GS"
    (site / "labels.json").write_text((src / "labels.json").read_text())
    for image in sorted((src / "images").iterdir())[:3]:  # cropped: new bytes, no training image of any site
        Image.open(image).convert("RGB").crop((8, 8, 376, 376)).save(site / "images" / f"{image.stem}.png")
        mask = Image.open(src / "masks" / f"{image.stem}.png")
        mask.crop((8, 8, 376, 376)).save(site / "masks" / f"{image.stem}.png")
    out = tmp_path / "report"
    assert predict(["--job", str(job), "--model", str(model), "--report", "--site-dir", str(site),
                    "--out", str(out)]) == 0
    assert f"model: {model} (SHA-256 {file_sha256(model)[:16]}" in capsys.readouterr().out
    text = (out / "report.html").read_text()
    page = _Page()
    page.feed(text)
    assert page.order[0] == "verdict" and page.order.index("verdict") < page.order.index("model")
    verdict = _section(text, "verdict", "model")
    assert "Nothing is certified" in verdict and "every case of Hospital-F must be reviewed" in verdict
    assert "cases.csv" in page.links
    rows = list(csv.DictReader(open(out / "cases.csv")))
    assert len(rows) == 3
    for r in rows:  # every structure's figures, the case's Dice their mean
        assert float(r["dice"]) == pytest.approx((float(r["dice_disc"]) + float(r["dice_cup"])) / 2, abs=2e-4)
        assert float(r["hd95_px"]) == pytest.approx((float(r["hd95_px_disc"]) + float(r["hd95_px_cup"])) / 2,
                                                    abs=0.02)
    words = _text(text)
    assert all(h in words for h in ("Dice disc (%)", "Dice cup (%)", "HD95 disc (px)", "HD95 cup (px)"))
    table = _section(text, "per-case")
    for r in rows:  # the per-case table's row: Dice, disc, cup (%), HD95, disc, cup (px)
        shown = [float(v) for v in table.split(f"Hospital-F {r['case']} ")[1].split()[:6]]
        assert shown == pytest.approx([100 * float(r[k]) for k in ("dice", "dice_disc", "dice_cup")]
                                      + [float(r[k]) for k in ("hd95_px", "hd95_px_disc", "hd95_px_cup")], abs=0.06)
    assert {"worst-0", "worst-1"} <= page.ids and page.figures == 2 * 3
    assert "The worst cases by disc Dice" in words and "The worst cases by cup Dice" in words
    worst_cup = min(rows, key=lambda r: float(r["dice_cup"]))
    assert f"{worst_cup['case']}: cup Dice {100 * float(worst_cup['dice_cup']):.1f} %" in words
    for src_ in page.images:
        with Image.open(out / src_) as im:
            im.load()


def test_training_cases_are_refused_or_named_as_optimistic(tmp_path, data_root, capsys):
    """A site folder holding a copy of a training image of the job's site (found by its bytes, the data root
    given): one line naming the site and how many, exit 2, nothing written; with --allow-training-cases the report
    is written and names the case as optimistic."""
    import shutil

    from feduq.commands.site.predict import main as predict

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    site = tmp_path / "data" / "Hospital-T"
    (site / "images").mkdir(parents=True)
    (site / "masks").mkdir()
    src = data_root / "polyp" / "Kvasir-SEG"
    shutil.copy(src / "labels.json", site)
    split = json.loads((REPO / "custom" / "splits" / "polyp" / "Kvasir-SEG.json").read_text())
    trained, new = split["training"][0], split["testing"][0]  # the job trains on the first 6 of its split
    for item in (trained, new):
        shutil.copy(src / item["image"], site / "images")
        shutil.copy(src / item["label"], site / "masks")
    out = tmp_path / "report"
    argv = ["--job", str(job), "--model", str(model), "--report", "--site-dir", str(site), "--out", str(out),
            "--data-root", str(data_root)]
    assert predict(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "site Hospital-T: 1 of its 2 labelled cases are training cases" in err, err
    assert "--allow-training-cases" in err and not out.exists()
    assert predict([*argv, "--allow-training-cases"]) == 0
    text = (out / "report.html").read_text()
    stem = trained["image"].split("/")[-1].split(".")[0]
    verdict = _section(text, "verdict", "model")
    assert "Optimistic: 1 of these 2 cases are training cases" in verdict
    assert f"{stem} " in _section(text, "per-case") and "yes (optimistic)" in text
    rows = {r["case"]: r for r in csv.DictReader(open(out / "cases.csv"))}
    assert rows[stem]["training_case"] == "yes" and sum(r["training_case"] == "yes" for r in rows.values()) == 1


def test_the_model_file_and_the_test_dice_shown_are_one_file(tmp_path, data_root, capsys):
    """A run folder whose test scored FL_global_model.pt (as FedA3I's jobs do): a report on best_FL_global_model.pt
    shows that file's SHA-256 and not the other file's test Dice (it names the file they are of); a report on
    FL_global_model.pt shows its SHA-256 and its test Dice."""
    import shutil

    from feduq.review.rule import file_sha256
    from feduq.commands.site.predict import main as predict

    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    run = tmp_path / "ws" / "server" / "simulate_job"
    shutil.copytree(job / "app", run / "app_server")
    shutil.copy(job / "meta.json", run)
    best = light_model(run / "app_server" / "best_FL_global_model.pt", seed=3)
    last = light_model(run / "app_server" / "FL_global_model.pt", seed=4)
    (run / "results").mkdir()
    (run / "results" / "per_client_table.csv").write_text("client,dice,num_images\nKvasir-SEG,0.4321,200\n"
                                                          "Avg,0.4321,\nStd,0.0,\n")
    (run / "results" / "per_client_table.md").write_text("# Test results: FedEvi\n\nModel evaluated: "
                                                         "`FL_global_model.pt`.\n\n| client | Dice (%) |\n")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-R", centers=["Kvasir-SEG"], per_center=1)
    for which, model, other in (("best", best, last), ("last", last, best)):
        out = tmp_path / f"report_{which}"
        assert predict(["--job", str(tmp_path / "ws"), "--which", which, "--report", "--site-dir", str(site),
                        "--out", str(out)]) == 0
        assert f"model: {model} (SHA-256 {file_sha256(model)[:16]}" in capsys.readouterr().out
        text = (out / "report.html").read_text()
        section = _section(text, "model", "cases")
        assert file_sha256(model) in section and file_sha256(other) not in section
        if which == "best":
            assert "43.2" not in section and "table scored FL_global_model.pt" in section
            assert "not this report's model file best_FL_global_model.pt" in section
        else:
            assert "test Dice (%) of FL_global_model.pt Kvasir-SEG 200 43.2" in section


def test_a_calibration_that_cannot_certify_still_writes_its_report(tmp_path, data_root, capsys, monkeypatch):
    """--calibrate --report when nothing certifies (ReviewError with its verdict): the report says why and how many
    more units would be needed, predict prints the error line and exits 2."""
    import feduq.commands.site.predict as predict_verb
    from feduq.review.rule import ReviewError

    def cannot_certify(loaded, **kwargs):
        e = ReviewError("these 2 labelled images (2 patients) cannot certify a mean Dice of 0.800 at delta 0.1; about "
                        "40 patients like these would be needed")
        e.verdict = {"target": 0.8, "delta": 0.1, "k": 2, "n_units": 2, "unit": "patient", "units_needed": 40,
                     "best_target": 0.0}
        raise e

    monkeypatch.setattr(predict_verb, "calibrate", cannot_certify)
    job = small_job("fedevi", tmp_path / "job", network="light", image_size=64)
    model = light_model(tmp_path / "model.pt")
    site = cropped_site(data_root, tmp_path / "data" / "Hospital-R", centers=["Kvasir-SEG"], per_center=1)
    out = tmp_path / "report"
    assert predict_verb.main(["--job", str(job), "--model", str(model), "--calibrate", "--report", "--site-dir",
                             str(site), "--out", str(out)]) == 2
    said = capsys.readouterr()
    assert said.err.count("\n") == 1 and "cannot certify a mean Dice of 0.800" in said.err
    assert f"wrote the site acceptance report {out / 'report.html'}" in said.out
    text = (out / "report.html").read_text()
    verdict = _section(text, "verdict", "model")
    assert verdict.startswith("Not certified.") and "2 labelled images (2 patients) of Hospital-R" in verdict
    assert "they certify no target" in verdict
    assert "About 38 more patients like these would be needed (about 40 in all)" in verdict
    limits = _section(text, "limits", "per-case")
    assert "The calibration counted 2 patients as its independent units" in limits


def test_the_verdict_and_the_limits_name_the_certificates_unit():
    """The page builder on hand-made rows: a certified rule's verdict gives the target, δ, the coverage here and the
    site; a certificate that counted videos says so instead of warning that frames are not independent; an older
    record (no units) counts its images."""
    from types import SimpleNamespace

    from feduq.report.page import limits_html, verdict_html

    rows = [{"site": "Hospital-V", "image": f"seq1_f{i}", "dice": d} for i, d in enumerate([0.9, 0.8, 0.2, 0.7])]
    decisions = [[], [], ["uncertain"], []]
    cert = {"k": 120, "n_units": 12, "unit": "video", "delta": 0.1, "bound": 0.75, "sites": ["Hospital-V"]}
    rule = SimpleNamespace(certificate=cert, target_dice=0.75, n_cases=120, calibrated_on=["Hospital-V:all"])
    verdict = _text(verdict_html(rule, rows, decisions))
    assert verdict.startswith("Certified for new patients of Hospital-V")
    assert "at least 90 % (δ = 0.1) over the 12 videos (120 labelled images)" in verdict
    assert "mean Dice of at least 75.0 %" in verdict and "accepts 75.0 % (its coverage here), with mean Dice 80.0 %" \
        in verdict
    limits = _text(limits_html(rule, len(rows)))
    assert "The certificate counted 12 videos as its independent units" in limits
    assert "frames of one video" not in limits
    old = SimpleNamespace(certificate={"k": 60, "delta": 0.1, "bound": 0.7, "sites": ["Hospital-V"]}, target_dice=0.7,
                          n_cases=60, calibrated_on=[])
    assert "over the 60 images it was certified on" in _text(verdict_html(old, rows, decisions))
    limits = _text(limits_html(old, len(rows)))
    assert "counted each of its 60 images as one unit" in limits and "frames of one video" in limits
    other = _text(verdict_html(rule, [{**r, "site": "Hospital-W"} for r in rows], decisions))
    assert "not of the site it was certified for: it promises nothing for them" in other


def test_the_verdict_says_when_the_reference_masks_are_empty():
    """Issue 70: a report on all-empty masks showed Dice 0 and HD95 = the image diagonal for every case without a
    word; the verdict now says the masks are empty (all, or how many)."""
    from feduq.report.page import verdict_html

    rows = [{"site": "S", "image": f"c{i}", "dice": 0.0, "mask_fraction": 0.0} for i in range(3)]
    text = _text(verdict_html(None, rows, [None] * 3))
    assert ("All 3 reference masks are empty (nothing labelled): there Dice is 0 and HD95 the image diagonal by "
            "convention, whatever the model predicts, so these figures say nothing of the model") in text
    rows[0]["mask_fraction"] = 0.2
    text = _text(verdict_html(None, rows, [None] * 3))
    assert "2 of these 3 reference masks are empty" in text and "say nothing" not in text
    rows[1]["mask_fraction"] = rows[2]["mask_fraction"] = 0.1
    assert "empty" not in _text(verdict_html(None, rows, [None] * 3))
