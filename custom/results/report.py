"""One report per comparison (``feduq compare-report``, called by ``feduq compare``): ``report.md`` beside ``results.md`` with pictures where people would rather look.

For every finished run of a ``feduq compare`` folder, the run's global model is scored again on each federation
site's test split with ``feduq evaluate`` (the job's own network, preprocessing and uncertainty: predictive
entropy for FedAvg/FedProx/FedBN/FedA3I, evidential total uncertainty for FedEvi, vacuity for FedUAA and GraphFedSeg),
and the report puts side by side:

* the per-site test tables of ``results.md``;
* the held-out sites of ``--holdout`` runs (``holdout.md``);
* the uncertainty-quality table: ECE (15 bins, pixels pooled over the sites), Brier, NLL, AUROC/AUPRC of the method's
  own uncertainty as a detector of mis-segmented pixels, Spearman ρ between an image's mean uncertainty and its Dice,
  AURC and its optimum (images pooled over the sites; lower is better);
* a reliability diagram per method, one risk–coverage plot with a curve per method, and per site a grid of test
  images (image, ground truth, then each method's prediction and uncertainty map).

    feduq compare-report --out workspaces/compare/polyp-128 --data-root /data/feduq

``feduq compare`` calls it at the end of every sweep. Files: ``report.md``, ``report/`` (figures, ``eval/``
with each run's ``per_image.csv``/``per_site.csv``), ``uncertainty_quality.csv`` (tidy: method, seed, site, metric,
value).
"""

from __future__ import annotations

import csv
from collections import defaultdict
from pathlib import Path

import numpy as np

from .sweeps import federation_sites, finished_runs

QUALITY = [("ece15", "pooled ECE (15 bins)", 1.0), ("brier", "Brier", 1.0), ("nll", "NLL (nats)", 1.0),
           ("auroc", "AUROC errors", 1.0), ("auprc", "AUPRC errors", 1.0), ("spearman_rho", "Spearman ρ(u, Dice)", 1.0),
           ("aurc", "AURC", 1.0), ("optimal_aurc", "optimal AURC", 1.0)]


def evaluate_runs(out: Path, data_root: str, maps: int = 2, max_items: int | None = None) -> dict:
    """Score every finished run's global model on its sites' test splits. Returns ``{(method, seed): (rows, results)}``
    (see ``feduq evaluate``); a run that cannot be scored (CT, classification) is skipped with its reason."""
    from ..data import DataError
    from ..site.evaluation import EvaluationError, evaluate_job

    scored = {}
    for method, seed, ws in finished_runs(out):
        try:
            scored[(method, seed)] = evaluate_job(ws, out=out / "report" / "eval" / ws.name, sites=federation_sites(ws),
                                              data_root=data_root, split="test", maps=maps, max_items=max_items)
        except (EvaluationError, DataError) as e:
            print(f"report: {ws.name} not scored: {e}")
    return scored


def _fmt(v: float) -> str:
    return "–" if v is None or not np.isfinite(v) else f"{v:.4f}"


def quality_rows(scored: dict) -> list[dict]:
    """Tidy ``method, seed, site, metric, value`` rows of every per-site figure."""
    rows = []
    for (method, seed), (per_site, _) in scored.items():
        for r in per_site:
            for key, value in r.items():
                if isinstance(value, (int, float)) and key != "n_images":
                    rows.append({"method": method, "seed": seed, "site": r["site"], "metric": key, "value": value})
    return rows


def quality_table(scored: dict) -> tuple[str, dict, dict]:
    """The markdown table (one row per method: its uncertainty, then :data:`QUALITY` pooled over sites and seeds),
    pooled reliability bins and pooled risk-coverage curves per method."""
    from ..scores.uncertainty_quality import (
        ece_from_bins,
        optimal_aurc,
        pool_bins,
        risk_coverage,
        uncertainty_dice_spearman,
    )

    by_method = defaultdict(list)
    for (method, seed), value in sorted(scored.items()):
        by_method[method].append(value)
    lines = ["| Method | uncertainty | " + " | ".join(t for _, t, _ in QUALITY) + " |", "|---" * (len(QUALITY) + 2) + "|"]
    bins, curves = {}, {}
    for method, values in by_method.items():
        results = [res for _, site_results in values for res in site_results.values()]
        primary = values[0][0][0]["uncertainty"]
        quality = [res["quality"][primary] for res in results]
        pooled = pool_bins(q["bins"] for q in quality)
        u = np.concatenate([q["image_uncertainty"] for q in quality])
        dice = np.concatenate([[r["dice"] for r in res["per_image"]] for res in results])
        coverage, risk, aurc = risk_coverage(u, 1.0 - dice)
        n_pix = np.array([q["n_pixels"] for q in quality], dtype=float)
        mean = lambda key: float(np.average([q.get(key, np.nan) for q in quality], weights=n_pix))  # noqa: E731
        rho = uncertainty_dice_spearman(u, dice)[0] if len(u) >= 2 else float("nan")
        cells = {"ece15": ece_from_bins(pooled), "brier": mean("brier"), "nll": mean("nll"), "auroc": mean("auroc"),
                 "auprc": mean("auprc"), "spearman_rho": rho, "aurc": aurc, "optimal_aurc": optimal_aurc(1.0 - dice)}
        lines.append(f"| {method} | {primary} | " + " | ".join(_fmt(cells[k]) for k, _, _ in QUALITY) + " |")
        bins[method], curves[method] = pooled, (coverage, risk)
    notes = {m: v[0][0][0].get("note") for m, v in by_method.items() if v[0][0][0].get("note")}
    lines += [""] + [f"* {m}: {n}." for m, n in notes.items()]
    return "\n".join(lines).rstrip(), bins, curves


