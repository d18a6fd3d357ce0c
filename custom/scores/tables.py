"""Writing results as tables: the paper-style table (per client, Avg, Std) as CSV and Markdown, a site's per-image
test scores, and any list of rows as CSV."""

from __future__ import annotations

import csv
import os
import re
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from .metrics import summarize_sites, table_to_markdown

#: (metric key, Markdown header, scale) of the table columns, in order.
TABLE_COLUMNS = (("dice", "Dice (%)", 100.0), ("hd95", "HD95 (px)", 1.0), ("ece", "ECE per image (%, 20 bins)", 100.0))
#: A volume site's scores per case (a declared task's 3D sites; feduq.scores.volume_scores): HD95 in mm.
TABLE_COLUMNS += (("hd95_mm", "HD95 (mm)", 1.0),)
#: Image-level classification columns (FedUAA's original form); a column appears only when every site reports it,
#: so segmentation tables are unchanged.
TABLE_COLUMNS += (("auc", "AUC (%)", 100.0), ("accuracy", "Accuracy (%)", 100.0))
#: The privacy budget each site's DP-SGD training spent (jobs with ``dp``; feduq.privacy.dp_sgd).
TABLE_COLUMNS += (("dp_epsilon", "ε spent", 1.0),)


def structure_names(keys: Iterable[str]) -> list[str]:
    """The scored structures a set of metric keys names, in first-seen order: ``s`` for every ``dice_<s>`` with an
    HD95 of the same structure beside it (``hd95_<s>`` in the sites' test metrics, ``hd95_px_<s>`` in per-image rows,
    ``hd95_mm_<s>`` of volume sites). Keys such as ``dice_std`` or ``dice_un`` (no HD95 beside them) are no
    structures. E.g. ``["dice", "dice_disc", "dice_cup", "hd95_disc", "hd95_cup"]`` -> ``["disc", "cup"]``."""
    keys = list(dict.fromkeys(keys))
    have = set(keys)
    return [k[len("dice_"):] for k in keys if k.startswith("dice_")
            and any(f"{p}{k[len('dice_'):]}" in have for p in ("hd95_", "hd95_px_", "hd95_mm_"))]


def annotated_note(site_metrics: Mapping[str, Mapping[str, float]]) -> str:
    """One line per site that lacks some of the structures the other sites report (partial labels: a site is scored
    only on the structures it annotates): ``"site X annotates only: optic_cup"``; empty when every site reports
    every structure."""
    names = structure_names(k for m in site_metrics.values() for k in m)
    lines = [f"site {site} annotates only: {', '.join(s for s in names if f'dice_{s}' in m) or 'none of them'}"
             for site, m in site_metrics.items() if any(f"dice_{s}" not in m for s in names)]
    if not lines:
        return ""
    return ("Partial labels (a blank cell: the site does not annotate that structure; a structure's Avg and Std are "
            "over the sites that annotate it): " + "; ".join(lines) + ".")


