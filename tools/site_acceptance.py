#!/usr/bin/env python3
"""Does the certified review threshold keep its promise at a held-out site? (issue 64, feduq.results.site_acceptance)

For each per-case CSV of ``--holdout-dir`` (``<site folder>/<method>_s<seed>_cases.csv``, as ``tools/compare.py
--holdout ... --review-target`` writes them), each k and each target: ``--draws`` random draws of k labelled cases,
the certified rule (``predict --calibrate``'s threshold, delta ``--delta``) and today's uncertified rule chosen on them
and applied to the site's other cases. Writes ``acceptance.csv`` (one row per site, method, target and k),
``acceptance.md`` (the table) and ``acceptance.png`` (per k: how often the accepted cases reached the target, over
the draws that certified / chose a rule, against 1 - delta).

    python tools/site_acceptance.py --holdout-dir benchmarks/review-holdout --k 10 20 40 --targets 0.5 0.7 \\
        --draws 200 --out benchmarks/site-acceptance
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path

TOOL = "site_acceptance.py"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--holdout-dir", required=True, help="folder of <site>/<method>_s<seed>_cases.csv files")
    p.add_argument("--k", type=int, nargs="+", default=[10, 20, 40], help="labelled cases per draw")
    p.add_argument("--targets", type=float, nargs="+", default=[0.5, 0.7], help="target mean Dice (fractions)")
    p.add_argument("--delta", type=float, default=0.1, help="the certificate's error level")
    p.add_argument("--draws", type=int, default=200, help="draws per site, method, target and k")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--force", action="store_true", help="replace only what this tool wrote there before")
    args = p.parse_args(argv)
    from feduq.outputs import OutputFolderError, claim_output_folder, write_marker

    try:
        files = sorted(Path(args.holdout_dir).glob("*/*_s*_cases.csv"))
        if not files:
            raise ValueError(f"--holdout-dir {args.holdout_dir}: no <site>/<method>_s<seed>_cases.csv file")
        if not all(0 < t < 1 for t in args.targets) or not 0 < args.delta < 1:
            raise ValueError(f"--targets {args.targets} and --delta {args.delta}: each must lie in (0, 1)")
        if any(k < 1 for k in args.k) or args.draws < 1:
            raise ValueError(f"--k {args.k} and --draws {args.draws}: expected integers >= 1")
        out, keep = claim_output_folder(args.out, {"holdout folder": args.holdout_dir}, TOOL, force=args.force)
    except (ValueError, OutputFolderError) as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    from feduq.results.site_acceptance import acceptance_draws, acceptance_markdown, acceptance_row, read_cases

    rows = []
    for path in files:
        site = path.parent.name
        method = re.sub(r"_s\d+_cases$", "", path.stem)
        scores, dice = read_cases(path)
        for target in args.targets:
            for k in args.k:
                if k >= dice.size:
                    print(f"{site} {method}: k = {k} is not below its {dice.size} cases; skipped")
                    continue
                draws = acceptance_draws(scores, dice, k, target=target, delta=args.delta, draws=args.draws,
                                         seed=args.seed)
                row = {"site": site, "method": method, "n": int(dice.size), "target": target, "k": k,
                       **acceptance_row(draws, args.delta)}
                rows.append(row)
                print(f"{site} {method} target {target:g} k {k}: certified {100 * row['certified']:.0f} %, holds "
                      f"{100 * row['holds']:.1f} % of them, coverage {100 * row['coverage']:.1f} %", flush=True)
    with open(out / "acceptance.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (out / "acceptance.md").write_text(acceptance_markdown(rows))
    picture(rows, args.delta, out / "acceptance.png")
    write_marker(out, TOOL, exclude=keep)
    print(f"wrote {out / 'acceptance.csv'}, acceptance.md and acceptance.png")
    return 0


def picture(rows: list[dict], delta: float, path: Path) -> None:
    """Per k, pooled over sites, methods and targets: left, the fraction of draws whose accepted other cases reached
    the target (over the draws that certified / chose a rule) against 1 - delta; right, the mean coverage of the other
    cases over every draw (a draw without a certificate accepts none)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ks = sorted({r["k"] for r in rows})

    def pooled(key, weight):
        out = []
        for k in ks:
            sel = [r for r in rows if r["k"] == k and not np.isnan(r[key])]
            w = np.array([r[weight] * r["draws"] for r in sel])
            out.append(float(np.sum(w * [r[key] for r in sel]) / w.sum()) if w.sum() else np.nan)
        return out

    x = np.arange(len(ks))
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(9, 3.5))
    ax.bar(x - 0.2, pooled("holds", "certified"), 0.4, label="certified rule")
    ax.bar(x + 0.2, pooled("uncert_holds", "uncert_chosen"), 0.4, label="uncertified rule (today)")
    ax.axhline(1 - delta, color="k", ls="--", lw=1, label=f"1 - δ = {1 - delta:g}")
    ax.set_xticks(x, [f"k = {k}" for k in ks])
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("draws whose accepted cases\nreach the target")
    ax.legend(loc="lower right", fontsize=8)
    cov = {k: [np.mean([r[key] for r in rows if r["k"] == k]) for key in ("coverage", "uncert_coverage")] for k in ks}
    bx.bar(x - 0.2, [cov[k][0] for k in ks], 0.4, label="certified rule")
    bx.bar(x + 0.2, [cov[k][1] for k in ks], 0.4, label="uncertified rule (today)")
    bx.set_xticks(x, [f"k = {k}" for k in ks])
    bx.set_ylim(0, 1.05)
    bx.set_ylabel("mean fraction of the other\ncases accepted (every draw)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
