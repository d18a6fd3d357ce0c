"""``feduq calibrate``: choose the review rule on a site's labelled cases and certify it (``feduq predict
--calibrate``; its options are predict's ``--calibrate`` options).

    feduq calibrate --job workspaces/fedevi --site-dir /data/polyp/Hospital-X --target-dice 0.8 [--report --out R]

The rule (``<model file>.review.json``) is what ``feduq predict`` then flags cases with. Bad input: one line, exit 2.
"""

from __future__ import annotations

from .predict import main as predict_main

#: predict's options that do not apply here (left out of --help)
HIDDEN = ("--input", "--outputs", "--resample-gaps", "--mirror", "--pixel-spacing", "--export-bundle", "--calibrate")


def main(argv=None) -> int:
    """``feduq predict --calibrate ARGS``, its errors and help named ``feduq calibrate``."""
    argv = list(argv or [])
    return predict_main(argv if "-h" in argv or "--help" in argv else ["--calibrate", *argv], prog="feduq calibrate",
                        description=__doc__, hide=HIDDEN)
