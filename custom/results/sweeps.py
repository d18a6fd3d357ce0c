"""Reading a sweep's finished runs and rendering its tables and figures (for ``feduq compare``).

Each function reads what one run left (its per-client table, its sites' and server's ``FEDUQ_`` log records, or a
reference's ``reference_log.jsonl``) or renders tidy rows; nothing here runs a job.
"""

from __future__ import annotations

import csv
import json
import re
import shutil
import statistics
from collections import defaultdict
from pathlib import Path

from ..scores.tables import PER_IMAGE_TEST_FILE, PERSONALISED

# a site's record of the global model it received: at the start of each round (FEDUQ_TRAIN), and the last global
# model after the final round (FEDUQ_VALIDATE)
SITE_RECORD = re.compile(r"FEDUQ_(?:TRAIN|VALIDATE) (\{.*\})")
# the validation metric of the received global model, per round: segmentation jobs, classification jobs
VALIDATION_KEYS = ("val_dice_global", "val_auc_global")
# further per-round curves when the sites log them: the validation loss, and test Dice / HD95 (test_protocol.every_round)
CURVE_KEYS = ("val_loss_global", "test_dice_global", "test_hd95_global")
AGG_RECORD = re.compile(r"FEDUQ_AGGREGATION (\{.*\})")
GRAPH_RECORD = re.compile(r"FEDUQ_GRAPHFEDSEG (\{.*\})")


# FLamby's two references, run by feduq reference instead of a job: one model per site trained on
# its own data only, and one model trained on all sites' data pooled (no FLARE).
REFERENCES = ("local", "pooled")


def table_path(method: str, ws: Path) -> Path:
    """Where a run's per-client test table lands (simulator run folder, or the reference's output)."""
    if method in REFERENCES:
        return ws / "per_client_table.csv"
    return ws / "server" / "simulate_job" / "results" / "per_client_table.csv"


#: what a finished run's summary keeps (feduq compare --archive): tables, per-image scores, the run's time, its record and
#: the job configuration it ran (what a run without a readable RUN.json is checked against:
#: :func:`feduq.results.run_records.stored_configuration`)
SUMMARY_FILES = ("DONE", "RUN.json", "per_client_table.csv", "reference_log.jsonl", "per_image_test/per_image.csv",
                 "server/simulate_job/app_server/config/config_fed_client.json",
                 "server/simulate_job/app_server/config/config_fed_server.json", "server/simulate_job/meta.json",
                 "local/feduq_site.json",
                 "server/simulate_job/results/per_client_table.csv", "server/simulate_job/results/per_client_table.md",
                 "server/simulate_job/results/personalised/per_client_table.csv",
                 "server/simulate_job/results/per_organ_table.csv", "server/simulate_job/results/per_organ_table.md")
#: the log lines a summary keeps: FedUQ's per-round records (site and server)
RECORD_LINE = re.compile(r"FEDUQ_|FEDEVI_")


