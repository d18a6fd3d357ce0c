"""FedA3I against FedAvg-CE over the same 150 clean ISIC-2017 test images, from the sweep's archive (run.sh).

Reads ``runs/<method>_<noise>_s<seed>/eval/per_image.csv`` (``feduq evaluate`` of each run's last-round model) and
``run.json``, and writes beside this file ``results.md`` (mean test Dice per method, noise and seed; the paired tests)
and ``paired_tests.csv``. The test images are independent (one dermoscopy image per lesion), so each image is one unit:
the Wilcoxon signed-rank test per seed and, where both seeds ran, over each image's seed-mean difference, with a 95 %
bootstrap interval of the mean difference (:func:`feduq.results.paired.clustered_tests`, every image its own cluster).

    python benchmarks/feda3i-isic50/pair.py
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BASELINE, METHOD = "fedavg_ce", "feda3i"
# FedA3I's SKIN columns, Dice %: (FedAvg-CE, the ablation's FedAvg row of Table 3; FedA3I (CE) of Table 2)
PAPER = {"ns": (63.85, 72.69), "ne": (75.69, 78.81)}


def read_runs(runs: Path) -> list[dict]:
    """Per-image rows ``{"method", "noise", "seed", "site", "image", "dice"}`` of every archived run."""
    rows = []
    for run in sorted(runs.glob("*/run.json")):
        meta = json.loads(run.read_text())
        method = meta["run"].rsplit("_", 2)[0]
        noise = meta["noise"].removeprefix("skin_")
        with open(run.parent / "eval" / "per_image.csv") as f:
            rows += [{"method": method, "noise": noise, "seed": int(meta["seed"]), "site": r["site"],
                      "image": r["image"], "dice": float(r["dice"])} for r in csv.DictReader(f)]
    return rows


def main() -> int:
    from feduq.scores.tables import write_rows
    from feduq.results.paired import clustered_markdown, clustered_tests, markdown_rows, with_q_values

    rows = read_runs(HERE / "runs")
    if not rows:
        print("pair.py: no archived run under runs/ (run run.sh first)", file=sys.stderr)
        return 1
    md = ["# FedA3I vs FedAvg-CE on 50 noisy ISIC-2017 sites: FedUQ's archived runs", "",
          "Mean test Dice (%) of the last-round model on the 150 clean ISIC-2017 test images:", ""]
    dice = {}  # (method, noise, seed) -> the run's per-image test Dice
    for r in rows:
        dice.setdefault((r["method"], r["noise"], r["seed"]), []).append(r["dice"])
    means = [[method, f"N_{noise[1].upper()}", str(seed), str(len(d)), f"{100 * statistics.fmean(d):.2f}"]
             for (method, noise, seed), d in sorted(dice.items())]
    md += [markdown_rows(["method", "noise", "seed", "images", "Dice (%)"], means), ""]
    per_seed = {}  # (method, noise) -> each seed's unrounded mean Dice
    for (method, noise, _), d in sorted(dice.items()):
        per_seed.setdefault((method, noise), []).append(statistics.fmean(d))
    over = [[method, f"N_{noise[1].upper()}", str(len(m)),
             f"{100 * statistics.fmean(m):.2f} ± {100 * statistics.stdev(m):.2f}"]
            for (method, noise), m in per_seed.items() if len(m) > 1]
    if over:
        md += ["Over the seeds (mean ± sample standard deviation of the per-seed means):", "",
               markdown_rows(["method", "noise", "seeds", "Dice (%)"], over), ""]
    tests = []
    for noise in sorted({r["noise"] for r in rows}):
        mine = [r for r in rows if r["noise"] == noise]
        seeds = sorted({r["seed"] for r in mine if r["method"] == METHOD} & {r["seed"] for r in mine if r["method"] == BASELINE})
        for chosen in [[s] for s in seeds] + ([seeds] if len(seeds) > 1 else []):
            part = [r for r in mine if r["seed"] in chosen]
            tests += [dict(t, noise=noise) for t in clustered_tests(part, BASELINE) if t["scope"] == "all"]
    tests = with_q_values([{k: v for k, v in t.items() if k != "q_value"} for t in tests])
    for noise in sorted({t["noise"] for t in tests}):
        base, paper = PAPER[noise]
        md += [f"N_{noise[1].upper()} (paper: FedA3I (CE) {paper} vs FedAvg-CE {base}, Δ {paper - base:+.2f}); paired "
               "over the test images (each image one unit; seeds combined: each image's seed-mean difference):", "",
               clustered_markdown([t for t in tests if t["noise"] == noise]), ""]
    write_rows(HERE / "paired_tests.csv", tests)
    (HERE / "results.md").write_text("\n".join(md))
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
