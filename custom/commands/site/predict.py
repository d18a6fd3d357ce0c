"""Apply a trained FedUQ model to new, unlabelled images and volumes: label maps, probabilities, the method's own
uncertainty, an overlay and a review flag per case.

::

    # the best global model of a run on a folder of images (PNG, JPEG, TIFF), NIfTI volumes or DICOM series folders
    feduq predict --job workspaces/fedevi --input /data/new_patients --out predictions/

    # choose the review flag's threshold on a labelled set (a site folder with masks, or a site's validation split)
    feduq predict --job workspaces/fedevi --calibrate --site-dir /data/polyp/Hospital-X --target-dice 0.8
    feduq predict --job workspaces/fedevi --calibrate --site Kvasir-SEG --split val --data-root DATA ...

    # export the model as a MONAI Bundle (TorchScript network, inference config, README)
    feduq predict --job workspaces/fedevi --export-bundle bundles/fedevi_polyp

The job's own network, preprocessing, post-processing and uncertainty are rebuilt from its client config
(:func:`feduq.site.evaluation.load_model`, as ``feduq evaluate`` does), and the same functions score and predict: the
test-stage image transforms (:func:`feduq.io.transforms.make_image_transforms`), the mapping of logits back onto the
image's grid (:func:`feduq.scores.scoring.to_stored_grid`) and the class map with its post-processing
(:func:`feduq.scores.scoring.segment`). So on a site's own images ``predict``'s label maps are ``evaluate``'s predictions.

Per case, written into ``--out/<case>/`` only when complete (:func:`feduq.predict.files.write_case`), what
``--outputs`` names (:data:`feduq.predict.files.OUTPUTS`; default ``label,uncertainty,dicom_seg``): ``label``, the
label map in the input's own geometry (2D: PNG at the image's width x height; NIfTI/DICOM: NIfTI with the input's
shape and affine); ``dicom_seg``, for a DICOM series also ``segmentation.dcm``, a DICOM Segmentation that references
the series' instances frame by frame, for the hospital's viewer (:mod:`feduq.predict.dicom_seg`); ``uncertainty``, the method's own uncertainty map (FedEvi: total = aleatoric + epistemic in nats; FedUAA,
GraphFedSeg: vacuity C/S; the softmax methods: predictive entropy in nats); ``uncertainty_maps``, every map of the
method (FedEvi adds aleatoric, epistemic and vacuity); ``probability``, the foreground probability and, where the
task reports several structures, ``probability_<structure>`` for each (a nested region's is the sum of its classes'
probabilities, as nnU-Net's ``--save_probabilities`` gives one map per region); ``overlay``,
``overlay.png`` for a person. ``predictions.csv`` has one row per case whatever is written: predicted foreground in
pixels (voxels) and in mm² (mL) where the spacing is known, the case-level uncertainty (the image mean of the
method's own map) and its mean inside and outside the prediction, each map's mean, and the review flag
(:mod:`feduq.review.rule`). ``scales.json`` states the PNG scales. 2D images run as a pipeline
(:func:`feduq.predict.planes.predict_planes`): worker threads decode the next batch and write the last one's files
while the device computes, and everything but the connected components runs on the model's device.

Volumes go through a 2D model slice by slice as FedUQ's MRI sites were made (:mod:`feduq.io.volumes`). A CT job
(nnU-Net 2D plan, multi-head: FedAvg, FIVA, FUNAvg) predicts with its released ``multi_head_model.pt`` through the
same slice inference its sites' test task runs (:mod:`feduq.ct.inference`): one label map in the global organ ids
(``scales.json`` names them), the foreground probability and FIVA's uncertainty maps, the volume of each organ in mL
(:func:`predict_ct`). Bad input stops with exit code 2 and one line naming it, before anything is written.

    # a CT job's multi-head model on NIfTI volumes, DICOM series or 8-bit CT slices
    feduq predict --job workspaces/fiva_p --input /data/ct_volumes --out ct_predictions/

A declared volume task's 3D job (``configuration 3d_fullres``) predicts each case whole, nnU-Net's way
(:mod:`feduq.predict.volumes_3d`: its preprocessing, Gaussian sliding windows of the plan's patch, the label and
uncertainty volumes on the input's grid); its inputs are nnU-Net-named files or, for a one-channel task, DICOM series
folders (a DICOM Segmentation beside the label file); ``--mirror`` adds nnU-Net's test-time mirroring; ``--calibrate``
scores whole volumes (:mod:`feduq.site.evaluation_3d`).

    feduq predict --job workspaces/fedavg_3d --input /data/Dataset005_Prostate/Hospital-A/imagesTs \
        --out pred3d/ --mirror
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from ...cli import verb_parser
# only what --help and argument checks need at the top: torch, MONAI and the network load when a command runs
from ...predict.calibrate import calibrate
from ...predict.files import DEFAULT_OUTPUTS, OUTPUTS, PredictError, parse_outputs
from ...predict.pipeline import predict, predict_ct

__all__ = ["predict", "calibrate", "main", "bundle_command"]

TOOL = "predict"


def bundle_command(bundle: str | os.PathLike) -> str:
    """The shell line that runs an exported bundle under MONAI's runner, verbatim: ``IMAGES`` and ``OUT`` are the
    only words to replace (the bundle's paths resolve against ``--bundle_root``, so it runs from any folder)."""
    import shlex

    root = Path(bundle).resolve()
    return (f"python -m monai.bundle run --config_file {shlex.quote(str(root / 'configs' / 'inference.json'))} "
            f"--bundle_root {shlex.quote(str(root))} --dataset_dir IMAGES --output_dir OUT")


def main(argv=None, prog: str = "feduq predict", description: str | None = None, hide: tuple[str, ...] = ()) -> int:
    """``feduq predict`` (and, as ``prog``, the verbs over it: ``calibrate``, ``report``, ``export-bundle``, whose
    ``--help`` shows their ``description`` and leaves out the options in ``hide``). Returns the exit code."""
    p = verb_parser(prog, description=description or __doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True, help="workspace, server run folder, job folder or config_fed_client.json")
    p.add_argument("--model", help="model file (default: the workspace's global model, or a CT job's "
                                   "multi_head_model.pt; any state dict of the job's network, e.g. a site's own model)")
    p.add_argument("--which", choices=["best", "last"], default="best", help="which global model of a workspace")
    p.add_argument("--input", help="an image, NIfTI volume or DICOM series folder, or a folder of them")
    p.add_argument("--out", help="output folder (made by predict; refused inside the input)")
    p.add_argument("--force", action="store_true", help="replace an output folder that predict did not make")
    p.add_argument("--batch-size", type=int, default=8, help="planes per forward pass (default 8)")
    p.add_argument("--outputs", default=",".join(DEFAULT_OUTPUTS),
                   help=f"what is written per case, comma-separated from {', '.join(OUTPUTS)} or all (default "
                        f"{','.join(DEFAULT_OUTPUTS)}: the label map, the method's own uncertainty map and, for a DICOM "
                        f"series, the label map as a DICOM Segmentation; "
                        f"predictions.csv is always written)")
    p.add_argument("--resample-gaps", action="store_true",
                   help="resample a DICOM series whose slices are not evenly spaced (a missing slice) onto an even "
                        "grid over its true extent, step at most the smallest slice step (default: refuse it)")
    p.add_argument("--mirror", action="store_true",
                   help="a 3D job: test-time mirroring as nnU-Net's predictor does by default (the logits averaged "
                        "over every flip of the plan's mirror axes, 2^k passes); the sites' test and the bundle do "
                        "not mirror")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--pixel-spacing", type=float, help="side of a 2D image pixel in mm (adds foreground_mm2)")
    p.add_argument("--review-file", help="the review threshold file (default: <model file>.review.json)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--calibrate", action="store_true", help="choose the review threshold on labelled images")
    p.add_argument("--target-dice", type=float, default=0.8, help="--calibrate: accepted cases' mean Dice (fraction)")
    p.add_argument("--delta", type=float, default=None,
                   help="--calibrate: the certificate's error level: the accepted cases' mean Dice at the labelled "
                        "cases' site reaches --target-dice with probability >= 1 - delta (default 0.1)")
    p.add_argument("--uncertified", action="store_true",
                   help="--calibrate: the empirical rule (no finite-sample promise; e.g. several training sites' "
                        "validation images, for a site that labels none of its own)")
    p.add_argument("--units", choices=["images"],
                   help="--calibrate: 'images': each labelled image is its own patient (recorded in the certificate); "
                        "default: the site's own grouping (videos, volumes, the task's group pattern)")
    p.add_argument("--unit-pattern", metavar="REGEX",
                   help="--calibrate: a regular expression on the image names whose first group names the patient")
    p.add_argument("--max-unit-images", type=int,
                   help="--calibrate: the most images one patient may hold, fixed before the data (default 32 when "
                        "units group images, 1 for --units images); a larger unit is refused")
    p.add_argument("--pooled-sites", action="store_true",
                   help="--calibrate with several sites: certify the mixture of their patients in the labelled "
                        "proportions (stored and said as the mixture's; it promises nothing for each site alone). "
                        "Without it several sites are refused: certify at each site")
    p.add_argument("--site-dir", action="append", default=[], help="--calibrate: a labelled site folder (repeat)")
    p.add_argument("--site", type=lambda v: v.split(","), default=[], help="--calibrate: sites of --data-root")
    p.add_argument("--data-root", help="--calibrate: data root of --site (default: $FEDUQ_DATA_ROOT)")
    p.add_argument("--split", choices=["all", "train", "val", "test"], default="val", help="--calibrate: split of --site")
    p.add_argument("--report", action="store_true",
                   help="write the site acceptance report (report.html, its pictures, cases.csv) of the labelled cases "
                        "of --site-dir / --site into --out (with --calibrate: after choosing the rule on them)")
    p.add_argument("--allow-training-cases", action="store_true",
                   help="--calibrate/--report: use labelled cases the model's job trained on (refused by default); "
                        "the certificate records them and the report names them as optimistic")
    p.add_argument("--export-bundle", metavar="DIR", help="write the model as a MONAI Bundle into DIR")
    for action in p._actions:
        if set(action.option_strings) & set(hide):
            action.help = argparse.SUPPRESS
    args = p.parse_args(argv)
    from ...common.lean_monai import import_monai_lean, quiet_monai_notices

    import_monai_lean()  # MONAI without the packages predict never uses (a faster start-up)
    quiet_monai_notices()
    from ...core.training import check_device
    from ...data import DataError
    from ...site.evaluation import EvaluationError, client_config, load_model, locate, model_path
    from ...review.rule import ReviewError, file_sha256

    modes = [bool(args.input or (args.out and not args.report)), args.calibrate or args.report,
             bool(args.export_bundle)]
    try:
        if sum(modes) != 1:
            raise PredictError("choose one of: --input with --out (predict), --calibrate and/or --report with --out R, "
                               "--export-bundle DIR")
        if modes[0] and not (args.input and args.out):
            raise PredictError("predicting needs both --input and --out")
        if (args.delta is not None or args.uncertified) and not args.calibrate:
            raise PredictError("--delta and --uncertified choose how --calibrate chooses the rule; give --calibrate")
        if (args.units or args.unit_pattern or args.max_unit_images is not None) and (not args.calibrate
                                                                                      or args.uncertified):
            raise PredictError("--units, --unit-pattern and --max-unit-images say how a certificate counts patients; "
                               "give --calibrate (without --uncertified)")
        if args.units and args.unit_pattern:
            raise PredictError("--units images and --unit-pattern say two things: each image its own patient, or the "
                               "pattern's group; give one")
        if args.report and not args.out:
            raise PredictError("--report needs --out R, the report's folder")
        if args.allow_training_cases and not (args.report or args.calibrate):
            raise PredictError("--allow-training-cases lets --report and --calibrate use labelled cases the model's "
                               "job trained on; give one of them")
        if args.report and not (args.site_dir or args.site):
            raise PredictError("--report needs the site's labelled cases: --site-dir (a folder with masks) or --site "
                               "with --split")
        if args.batch_size < 1:
            raise PredictError(f"--batch-size {args.batch_size}: expected an integer >= 1")
        parse_outputs(args.outputs)  # refused before the model loads
        check_device(args.device)
        from ...ct.inference import MODEL_FILE, is_ct_config, load_ct_model

        config = client_config(args.job)
        if is_ct_config(config):
            if args.calibrate or args.report or args.export_bundle:
                raise PredictError("a CT job's multi-head model predicts only (no --calibrate or --export-bundle yet)")
            if args.mirror:
                raise PredictError("--mirror: test-time mirroring is built for a 3D job's sliding window; a CT job's "
                                   "multi-head model predicts 2D slices")
            model_file = model_path(args.model, args.job, MODEL_FILE)
            m = load_ct_model(config, model_file, device=args.device)
            for note in m.notes:
                print(f"note: {note}")
            print(f"model: {model_file} (SHA-256 {file_sha256(model_file)[:16]}…)")
            rows = predict_ct(m, args.input, args.out, force=args.force, progress=not args.no_progress,
                              outputs=args.outputs, resample_gaps=args.resample_gaps)
            print(f"{m.method}: {len(rows)} cases predicted into {args.out} ({Path(args.out) / 'predictions.csv'}); "
                  f"organs {', '.join(m.organs)}")
            return 0
        config, model_file = locate(args.job, args.model, args.which)
        loaded = load_model(config, model_file, device=args.device)
        for note in loaded.notes:
            print(f"note: {note}")
        print(f"model: {loaded.model_file} (SHA-256 {file_sha256(loaded.model_file)[:16]}…)")  # the one it describes
        if args.report:  # the report's folder is checked before anything is scored or stored
            from ...report.site_report import REPORT_FILES
            from ...outputs import check_output_folder, refuse_clashes, user_files

            out = check_output_folder(args.out, {"model file": loaded.model_file, "data root": args.data_root,
                                                 **{f"site folder {d}": d for d in args.site_dir}}, TOOL, args.force)
            refuse_clashes(out, user_files(out), REPORT_FILES, TOOL)  # with --force too: a user's report.html stays
        failed = None  # a --calibrate that could not certify: with --report, the report still says why
        if args.calibrate:
            from ...review.notes import calibration_line

            try:
                t, path = calibrate(loaded, target_dice=args.target_dice, site_dirs=args.site_dir, sites=args.site,
                                    data_root=args.data_root, split=args.split, review_path=args.review_file,
                                    delta=None if args.uncertified else (0.1 if args.delta is None else args.delta),
                                    units=args.units, unit_pattern=args.unit_pattern,
                                    max_unit_images=args.max_unit_images,
                                    allow_training_cases=args.allow_training_cases, pooled_sites=args.pooled_sites)
                print(calibration_line(t, path))
            except ReviewError as e:
                if not (args.report and getattr(e, "verdict", None) is not None):
                    raise
                failed = e
        if args.report:
            from ...review.rule import load_threshold
            from ...report.site_report import site_report

            page = site_report(loaded, args.out, site_dirs=args.site_dir, sites=args.site, data_root=args.data_root,
                               split=args.split, rule=load_threshold(loaded.model_file, args.review_file),
                               force=args.force, failure=None if failed is None else failed.verdict,
                               allow_training_cases=args.allow_training_cases)
            print(f"wrote the site acceptance report {page} (open it in a browser)")
            if failed is not None:  # nothing certified, no rule stored: the report says why
                raise failed
        if args.export_bundle:
            if getattr(loaded.site, "configuration", "2d") != "2d":  # a volume job's 3D network: nnU-Net's way
                from ...bundle.export_3d import export_bundle_3d as export_bundle
            else:
                from ...bundle.export import export_bundle

            path = export_bundle(loaded, args.export_bundle, force=args.force)
            print(f"wrote the MONAI Bundle {path}; run it with MONAI's runner (IMAGES: a folder of inputs, OUT: the "
                  f"output folder):\n{bundle_command(path)}")
        if modes[0]:
            from ...review.rule import load_threshold, review_file

            if load_threshold(loaded.model_file, args.review_file) is None:
                print(f"note: no review threshold for {loaded.model_file} ({args.review_file or review_file(model_file)}"
                      f" does not exist): no review flag is written; choose one with --calibrate")
            rows = predict(loaded, args.input, args.out, batch_size=args.batch_size, pixel_spacing=args.pixel_spacing,
                           review_path=args.review_file, force=args.force, progress=not args.no_progress,
                           outputs=args.outputs, resample_gaps=args.resample_gaps, mirror=args.mirror)
            flagged = sum(r["review"] == "yes" for r in rows)
            print(f"{loaded.method}: {len(rows)} cases predicted into {args.out}"
                  + (f", {flagged} flagged for review" if rows and rows[0]["review"] else "")
                  + f" ({Path(args.out) / 'predictions.csv'})")
            from ...review.notes import coverage_note, rule_note, unfamiliar_note

            rule = load_threshold(loaded.model_file, args.review_file)
            for note in (rule_note(rule), unfamiliar_note(rows, rule), coverage_note(rows, rule)):
                if note:
                    print(note)
    except (EvaluationError, DataError, ReviewError, ValueError) as e:
        message = str(e)
        for prefix in (f"{prog}: ", "feduq predict: ", "predict: "):  # a library error that names its tool already
            message = message[len(prefix):] if message.startswith(prefix) else message
        print(f"{prog}: error: {message}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from ...cli import run_main

    sys.exit(run_main("feduq predict", main))
