"""One report per comparison: ``report.md`` beside ``results.md``, with the uncertainty-quality table, reliability
diagrams, risk–coverage curves and test-image grids (what each holds: :mod:`feduq.results.report`).

    feduq compare-report --out workspaces/compare/polyp-128 --data-root /data/feduq

``feduq compare`` calls it at the end of every sweep.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from feduq.cli import verb_parser

from feduq.results.report import write_report  # (tests call it from here too)


def main(argv=None) -> int:
    p = verb_parser("feduq compare-report", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True, help="a feduq compare output folder")
    p.add_argument("--data-root", default=os.environ.get("FEDUQ_DATA_ROOT"),
                   help="the folder holding <task>/<center>/ (default $FEDUQ_DATA_ROOT)")
    p.add_argument("--maps", type=int, default=2, help="test images per site in the image grid")
    p.add_argument("--max-items", type=int, help="first N test images per site (quick checks)")
    a = p.parse_args(argv)
    if a.data_root is None:
        p.error("--data-root: give the folder holding <task>/<center>/ (or set FEDUQ_DATA_ROOT)")
    write_report(a.out, a.data_root, a.maps, a.max_items)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq compare-report", main))
