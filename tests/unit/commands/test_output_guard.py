"""Every FedUQ entry point that writes a folder goes through the one output guard (issue 53 item 1).

The entry points are found by reading the sources: every ``add_argument`` of an output option in ``tools/``, ``poc/``
and the ``python -m feduq.*`` modules. Each is given an output folder holding a user's file under names the tool
writes there; the call must refuse with exit code 2 and leave every file byte for byte as it was. A new tool with an
output option and no entry in :data:`CASES` fails :func:`test_every_output_option_is_walked`: put it behind the
guard (:func:`feduq.outputs.check_output_folder` / :func:`feduq.outputs.claim_output_folder`) and add it here.
"""

import hashlib
import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from conftest import REPO, small_job

OUTPUT_FLAGS = ("--out", "-o", "-w", "--dst", "--export-to", "--export-bundle", "--workspace", "--workspace-root")


def _sources() -> dict[str, str]:
    """Entry point -> its module: every verb of the ``feduq`` command (``feduq convert <dataset>`` each), and each
    developer tool ``tools/<name>.py``."""
    from feduq.commands.main import VERBS
    from feduq.commands.research.convert import CONVERTERS

    found = {f"feduq {v.name}": v.module for v in VERBS if v.name != "convert"}
    found.update({f"feduq convert {name}": f"feduq.data.convert.{mod}" for name, mod in CONVERTERS.items()})
    found.update({p.relative_to(REPO).as_posix(): str(p) for p in REPO.glob("tools/*.py")})
    return found


SOURCES = _sources()
#: an output option that is not an output folder of the tool's own
NOT_OUTPUTS = {("feduq compare-report", "--out"): "the feduq compare folder it reads; report.md is written into it"}


def _path(module: str) -> Path:
    if module.endswith(".py"):
        return Path(module)
    return Path(importlib.util.find_spec(module).origin)


def output_options() -> set[tuple[str, str]]:
    found = set()
    for entry, module in SOURCES.items():
        for flag in re.findall(r"add_argument\(\s*\"(-[-\w]+)\"", _path(module).read_text()):
            if flag in OUTPUT_FLAGS:
                found.add((entry, flag))
    return found - set(NOT_OUTPUTS)


def _module(entry: str):
    module = SOURCES[entry]
    if not module.endswith(".py"):
        return importlib.import_module(module)
    spec = importlib.util.spec_from_file_location(f"feduq_guard_{Path(module).stem}", module)
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def _light_job(tmp: Path, data_root: Path):
    """A light FedEvi job, a seeded model and a site folder of two real images (for evaluate and predict)."""
    from helpers import cropped_site, light_model

    job = small_job("fedevi", tmp / "job", network="light", image_size=64)
    return job, light_model(tmp / "model.pt"), cropped_site(data_root, tmp / "site", per_center=1)


def _kvasir_download(tmp: Path, data_root: Path) -> Path:
    src = tmp / "kvasir-download"
    for sub in ("images", "masks"):
        (src / sub).mkdir(parents=True)
        for f in sorted((data_root / "polyp" / "Kvasir-SEG" / sub).iterdir())[:2]:
            shutil.copy(f, src / sub / f.name)
    return src


JOB = str(REPO / "jobs" / "fedavg")
#: converters whose source layout takes real downloads to build: they refuse the empty source here before the output
#: (their output goes through feduq.io.image_files.SiteWriter's staged folder, tested with their own sources)
SOURCE_CHECKED_FIRST = {("feduq convert ct", "--out"), ("feduq convert fundus", "--dst"),
                        ("feduq convert prostate", "--dst"), ("feduq convert skin-breast", "--dst")}
