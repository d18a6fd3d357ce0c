#!/usr/bin/env python3
"""Apply a trained FedUQ model to new images, NIfTI volumes or DICOM series; choose the review flag; export a MONAI
Bundle. The same as ``python -m feduq.predict`` (see its ``--help``)."""

import sys

from feduq.predict import main

if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("predict.py", main))