def archive_run(ws: Path, dest: Path) -> None:
    """Copy a finished run's summary to ``dest`` (same layout; logs cut to FedUQ's record lines; no models), so that
    :func:`collect` and ``feduq compare``'s ``per_image_scores`` read it as they read ``ws`` and ``feduq compare`` skips the run."""
    for rel in SUMMARY_FILES:
        if (ws / rel).is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(ws / rel, dest / rel)
    for results in (None, PERSONALISED):  # the sites' own per-image test scores (and of their personalised models)
        for path in sites_per_image(ws, results).values():
            (dest / path.relative_to(ws)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(path, dest / path.relative_to(ws))
    for log in ws.glob("*/log.txt"):
        lines = [line for line in log.read_text(errors="replace").splitlines(keepends=True) if RECORD_LINE.search(line)]
        (dest / log.parent.name).mkdir(parents=True, exist_ok=True)
        (dest / log.parent.name / "log.txt").write_text("".join(lines))


def sites_per_image(ws: Path, results: str | None = None) -> dict[str, Path]:
    """Site -> the per-image test scores its own test task wrote (``<ws>/<site>/simulate_job/per_image_test.csv``),
    or a reference wrote for it (``feduq reference``: ``<ws>/<site>/per_image_test.csv``); with ``results``
    (:data:`PERSONALISED`), those of the model the server tested under that name (``simulate_job/<results>/``)."""
    if results is not None:
        return {p.parents[2].name: p for p in sorted(ws.glob(f"*/simulate_job/{results}/{PER_IMAGE_TEST_FILE}"))}
    found = {p.parent.parent.name: p for p in sorted(ws.glob(f"*/simulate_job/{PER_IMAGE_TEST_FILE}"))}
    return found or {p.parent.name: p for p in sorted(ws.glob(f"*/{PER_IMAGE_TEST_FILE}"))}


def dp_label(method: str, epsilon: float | None, sweep: bool) -> str:
    """The row name of a run: the method, or in an ε sweep ``"<method> (ε=10)"`` / ``"<method> (no DP)"``."""
    if not sweep:
        return method
    return f"{method} (no DP)" if epsilon is None else f"{method} (ε={epsilon:g})"


def collect_ct(method: str, seed: int, ws: Path) -> list[dict]:
    """Tidy rows of a CT run: per site/organ Dice (naive, +UN) and HD95, per site ECE."""
    results = ws / "server" / "simulate_job" / "results"
    tidy = []
    with open(results / "per_organ_table.csv") as f:
        for row in csv.DictReader(f):
            for metric in ("dice", "dice_un", "hd95"):
                tidy.append({"method": method, "seed": seed, "client": f"{row['site']}/{row['organ']}",
                             "metric": metric, "value": float(row[metric]), "held_out": int(row["held_out"])})
    with open(results / "per_client_table.csv") as f:
        for row in csv.DictReader(f):
            if row["client"] not in ("Avg", "Std"):
                tidy.append({"method": method, "seed": seed, "client": row["client"], "metric": "ece",
                             "value": float(row["ece"]), "held_out": int(row["held_out"])})
    return tidy


def ct_markdown(tidy: list[dict], methods: list[str]) -> str:
    """FIVA Table 2's layout: rows = methods (naive and +UN), columns = training site/organ Dice (%), their mean,
    held-out site/organ Dice and their mean, and the mean ECE (%); mean over seeds."""
    def mean(method, client, metric):
        vals = [r["value"] for r in tidy if r["method"] == method and r["client"] == client and r["metric"] == metric]
        return statistics.fmean(vals) if vals else float("nan")

    organs = list(dict.fromkeys(r["client"] for r in tidy if "/" in r["client"]))
    held = {r["client"] for r in tidy if r["held_out"]}
    train, out = [c for c in organs if c not in held], [c for c in organs if c in held]
    head = ["Method", *train, "Mean", *out, "Held-out mean", "ECE per image (%, 15 bins)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for method in methods:
        ece = statistics.fmean([r["value"] for r in tidy if r["method"] == method and r["metric"] == "ece"] or [float("nan")])
        for metric, tag in (("dice", ""), ("dice_un", "+UN")):
            tr = [100 * mean(method, c, metric) for c in train]
            ho = [100 * mean(method, c, metric) for c in out]
            cells = [f"{v:.2f}" for v in tr] + [f"**{statistics.fmean(tr):.2f}**" if tr else "-"]
            cells += [f"{v:.2f}" for v in ho] + [f"**{statistics.fmean(ho):.2f}**" if ho else "-", f"{100 * ece:.2f}"]
            lines.append(f"| {method}{tag} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def ct_slice_rows(label: str, seed: int, files) -> list[dict]:
    """Per-slice test rows of a CT run from its sites' files (:func:`feduq.flare.ct.slice_row`): ``{"method",
    "seed", "site", "image", "case", "dice", "dice_un"}`` (fractions), slices with no scored organ left out."""
    rows = []
    for path in files:
        with open(path) as f:
            for r in csv.DictReader(f):
                if r.get("dice") not in (None, "", "nan"):
                    rows.append({"method": label, "seed": seed, "site": r["site"], "image": r["image"],
                                 "case": r["case"], "dice": float(r["dice"]), "dice_un": float(r["dice_un"])})
    return rows


def ct_paired_tests(rows: list[dict], methods: list[str], baseline: str, n_boot: int = 10_000) -> list[dict]:
    """FIVA Table 2's ordering as paired tests over patients: every method against ``baseline`` (FedAvg-CT), and the
    FIVA jobs against FUNAvg when it ran, on the naive merge (``dice``) and "+UN" (``dice_un``), over all sites, over
    the training sites (``scope`` "training sites": Table 2's mean column; the held-out site is per site) and per
    site; each patient (``case``) of a site is one independent unit (:func:`feduq.results.paired.clustered_tests`:
    slice differences averaged over the seeds, then over the patient's slices). ``q_value``: Benjamini–Hochberg over
    every returned row."""
    from .paired import clustered_tests, with_q_values

    clusters = {(r["site"], r["image"]): f"patient:{r['case']}" for r in rows}
    units = {r["site"]: "patient" for r in rows}
    pairs = [(baseline, methods)]
    if "funavg" in methods and baseline != "funavg":
        pairs.append(("funavg", [m for m in methods if m.startswith("fiva")]))
    from ..data.ct import HELD_OUT

    out = []
    for base, against in pairs:
        chosen = [r for r in rows if r["method"] == base or r["method"] in against]
        trained = [r for r in chosen if r["site"] not in HELD_OUT]
        for metric in ("dice", "dice_un"):
            tests = clustered_tests(chosen, base, clusters, units, metric, n_boot)
            if trained and len(trained) < len(chosen):  # Table 2's "Mean" column: the training sites' test slices
                mean_column = {t["method"]: dict(t, scope="training sites") for t in
                               clustered_tests(trained, base, clusters, units, metric, n_boot) if t["scope"] == "all"}
                tests = [row for t in tests for row in
                         ([t, mean_column[t["method"]]] if t["scope"] == "all" and t["method"] in mean_column else [t])]
            out += [dict(t, metric=metric) for t in tests]
    return with_q_values([{k: v for k, v in t.items() if k != "q_value"} for t in out])


def ct_results(out: Path, title: str, tidy: list[dict], per_slice: list[dict], methods: list[str],
               baseline: str | None) -> str:
    """Write a CT sweep's ``results.md`` (FIVA Table 2's layout, :func:`ct_markdown`; with per-slice rows and a
    baseline, the paired tests over patients of :func:`ct_paired_tests`, also as ``paired_tests.csv`` beside
    ``per_image_test.csv``) into ``out``; returns the Markdown."""
    from ..scores.tables import write_rows
    from .paired import clustered_markdown

    md = [title, "", "Dice (%) per site/organ of the final multi-head model (naive merge; +UN: uncertainty-reweighted "
          "background); mean over seeds.", "", ct_markdown(tidy, methods), ""]
    if per_slice and baseline:
        tests = ct_paired_tests(per_slice, methods, baseline)
        write_rows(out / "per_image_test.csv", per_slice)
        write_rows(out / "paired_tests.csv", tests)
        md += ["Paired over patients (each patient of a site one unit: its slices' Dice differences averaged over the "
               "seeds, then over its slices; a slice's Dice: the mean over the organs its site labels that are in it). "
               "Wilcoxon signed-rank over patients, two-sided; Δ in Dice points (method − baseline) with a patient "
               "bootstrap 95 % interval (10,000 draws, seed 0); q: Benjamini–Hochberg over both tables:", ""]
        for metric, name in (("dice", "naive merge"), ("dice_un", "+UN")):
            md += [f"{name}:", "", clustered_markdown([t for t in tests if t["metric"] == metric]), ""]
    (out / "results.md").write_text("\n".join(md))
    return "\n".join(md)


def collect_table(path: Path, method: str, seed: int) -> list[dict]:
    """Tidy rows ``{method, seed, client, metric, value}`` of one per-client table (Avg/Std rows left out)."""
    tidy = []
    with open(path) as f:
        for row in csv.DictReader(f):
            if row["client"] in ("Avg", "Std"):
                continue
            for metric, value in row.items():
                if metric != "client" and value != "":
                    tidy.append({"method": method, "seed": seed, "client": row["client"], "metric": metric,
                                 "value": float(value)})
    return tidy


def collect(method: str, seed: int, ws: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """Tidy test rows, per-round validation curves and per-round weights of one run."""
    tidy = collect_table(table_path(method, ws), method, seed)
    curves = []
    if method in REFERENCES:  # validation Dice after block r = the model a federation holds after round r + 1
        for line in (ws / "reference_log.jsonl").read_text().splitlines():
            rec = json.loads(line)
            for client, value in rec["val_dice_per_site"].items():
                curves.append({"method": method, "seed": seed, "client": client, "round": rec["round"] + 1,
                               "metric": "val_dice", "value": value})
        return tidy, curves, []
    for site_log in sorted(ws.glob("*/log.txt")):
        if site_log.parent.name == "server":
            continue
        for m in SITE_RECORD.finditer(site_log.read_text()):
            rec = json.loads(m.group(1))
            keys = [next((k for k in VALIDATION_KEYS if k in rec), None), *(k for k in CURVE_KEYS if k in rec)]
            curves += [{"method": method, "seed": seed, "client": rec["site"], "round": rec["round"], "metric": key,
                        "value": rec[key]} for key in keys if key is not None]
    weights = []
    for m in AGG_RECORD.finditer((ws / "server" / "log.txt").read_text()):
        rec = json.loads(m.group(1))
        for client, w in rec["weights"].items():
            weights.append({"method": method, "seed": seed, "round": rec["round"], "client": client, "weight": w})
    return tidy, curves, weights


def _mean_std(values: list[float], scale: float) -> str:
    values = [v * scale for v in values]
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def markdown_table(tidy: list[dict], methods: list[str], metric: str, scale: float) -> str:
    """Rows = methods; columns = clients, Avg, Std (over clients); cells = mean ± std over seeds."""
    by = defaultdict(dict)  # (method, seed) -> client -> value
    for r in tidy:
        if r["metric"] == metric:
            by[(r["method"], r["seed"])][r["client"]] = r["value"]
    clients = sorted({c for v in by.values() for c in v}, key=lambda c: [r["client"] for r in tidy].index(c))
    lines = ["| Method | " + " | ".join(clients) + " | Avg | Std |", "|---" * (len(clients) + 3) + "|"]
    for method in methods:
        runs = [v for (m, _), v in sorted(by.items()) if m == method and all(c in v for c in clients)]
        if not runs:
            continue
        cells = [_mean_std([r[c] for r in runs], scale) for c in clients]
        cells.append(_mean_std([statistics.mean(r[c] for c in clients) for r in runs], scale))
        cells.append(_mean_std([statistics.pstdev([r[c] for c in clients]) for r in runs], scale))
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(rows: list[dict], value: str, title: str, path: Path, methods: list[str]) -> None:
    """One panel per method; one line per client (mean over seeds) against the round."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    present = [m for m in methods if any(r["method"] == m for r in rows)]
    if not present:
        return
    fig, axes = plt.subplots(1, len(present), figsize=(4.2 * len(present), 3.4), sharey=True, squeeze=False)
    for ax, method in zip(axes[0], present):
        series = defaultdict(lambda: defaultdict(list))
        for r in rows:
            if r["method"] == method and r["round"] is not None:
                series[r["client"]][int(r["round"])].append(r[value])
        for client, points in sorted(series.items()):
            xs = sorted(points)
            ax.plot(xs, [statistics.mean(points[x]) for x in xs], marker=".", label=client)
        ax.set_title(method)
        ax.set_xlabel("round")
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(title)
    axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def graph_records(ws: Path) -> list[dict]:
    """GraphFedSeg's per-round collaboration graphs ``{"round", "sites", "W", ...}`` from a run's server log."""
    log = ws / "server" / "log.txt"
    return [json.loads(m.group(1)) for m in GRAPH_RECORD.finditer(log.read_text())] if log.is_file() else []


def plot_graphs(records: list[dict], path: Path, max_panels: int = 6) -> None:
    """W as heat maps (GraphFedSeg Fig. 4-5): up to ``max_panels`` rounds evenly spaced, the last one included."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    if not records:
        return
    idx = sorted({int(round(i)) for i in np.linspace(0, len(records) - 1, min(max_panels, len(records)))})
    fig, axes = plt.subplots(1, len(idx), figsize=(3.4 * len(idx), 3.3), squeeze=False)
    for ax, i in zip(axes[0], idx):
        rec = records[i]
        W = np.asarray(rec["W"])
        im = ax.imshow(W, vmin=0, vmax=max(0.5, float(W.max())), cmap="viridis")
        for (a, b), v in np.ndenumerate(W):
            ax.text(b, a, f"{v:.2f}", ha="center", va="center", fontsize=7, color="w" if v < 0.35 else "k")
        short = [s[:10] for s in rec["sites"]]
        ax.set_xticks(range(len(short)), short, rotation=60, fontsize=7)
        ax.set_yticks(range(len(short)), short if i == idx[0] else [""] * len(short), fontsize=7)
        ax.set_title(f"W, round {rec['round']}")
    fig.colorbar(im, ax=axes[0].tolist(), shrink=0.8)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def dp_sweep_rows(tidy: list[dict], methods: list[str], epsilons: list[float | None]) -> list[dict]:
    """Avg test Dice over clients per (method, ε) and seed, and the largest ε any site spent (GraphFedSeg Fig. 7)."""
    rows = []
    for method in methods:
        for eps in epsilons:
            label = dp_label(method, eps, True)
            for seed in sorted({r["seed"] for r in tidy if r["method"] == label}):
                mine = [r for r in tidy if r["method"] == label and r["seed"] == seed]
                dice = [r["value"] for r in mine if r["metric"] == "dice"]
                spent = [r["value"] for r in mine if r["metric"] == "dp_epsilon"]
                rows.append({"method": method, "target_epsilon": "none" if eps is None else eps, "seed": seed,
                             "avg_dice": statistics.mean(dice) if dice else float("nan"),
                             "max_spent_epsilon": max(spent) if spent else ""})
    return rows


def plot_dp_sweep(rows: list[dict], path: Path) -> None:
    """Avg test Dice against ε (log axis), one line per method; the no-DP run as a dashed line of its colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not rows:
        return
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = [r for r in rows if r["method"] == method]
        pts = defaultdict(list)
        for r in mine:
            if r["target_epsilon"] != "none":
                pts[float(r["target_epsilon"])].append(r["avg_dice"] * 100)
        xs = sorted(pts)
        line = ax.plot(xs, [statistics.mean(pts[x]) for x in xs], marker="o", label=method)[0]
        free = [r["avg_dice"] * 100 for r in mine if r["target_epsilon"] == "none"]
        if free:
            ax.axhline(statistics.mean(free), ls="--", color=line.get_color(), label=f"{method}, no DP")
    ax.set_xscale("log")
    ax.set_xlabel("privacy budget ε (δ fixed)")
    ax.set_ylabel("Avg test Dice (%)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finished_runs(out: Path) -> list[tuple[str, int, Path]]:
    """``(method, seed, workspace)`` of every finished segmentation run under ``out/runs`` (``<method>_s<seed>``)."""
    runs = []
    for ws in sorted((out / "runs").glob("*_s*")):
        method, _, seed = ws.name.rpartition("_s")
        if (ws / "DONE").is_file() and seed.isdigit() and method not in ("local", "pooled"):
            runs.append((method, int(seed), ws))
    return runs


def federation_sites(ws: Path) -> list[str]:
    """The sites of a simulator workspace: folders with a ``simulate_job`` app, the server excepted."""
    return sorted(p.parent.name for p in ws.glob("*/simulate_job") if p.parent.name != "server")


def classification_rows(label: str, seed: int, ws: Path) -> list[dict]:
    """Per-image rows of a classification run's sites (label, class probabilities, correct), for
    :func:`feduq.results.classification_paired.classification_tests`."""
    rows = []
    for path in sites_per_image(ws).values():
        with open(path) as f:
            rows += [{**r, "method": label, "seed": seed} for r in csv.DictReader(f) if r.get("label") not in (None, "")]
    return rows