#: (source, option) -> (arguments with OUT for the output and DATA for the data root, names written under OUT);
#: a callable builds the arguments from (tmp folder, data root)
CASES = {
    ("tools/benchmark_rounds.py", "--out"): (["--methods", "fedavg", "--rounds", "1", "--data-root", "DATA", "--out",
                                              "OUT"], ["benchmark.md", "benchmark.json"]),
    ("tools/benchmark_sites.py", "--out"): ([JOB, "--data-root", "DATA", "--out", "OUT"], ["sites.md", "sites.json"]),
    ("feduq compare", "--out"): (["--task", "polyp", "--methods", "fedavg", "--data-root", "DATA", "--out", "OUT"],
                                    ["results.md", "results_tidy.csv"]),
    ("feduq configure", "-o"): ([JOB, "-o", "OUT"], ["meta.json", "app/config/config_fed_client.json"]),
    ("feduq convert ct", "--out"): (lambda t, d: ["--layout", "msd", "--src", str(t / "nothing"), "--out", "OUT"],
                                       ["NIH-Pancreas-CT/labels.json"]),
    ("feduq convert fundus", "--dst"): (lambda t, d: ["--src", str(t / "nothing"), "--dst", "OUT"],
                                           ["fundus/Domain1/labels.json"]),
    ("feduq convert polyp", "--dst"): (lambda t, d: ["--kvasir", str(_kvasir_download(t, d)), "--dst", "OUT",
                                                        "--size", "64"], ["polyp/Kvasir-SEG/labels.json"]),
    ("feduq convert prostate", "--dst"): (lambda t, d: ["--src", str(t / "nothing"), "--dst", "OUT"],
                                             ["prostate/RUNMC/labels.json"]),
    ("feduq convert skin-breast", "--dst"): (lambda t, d: ["--busi", str(t / "nothing"), "--dst", "OUT"],
                                                ["breast/BUSI/labels.json"]),
    ("feduq evaluate", "--out"): (lambda t, d: (lambda j, m, s: ["--job", str(j), "--model", str(m), "--site-dir",
                                                                    str(s), "--out", "OUT"])(*_light_job(t, d)),
                                     ["per_image.csv", "per_site.csv"]),
    ("tools/make_ct_plans.py", "--out"): (["--data-root", "DATA", "--out", "OUT"], ["ct_2d.json", "ct_2d_slim.json"]),
    ("tools/make_jobs.py", "--out"): (["--out", "OUT"], ["fedavg/meta.json"]),
    ("feduq noisy-labels", "--out"): (["--data-root", "DATA", "--task", "polyp", "--sites", "Kvasir-SEG",
                                               "--preset", "skin_ns", "--out", "OUT"],
                                              ["polyp/Kvasir-SEG/noisy/Kvasir-SEG/cju0qkwl35piu0993l0dewei2.png"]),
    ("feduq fingerprint", "--out"): (lambda t, d: ["--task", str(_ct_task(t)), "--data-root", "DATA",
                                                                "--out", "OUT"], ["task.json"]),
    ("feduq fingerprint", "-w"): (lambda t, d: ["--task", str(_ct_task(t)), "--data-root", "DATA",
                                                             "--out", str(t / "fp.json"), "-w", "OUT"],
                                               ["job/feduq_intensity_fingerprint/meta.json"]),
    ("feduq fingerprint", "--export-to"): (lambda t, d: ["--task", str(_ct_task(t)), "--export-to", "OUT"],
                                                        ["feduq_intensity_fingerprint/meta.json"]),
    ("feduq plan", "--out"): (lambda t, d: ["--task", str(_ct_task(t)), "--data-root", "DATA", "--out",
                                                          "OUT"], ["plans.json"]),
    ("feduq plan", "-w"): (lambda t, d: ["--task", str(_ct_task(t)), "--data-root", "DATA", "--out",
                                                       str(t / "plans.json"), "-w", "OUT"],
                                         ["job/feduq_nnunet_plan/meta.json"]),
    ("feduq plan", "--export-to"): (lambda t, d: ["--task", str(_ct_task(t)), "--export-to", "OUT"],
                                                  ["feduq_nnunet_plan/meta.json"]),
    ("tools/study_3d_vs_2d.py", "--out"): (["--data-root", "DATA", "--out", "OUT"], ["study.md"]),
    ("feduq convert nnunet-raw", "--out"): (["--data-root", "DATA", "--prostate", "BMC", "--cases", "1", "--out",
                                               "OUT"], ["dataset.json", "imagesTr/case30_0000.nii.gz"]),
    ("feduq split", "--out"): (["--data-root", "DATA", "--task", "polyp", "--out", "OUT"],
                                        ["Kvasir-SEG.json", "CVC-ClinicDB.json"]),
    ("feduq synthetic", "--out"): (["--out", "OUT", "--n-per-center", "3"], ["polyp/Kvasir-SEG/labels.json"]),
    ("feduq resume", "-o"): (lambda t, d: ["--checkpoint", str(_file(t / "ckpt" / "FL_global_model.pt")), "-o",
                                                  "OUT", JOB], ["meta.json"]),
    ("feduq acceptance-study", "--out"): (lambda t, d: ["--holdout-dir", str(_cases_csv(t)), "--k", "5", "--draws",
                                                          "2", "--out", "OUT"], ["acceptance.csv", "acceptance.md"]),
    ("feduq simulate", "-w"): ([JOB, "-w", "OUT", "--data-root", "DATA"], ["server/log.txt", "simulator.log"]),
    ("feduq reference", "--out"): (["--mode", "local", "--task", "polyp", "--data-root", "DATA", "--out",
                                             "OUT"], ["per_client_table.md", "reference_log.jsonl"]),
    ("feduq virtual", "--out"): ([JOB, "--data-root", "DATA", "--out", "OUT"], ["log.txt"]),
    ("tools/provisioned.py", "--out"): (["up", "--out", "OUT", "--data-root", "DATA"], ["feduq_loop.yml"]),
    ("feduq predict", "--out"): (lambda t, d: (lambda j, m, s: ["--job", str(j), "--model", str(m), "--input",
                                                                    str(s / "images"), "--out", "OUT"])(*_light_job(t, d)),
                                     ["predictions.csv", "scales.json"]),
    ("feduq predict", "--export-bundle"): (lambda t, d: (lambda j, m, s: ["--job", str(j), "--model", str(m),
                                                                              "--export-bundle", "OUT"])(
        *_light_job(t, d)), ["configs/inference.json", "models/model.ts"]),
    ("feduq export-bundle", "--out"): (lambda t, d: (lambda j, m, s: ["--job", str(j), "--model", str(m),
                                                                        "--out", "OUT"])(*_light_job(t, d)),
                                       ["configs/inference.json", "models/model.ts"]),
    ("feduq project", "--out"): (lambda t, d: ["--out", str(t / "out" / "project.yml")], ["project.yml"]),
    ("feduq run", "--export-to"): (["fedavg", "--export-to", "OUT"], ["fedavg/meta.json"]),
    ("feduq run", "-w"): (["fedavg", "-w", "OUT", "--data-root", "DATA"], ["fedavg/notes.txt"]),
}


