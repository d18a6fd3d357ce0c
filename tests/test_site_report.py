"""The site acceptance report (issue 64 item 2, feduq.inference.site_report): written by predict on a site's
labelled cases, its page's structure and every picture it references present and decodable; a report folder
holding a user's file is refused before anything is scored or stored."""

from __future__ import annotations

import csv
import json
from html.parser import HTMLParser

import pytest
from PIL import Image

from conftest import small_job
from test_predict import cropped_site, light_model


class _Page(HTMLParser):
    def __init__(self):
        super().__init__()
        self.ids, self.images, self.figures = set(), [], 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if tag == "img":
            self.images.append(a["src"])
        self.figures += tag == "figure"


def test_the_report_has_its_sections_and_every_picture_decodes(tmp_path, data_root, capsys):
    from feduq.inference.review import review_file
    from feduq.predict import main as predict

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
    # a job folder has no run table: none is borrowed from a folder beside it
    sibling = tmp_path / "someone_elses_run" / "results"
    sibling.mkdir(parents=True)
    (sibling / "per_client_table.csv").write_text("client,dice,num_images\nHospital-Z,0.91,99\n")
    from feduq.inference.site_report import _training

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
    from feduq.inference.review import review_file
    from feduq.predict import main as predict

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
    proc = subprocess.run([sys.executable, "-m", "feduq.predict", "--job", str(job), "--model", str(model),
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

    from feduq.inference.review import review_file
    from feduq.predict import main as predict

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
