#!/usr/bin/env python3
"""Evaluate a saved FedUQ model on any site: Dice, HD95, calibration and the quality of its uncertainty.

The network, preprocessing, post-processing and uncertainty of the job that trained the model are rebuilt from its
client config (:mod:`feduq.evaluation`), so a model is scored exactly as the job's final test task scores it, also
on a site folder that is in no split file and never took part in training (a held-out hospital)::

    # the best global model of a simulator run, on a folder of images/ + masks/ + labels.json nobody trained on
    python tools/evaluate.py --job workspaces/fedevi --site-dir /data/new_hospital/polyp/Hospital-X --out eval/x

    # the final global model on the test splits of two federation sites
    python tools/evaluate.py --job workspaces/fedevi --which last --site Kvasir-SEG,CVC-ClinicDB --split test \\
        --data-root ../shared/data --out eval/test

    # a model file with the job folder it came from
    python tools/evaluate.py --job jobs/fedavg --model FL_global_model.pt --site-dir ... --out ...

Writes to ``--out``: ``per_image.csv`` (site, image, Dice, per-class Dice, HD95 in stored pixels and in mm where
``provenance.csv`` records the spacing, ECE, pixel error rate, the image's mean of each uncertainty map),
``per_site.csv`` (one row per site: Dice, HD95, ECE; for the method's own uncertainty ECE (15 bins), Brier, NLL,
AUROC/AUPRC of errors, Spearman ρ with Dice, AURC, and the other maps' figures), ``reliability_<site>.png``,
``risk_coverage.png``, uncertainty maps of the first ``--maps`` images per site (``maps/<site>/``) and, with
``--save-predictions``, every image's scored class map (``predictions/<site>/<image>.png``).
Bad input stops with exit code 2 and one line naming the file, site or parameter.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

def evaluate(job, *, out, site_dirs=(), sites=(), data_root=None, split="all", model=None, which="best",
             device="cpu", max_items=None, maps=4, save_predictions=False, force=False) -> tuple[list[dict], dict]:
    """Score one model on several sites and write the files of the module doc.

    The output folder is checked first (:func:`feduq.outputs.check_output_folder`: never the job's config, the model, a site
    folder or the data root; an existing one only when FedUQ wrote every file in it, or with ``force``, which keeps
    the other files) and written all at once (:func:`feduq.outputs.staged_folder`): a failure leaves nothing.

    Returns:
        ``(per-site rows, {site: feduq.evaluation.evaluate_site result})``.

    Raises:
        feduq.evaluation.EvaluationError / feduq.data.DataError: bad job, model or site (named).
    """
    import warnings

    from feduq.evaluation import locate
    from feduq.outputs import check_output_folder, staged_folder

    warnings.filterwarnings("ignore", message=".*always_return_as_numpy.*")  # MONAI's own HD95 call
    config, model_file = locate(job, model, which)
    inputs = {"job config": config, "model file": model_file, "data root": data_root,
              **{f"site folder {d}": d for d in site_dirs}}
    final = check_output_folder(out, inputs, "evaluate.py", force=force)
    with staged_folder(final, overwrite=True, what="evaluate.py", marker="evaluate.py") as out:
        return _evaluate(config, model_file, out, site_dirs, sites, data_root, split, device, max_items, maps,
                         save_predictions)


def _evaluate(config, model_file, out, site_dirs, sites, data_root, split, device, max_items, maps, save_predictions):
    import numpy as np

    from feduq.evaluation import evaluate_site, load_model, site_dataset
    from feduq.reporting import write_rows
    from feduq.uncertainty_quality import plot_reliability, plot_risk_coverage

    loaded = load_model(config, model_file, device=device)
    for note in loaded.notes:
        print(f"note: {note}")
    print(f"{loaded.method} model {model_file} (task {loaded.task}, uncertainty "
          f"{loaded.site.primary_uncertainty!r})")
    per_image, per_site, curves, results = [], [], {}, {}
    targets = [dict(site_dir=d) for d in site_dirs] + [dict(site=s, data_root=data_root) for s in sites]
    if not targets:
        raise ValueError("name at least one site (--site-dir or --site)")
    for target in targets:
        name, dataset, center_dir = site_dataset(loaded, split=split, work_dir=out, max_items=max_items, **target)
        result = evaluate_site(loaded, dataset, name, center_dir, maps_dir=out / "maps" / name, max_maps=maps,
                               predictions_dir=out / "predictions" / name if save_predictions else None)
        row = {**result["summary"], "split": split, "model_file": str(model_file), "note": "; ".join(loaded.notes)}
        results[name] = result
        per_image += result["per_image"]
        per_site.append(row)
        q = result["quality"][row["uncertainty"]]
        plot_reliability(q["bins"], out / f"reliability_{name}.png", f"{loaded.method} {name}")
        curves[name] = (q["coverage"], q["risk"])
        print(f"{name}: {row['n_images']} images, Dice {100 * row['dice']:.2f}%, HD95 {row['hd95_px']:.2f} px"
              + ("" if np.isnan(row["hd95_mm"]) else f" ({row['hd95_mm']:.2f} mm)")
              + f", pooled ECE (15 bins) {row['ece15']:.4f}, AUROC({row['uncertainty']}) {row['auroc']:.3f}, AURC {row['aurc']:.4f}")
    write_rows(out / "per_image.csv", per_image)
    write_rows(out / "per_site.csv", per_site)
    plot_risk_coverage(curves, out / "risk_coverage.png", f"{loaded.method}: risk-coverage per site")
    return per_site, results


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value}")
    return value


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
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
    from feduq.evaluation import EvaluationError

    try:
        from feduq.engine import check_device

        check_device(args.device)
        evaluate(args.job, out=args.out, site_dirs=args.site_dir, sites=args.site, data_root=args.data_root,
                 split=args.split, model=args.model, which=args.which, device=args.device, max_items=args.max_items,
                 maps=args.maps, save_predictions=args.save_predictions, force=args.force)
    except (EvaluationError, DataError, ValueError) as e:
        print(f"evaluate.py: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # MONAI wraps a transform's DataError (e.g. a mask value labels.json does not declare)
        cause = data_error_in(e)
        if cause is None:
            raise
        print(f"evaluate.py: error: {cause}", file=sys.stderr)
        return 2
    print(f"wrote {args.out / 'per_image.csv'} and {args.out / 'per_site.csv'}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("evaluate.py", main))
