#!/usr/bin/env python3
"""3D against slice-wise 2D on the same volumes, sites, splits and CPU budget (a study, not a test).

Two prostate centers of ``--data-root`` (default RUNMC, 30 cases, and BMC, 9 cases) are restacked into NIfTI
volumes with their recorded spacing (``feduq convert nnunet-raw``; in ``--out``, never committed), each with a
seeded case-level split (70/10/20, seed 0); the same FedAvg job then trains twice in FLARE's simulator:

* **3d**: ``configuration 3d_fullres`` on nnU-Net's plan of the two sites' federated fingerprint
  (:mod:`feduq.nnunet.federated_plans`; ``--slim``, the default on a CPU: its slim form), ``--rounds-3d`` rounds of
  ``--iterations`` iterations;
* **2d**: the slice-wise path (each axial slice at ``--image-size`` px on the job's 2D network, stacked back for
  scoring), ``--rounds-2d`` rounds of one local epoch; pick the rounds so both arms take about the same wall time
  (both are printed and written).

Each test case's Dice (mean over PZ and TZ) and HD95 (mm) come from the sites' per-case files; the arms are compared
by a paired Wilcoxon test over cases with a bootstrap 95 % interval of the mean difference (cases resampled within
their site). Writes ``--out``/``study.md`` and ``study.json``; an arm already finished (its ``DONE`` file) is not
run again, so an interrupted study resumes (refused, naming what differs, when its ``settings.json`` records
other settings).

    python tools/study_3d_vs_2d.py --data-root ../shared/data --out workspaces/study_3d \\
        --rounds-3d 20 --iterations 50 --rounds-2d 10 --image-size 128
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NAME = "Dataset993_ProstateStudy"


def _is_study(folder: Path) -> bool:
    """A folder this tool made (its sites, plan or an arm), interrupted before its manifest was written."""
    return (folder / "data" / "BUILT").is_file() or (folder / "plans.json").is_file() or any(
        (folder / arm / "DONE").is_file() for arm in ("3d", "2d"))


def declaration(centers: list[str]) -> dict:
    """The study's task: the two centers' T2 volumes with the prostate's peripheral and transition zones."""
    return {"name": NAME, "channel_names": {"0": "T2"}, "labels": {"background": 0, "PZ": 1, "TZ": 2},
            "file_ending": ".nii.gz", "feduq": {"sites": list(centers)}}


def build_sites(data_root: Path, root: Path, centers: list[str], max_cases: int | None) -> dict[str, Path]:
    """The centers as nnU-Net raw sites under ``root/NAME/`` (``feduq convert nnunet-raw``; made once: a finished
    build leaves ``BUILT``), each with its seeded case split in ``split.json``."""
    import shutil
    import subprocess

    from feduq.data import job_task
    from feduq.sites import nnunet_raw as nr

    out = {c: root / NAME / c for c in centers}
    if not (root / "BUILT").is_file():
        task = job_task(declaration(centers))
        for stale in staging_folders(root, centers):  # a study stopped by SIGKILL: no finally ran
            print(f"removing an interrupted build's staging folder {stale}", file=sys.stderr)
            shutil.rmtree(stale, ignore_errors=True)
        try:
            for center, site in out.items():
                cmd = [sys.executable, "-m", "feduq", "convert", "nnunet-raw", "--data-root", str(data_root),
                       "--prostate", center, "--out", str(site), *(["--cases", str(max_cases)] if max_cases else [])]
                subprocess.run(cmd, check=True, capture_output=True)
                cases = sorted(p.name[: -len("_0000.nii.gz")] for p in (site / "imagesTr").iterdir())
                split = nr.make_case_split(site, task, center, cases, seed=0)
                (site / "split.json").write_text(json.dumps(split, indent=1))
        finally:  # a stopped conversion (Ctrl-C kills the converter before its own clean-up) leaves its staging
            for stale in staging_folders(root, centers):
                shutil.rmtree(stale, ignore_errors=True)
        (root / "BUILT").write_text("ok\n")
    return out


def staging_folders(root: Path, centers: list[str]) -> list[Path]:
    """The converter's hidden staging folders (``.<center>.partial-*``, :func:`feduq.outputs.staged_folder`) beside
    the study's sites: what a stopped build leaves."""
    return sorted(p for c in centers for p in (root / NAME).glob(f".{c}.partial-*") if p.is_dir())


#: the field a settings record of this tool carries (so a user's own settings.json is not read as a study's)
RECORD_FIELD = "feduq_study"
#: the fields a record written before that field had
_OLDER_RECORD = {"data_root", "centers", "rounds_3d", "rounds_2d", "iterations", "image_size"}


