#!/usr/bin/env python3
"""One report per comparison: ``report.md`` beside ``results.md``, with the uncertainty-quality table, reliability
diagrams, risk–coverage curves and test-image grids (what each holds: :mod:`feduq.results.report`).

    python tools/report.py --out workspaces/compare/polyp-128 --data-root ../shared/data

``tools/compare.py`` calls it at the end of every sweep.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from feduq.results.report import write_report  # (tests call it from here too)

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
