"""Evaluate a saved FedUQ model on any site: Dice, HD95, calibration and the quality of its uncertainty.

The network, preprocessing, post-processing and uncertainty of the job that trained the model are rebuilt from its
client config (:mod:`feduq.site.evaluation`), so a model is scored exactly as the job's final test task scores it, also
on a site folder that is in no split file and never took part in training (a held-out hospital)::

    # the best global model of a simulator run, on a folder of images/ + masks/ + labels.json nobody trained on
    feduq evaluate --job workspaces/fedevi --site-dir /data/new_hospital/polyp/Hospital-X --out eval/x

    # the final global model on the test splits of two federation sites
    feduq evaluate --job workspaces/fedevi --which last --site Kvasir-SEG,CVC-ClinicDB --split test \\
        --data-root /data/feduq --out eval/test

    # a model file with the job folder it came from
    feduq evaluate --job jobs/fedavg --model FL_global_model.pt --site-dir ... --out ...

Writes to ``--out``: ``per_image.csv`` (site, image, Dice, per-class Dice, HD95 in stored pixels and in mm where
``provenance.csv`` records the spacing, ECE, pixel error rate, the image's mean of each uncertainty map),
``per_site.csv`` (one row per site: Dice, HD95, ECE, and where the task scores several structures each one's Dice
and HD95 beside the mean; for the method's own uncertainty ECE (15 bins), Brier, NLL,
AUROC/AUPRC of errors, Spearman ρ with Dice, AURC, and the other maps' figures), ``reliability_<site>.png``,
``risk_coverage.png``, uncertainty maps of the first ``--maps`` images per site (``maps/<site>/``) and, with
``--save-predictions``, every image's scored class map (``predictions/<site>/<image>.png``).
Bad input stops with exit code 2 and one line naming the file, site or parameter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from feduq.cli import verb_parser

from feduq.site.evaluation import evaluate_job as evaluate  # the tool's function (tests call it from here too)

def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def with_structures(out: Path, per_site: list[dict], results: dict) -> list[dict]:
    """``per_site.csv`` rewritten with each scored structure's mean Dice (``dice_<s>``, fraction) and HD95
    (``hd95_px_<s>``, stored pixels) beside the means, where the task scores several (fundus disc and cup), from the
    sites' per-image rows (:func:`feduq.scores.tables.structure_means`); a volume site's row (per case) is kept as it
    is. Returns the rows."""
    from feduq.scores.tables import structure_means, write_rows

    rows = [r if "n_cases" in r else structure_means(r, results[r["site"]]["per_image"]) for r in per_site]
    if rows != per_site:
        write_rows(Path(out) / "per_site.csv", rows)
    return rows


def main(argv=None) -> int:
    p = verb_parser("feduq evaluate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="workspace, server run folder, job folder or config_fed_client.json")
    p.add_argument("--model", help="model file (default: the workspace's global model)")
    p.add_argument("--which", choices=["best", "last"], default="best", help="which global model of a workspace")
    p.add_argument("--site-dir", action="append", default=[], help="a site folder (images/, masks/, labels.json); "
                   "repeat for several")
    p.add_argument("--site", type=lambda v: v.split(","), default=[], help="sites of --data-root, comma-separated")
    p.add_argument("--data-root", help="data root of --site (default: $FEDUQ_DATA_ROOT)")
    p.add_argument("--split", choices=["all", "train", "val", "test"], default="all",
                   help="all: every image/mask pair of the folder (default); else the site's own split")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (checked before anything is loaded)")
    p.add_argument("--max-items", type=_positive_int, help="first N >= 1 images per site (quick checks)")
    p.add_argument("--maps", type=int, default=4, help="uncertainty-map panels per site (0: none)")
    p.add_argument("--save-predictions", action="store_true", help="write each image's scored class map "
                   "(predictions/<site>/<image>.png, uint8 class indices at the stored size)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true", help="replace an --out folder holding files FedUQ did not write "
                                                         "(what FedUQ wrote there is replaced, the rest kept)")
    args = p.parse_args(argv)
    from feduq.data import DataError, data_error_in
    from feduq.site.evaluation import EvaluationError

    try:
        from feduq.core.training import check_device

        check_device(args.device)
        if args.maps < 0:
            raise ValueError(f"--maps {args.maps}: expected an integer >= 0 (uncertainty-map panels per site)")
        per_site, results = evaluate(
            args.job, out=args.out, site_dirs=args.site_dir, sites=args.site, data_root=args.data_root,
            split=args.split, model=args.model, which=args.which, device=args.device, max_items=args.max_items,
            maps=args.maps, save_predictions=args.save_predictions, force=args.force)
        with_structures(args.out, per_site, results)
    except (EvaluationError, DataError, ValueError) as e:
        print(f"feduq evaluate: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # MONAI wraps a transform's DataError (e.g. a mask value labels.json does not declare)
        cause = data_error_in(e)
        if cause is None:
            raise
        print(f"feduq evaluate: error: {cause}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'per_image.csv'} and {args.out / 'per_site.csv'}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq evaluate", main))