def read_settings(path: Path) -> dict | None:
    """The study's settings recorded at ``path`` (without :data:`RECORD_FIELD`), or None when the file is not one
    this tool wrote (not JSON, not an object, neither the field nor an older record's fields)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or not (record.get(RECORD_FIELD) == "study_3d_vs_2d.py"
                                            or _OLDER_RECORD <= set(record)):
        return None
    return {k: v for k, v in record.items() if k != RECORD_FIELD}


def federated_plan(sites: dict[str, Path], slim: bool, out: Path) -> dict:
    """The sites' federated fingerprint (their training cases) planned by nnU-Net, written to ``out``."""
    from nnunetv2.imageio.simpleitk_reader_writer import SimpleITKIO

    from feduq.nnunet import federated_plans as fpl

    if out.is_file():
        return json.loads(out.read_text())
    train = {c: json.loads((s / "split.json").read_text())["training"] for c, s in sites.items()}
    pooled = sum(len(v) for v in train.values())
    fps = {c: fpl.site_fingerprint([([s / "imagesTr" / f"{case}_0000.nii.gz"], s / "labelsTr" / f"{case}.nii.gz")
                                    for case in train[c]], SimpleITKIO, fpl.samples_per_case(pooled), c)
           for c, s in sites.items()}
    plans = fpl.plan_from_fingerprint(declaration(list(sites)), fpl.merge_fingerprints(fps),
                                      "SimpleITKIO")
    plans = fpl.slim_plan_3d(plans) if slim else plans
    out.write_text(json.dumps(plans, indent=1))
    return plans


def run_arm(arm: str, a, sites: dict[str, Path], plans: dict | None) -> dict:
    """One arm in the simulator (skipped when its DONE file exists); returns ``{"wall_s", "cases": {(site, case):
    {"dice", "hd95_mm"}}}``."""
    from feduq.recipes.job_folders import configure
    from feduq.recipes.simulation import simulate

    folder = a.out / arm
    done = folder / "DONE"
    if not done.is_file():
        task = declaration(list(sites))
        common = dict(task=task, sites=list(sites), seed=a.seed, executor_args={"num_threads": a.num_threads},
                      force=True)
        if arm == "3d":
            job = configure(REPO / "jobs" / "fedavg", folder / "job", num_rounds=a.rounds_3d, configuration="3d_fullres",
                            plans=plans, **{**common, "executor_args": {**common["executor_args"],
                                                                        "iterations": a.iterations}})
        else:
            job = configure(REPO / "jobs" / "fedavg", folder / "job", num_rounds=a.rounds_2d, image_size=a.image_size,
                            local_epochs=1, **common)
        t0 = time.time()
        outcome = simulate(job, folder / "ws", a.out / "data", force=True)
        if not outcome.ok:
            raise SystemExit(f"study_3d_vs_2d.py: arm {arm} failed: {outcome.summary()}")
        done.write_text(json.dumps({"wall_s": round(time.time() - t0, 1)}))
    cases = {}
    for site in sites:
        for path in (folder / "ws" / site).rglob("per_image_test.csv"):
            for r in csv.DictReader(open(path)):
                cases[(site, r["image"])] = {"dice": float(r["dice"]), "hd95_mm": float(r["hd95_mm"])}
    return {"wall_s": json.loads(done.read_text())["wall_s"], "cases": cases}


def compare(res: dict) -> dict:
    """Paired Wilcoxon (3d - 2d) over the cases both arms scored, per metric, with a bootstrap 95 % interval of the
    mean difference (cases resampled within their site)."""
    from feduq.results.paired import cluster_bootstrap_ci, wilcoxon_paired

    keys = sorted(set(res["3d"]["cases"]) & set(res["2d"]["cases"]))
    out = {"n_cases": len(keys)}
    for metric in ("dice", "hd95_mm"):
        a = [res["3d"]["cases"][k][metric] for k in keys]
        b = [res["2d"]["cases"][k][metric] for k in keys]
        test = wilcoxon_paired(a, b)
        low, high = cluster_bootstrap_ci([x - y for x, y in zip(a, b)], [k[0] for k in keys])
        out[metric] = {"mean_3d": sum(a) / len(a), "mean_2d": sum(b) / len(b), **test, "ci_low": low,
                       "ci_high": high}
    return out