def image_grid(out: Path, site: str, methods: list[tuple[str, str]], max_images: int = 2) -> Path | None:
    """Rows = the first test images of ``site``; columns = image, ground truth, and per method its prediction and its
    own uncertainty map (from the maps ``feduq evaluate`` saved). ``methods``: ``(label, run folder name)``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stems = sorted(p.stem for p in (out / "report" / "eval" / methods[0][1] / "maps" / site).glob("*.npz"))[:max_images]
    if not stems:
        return None
    cols = 2 + 2 * len(methods)
    fig, axes = plt.subplots(len(stems), cols, figsize=(1.9 * cols, 2.0 * len(stems)), squeeze=False)
    for i, stem in enumerate(stems):
        for j, (label, run) in enumerate(methods):
            path = out / "report" / "eval" / run / "maps" / site / f"{stem}.npz"
            per_site = out / "report" / "eval" / run / "per_site.csv"
            if not path.is_file() or not per_site.is_file():
                continue
            data = np.load(path)
            primary = next(csv.DictReader(open(per_site)))["uncertainty"]
            if j == 0:
                img = np.moveaxis(data["image"], 0, -1).transpose(1, 0, 2)
                axes[i, 0].imshow(img[..., 0] if img.shape[-1] == 1 else np.clip(img, 0, 1), cmap="gray")
                axes[i, 1].imshow(data["label"].T, interpolation="nearest")
                axes[i, 0].set_title(stem, fontsize=6)
                axes[i, 1].set_title("ground truth", fontsize=6)
            axes[i, 2 + 2 * j].imshow(data["prediction"].T, interpolation="nearest")
            axes[i, 2 + 2 * j].set_title(f"{label}: prediction", fontsize=6)
            axes[i, 3 + 2 * j].imshow(data[primary].T, cmap="magma")
            axes[i, 3 + 2 * j].set_title(f"{label}: {primary}", fontsize=6)
    for ax in axes.ravel():
        ax.axis("off")
    fig.tight_layout()
    path = out / "report" / f"images_{site}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(out: Path, data_root: str, maps: int = 2, max_items: int | None = None) -> Path:
    """Score the runs of a comparison folder and write ``report.md`` (module doc). Returns its path."""
    from ..scores.tables import write_rows
    from ..scores.uncertainty_quality import plot_reliability, plot_risk_coverage

    out = Path(out)
    scored = evaluate_runs(out, data_root, maps, max_items)
    md = ["# FedUQ report", ""]
    if (out / "results.md").is_file():
        md += ["## Test results per site", "", (out / "results.md").read_text().split("\n", 2)[-1].strip(), ""]
    if (out / "holdout.md").is_file():
        md += ["## Held-out sites (leave-one-site-out)", "", (out / "holdout.md").read_text().split("\n", 2)[-1].strip(),
               ""]
    if not scored:
        md += ["No segmentation run to score for uncertainty quality.", ""]
    else:
        write_rows(out / "uncertainty_quality.csv", quality_rows(scored))
        table, bins, curves = quality_table(scored)
        md += ["## Uncertainty quality", "",
               "Global model on every site's test split, scored by `feduq evaluate` with each method's own "
               "uncertainty. ECE over all pixels of all sites (15 bins, top-label confidence); Brier, NLL, AUROC and "
               "AUPRC (uncertainty as a detector of mis-segmented pixels) pixel-weighted over sites; Spearman ρ, "
               "AURC (risk = 1 − Dice, most uncertain images set aside first; lower is better) over all test images. "
               "A good uncertainty has AUROC near 1, ρ < 0 and AURC near its optimum.", "", table, "",
               "### Reliability diagrams", ""]
        for method, b in bins.items():
            path = plot_reliability(b, out / "report" / f"reliability_{method}.png", method)
            md.append(f"![{method}](report/{path.name})")
        path = plot_risk_coverage(curves, out / "report" / "risk_coverage.png", "risk-coverage, all test images")
        md += ["", "### Risk–coverage", "", f"![risk-coverage](report/{path.name})", "", "### Test images per site", ""]
        runs = sorted({(m, f"{m}_s{s}") for (m, s) in scored if s == min(s2 for (m2, s2) in scored if m2 == m)})
        sites = sorted({r["site"] for rows, _ in scored.values() for r in rows})
        for site in sites:
            grid = image_grid(out, site, runs)
            if grid is not None:
                md.append(f"![{site}](report/{grid.name})")
        md.append("")
    path = out / "report.md"
    path.write_text("\n".join(md))
    print(f"written: {path}")
    return path
