"""Writing results as tables: the paper-style table (per client, Avg, Std) as CSV and Markdown, a site's per-image
test scores, and any list of rows as CSV."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from .metrics import summarize_sites, table_to_markdown

#: (metric key, Markdown header, scale) of the table columns, in order.
TABLE_COLUMNS = (("dice", "Dice (%)", 100.0), ("hd95", "HD95 (px)", 1.0), ("ece", "ECE per image (%, 20 bins)", 100.0))
#: A volume site's scores per case (a declared task's 3D sites; feduq.core.volume_scores): HD95 in mm.
TABLE_COLUMNS += (("hd95_mm", "HD95 (mm)", 1.0),)
#: Image-level classification columns (FedUAA's original form); a column appears only when every site reports it,
#: so segmentation tables are unchanged.
TABLE_COLUMNS += (("auc", "AUC (%)", 100.0), ("accuracy", "Accuracy (%)", 100.0))
#: The privacy budget each site's DP-SGD training spent (jobs with ``dp``; feduq.privacy.dp_sgd).
TABLE_COLUMNS += (("dp_epsilon", "ε spent", 1.0),)


def write_results(
    site_metrics: Mapping[str, Mapping[str, float]], out_dir: str | Path, method: str = "", note: str = "",
    missing: Sequence[str] = (),
) -> dict[str, Path]:
    """Write the per-client test table.

    Args:
        site_metrics: site -> metric name -> value (per-site means over its test images), e.g.
            ``{"Kvasir-SEG": {"dice": 0.85, "hd95": 20.1, "ece": 0.03, "num_images": 200}}``.
        out_dir: folder to write into (created).
        method: method name written into the tidy CSV and the Markdown title.
        note: one line under the Markdown title (e.g. which model was evaluated).
        missing: sites of the job that gave no test result (a run with ``min_clients`` below the site count): the
            Markdown says under its title that Avg and Std are over the others and names them.

    Returns:
        ``{"csv": per_client_table.csv, "markdown": per_client_table.md, "tidy": test_results_tidy.csv}``.
        The wide CSV has one row per client plus ``Avg`` and ``Std`` (ddof=0 over clients); the
        tidy CSV has columns ``method, client, metric, value`` (FLamby style).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = [k for m in site_metrics.values() for k in m if k.startswith(("dice_", "hd95_"))
             and k not in {c for c, _, _ in TABLE_COLUMNS}]
    extra = sorted(dict.fromkeys(extra), key=lambda k: (not k.startswith("dice_"), extra.index(k)))
    metric_keys = [k for k, _, _ in TABLE_COLUMNS] + extra  # per-region columns in the task's order
    metric_keys = [k for k in metric_keys if all(k in m for m in site_metrics.values())]
    table = summarize_sites({s: {k: float(m[k]) for k in metric_keys} for s, m in site_metrics.items()}, metric_keys)
    paths = {"csv": out / "per_client_table.csv", "markdown": out / "per_client_table.md", "tidy": out / "test_results_tidy.csv"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        cases = all("num_cases" in m for m in site_metrics.values()) and bool(site_metrics)  # volume sites
        w.writerow(["client", *metric_keys, "num_images", *(["num_cases"] if cases else [])])
        for row, vals in table.items():
            m = site_metrics.get(row, {})
            w.writerow([row, *(f"{vals[k]:.6f}" for k in metric_keys), m.get("num_images", ""),
                        *([m.get("num_cases", "")] if cases else [])])
    with open(paths["tidy"], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["method", "client", "metric", "value"])
        for site, vals in site_metrics.items():
            for k in [*metric_keys, "num_images", "num_cases"]:
                if k in vals:
                    w.writerow([method, site, k, vals[k]])
    columns = [c for c in TABLE_COLUMNS if c[0] in metric_keys] + [
        (k, (k[len("hd95_mm_"):] + " HD95 (mm)") if k.startswith("hd95_mm_") else
         k.replace("_", " ") + (" (%)" if k.startswith("dice") else " (px)"), 100.0 if k.startswith("dice") else 1.0)
        for k in metric_keys
        if k.startswith(("dice_", "hd95_")) and k not in {c for c, _, _ in TABLE_COLUMNS}
    ]
    title = f"# Test results{f': {method}' if method else ''}\n\n" + (f"{note}\n\n" if note else "")
    if missing:
        title += (f"**Avg and Std are over {len(site_metrics)} of the job's {len(site_metrics) + len(missing)} sites**: "
                  f"{', '.join(missing)} gave no test result.\n\n")
    paths["markdown"].write_text(title + table_to_markdown(table, columns) + "\n")
    return paths


#: a site's per-image test scores of the model its test task scored, in the site's run folder (they stay on the site)
PER_IMAGE_TEST_FILE = "per_image_test.csv"
#: the results name of each site's personalised model, tested after the last round (GraphFedSeg's neighbourhood
#: models): the server's ``results/personalised/`` table and each site's ``personalised/per_image_test.csv``
PERSONALISED = "personalised"


def per_image_test_path(run_dir: str | os.PathLike, results: str | None = None) -> Path:
    """Where a site keeps the per-image test scores of one tested model: ``<run_dir>/per_image_test.csv`` for the
    global model, ``<run_dir>/<results>/per_image_test.csv`` for another one the server named (``results``, e.g.
    GraphFedSeg's ``"personalised"``), so a second test never replaces the global model's scores.

    Raises:
        ValueError: ``results`` is not a plain name (letters, digits, ``_``, ``-``).
    """
    if results is None:
        return Path(run_dir) / PER_IMAGE_TEST_FILE
    if not isinstance(results, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", results):
        raise ValueError(f"test results name must be a plain name (letters, digits, _ or -), got {results!r}")
    return Path(run_dir) / results / PER_IMAGE_TEST_FILE


def per_image_test_rows(site: str, stems: list[str], scores: dict) -> list[dict]:
    """One row per test image, in the split's order: ``{"site", "image", "dice", "hd95_px"}`` with Dice the mean over
    the foreground classes or regions (fraction in [0, 1]) and HD95 their mean in pixels of the stored mask, from the
    per-image arrays of :func:`feduq.core.scoring.evaluate_test` (``scores["dice"]``, ``scores["hd95"]``: ``[N]`` or
    ``[N, C]``) and the images' file stems. What a site writes from its own test, and ``tools/compare.py`` pairs."""
    return [{"site": site, "image": stem, "dice": float(np.mean(d)), "hd95_px": float(np.mean(h))}
            for stem, d, h in zip(stems, scores["dice"], scores["hd95"])]


#: a volume site's per-case test scores (Dice, HD95 in mm, volumes in mL per structure), beside the per-slice file
PER_CASE_TEST_FILE = "per_case_test.csv"


def per_case_rows(site: str, cases: list[str], scores: dict, columns: list[str]) -> list[dict]:
    """One row per test case of a volume site: ``{"site", "case", "dice", "hd95_mm", and per structure
    "dice_<s>", "hd95_mm_<s>", "volume_ml_<s>" (predicted), "reference_ml_<s>"}`` from
    :meth:`feduq.core.volume_scores.CaseCollector.scores`."""
    rows = []
    for i, case in enumerate(cases):
        row = {"site": site, "case": case, "dice": float(scores["dice"][i].mean()),
               "hd95_mm": float(scores["hd95_mm"][i].mean())}
        for c, name in enumerate(columns):
            row.update({f"dice_{name}": float(scores["dice"][i, c]), f"hd95_mm_{name}": float(scores["hd95_mm"][i, c]),
                        f"volume_ml_{name}": float(scores["volume_ml"][i, c]),
                        f"reference_ml_{name}": float(scores["reference_ml"][i, c])})
        rows.append(row)
    return rows


def write_rows(path: str | os.PathLike, rows: list[dict]) -> Path:
    """Write dict rows as CSV (columns: the union, in first-seen order); no rows, no file. Returns the path."""
    path = Path(path)
    if not rows:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)
    return path