def _ct_task(tmp: Path) -> Path:
    """A declared task file with a CT channel without a window (feduq fingerprint's input)."""
    import json

    path = tmp / "ct_task.json"
    path.write_text(json.dumps({"name": "Dataset970_GuardCT", "channel_names": {"0": "CT"}, "labels": {
        "background": 0, "liver": 1}, "file_ending": ".nii.gz", "feduq": {"sites": ["A", "B"]}}))
    return path


def _cases_csv(tmp: Path) -> Path:
    """A review-holdout folder with one per-case CSV of 12 cases."""
    path = tmp / "holdout" / "site-A" / "fedavg_s0_cases.csv"
    path.parent.mkdir(parents=True)
    path.write_text("image,dice,u_mean,u_foreground,u_boundary\n"
                    + "".join(f"c{i},{0.9 - 0.05 * i:.2f},{i / 10},{i / 10},{i / 10}\n" for i in range(12)))
    return tmp / "holdout"


def _file(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"not a model")
    return path


def _digest(folder: Path) -> dict:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_every_output_option_is_walked():
    found = output_options()
    assert found, "no output option found: the pattern no longer matches the sources"
    missing = sorted(found - set(CASES))
    assert not missing, f"output options not behind the guard test (add them to CASES): {missing}"
    assert not sorted(set(CASES) - found), "CASES names options that no longer exist"


@pytest.mark.parametrize("entry", sorted(CASES), ids=lambda e: f"{Path(e[0]).stem.replace(' ', '-')}{e[1]}")
def test_a_users_files_in_the_output_are_refused_and_left_as_they_were(entry, tmp_path, data_root, capsys,
                                                                       monkeypatch):
    argv, names = CASES[entry]
    out = tmp_path / "out"
    for name in names:  # the user's files, under names the tool writes there
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(f"the user's own {name}\n")
    if callable(argv):
        argv = argv(tmp_path, data_root)
    argv = [{"OUT": str(out), "DATA": str(data_root)}.get(a, a) for a in argv]
    before = _digest(out)
    monkeypatch.setenv("FEDUQ_DATA_ROOT", str(data_root))
    main = _module(entry[0]).main
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's error: its usage, then one line
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, (entry, code, err[-3:])
    assert _digest(out) == before, entry
    if entry not in SOURCE_CHECKED_FIRST:  # the refusal is the guard's: it names the output
        assert str(out) in err[-1], (entry, err[-1])