def write_results(
    site_metrics: Mapping[str, Mapping[str, float]], out_dir: str | Path, method: str = "", note: str = "",
    missing: Sequence[str] = (),
) -> dict[str, Path]:
    """Write the per-client test table.

    Args:
        site_metrics: site -> metric name -> value (per-site means over its test images), e.g.
            ``{"Kvasir-SEG": {"dice": 0.85, "hd95": 20.1, "ece": 0.03, "num_images": 200}}``; a task with several
            structures adds ``dice_<s>`` (fraction) and ``hd95_<s>`` (pixels; ``hd95_mm_<s>`` in mm on volume
            sites) per structure, and a site with partial labels sends only the structures it annotates.
        out_dir: folder to write into (created).
        method: method name written into the tidy CSV and the Markdown title.
        note: one line under the Markdown title (e.g. which model was evaluated).
        missing: sites of the job that gave no test result (a run with ``min_clients`` below the site count): the
            Markdown says under its title that Avg and Std are over the others and names them.

    Returns:
        ``{"csv": per_client_table.csv, "markdown": per_client_table.md, "tidy": test_results_tidy.csv}``.
        The wide CSV has one row per client plus ``Avg`` and ``Std`` (ddof=0 over clients); the
        tidy CSV has columns ``method, client, metric, value`` (FLamby style). Every structure any site reports
        keeps its columns: blank (and no tidy row) at a site that does not report it, its Avg and Std over the sites
        that do, and the Markdown names once, under its title, each such site's annotated structures.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    extra = [k for m in site_metrics.values() for k in m if k.startswith(("dice_", "hd95_"))
             and k not in {c for c, _, _ in TABLE_COLUMNS}]
    extra = sorted(dict.fromkeys(extra), key=lambda k: (not k.startswith("dice_"), extra.index(k)))
    # the table's own columns where every site reports them; per-structure columns where any site does (the union)
    metric_keys = [k for k, _, _ in TABLE_COLUMNS if all(k in m for m in site_metrics.values())] + extra
    table = summarize_sites({s: {k: float(m[k]) for k in metric_keys if k in m} for s, m in site_metrics.items()},
                            metric_keys)
    paths = {"csv": out / "per_client_table.csv", "markdown": out / "per_client_table.md", "tidy": out / "test_results_tidy.csv"}
    with open(paths["csv"], "w", newline="") as f:
        w = csv.writer(f)
        cases = all("num_cases" in m for m in site_metrics.values()) and bool(site_metrics)  # volume sites
        w.writerow(["client", *metric_keys, "num_images", *(["num_cases"] if cases else [])])
        for row, vals in table.items():
            m = site_metrics.get(row, {})
            w.writerow([row, *(f"{vals[k]:.6f}" if k in vals else "" for k in metric_keys), m.get("num_images", ""),
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
        for k in extra
    ]
    title = f"# Test results{f': {method}' if method else ''}\n\n" + (f"{note}\n\n" if note else "")
    if missing:
        title += (f"**Avg and Std are over {len(site_metrics)} of the job's {len(site_metrics) + len(missing)} sites**: "
                  f"{', '.join(missing)} gave no test result.\n\n")
    partial = annotated_note(site_metrics)
    title += f"{partial}\n\n" if partial else ""
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


def per_image_test_rows(site: str, stems: list[str], scores: dict, columns: Sequence[str] = ()) -> list[dict]:
    """One row per test image, in the split's order: ``{"site", "image", "dice", "hd95_px"}`` with Dice the mean over
    the foreground classes or regions (fraction in [0, 1]) and HD95 their mean in pixels of the stored mask, from the
    per-image arrays of :func:`feduq.scores.scoring.evaluate_test` (``scores["dice"]``, ``scores["hd95"]``: ``[N]`` or
    ``[N, C]``) and the images' file stems. With ``columns`` (the names of the ``C >= 2`` scored structures, in the
    arrays' column order) each row also has ``dice_<s>`` and ``hd95_px_<s>`` per structure, as ``feduq evaluate``'s
    ``per_image.csv``. What a site writes from its own test, and ``feduq compare`` pairs (per structure too).

    Raises:
        ValueError: ``columns`` names another number of structures than the arrays have columns.
    """
    columns = list(columns) if len(columns) > 1 else []
    dice, hd = np.asarray(scores["dice"], dtype=np.float64), np.asarray(scores["hd95"], dtype=np.float64)
    if columns and (dice.ndim != 2 or dice.shape[1] != len(columns) or hd.shape != dice.shape):
        raise ValueError(f"per_image_test_rows: {len(columns)} structures {columns}, scores of shape {dice.shape}")
    rows = []
    for stem, d, h in zip(stems, dice, hd):
        row = {"site": site, "image": stem, "dice": float(np.mean(d)), "hd95_px": float(np.mean(h))}
        row.update({f"dice_{c}": float(v) for c, v in zip(columns, d)})
        row.update({f"hd95_px_{c}": float(v) for c, v in zip(columns, h)})
        rows.append(row)
    return rows


def structure_means(row: Mapping, per_image: Sequence[Mapping]) -> dict:
    """A site's summary ``row`` with each scored structure's mean over its images beside the mean over structures:
    ``dice_<s>`` (fraction) after ``dice``, ``hd95_px_<s>`` (stored pixels) after ``hd95_px``, for every
    structure of :func:`structure_names` of the ``per_image`` rows (``dice_<s>``, ``hd95_px_<s>``) when there are
    two or more; an image without a structure's value (NaN, or a row that lacks it) is left out of that mean. Keys
    ``row`` has already are kept as they are. E.g. ``{"site": "A", "dice": 0.8, "hd95_px": 9.0}`` and rows of
    disc and cup -> ``{"site", "dice", "dice_disc", "dice_cup", "hd95_px", "hd95_px_disc", "hd95_px_cup"}``."""
    names = structure_names(k for r in per_image for k in r)
    if len(names) < 2:
        return dict(row)

    def mean(key):
        values = [float(r[key]) for r in per_image if r.get(key) not in (None, "") and np.isfinite(float(r[key]))]
        return float(np.mean(values)) if values else float("nan")

    added = {"dice": {f"dice_{s}": mean(f"dice_{s}") for s in names},
             "hd95_px": {f"hd95_px_{s}": mean(f"hd95_px_{s}") for s in names}}
    out = {}
    for key, value in row.items():
        out[key] = value
        out.update({k: v for k, v in added.get(key, {}).items() if k not in row})
    return out


#: a volume site's per-case test scores (Dice, HD95 in mm, volumes in mL per structure), beside the per-slice file
PER_CASE_TEST_FILE = "per_case_test.csv"


def per_case_rows(site: str, cases: list[str], scores: dict, columns: list[str]) -> list[dict]:
    """One row per test case of a volume site: ``{"site", "case", "dice", "hd95_mm", and per structure
    "dice_<s>", "hd95_mm_<s>", "volume_ml_<s>" (predicted), "reference_ml_<s>"}`` from
    :meth:`feduq.scores.volume_scores.CaseCollector.scores`."""
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
