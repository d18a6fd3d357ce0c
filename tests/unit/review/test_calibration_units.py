"""Issue 68: the certificate counts patients. Which images belong to one patient (feduq.review.calibration.
case_units): a site's own grouping (CVC's video sequences, a prostate site's volumes, a declared task's group
pattern, ``<case>_zNNN`` slices), ``--unit-pattern``, or ``--units images``; bad options named in one line; and
``predict --calibrate`` on a prostate site's slices counting volumes."""

from __future__ import annotations

import csv
import re
import json
import shutil

import numpy as np
import pytest

from conftest import small_job
from helpers import light_model


def _prostate_site(data_root, folder, cases):
    """A copy of RUNMC's slices of ``cases`` (images, masks, labels.json, their provenance.csv rows)."""
    src = data_root / "prostate" / "RUNMC"
    (folder / "images").mkdir(parents=True)
    (folder / "masks").mkdir()
    shutil.copy(src / "labels.json", folder)
    with open(src / "provenance.csv", newline="") as f:
        reader = csv.DictReader(f)
        rows = [r for r in reader if r["case"] in cases]
        fields = reader.fieldnames
    with open(folder / "provenance.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        shutil.copy(src / r["image_file"], folder / r["image_file"])
        shutil.copy(src / r["mask_file"], folder / r["mask_file"])
    return folder, [r["image_file"].split("/")[-1].rsplit(".", 1)[0] for r in rows]


def test_units_from_the_sites_own_grouping_or_as_the_user_says(data_root):
    from feduq.review.calibration import UnitError, case_units

    colon = data_root / "polyp" / "CVC-ColonDB"
    stems = sorted(p.stem for p in (colon / "images").iterdir())[:40]
    rows = [{"site": "CVC-ColonDB", "image": s} for s in stems]
    units, word, how = case_units(rows, "polyp", {"CVC-ColonDB": colon})
    assert word == "video" and "column 'sequence'" in how
    with open(colon / "provenance.csv", newline="") as f:
        truth = {r["image_file"].split("/")[-1].rsplit(".", 1)[0]: r["sequence"] for r in csv.DictReader(f)}
    assert units == [f"CVC-ColonDB/{truth[s]}" for s in stems]
    kvasir = data_root / "polyp" / "Kvasir-SEG"
    rows = [{"site": "Kvasir-SEG", "image": p.stem} for p in sorted((kvasir / "images").iterdir())[:5]]
    with pytest.raises(UnitError, match="site 'Kvasir-SEG': its labelled images cannot be told apart by patient.*"
                                        "--unit-pattern REGEX.*--units images"):
        case_units(rows, "polyp", {"Kvasir-SEG": kvasir})
    units, word, _ = case_units(rows, "polyp", {"Kvasir-SEG": kvasir}, units="images")
    assert word == "image" and len(set(units)) == 5
    slices = [{"site": "H", "image": f"Case{c:02d}_z{z:03d}"} for c in range(3) for z in range(4)]
    units, word, how = case_units(slices, "polyp", {"H": kvasir})
    assert word == "volume" and units[5] == "H/Case01" and "slices" in how
    units, word, _ = case_units(slices, "polyp", {"H": kvasir}, unit_pattern=r"Case(\d+)_z.*")
    assert word == "patient" and units[11] == "H/02"
    for kwargs, said in ((dict(unit_pattern=r"Patient(\d+)"), "does not match image 'Case00_z000' of site 'H' (12 of "
                                                              "its 12 images)"),
                         (dict(unit_pattern=r"(Case)\d+_z\d+"), "puts all 12 images in one unit \\('Case'\\)"),
                         (dict(unit_pattern=r"Case\d+_z\d+"), "has no group"),
                         (dict(unit_pattern=r"Case(\d+"), "is not a regular expression"),
                         (dict(units="images", unit_pattern=r"Case(\d+)_z.*"), "say two things")):
        with pytest.raises(UnitError, match=re.escape(said) if "(12" in said else said):
            case_units(slices, "polyp", {"H": kvasir}, **kwargs)


def test_predict_calibrate_on_a_prostate_sites_slices_counts_volumes(tmp_path, data_root, capsys, monkeypatch):
    """Two RUNMC volumes' slices, scored by predict itself: they never certify (two units; "images from 2 volumes",
    exit 2, nothing stored, no site record). Then RUNMC's 30 volumes' slices as predict would score them
    (the cases given, the units read from the site's provenance.csv): certified, and the line and the rule say
    "k images from n volumes"."""
    import feduq.review.calibration as calibration
    from feduq.review.rule import review_file
    from feduq.commands.site.predict import main as predict

    job = small_job("fedavg", tmp_path / "job", task="prostate", sites=["RUNMC", "BMC"], network="light",
                    image_size=64, executor_args={"test_protocol": {"resolution": "training"}})
    model = light_model(tmp_path / "model.pt", in_channels=1)
    site, stems = _prostate_site(data_root, tmp_path / "data" / "RUNMC", ["Case00", "Case01"])
    calibrate = ["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(site), "--no-progress"]
    assert predict([*calibrate, "--target-dice", "0.03"]) == 2
    err = capsys.readouterr().err
    assert f"these {len(stems)} labelled images from 2 volumes cannot certify a mean Dice of 0.030" in err
    assert not review_file(model).exists() and not list(site.parent.glob("*.feduq-calibration.json"))

    big, big_stems = _prostate_site(data_root, tmp_path / "data2" / "RUNMC", [f"Case{c:02d}" for c in range(30)])
    n = len(big_stems)
    volume = np.array([int(s[4:6]) for s in big_stems])
    score = np.where(volume % 4 == 0, 0.4, 0.02)  # a quarter of the volumes uncertain and bad
    cases = {"u_mean": score, "u_foreground": score, "u_boundary": score, "area_fraction": np.full(n, 0.1),
             "mask_fraction": np.full(n, 0.1), "dice": np.where(volume % 4 == 0, 0.2, 0.95)}
    rows = [{"site": "RUNMC", "image": s, "sha256": "0" * 64} for s in big_stems]

    def scored(*a, center_dirs=None, **k):
        center_dirs["RUNMC"] = big
        return cases, None, ["RUNMC:all"], rows

    monkeypatch.setattr(calibration, "labelled_cases", scored)
    n_volumes = len(set(volume.tolist()))
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(big),
                    "--target-dice", "0.6"]) == 0
    assert f"over the {n} images from {n_volumes} volumes drawn" in capsys.readouterr().out
    c = json.loads(review_file(model).read_text())["certificate"]
    assert (c["k"], c["n_units"], c["unit"], c["max_unit_images"]) == (n, n_volumes, "volume", 32)
    assert "provenance.csv column 'case'" in c["units_from"]
    assert predict(["--job", str(job), "--model", str(model), "--calibrate", "--site-dir", str(big),
                    "--max-unit-images", "10"]) == 2
    err = capsys.readouterr().err
    assert "labelled images, more than the bound 10 on a unit's images fixed before the data (--max-unit-images)" in err


