#!/usr/bin/env python3
"""One report per comparison: ``report.md`` beside ``results.md`` with pictures where people would rather look.

For every finished run of a ``tools/compare.py`` folder, the run's global model is scored again on each federation
site's test split with ``tools/evaluate.py`` (the job's own network, preprocessing and uncertainty: predictive
entropy for FedAvg/FedProx/FedBN/FedA3I, evidential total uncertainty for FedEvi, vacuity for FedUAA and GraphFedSeg),
and the report puts side by side:

* the per-site test tables of ``results.md``;
* the held-out sites of ``--holdout`` runs (``holdout.md``);
* the uncertainty-quality table: ECE (15 bins, pixels pooled over the sites), Brier, NLL, AUROC/AUPRC of the method's
  own uncertainty as a detector of mis-segmented pixels, Spearman ρ between an image's mean uncertainty and its Dice,
  AURC and its optimum (images pooled over the sites; lower is better);
* a reliability diagram per method, one risk–coverage plot with a curve per method, and per site a grid of test
  images (image, ground truth, then each method's prediction and uncertainty map).

    python tools/report.py --out workspaces/compare/polyp-128 --data-root ../shared/data

``tools/compare.py`` calls it at the end of every sweep. Files: ``report.md``, ``report/`` (figures, ``eval/``
with each run's ``per_image.csv``/``per_site.csv``), ``uncertainty_quality.csv`` (tidy: method, seed, site, metric,
value).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from feduq.comparison_report import write_report  # (tests call it from here too)

REPO = Path(__file__).resolve().parents[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a tools/compare.py output folder")
    p.add_argument("--data-root", default=os.environ.get("FEDUQ_DATA_ROOT", str(REPO.parent / "shared" / "data")))
    p.add_argument("--maps", type=int, default=2, help="test images per site in the image grid")
    p.add_argument("--max-items", type=int, help="first N test images per site (quick checks)")
    a = p.parse_args(argv)
    write_report(a.out, a.data_root, a.maps, a.max_items)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("report.py", main))
