"""Leave-one-site-out for ``feduq compare --holdout SITE|all`` (FedDG's protocol).

For each held-out site h: the same sweep (methods, seeds, size, rounds) runs on the other sites into
``<out>/holdout-<h>/`` (its own ``results.md``: the in-federation table), then every run's global model is scored
on **every** image of h's folder with ``feduq evaluate`` (h is in no split the federation read). The table in
``<out>/holdout.md`` / ``holdout.csv``: per method, the held-out site's Dice/HD95 (and ECE, AUROC of errors, AURC of
the method's own uncertainty) next to the in-federation Avg Dice of the same run.
"""

from __future__ import annotations

import csv
import statistics
from collections import defaultdict
from pathlib import Path

import numpy as np

_VALUE_OPTIONS = ("--holdout", "--out", "--sites", "--review-target")


def _strip(argv: list[str]) -> list[str]:
    """``argv`` without ``--holdout``/``--out``/``--sites``/``--review-target`` (either ``--x v`` or ``--x=v``) and ``--report``."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg in _VALUE_OPTIONS:
            skip = True
            continue
        if arg.split("=", 1)[0] in _VALUE_OPTIONS or arg == "--report":
            continue
        out.append(arg)
    return out


def _in_federation_dice(folder: Path) -> dict[tuple[str, int], float]:
    """(method, seed) -> mean test Dice over the federation's sites, from ``results_tidy.csv``."""
    per = defaultdict(list)
    with open(folder / "results_tidy.csv") as f:
        for r in csv.DictReader(f):
            if r["metric"] == "dice":
                per[(r["method"], int(r["seed"]))].append(float(r["value"]))
    return {k: statistics.mean(v) for k, v in per.items()}