def test_a_declared_volume_tasks_case_is_the_volume(tmp_path, data_root, capsys):
    """Four NIfTI volumes of a declared task: the labelled cases are the four volumes (their case scores from the
    stacked slices, one row each, the 3D Dice of evaluate's per-case score), each its own patient; a target of 0.03
    is refused naming 4 volumes, where the slices counted as cases had certified it (issue 68)."""
    import nnunet_sites

    from feduq.core.networks import build_network
    from feduq.review.calibration import case_units, labelled_cases
    from feduq.review.rule import review_file
    from feduq.commands.site.predict import main as predict
    from feduq.site.evaluation import load_model, locate

    name = "Dataset968_Volumes"
    site = tmp_path / "data" / name / "Hospital-V"
    cases = nnunet_sites.prostate_site(data_root, "RUNMC", site, max_cases=4)
    task = nnunet_sites.task_declaration(name, ["Hospital-V"])
    job = small_job("fedavg", tmp_path / "job", task=task, sites=["Hospital-V"], network="light",
                    executor_args={"test_protocol": {"resolution": "training"}})  # scored at 32 px: seconds
    classes = len(task["labels"])
    torch_model = build_network("light", 1, classes, init_seed=3)
    import torch

    torch.save({"model": torch_model.state_dict()}, tmp_path / "model.pt")
    config, model_file = locate(str(job), str(tmp_path / "model.pt"), "best")
    loaded = load_model(config, model_file)
    folders = {}
    scored, features, _, rows = labelled_cases(loaded, site_dirs=[site], center_dirs=folders)
    assert sorted(r["image"] for r in rows) == sorted(c.lower() for c in cases) or sorted(
        r["image"] for r in rows) == sorted(cases)
    assert features.shape[0] == 4 and scored["dice"].shape == (4,) and all(r["slices"] > 5 for r in rows)
    assert all(0 <= r["area_fraction"] <= 1 and r["sha256"] for r in rows)
    units, word, _ = case_units(rows, loaded.task, folders)
    assert word == "volume" and len(set(units)) == 4
    assert predict(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--calibrate", "--site-dir", str(site),
                    "--target-dice", "0.03", "--no-progress"]) == 2
    assert "these 4 labelled volumes cannot certify a mean Dice of 0.030" in capsys.readouterr().err
    assert not review_file(tmp_path / "model.pt").exists()
    # the site report reads the volumes (it stopped on "cannot read this image with Pillow" after 286 s, issue 70):
    # one row per volume, each worst case pictured at its slice with the largest reference area
    assert predict(["--job", str(job), "--model", str(tmp_path / "model.pt"), "--report", "--site-dir", str(site),
                    "--out", str(tmp_path / "report"), "--no-progress"]) == 0
    import csv

    from PIL import Image

    assert len(list(csv.DictReader(open(tmp_path / "report" / "cases.csv")))) == 4
    pictures = sorted((tmp_path / "report").rglob("worst_*.png"))
    assert len(pictures) == 4 and all(Image.open(f).size == (2 * 384 + 4, 384) for f in pictures)


