"""Apply a trained FedUQ model to a folder of cases (the body of ``feduq predict``, whose help is its module doc:
:mod:`feduq.commands.site.predict`): the cases' kinds decided once (:func:`feduq.predict.files.find_cases`), 2D images
through :func:`feduq.predict.planes.predict_planes`, a declared task's volumes through
:mod:`feduq.predict.declared_cases` or, for a 3D job, :mod:`feduq.predict.volumes_3d`, and a CT job's multi-head model
through :func:`predict_ct`. Every case's files are written only when complete; ``predictions.csv`` has one row per
case (:mod:`feduq.predict.rows`)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np

# only what --help and argument checks need at the top: torch, MONAI and the network load when a command runs
from .files import (DEFAULT_OUTPUTS, OUTPUTS, Case, PredictError, find_cases, map_scale, overlay, parse_outputs,
                    read_plane, write_case)
from .rows import case_row, label_meanings, structures

__all__ = ["predict", "predict_ct"]

TOOL = "predict"


def _check_inputs(cases: list[Case], in_channels: int, outputs=(), resample_gaps: bool = False) -> None:
    """Decode every 2D image and open every volume's header before anything runs (bad input: nothing written; a DICOM
    series with unevenly spaced slices without ``resample_gaps``: :func:`feduq.io.volumes.read_volume`); with
    ``dicom_seg`` in ``outputs``, check that a DICOM Segmentation can reference each DICOM series. Prints a note per
    resampled series."""
    from ..io.volumes import read_volume
    from .dicom_seg import seg_problem

    for case in cases:
        if case.kind == "image":
            read_plane(case.path, in_channels)
            continue
        vol = read_volume(case.path, resample_gaps)
        if vol.resampled:
            print(f"note: {vol.resampled}")
        problem = seg_problem(vol.source_files) if vol.source_files and "dicom_seg" in outputs else None
        if problem:
            raise PredictError(f"input {case.path}: no DICOM Segmentation can be written for this series: {problem} "
                               f"(leave dicom_seg out of --outputs to write the NIfTI label map only)")


def _seg_identity(method: str, names, model_file, outputs, regions=None):
    """What a DICOM Segmentation says of its maker and its segments: the task's structures, a nested region
    covering every class inside it (None: no SEG is written)."""
    if "dicom_seg" not in outputs:
        return None
    from .dicom_seg import SegIdentity
    from ..review.rule import file_sha256

    return SegIdentity(method, list(names), {"model_file": Path(model_file).name, "model_sha256": file_sha256(model_file)},
                       structures(names, regions))


def predict(loaded, input_path, out, *, batch_size: int = 8, pixel_spacing: float | None = None,
            review_path=None, force: bool = False, progress: bool = True, outputs=DEFAULT_OUTPUTS,
            threads: int | None = None, resample_gaps: bool = False, mirror: bool = False) -> list[dict]:
    """Predict every case of ``input_path`` into ``out`` (see the module doc); returns the CSV rows.

    Args:
        outputs: what is written per case, names of :data:`feduq.predict.files.OUTPUTS` (default: the label map and
            the method's own uncertainty map); ``predictions.csv`` and ``scales.json`` are always written.
        threads: worker threads decoding and writing 2D images beside the device (default
            :func:`feduq.predict.planes.writer_threads`).
        resample_gaps: resample a DICOM series whose slices are not evenly spaced onto an even grid over its true
            extent (:func:`feduq.io.volumes.read_volume`) instead of refusing it.
        mirror: a 3D job's test-time mirroring (:class:`feduq.nnunet.volume_inference.Mirrored`, the plan's mirror
            axes); refused for any other job.

    Raises:
        PredictError / feduq.io.volumes.VolumeError / feduq.outputs.OutputFolderError / feduq.review.rule.ReviewError:
            bad input, output, option or threshold, before anything is written (one line naming it).
    """
    import tempfile

    with tempfile.TemporaryDirectory(prefix="feduq-predict-") as scratch:  # DICOM series staged for a declared task
        return _predict(loaded, input_path, out, Path(scratch), batch_size=batch_size, pixel_spacing=pixel_spacing,
                        review_path=review_path, force=force, progress=progress, outputs=outputs, threads=threads,
                        resample_gaps=resample_gaps, mirror=mirror)


def _predict(loaded, input_path, out, scratch: Path, *, batch_size, pixel_spacing, review_path, force, progress,
             outputs, threads, resample_gaps, mirror) -> list[dict]:
    import torch
    from tqdm import tqdm

    from ..scores.tables import write_rows
    from ..outputs import check_output_folder, user_files, write_marker
    from .planes import Predictor, array_stats, predict_planes
    from ..review.rule import load_threshold
    from ..io.volumes import normalise_volume, read_volume

    if pixel_spacing is not None and not (pixel_spacing > 0 and math.isfinite(pixel_spacing)):
        raise PredictError(f"--pixel-spacing {pixel_spacing}: expected a positive size in mm")
    if mirror and getattr(loaded.site, "configuration", "2d") == "2d":
        raise PredictError("--mirror: test-time mirroring is built for a 3D job's sliding window (configuration "
                           "3d_fullres); this job predicts 2D planes")
    from ..data import get_task

    outputs = parse_outputs(outputs)
    declared = get_task(loaded.task).layout == "nnunet"  # nnU-Net-named inputs, label files as nnU-Net
    # writes them (a task in FedUQ's own layout takes image files of any name)
    if declared:
        from .declared_cases import find_declared_cases, predict_declared_cases, stage_series

        declared_cases = stage_series(find_declared_cases(input_path, loaded.task), scratch, resample_gaps,
                                      seg="dicom_seg" in outputs)
        cases = [c for c, _ in declared_cases]
    else:
        cases = find_cases(input_path)
    out = check_output_folder(out, {"input": input_path, "model file": loaded.model_file,
                                    "job config": loaded.config_file}, TOOL, force=force)
    threshold = load_threshold(loaded.model_file, review_path)
    predictor = Predictor(loaded, batch_size)
    in_channels = predictor.spec.in_channels
    if not declared:
        _check_inputs(cases, in_channels, outputs, resample_gaps)
    out.mkdir(parents=True, exist_ok=True)
    keep = user_files(out)  # the user's files (kept with --force) are never listed as FedUQ's
    write_marker(out, TOOL, exclude=keep)
    names, C = predictor.spec.class_names, predictor.num_classes
    parts = structures(names, predictor.spec.eval_regions)  # classes and nnU-Net's nested regions, by name
    scales = {"probability.png": 1.0, **({f"probability_{k}.png": 1.0 for k in parts} if len(parts) > 1 else {}),
              **{f"uncertainty_{k}.png": map_scale(k, C) for k in predictor.uncertainty(
        torch.zeros(1, C, 1, 1))}}
    volume_job = declared and getattr(loaded.site, "configuration", "2d") != "2d"  # float NIfTI volumes, no PNG
    series = any(f.get("series") is not None for _, f in declared_cases) if declared else any(
        c.kind == "volume" and Path(c.path).is_dir() for c in cases)
    written = [o for o in outputs if not (volume_job and o == "overlay") and (o != "dicom_seg" or series)]
    if volume_job and "overlay" in outputs:
        print("note: --outputs overlay: a 3D job writes no overlay picture of a volume; its label and uncertainty "
              "volumes open in a viewer over the input (3D Slicer, ITK-SNAP)")
    png = {} if volume_job else {"png16": "value = png / 65535 * scale", "scales": scales}
    (out / "scales.json").write_text(json.dumps({
        **png, "label": label_meanings(names, parts),
        **({"regions": {n: list(c) for n, c in predictor.spec.eval_regions.items()}} if predictor.spec.eval_regions
           else {}),
        "uncertainty_units": "nats (vacuity: C/S, unitless)", "method": loaded.method, "model_file": str(loaded.model_file),
        "outputs": written, "review": None if threshold is None else threshold.__dict__}, indent=1) + "\n")
    rows = []
    seg_identity = _seg_identity(loaded.method, names, loaded.model_file, outputs, predictor.spec.eval_regions)
    images = [] if declared else [c for c in cases if c.kind == "image"]
    bar = tqdm(total=len(cases), unit="case", disable=not progress, desc="predict")
    scale = map_scale(predictor.primary, C)

    def read(case):
        return read_plane(case.path, in_channels)

    def write_image(case, image, res):
        pic = None
        if "overlay" in outputs:
            shown = np.asarray(image.convert("RGB") if image.mode not in ("L", "RGB") else image)
            pic = overlay(shown, res["label"].T, res["maps"][predictor.primary].T, scale)
        write_case(out, case, res["label"] if "label" in outputs else None, res.get("probability"), res["maps"],
                   predictor.primary, C, pic, probabilities=res.get("probabilities"))
        bar.update(1)

    familiar = threshold is not None and threshold.familiarity is not None
    volume_job = declared and getattr(loaded.site, "configuration", "2d") != "2d"
    if familiar and not volume_job:  # a 3D network's features are pooled over its windows (predict_3d_cases)
        predictor.take_features()

    def declared_row(case, stats, shape, primary, _, *a, features=None):
        return case_row(case, stats, shape, primary, parts, *a, threshold, features)

    if volume_job:  # a volume job's 3D network, nnU-Net's way
        from .volumes_3d import predict_3d_cases

        rows += predict_3d_cases(loaded, declared_cases, out, outputs, declared_row, on_case=lambda: bar.update(1),
                                 seg_identity=seg_identity, mirror=mirror, features=familiar)
    elif declared:  # nnU-Net-named cases: the label file as nnU-Net writes it, FedUQ's folder and row beside
        rows += predict_declared_cases(predictor, declared_cases, out, outputs, declared_row, pixel_spacing,
                                       on_case=lambda: bar.update(1), seg_identity=seg_identity)
    results = predict_planes(predictor, images, read, write_image, outputs, threads)
    rows += [case_row(case, res["stats"], res["label"].shape, predictor.primary, parts,
                  None if pixel_spacing is None else pixel_spacing ** 2, False, threshold, res.get("features"))
             for case, res in zip(images, results)]
    for case in (c for c in cases if c.kind == "volume" and not declared):
        vol = read_volume(case.path, resample_gaps)
        u8 = normalise_volume(vol.lps)[0].astype(np.float32)
        planes = [np.repeat(u8[None, :, :, z], in_channels, axis=0) for z in range(u8.shape[2])]
        res = predictor.planes(planes)
        label = np.stack([r["label"] for r in res], axis=-1)
        prob = np.stack([r["probability"] for r in res], axis=-1)
        maps = {k: np.stack([r["maps"][k] for r in res], axis=-1) for k in res[0]["maps"]}
        z = int(np.argmax((label > 0).sum(axis=(0, 1)))) if label.any() else label.shape[2] // 2
        pic = overlay(u8[:, :, z].T, label[:, :, z].T, maps[predictor.primary][:, :, z].T, scale) \
            if "overlay" in outputs else None
        kept = {k: v for k, v in maps.items() if "uncertainty_maps" in outputs or
                (k == predictor.primary and "uncertainty" in outputs)}
        probs = ({k: np.stack([r["probabilities"][k] for r in res], axis=-1) for k in res[0]["probabilities"]}
                 if "probabilities" in res[0] else None)
        write_case(out, case, label if "label" in outputs else None, prob if "probability" in outputs else None,
                   kept, predictor.primary, C, pic, volume=vol, seg_identity=seg_identity, probabilities=probs,
                   seg_label=label)
        stats = array_stats(label, maps, predictor.primary, C)
        feats = np.mean([r["features"] for r in res], axis=0) if "features" in res[0] else None
        rows.append(case_row(case, stats, label.shape, predictor.primary, parts, float(np.prod(vol.spacing)), True,
                         threshold, feats))
        bar.update(1)
    bar.close()
    csv_tmp = out / ".predictions.csv.tmp"
    write_rows(csv_tmp, rows)
    os.replace(csv_tmp, out / "predictions.csv")
    write_marker(out, TOOL, exclude=keep)
    return rows


def predict_ct(m, input_path, out, *, force: bool = False, progress: bool = True, outputs=DEFAULT_OUTPUTS,
               resample_gaps: bool = False) -> list[dict]:
    """Predict every case of ``input_path`` with a CT job's multi-head model ``m``
    (:func:`feduq.ct.inference.load_ct_model`) into ``out``: NIfTI volumes and DICOM series through the nnU-Net 2D plan
    slice by slice, or 8-bit windowed CT slices (PNG). One label map in the global organ ids (``scales.json`` names
    them: background, liver, kidney, spleen, pancreas), the foreground probability and FIVA's uncertainty maps (the mean
    over the heads of u = aleatoric + epistemic, and each part; 0 <= u < 1) in the input's geometry; per case the
    volume of each organ in mL. FedUQ's CT sites train on windowed 8-bit slices, so a volume in HU is first windowed
    like them (:data:`feduq.ct.inference.CT_WINDOW_HU` -> 0..255) when the plan's intensity statistics are 8-bit.

    Raises:
        PredictError / feduq.io.volumes.VolumeError / feduq.outputs.OutputFolderError: before anything is written.
    """
    from tqdm import tqdm

    from ..data import ct as fct
    from ..ct.inference import CT_MAPS, hu_to_window, predict_volume
    from ..scores.tables import write_rows
    from ..outputs import check_output_folder, user_files, write_marker
    from ..io.volumes import normalise_volume, read_volume

    from .planes import array_stats

    outputs = parse_outputs(outputs)
    cases = find_cases(input_path)
    out = check_output_folder(out, {"input": input_path, "model file": m.model_file, "job config": m.config_file},
                              TOOL, force=force)

    def chosen(label, prob, maps, pic):  # what --outputs keeps of a case (FIVA's own map: total)
        return (label if "label" in outputs else None, prob if "probability" in outputs else None,
                {k: v for k, v in maps.items() if "uncertainty_maps" in outputs or
                 (k == "total" and "uncertainty" in outputs)}, pic if "overlay" in outputs else None)

    _check_inputs(cases, 1, outputs, resample_gaps)
    out.mkdir(parents=True, exist_ok=True)
    keep = user_files(out)  # the user's files (kept with --force) are never listed as FedUQ's
    write_marker(out, TOOL, exclude=keep)
    names = list(fct.ORGANS)
    (out / "scales.json").write_text(json.dumps({
        "png16": "value = png / 65535 * scale", "scales": {"probability.png": 1.0, **{f"uncertainty_{k}.png": 1.0
                                                                                     for k in CT_MAPS}},
        "label": {str(i): n for i, n in enumerate(names)}, "organs_predicted": m.organs,
        "uncertainty_units": "FIVA's per-head u = aleatoric + epistemic (1 - sum_c p^2), mean over the heads",
        "method": m.method, "model_file": str(m.model_file), "review": None}, indent=1) + "\n")
    rows = []
    seg_identity = _seg_identity(m.method, names, m.model_file, outputs)
    for case in tqdm(cases, unit="case", disable=not progress, desc="predict"):
        if case.kind == "image":
            array, image = read_plane(case.path, 1)
            res = predict_volume(m, array[0].T, None)  # [H, W] rows, as FedUQ's CT sites read their slices
            label, prob, maps = res["label"].T, res["probability"].T, {k: v.T for k, v in res["maps"].items()}
            pic = overlay(np.asarray(image.convert("L")), res["label"], res["maps"]["total"], 1.0)
            kept_label, kept_prob, kept_maps, kept_pic = chosen(label, prob, maps, pic)
            write_case(out, case, kept_label, kept_prob, kept_maps, "total", len(names), kept_pic)
            rows.append(case_row(case, array_stats(label, maps, "total", len(names)), label.shape, "total",
                                 structures(names), None,
                            False, None))
            continue
        vol = read_volume(case.path, resample_gaps)
        image = vol.lps.astype(np.float32).transpose(2, 1, 0)  # [Z, H, W] = (S, P, L), as feduq.data.ct.read_case
        res = predict_volume(m, hu_to_window(m, image), tuple(vol.spacing[::-1]))
        label, prob = res["label"].transpose(2, 1, 0), res["probability"].transpose(2, 1, 0)
        maps = {k: v.transpose(2, 1, 0) for k, v in res["maps"].items()}
        z = int(np.argmax((label > 0).sum(axis=(0, 1)))) if label.any() else label.shape[2] // 2
        shown = normalise_volume(vol.lps)[0]
        pic = overlay(shown[:, :, z].T, label[:, :, z].T, maps["total"][:, :, z].T, 1.0)
        kept_label, kept_prob, kept_maps, kept_pic = chosen(label, prob, maps, pic)
        write_case(out, case, kept_label, kept_prob, kept_maps, "total", len(names), kept_pic, volume=vol,
                   seg_identity=seg_identity)
        rows.append(case_row(case, array_stats(label, maps, "total", len(names)), label.shape, "total",
                             structures(names),
                        float(np.prod(vol.spacing)), True, None))
    csv_tmp = out / ".predictions.csv.tmp"
    write_rows(csv_tmp, rows)
    os.replace(csv_tmp, out / "predictions.csv")
    write_marker(out, TOOL, exclude=keep)
    return rows