def holdout_markdown(rows: list[dict]) -> str:
    """Rows = methods; per held-out site ``Dice % (HD95 px)`` and, where the task scores several structures (the rows'
    ``dice_<s>``/``hd95_px_<s>``, :func:`feduq.scores.tables.structure_means`), each structure's beside it; then the
    mean over held-out sites of Dice (and of each structure's), and of the in-federation Avg Dice; then ECE, AUROC,
    AURC of the held-out sites (means over seeds and sites; a structure's over the rows that have it, "–" for none).
    """
    from ..scores.tables import structure_names

    sites = list(dict.fromkeys(r["held_out"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    names = structure_names(k for r in rows for k in r)
    head = ["Method", *[f"{s}{f' {n}' if n else ''} Dice (HD95)" for s in sites for n in ["", *names]],
            "held-out Avg Dice", *[f"held-out Avg Dice {n}" for n in names], "in-federation Avg Dice",
            "held-out ECE", "held-out AUROC errors", "held-out AURC"]
    lines = ["| " + " | ".join(head) + " |", "|---" * len(head) + "|"]

    def mean(rs, k):
        values = [float(r[k]) for r in rs if k in r and np.isfinite(float(r[k]))]
        return statistics.mean(values) if values else float("nan")

    def cell(rs, dice, hd95):
        d = mean(rs, dice)
        return "–" if not np.isfinite(d) else f"{100 * d:.2f} ({mean(rs, hd95):.1f})"

    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        cells = []
        for s in sites:
            rs = [r for r in mine if r["held_out"] == s]
            hd95 = "hd95_mm" if rs and "hd95_mm" in rs[0] else "hd95_px"  # volumes: per case, in mm
            cells += [cell(rs, "dice", hd95), *[cell(rs, f"dice_{n}", f"hd95_px_{n}") for n in names]]
        cells += [f"{100 * mean(mine, 'dice'):.2f}",
                  *[f"{100 * v:.2f}" if np.isfinite(v := mean(mine, f"dice_{n}")) else "–" for n in names],
                  f"{100 * mean(mine, 'in_federation_dice'):.2f}",
                  f"{mean(mine, 'ece15'):.4f}", f"{mean(mine, 'auroc'):.3f}", f"{mean(mine, 'aurc'):.4f}"]
        lines.append(f"| {m} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def holdout_row(held_out: str, method: str, seed: int, summary: dict, scored: dict, in_federation: float) -> dict:
    """One ``holdout.csv`` row from the held-out site's ``feduq evaluate`` summary (``per_site.csv``'s row) and
    its result (``scored[site]["per_image"]``): Dice (fraction), HD95 in stored pixels (volumes: per case, in mm),
    where the task scores several structures each one's ``dice_<s>`` and ``hd95_px_<s>`` beside them
    (:func:`feduq.scores.tables.structure_means`), the primary uncertainty's ECE (15 bins), AUROC of errors and AURC,
    and the run's in-federation Avg Dice."""
    from ..scores.tables import structure_means, structure_names

    volumes = "n_cases" in summary  # a declared task's volumes: Dice per case, HD95 in mm
    r = summary if volumes else structure_means(summary, scored[summary["site"]]["per_image"])
    keep = {"dice", "hd95_mm" if volumes else "hd95_px",
            *[f"{p}{n}" for n in structure_names(r) for p in ("dice_", "hd95_px_")]}
    return {"held_out": held_out, "method": method, "seed": seed, "n_images": r["n_images"],
            **{k: v for k, v in r.items() if k in keep}, "ece15": r["ece15"], "auroc": r["auroc"], "aurc": r["aurc"],
            "uncertainty": r["uncertainty"], "in_federation_dice": in_federation}


def run_holdout(a, argv: list[str], compare_main, error) -> int:
    """Run the rotation(s) of ``a.holdout`` (``compare_main`` is feduq compare's ``main``); write ``holdout.md``."""
    from ..data import DataError, get_task
    from ..site.evaluation import EvaluationError, evaluate_job
    from ..scores.tables import write_rows
    from .sweeps import finished_runs
    from ..tasks.spec import task_folder

    sites = list(a.sites or get_task(a.task).centers)
    held = sites if a.holdout == "all" else [a.holdout]
    for h in held:
        if h not in sites:
            error(f"--holdout {h!r}: not one of the sweep's sites {sites}")
    if len(sites) < 3:
        error(f"--holdout needs >= 3 sites (2 to train), got {sites}")
    base, rows, review_rows, volumes = _strip(argv), [], [], False
    for h in held:
        folder = a.out / f"holdout-{h}"
        others = ",".join(s for s in sites if s != h)
        print(f"[holdout] {h}: training on {others}", flush=True)
        rc = compare_main(base + ["--sites", others, "--out", str(folder)])
        if rc:
            return rc
        in_fed = _in_federation_dice(folder)
        for method, seed, ws in finished_runs(folder):
            try:
                per_site, scored = evaluate_job(ws, out=folder / "holdout_eval" / ws.name,
                                       site_dirs=[Path(a.data_root) / task_folder(a.task) / h], split="all", maps=2)
            except (EvaluationError, DataError) as e:
                print(f"[FAIL] held-out {h}, {ws.name}: {e}")
                return 1
            row = holdout_row(h, method, seed, per_site[0], scored, in_fed.get((method, seed), float("nan")))
            volumes = "hd95_mm" in row
            rows.append(row)
            if a.review_target is not None:
                review_rows += _review(a, h, [s for s in sites if s != h], method, seed, ws, folder)
    write_rows(a.out / "holdout.csv", rows)
    md = [f"# FedUQ leave-one-site-out: task {a.task}, {a.image_size} px, {a.rounds} rounds x {a.local_epochs} local "
          f"epochs, seeds {a.seeds}", "",
          "Global model (best by the federation's validation Dice) on every image of the held-out site's folder; "
          + ("Dice % per case, HD95 in mm per case (volumes)" if volumes else "Dice %, HD95 in stored pixels")
          + "; uncertainty figures of each method's own uncertainty.", "", holdout_markdown(rows), ""]
    if review_rows:
        from .review_holdout import review_markdown

        write_rows(a.out / "holdout_review.csv", review_rows)
        md += [f"## The review flag at the held-out site (target mean Dice {100 * a.review_target:.0f} %)", "",
               "The rule (feduq predict --calibrate) chosen on the training sites' validation images, then "
               "applied to every image of the held-out site, judged with its masks; 95 % intervals: cluster "
               "bootstrap over the site's independent units. Goal: accepted Dice >= flagged and >= all cases', "
               "AURC below random ordering's, no empty or implausibly small prediction accepted.", "",
               review_markdown(review_rows), ""]
    (a.out / "holdout.md").write_text("\n".join(md))
    from ..outputs import write_marker

    write_marker(a.out, "feduq compare", exclude=getattr(a, "keep", ()))
    print("\n".join(md))
    return 0


def _review(a, held: str, calibration_sites: list[str], method: str, seed: int, ws: Path, folder: Path) -> list[dict]:
    """The review flag of one run judged at its held-out site (:func:`feduq.results.review_holdout.held_out_review`):
    its summary row (none where no threshold reaches the target on the calibration sites: said), the per-case CSV and the
    risk-coverage picture in ``folder/holdout_review/``."""
    from ..scores.tables import write_rows
    from ..scores.uncertainty_quality import plot_risk_coverage
    from ..tasks.spec import task_folder
    from ..review.rule import ReviewError
    from ..site.evaluation import load_model, locate
    from .paired import site_clusters
    from .review_holdout import held_out_review

    config, model_file = locate(ws, None, "best")
    loaded = load_model(config, model_file, device="cpu")
    clusters, _ = site_clusters(a.data_root, a.task, [held])
    try:
        summary, cases, curves = held_out_review(
            loaded, calibration_sites=calibration_sites, data_root=a.data_root,
            held_out_dir=Path(a.data_root) / task_folder(a.task) / held, target_dice=a.review_target,
            units={stem: group for (_, stem), group in clusters.items()})
    except ReviewError as e:
        print(f"[note] review flag, held-out {held}, {ws.name}: {e}")
        return []
    out = folder / "holdout_review"
    out.mkdir(parents=True, exist_ok=True)
    write_rows(out / f"{ws.name}_cases.csv", cases)
    plot_risk_coverage(curves, out / f"{ws.name}_risk_coverage.png",
                       title=f"{method} s{seed}, held-out {held}: {summary['score']} rule")
    print(f"[review] held-out {held}, {ws.name}: coverage {100 * summary['coverage']:.1f} %, accepted Dice "
          f"{100 * summary['accepted_dice']:.1f} %, flagged {100 * summary['flagged_dice']:.1f} %, all "
          f"{100 * summary['all_dice']:.1f} %; goal {'met' if summary['goal_met'] else 'not met'}", flush=True)
    return [{"held_out": held, "method": method, "seed": seed, **{k: v for k, v in summary.items() if k != "rule"}}]