def test_the_site_record_keeps_the_cases_at_the_site_and_checks_them(tmp_path, data_root):
    """What travels is a digest; the record beside the site's folder lists the cases and their file hashes, and a
    changed image, another certificate or a missing record is said in one line."""
    from feduq.review.calibration import case_hashes, check_site_record, write_site_record

    site, stems = _prostate_site(data_root, tmp_path / "RUNMC", ["Case00"])
    hashes = case_hashes(site, stems)
    rows = [{"site": "RUNMC", "image": s, "sha256": hashes[s]} for s in stems]
    fields = write_site_record(rows, ["RUNMC/Case00"] * len(rows), {"RUNMC": site},
                              {"k": len(rows), "n_units": 1, "delta": 0.1, "bound": 0.5})
    record = json.loads((tmp_path / "RUNMC.feduq-calibration.json").read_text())
    assert record["digest"] == fields["digest"] and len(record["cases"]) == len(stems) and len(record["salt"]) == 32
    assert stems[0] not in json.dumps(fields)
    assert check_site_record(fields, site) is None
    assert "another certificate" in check_site_record({"digest": "0" * 64}, site)
    (site / "images" / f"{stems[3]}.png").write_bytes(b"changed")
    assert check_site_record(fields, site) == (f"1 of the {len(stems)} calibration cases at {site} changed or are "
                                               f"missing since the certificate (first: {stems[3]})")
    assert "no calibration record" in check_site_record(fields, tmp_path / "elsewhere" / "RUNMC")
    # a user's file of the record's name is never replaced
    (tmp_path / "RUNMC.feduq-calibration.json").write_text("my notes")
    with pytest.raises(FileExistsError, match="not a FedUQ calibration record"):
        write_site_record(rows, ["RUNMC/Case00"] * len(rows), {"RUNMC": site}, {"k": 1, "n_units": 1, "delta": 0.1,
                                                                                "bound": 0.5})
    assert (tmp_path / "RUNMC.feduq-calibration.json").read_text() == "my notes"
