"""``feduq report``: the site acceptance report of a model on a site's labelled cases (``report.html``, its
pictures and ``cases.csv``; ``feduq predict --report``, whose options it takes).

    feduq report --job workspaces/fedevi --site-dir /data/polyp/Hospital-X --out report/ [--calibrate]
"""

from __future__ import annotations

from .predict import main as predict_main

#: predict's options that do not apply here (left out of --help)
HIDDEN = ("--input", "--outputs", "--resample-gaps", "--mirror", "--pixel-spacing", "--export-bundle", "--report")


def main(argv=None) -> int:
    """``feduq predict --report ARGS``, its errors and help named ``feduq report``."""
    argv = list(argv or [])
    return predict_main(argv if "-h" in argv or "--help" in argv else ["--report", *argv], prog="feduq report",
                        description=__doc__, hide=HIDDEN)
