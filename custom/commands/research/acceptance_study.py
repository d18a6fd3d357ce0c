"""Does the certified review threshold keep its promise where it is sharp? (feduq.results.site_acceptance)

``predict --calibrate`` (:func:`feduq.review.certificate.certify_units`) promises: with probability >= 1 - δ over the
labelled units (patients, videos) drawn, the image-weighted mean Dice of the images its threshold accepts at the site
is >= the target. Checked three ways, for the unit procedure and for the image-level negative control (every image
its own unit, M = 1) on the same labelled sets:

(a) real held-out sites (``--holdout-dir``: ``<site>/<method>_s<seed>_cases.csv`` with a ``unit`` column; sites with
    at least ``--min-units`` units): ``--draws`` draws of n units (``--n``) with replacement from the site's units,
    targets at the site's boundary (its accepted Dice at each ``--coverages`` under its best-AURC score), judged
    against the site's exact accepted Dice at the certified threshold; the unit procedure also with ``u_mean`` alone;
(b) a simulation with a known truth (ρ in ``--rho``, n in ``--sim-n``, ``--sim-draws`` sets per cell; the truth by
    quadrature, checked against a population of ``--sim-population`` units per ρ);
(c) power: the highest target each of ``--power-draws`` draws certifies against the WSR lower bound of a threshold
    fixed in advance (the site's threshold at each coverage).

Writes acceptance.csv / .md (a), simulation.csv / .md (b), power.csv / .md (c), acceptance.png (violation rates with
Clopper–Pearson 95 % bars against δ) and prints the requirements a valid certificate meets, with PASS / FAIL
(:func:`feduq.results.site_acceptance.checks`; the first needs 100 in ``--sim-n`` and 0.8 in ``--coverages``); the
exit status is 1 when one fails (not with ``--quick``, whose tiny sizes only smoke-test the tool). ``--jobs``
processes share the cells; each cell has its own seed, so the figures do not depend on ``--jobs``.

    feduq acceptance-study --holdout-dir benchmarks/review-holdout --out benchmarks/site-acceptance
"""

from __future__ import annotations

import argparse
import csv
import sys
import time
from pathlib import Path
from feduq.cli import verb_parser

TOOL = "feduq acceptance-study"
DEFAULTS = {"n": [10, 20, 40, 80], "draws": 200, "sim_n": [10, 25, 50, 100, 200], "rho": [0.07, 0.2, 0.4],
            "sim_draws": 300, "sim_population": 100_000, "power_draws": 100}
QUICK = {"n": [10, 20], "draws": 10, "sim_n": [10, 100], "rho": [0.4], "sim_draws": 6, "sim_population": 2000,
         "power_draws": 2}
MARGINS = (0.0, 0.05)  # the simulation's targets: the truth at each coverage, and 0.05 below it


