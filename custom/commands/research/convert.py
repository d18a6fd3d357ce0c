"""``feduq convert <dataset>``: a public dataset's download into FedUQ's layout (``<task>/<center>/`` with images,
masks, ``labels.json`` and ``provenance.csv``), or FedUQ's layout into nnU-Net's raw one.

    feduq convert polyp --kvasir DOWNLOAD/kvasir-seg --dst DATA/polyp
    feduq convert nnunet-raw --data-root DATA --prostate RUNMC --out DATA/Dataset901_ProstateMR/Nijmegen

``feduq convert <dataset> --help`` gives each converter's options (:mod:`feduq.data.convert`).
"""

from __future__ import annotations

import difflib
import importlib
import sys

CONVERTERS = {"polyp": "polyp", "fundus": "fundus", "prostate": "prostate", "skin-breast": "skin_breast", "ct": "ct",
              "nnunet-raw": "nnunet_raw"}


def main(argv=None) -> int:
    """Dispatch to ``feduq.data.convert.<dataset>.main``; an unknown dataset is one line naming the nearest."""
    argv = list(argv or [])
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\ndatasets: " + ", ".join(CONVERTERS))
        return 0 if argv else 2
    name = argv[0]
    if name not in CONVERTERS:
        near = difflib.get_close_matches(name, list(CONVERTERS), n=1)
        print(f"feduq convert: error: unknown dataset {name!r}" + (f"; did you mean {near[0]}?" if near else
              f"; one of {', '.join(CONVERTERS)}"), file=sys.stderr)
        return 2
    module = importlib.import_module(f"feduq.data.convert.{CONVERTERS[name]}")
    return int(module.main(argv[1:]) or 0)