def markdown(res: dict, stats: dict, a) -> str:
    d, h = stats["dice"], stats["hd95_mm"]
    return "\n".join([
        "# 3D full-resolution against slice-wise 2D (FedAvg, two prostate sites)", "",
        f"Sites {', '.join(a.centers)} restacked as NIfTI volumes (seeded 70/10/20 case split, seed 0); "
        f"{stats['n_cases']} test cases. 3d: nnU-Net's {'slim ' if a.slim else ''}3d_fullres plan of the federated "
        f"fingerprint, {a.rounds_3d} rounds x {a.iterations} iterations, {res['3d']['wall_s']:.0f} s. 2d: slices at "
        f"{a.image_size} px on the job's 2D network, {a.rounds_2d} rounds x 1 local epoch, {res['2d']['wall_s']:.0f} s. "
        f"Seed {a.seed} (the case split: seed 0), {a.num_threads or 'shared'} torch threads per site, this machine's "
        "CPU.", "",
        "| metric | 3d | 2d | mean diff (3d - 2d) | 95 % CI (bootstrap) | Wilcoxon p | wins/losses |",
        "|---|---|---|---|---|---|---|",
        f"| Dice (%) | {100 * d['mean_3d']:.2f} | {100 * d['mean_2d']:.2f} | {100 * d['mean_diff']:+.2f} | "
        f"[{100 * d['ci_low']:+.2f}, {100 * d['ci_high']:+.2f}] | {d['p_value']:.3g} | {d['wins']}/{d['losses']} |",
        f"| HD95 (mm) | {h['mean_3d']:.2f} | {h['mean_2d']:.2f} | {h['mean_diff']:+.2f} | "
        f"[{h['ci_low']:+.2f}, {h['ci_high']:+.2f}] | {h['p_value']:.3g} | {h['wins']}/{h['losses']} |", "",
        f"Command: `python tools/study_3d_vs_2d.py --data-root {a.data_root} --out {a.out} --rounds-3d {a.rounds_3d} "
        f"--iterations {a.iterations} --rounds-2d {a.rounds_2d} --image-size {a.image_size}"
        + (f" --max-cases {a.max_cases}" if a.max_cases else "") + (f" --seed {a.seed}" if a.seed else "")
        + "`", ""])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data-root", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True, help="the study's folder (sites, plan, runs, study.md)")
    p.add_argument("--centers", nargs="+", default=["RUNMC", "BMC"])
    p.add_argument("--max-cases", type=int, help="first N >= 1 cases per center (smoke runs; omit it for all)")
    p.add_argument("--rounds-3d", type=int, default=20)
    p.add_argument("--iterations", type=int, default=50, help="3d: training iterations per round")
    p.add_argument("--rounds-2d", type=int, default=10)
    p.add_argument("--image-size", type=int, default=128, help="2d: slice size in pixels")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads per site (0: each site's share)")
    p.add_argument("--seed", type=int, default=0, help="the runs' seed (model initialisation, data order); the case "
                                                       "split stays seed 0")
    p.add_argument("--full-plan", dest="slim", action="store_false", help="nnU-Net's own network, not the slim one")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (they are kept)")
    a = p.parse_args(argv)
    from feduq.outputs import OutputFolderError, check_output_folder, user_files, write_marker

    tool = "study_3d_vs_2d.py"
    if a.max_cases is not None and a.max_cases < 1:  # 0 read as "all" before: a smoke run became the whole study
        print(f"{tool}: --max-cases {a.max_cases}: expected a number of cases >= 1 (omit it for every case)",
              file=sys.stderr)
        return 2
    try:  # never the data root, inside it or around it; a study of its own (interrupted or done) is resumed
        a.out = check_output_folder(a.out, {"data root": a.data_root}, tool, force=a.force, recognise=_is_study)
    except OutputFolderError as e:
        print(e, file=sys.stderr)
        return 2
    keep = user_files(a.out, _is_study) if a.force else []
    # a resumed study reuses its sites, plan and finished arms: only when they were made with these settings
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items() if k not in ("out", "force")}
    settings["data_root"] = str(Path(a.data_root).resolve())
    recorded = a.out / "settings.json"
    if recorded.is_file():
        before = read_settings(recorded)
        if before is None:
            print(f"{tool}: {recorded}: settings.json is not a FedUQ study record; move it or choose another --out",
                  file=sys.stderr)
            return 2
        changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
        if changed:
            diff = ", ".join(f"{k}: {before.get(k)!r} -> {settings.get(k)!r}" for k in changed)
            print(f"{tool}: {a.out} holds a study made with other settings ({diff}); choose another --out",
                  file=sys.stderr)
            return 2
    a.out.mkdir(parents=True, exist_ok=True)
    recorded.write_text(json.dumps({RECORD_FIELD: tool, **settings}, indent=1))
    sites = build_sites(a.data_root.resolve(), a.out / "data", a.centers, a.max_cases)
    plans = federated_plan(sites, a.slim, a.out / "plans.json")
    res = {arm: run_arm(arm, a, sites, plans) for arm in ("3d", "2d")}
    stats = compare(res)
    text = markdown(res, stats, a)
    (a.out / "study.md").write_text(text)
    (a.out / "study.json").write_text(json.dumps({"stats": stats, "wall_s": {k: v["wall_s"] for k, v in res.items()},
                                                  "per_case": {arm: {f"{s}/{c}": v for (s, c), v in r["cases"].items()}
                                                               for arm, r in res.items()}}, indent=1))
    write_marker(a.out, tool, exclude=keep)
    print(text)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("study_3d_vs_2d.py", main))