def main(argv=None) -> int:
    p = verb_parser("feduq acceptance-study", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--holdout-dir", required=True, help="folder of <site>/<method>_s<seed>_cases.csv files")
    p.add_argument("--n", "--k", type=int, nargs="+", dest="n", help="units per draw at the real sites (10 20 40 80)")
    p.add_argument("--coverages", type=float, nargs="+", default=[0.5, 0.8], help="where the targets sit")
    p.add_argument("--delta", type=float, default=0.1, help="the certificate's error level")
    p.add_argument("--draws", type=int, help="draws per real-site cell (200)")
    p.add_argument("--sim-n", type=int, nargs="+", help="simulated units per set (10 25 50 100 200)")
    p.add_argument("--rho", type=float, nargs="+", help="intra-unit correlations (0.07 0.2 0.4)")
    p.add_argument("--sim-draws", type=int, help="simulated sets per cell (300)")
    p.add_argument("--sim-population", type=int, help="units of the population checking the truth (100000)")
    p.add_argument("--power-draws", type=int, help="draws per site and n for the power table (100)")
    p.add_argument("--min-units", type=int, default=5, help="sites with fewer units are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=2, help="worker processes")
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test, requirements not enforced")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--force", action="store_true", help="replace only what this tool wrote there before")
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    from feduq.outputs import OutputFolderError, claim_output_folder, write_marker

    try:
        files = sorted(Path(args.holdout_dir).glob("*/*_s*_cases.csv"))
        if not files:
            raise ValueError(f"--holdout-dir {args.holdout_dir}: no <site>/<method>_s<seed>_cases.csv file")
        if not all(0 < c <= 1 for c in args.coverages) or not 0 < args.delta < 1:
            raise ValueError(f"--coverages {args.coverages} and --delta {args.delta}: each must lie in (0, 1]")
        if not all(0 <= r < 1 for r in args.rho):
            raise ValueError(f"--rho {args.rho}: each must lie in [0, 1)")
        if min(*args.n, *args.sim_n) < 2 or min(args.draws, args.sim_draws, args.power_draws, args.jobs) < 1:
            raise ValueError("--n and --sim-n must be >= 2, the draws and --jobs >= 1")
        from feduq.results import site_acceptance as sa

        loaded = [(path, sa.load_site(path)) for path in files]  # a malformed CSV is refused before the output
        out, keep = claim_output_folder(args.out, {"holdout folder": args.holdout_dir}, TOOL, force=args.force)
    except (ValueError, OutputFolderError) as e:
        print(f"{TOOL}: error: {e}", file=sys.stderr)
        return 2
    sites = []
    for path, s in loaded:
        if s["units"] < args.min_units:
            print(f"{s['site']} {s['method']}: {s['units']} units, fewer than --min-units {args.min_units}; skipped")
            continue
        sites.append(path)
        print(f"{s['site']} {s['method']}: {s['images']} images in {s['units']} units, M = {s['pop'].bound}, "
              f"targets on {s['score']} (best AURC)")
    cov = tuple(args.coverages)
    tasks = [(sa.sim_rows, (rho, n, cov, MARGINS, args.delta, args.sim_draws, args.seed), "sim")
             for n in sorted(args.sim_n, reverse=True) for rho in args.rho]
    tasks += [(sa.site_rows, (str(f), n, cov, args.delta, args.draws, args.seed), "site")
              for n in sorted(args.n, reverse=True) for f in sites]
    tasks += [(sa.power_row, (str(f), n, cov, args.delta, args.power_draws, args.seed), "power")
              for n in sorted(args.n, reverse=True) for f in sites]
    results = run(tasks, args.jobs)
    sim = sorted((r for res, (*_, kind) in zip(results, tasks) if kind == "sim" for r in res),
                 key=lambda r: (r["rho"], r["n"], r["coverage"], r["margin"], r["procedure"]))
    real = sorted((r for res, (*_, kind) in zip(results, tasks) if kind == "site" for r in res),
                  key=lambda r: (r["site"], r["method"], r["coverage"], r["n"], r["procedure"]))
    power = sorted((res for res, (*_, kind) in zip(results, tasks) if kind == "power"),
                   key=lambda r: (r["site"], r["method"], r["n"]))
    truth_error = truth_check(sa, args.rho, args.sim_population, args.seed)
    found = sa.checks(sim, real, args.delta)
    command = "feduq acceptance-study " + " ".join(argv if argv is not None else sys.argv[1:])
    for name, rows in (("acceptance", real), ("simulation", sim), ("power", power)):
        write_csv(out / f"{name}.csv", rows)
    (out / "acceptance.md").write_text(acceptance_md(real, found, args.delta, command))
    (out / "simulation.md").write_text(simulation_md(sim, truth_error, args.delta, command))
    (out / "power.md").write_text(power_md(power, real, args.delta, command))
    picture(sim, real, args.delta, out / "acceptance.png")
    write_marker(out, TOOL, exclude=keep)
    failed = [text for text, ok in found if not ok]
    for text, ok in found:
        print(f"{'PASS' if ok else 'FAIL'}: {text}")
    print(f"wrote {out}: acceptance, simulation and power (.csv, .md), acceptance.png")
    if failed and not args.quick:
        print(f"{TOOL}: {len(failed)} requirement(s) not shown (above)", file=sys.stderr)
        return 1
    return 0


def run(tasks: list, jobs: int) -> list:
    """Each task's ``function(*args)`` in ``jobs`` processes (in this one when 1), results in the tasks' order."""
    start = time.monotonic()

    def done(i, label):
        print(f"[{time.monotonic() - start:6.0f} s] {i}/{len(tasks)} done: {label}", flush=True)

    def label(fn, a):
        return f"{fn.__name__}({', '.join(Path(x).parent.name if isinstance(x, str) else str(x) for x in a[:2])})"

    if jobs == 1:
        out = []
        for fn, a, _ in tasks:
            out.append(fn(*a))
            done(len(out), label(fn, a))
        return out
    from concurrent.futures import ProcessPoolExecutor, as_completed

    with ProcessPoolExecutor(jobs) as ex:
        futures = {ex.submit(fn, *a): (i, label(fn, a)) for i, (fn, a, _) in enumerate(tasks)}
        out = [None] * len(tasks)
        for k, f in enumerate(as_completed(futures), 1):
            i, name = futures[f]
            out[i] = f.result()
            done(k, name)
    return out


def truth_check(sa, rhos, units: int, seed: int) -> float:
    """The largest difference, over the grid thresholds accepting at least 1 %, between the simulation's exact truth
    (quadrature) and the accepted Dice of a population of ``units`` simulated units, over the ρ."""
    import numpy as np

    truth, cov = sa.sim_truth(sa.GRID, **sa.SIM)
    worst = 0.0
    for rho in rhos:
        score, dice, _ = sa.simulate(np.random.default_rng([seed, 7]), units, rho, sizes=sa.SIM_SIZES, **sa.SIM)
        acc, _ = sa.population_curve(score, dice)
        worst = max(worst, float(np.nanmax(np.abs(acc - truth)[cov >= 0.01])))
    return worst


def write_csv(path: Path, rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["empty"])
        w.writeheader()
        w.writerows(rows)


RATES = ("draws", "certified", "violations", "violation", "viol_lo", "viol_hi", "accepted", "M")


def pivot(rows: list[dict]) -> list[dict]:
    """One row per configuration with each procedure's rates prefixed ``<procedure>_`` (tidy rows in, wide out)."""
    out = {}
    for r in rows:
        key = tuple(v for k, v in r.items() if k not in RATES and k != "procedure")
        wide = out.setdefault(key, {k: v for k, v in r.items() if k not in RATES and k != "procedure"})
        wide |= {f"{r['procedure']}_{k}": r[k] for k in RATES}
    return list(out.values())


def pooled(rows: list[dict], procedure: str) -> str:
    mine = [r for r in rows if r["procedure"] == procedure]
    n, cert, bad = (sum(r["draws"] for r in mine), round(sum(r["certified"] * r["draws"] for r in mine)),
                    sum(r["violations"] for r in mine))
    return f"{n:,} draws, {cert:,} certified ({100 * cert / max(n, 1):.1f} %), {bad:,} violations"


def acceptance_md(rows: list[dict], found: list, delta: float, command: str) -> str:
    from feduq.results.site_acceptance import markdown

    cols = [("site", "held-out site", ""), ("method", "method", ""), ("images", "images", ""), ("units", "units", ""),
            ("unit_M", "M", ""), ("score", "target's score", ""), ("coverage", "coverage", "g"),
            ("target", "target", ".3f"), ("n", "n units", ""), ("unit_certified", "unit: certified %", "%"),
            ("unit_", "unit: violations % [CP 95 %]", "ci"), ("unit_accepted", "unit: accepted %", "%"),
            ("image_certified", "image control: certified %", "%"), ("image_", "image control: violations %", "ci"),
            ("unit_fixed_certified", "u_mean only: certified %", "%"),
            ("unit_fixed_", "u_mean only: violations %", "ci")]
    checks = "\n".join(f"- **{'PASS' if ok else 'FAIL'}**: {text}" for text, ok in found)
    return (f"# (a) Real held-out sites: certified thresholds judged on the site's exact accepted Dice\n\n"
            f"Made by `{command}`. δ = {delta:g}. Each row: draws of n units with replacement from the site's units, "
            "the target the site's accepted Dice at the coverage under the target's score (its best AURC); a "
            "violation is a draw that certified a threshold whose accepted Dice at the site is below the target, "
            "over all draws. \"accepted\": the mean share of the site's images accepted (0 when not certified).\n\n"
            f"## Requirements (every part)\n\n{checks}\n\n## Pooled over the rows\n\n"
            f"- unit procedure: {pooled(rows, 'unit')}\n- image-level control: {pooled(rows, 'image')}\n"
            f"- unit procedure, u_mean alone: {pooled(rows, 'unit_fixed')}\n\n## Cells\n\n"
            + markdown(pivot(rows), cols))


def simulation_md(rows: list[dict], truth_error: float, delta: float, command: str) -> str:
    from feduq.results.site_acceptance import SIM, SIM_BOUND, SIM_SIZES, markdown

    cols = [("rho", "ρ", "g"), ("n", "n units", ""), ("coverage", "coverage", "g"), ("margin", "margin", "g"),
            ("target", "target", ".3f"), ("unit_draws", "sets", ""), ("unit_certified", "unit: certified %", "%"),
            ("unit_", "unit: violations % [CP 95 %]", "ci"), ("image_certified", "image control: certified %", "%"),
            ("image_", "image control: violations % [CP 95 %]", "ci")]
    return ("# (b) Simulation with a known truth\n\n"
            f"Made by `{command}`. δ = {delta:g}. Units of {SIM_SIZES[0]}-{SIM_SIZES[1]} images (uniform); latent "
            "q = sqrt(ρ) b_unit + sqrt(1 - ρ) e_image, Dice = clip(mu + sd q, 0, 1), score = scale exp(-c q + noise "
            f"N(0, 1)) with {', '.join(f'{k} {v:g}' for k, v in SIM.items())}; unit procedure M = {SIM_BOUND}. "
            "Target: the true accepted Dice at the threshold covering the coverage, less the margin. The truth "
            "(quadrature) differs from a simulated population's accepted Dice by at most "
            f"{truth_error:.4f} (thresholds accepting >= 1 %).\n\n" + markdown(pivot(rows), cols))


def power_md(rows: list[dict], real: list[dict], delta: float, command: str) -> str:
    from feduq.results.site_acceptance import markdown

    fixed = [k for k in (rows[0] if rows else {}) if k.startswith("fixed_")]
    cols = [("site", "held-out site", ""), ("method", "method", ""), ("units", "units", ""), ("M", "M", ""),
            ("score", "fixed rule's score", ""), ("n", "n units", ""), ("draws", "draws", ""),
            ("certified", "certified target (3 scores)", ".3f"), ("certified_fixed", "certified (u_mean only)", ".3f")]
    cols += [(k, f"fixed threshold at coverage {k[6:]}: WSR bound", ".3f") for k in fixed]
    cols += [(f"truth_{k[6:]}", f"site's Dice there ({k[6:]})", ".3f") for k in fixed]
    cols += [("gap", f"gap (fixed at {fixed[0][6:]} - certified)" if fixed else "gap", ".3f")]
    mean = (lambda key: sum(r[key] for r in rows) / len(rows)) if rows else (lambda key: float("nan"))
    return ("# (c) Power: the highest target certified against a threshold fixed in advance\n\n"
            f"Made by `{command}`. δ = {delta:g}. Means over the draws of n units with replacement: the highest "
            "target the unit procedure certifies (bisection to 0.001, as certify.best_certifiable_target), and the "
            "highest target whose WSR p-value at a threshold fixed before the draw (the site's threshold at the "
            "coverage, on the fixed rule's score) is <= δ, on all n units' values Y = α + (Λ - α C) / M.\n\n"
            f"Three scores against u_mean alone, pooled over the rows: mean certified target {mean('certified'):.3f} "
            f"against {mean('certified_fixed'):.3f}; at the real-site boundary targets of (a): "
            f"{pooled(real, 'unit')} against {pooled(real, 'unit_fixed')}.\n\n" + markdown(rows, cols))


def picture(sim: list[dict], real: list[dict], delta: float, path: Path) -> None:
    """Per panel (simulation, real sites): every cell's violation rate with its Clopper–Pearson 95 % interval, for
    the unit procedure and the image-level control, cells ordered by the control's rate; δ dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    for ax, rows, title in zip(axes, (sim, real), ("simulation (known truth)", "real held-out sites (exact truth)")):
        wide = sorted(pivot([r for r in rows if r["procedure"] in ("unit", "image")]),
                      key=lambda r: (r["image_violation"], r["image_viol_lo"]))
        x = np.arange(len(wide))
        for proc, color, name, dx in (("image", "tab:red", "image-level control", 0.15),
                                      ("unit", "tab:blue", "unit procedure", -0.15)):
            v = np.array([r[f"{proc}_violation"] for r in wide])
            lo, hi = (np.array([r[f"{proc}_viol_{e}"] for r in wide]) for e in ("lo", "hi"))
            ax.errorbar(x + dx, 100 * v, yerr=100 * np.vstack([v - lo, hi - v]), fmt="o", ms=2.5, lw=0.8,
                        color=color, label=name)
        ax.axhline(100 * delta, color="k", ls="--", lw=1, label=f"δ = {100 * delta:g} %")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("cells, ordered by the control's violation rate")
        ax.set_ylabel("violations, % of all draws")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
