"""Score a volume job's 3D model (``configuration 3d_fullres``) on a site's labelled cases, as its test task does.

:func:`feduq.site.evaluation.evaluate_site` scores a 2D dataset slice by slice; a 3D job's model sees whole volumes,
so its site's cases are read here as nnU-Net raw cases (:func:`volume_cases`: a split of the site, or every case of
a folder), each preprocessed with the plan's pipeline, predicted by Gaussian sliding windows and mapped back onto
its file's grid (:func:`feduq.nnunet.volume_inference.predict_volume`), then scored as the site's test task scores it
(Dice per case, HD95 in mm with the file's spacing: :func:`feduq.scores.volume_scores.volume_site_results`; the
case's ECE on the preprocessed grid) and as
``predict`` scores a volume for the review rule (:func:`feduq.scores.case_scores.array_stats` on the whole class map
and the method's own uncertainty volume), so ``predict --calibrate`` and ``feduq evaluate`` work on a 3D job. The
uncertainty quality (ECE, Brier, AUROC of voxel errors, ...) is accumulated over every voxel of the files' grids.
With ``case_level`` each volume also gets the review rule's familiarity features: the spatial mean of the encoder's
last stage on each window of the sliding window, averaged over the volume's windows
(:func:`feduq.nnunet.volume_inference.volume_features`), as ``predict`` and the bundle take them.
Not here: uncertainty-map pictures.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..scores.metrics import calibration_error
from ..scores.uncertainty_quality import PixelAccumulator
from ..scores.volume_scores import WholeCaseMaps, volume_site_results
from ..data import DataError, get_task
from ..sites import nnunet_raw as nr

__all__ = ["VolumeCases", "volume_cases", "evaluate_volume_site", "volume_case_slice"]

#: evaluate's split names -> nnU-Net's split keys
_SPLIT_KEYS = {"train": "training", "val": "validation", "test": "testing"}


@dataclass
class VolumeCases:
    """A site's labelled volumes for a 3D job: ``cases`` (case -> ``{"channels": [paths], "label": path}``, in order)
    and the site's ``labels`` (:class:`feduq.sites.nnunet_raw.SiteLabels`: its values as the task's classes)."""

    cases: dict
    labels: object
    center_dir: Path
    annotated: tuple | None = field(default=None)

    def __len__(self) -> int:
        return len(self.cases)


def volume_cases(task, center_dir: Path, site: str, split: str, max_items: int | None = None) -> VolumeCases:
    """The labelled cases of ``split`` (``"all"``, ``"train"``, ``"val"``, ``"test"``: the site's own split by case,
    :func:`feduq.sites.nnunet_raw.nnunet_split`) of the nnU-Net raw site at ``center_dir``; at most ``max_items``.

    Raises:
        DataError: naming the site: not an nnU-Net raw site of the task, a bad ``dataset.json`` or split file, or no
            case in the split; a volume whose header gives no spacing or with a NaN or infinite voxel (naming the
            file; every case's files are checked before any case is scored:
            :func:`feduq.io.volume_checks.check_case_files`).
    """
    from ..io.volume_checks import check_case_files

    spec = get_task(task)
    labels = nr.read_site_labels(center_dir, spec, site)
    cases = nr.list_cases(center_dir, spec, site, labels)
    names = list(cases) if split == "all" else nr.nnunet_split(center_dir, spec, site, list(cases))[_SPLIT_KEYS[split]]
    names = names[:max_items] if max_items else names
    if not names:
        raise DataError(f"site {site!r}: no cases in split {split!r} of {center_dir}")
    for name in names:  # nnU-Net's reader would read NaN voxels as 0: refused before minutes of scoring
        check_case_files(cases[name], site)
    return VolumeCases({n: cases[n] for n in names}, labels, Path(center_dir),
                       labels.annotated if labels.partial else None)


def evaluate_volume_site(loaded, cases: VolumeCases, site: str, case_level: bool = False,
                         predictions_dir=None, max_maps: int = 0) -> dict:
    """Score ``loaded``'s 3D model on ``cases`` (module doc); the result has :func:`feduq.site.evaluation.
    evaluate_site`'s keys, one row per case (``image`` = the case; ``dice``, ``hd95_mm`` and per structure
    ``dice_<s>``, ``hd95_mm_<s>``, ``volume_ml_<s>``, ``reference_ml_<s>``; ``hd95_px`` NaN: a volume's distance is
    in mm):
    ``per_image``, ``summary``, ``quality`` and, with ``case_level``, ``features`` (``[cases, F]`` float64: each
    volume's pooled bottleneck features, :func:`feduq.nnunet.volume_inference.volume_features`, in the rows' order;
    None for a network without :meth:`feduq.nnunet.planned.PlannedNetwork.bottleneck`), ``volumes`` (the same rows,
    each with ``predict``'s case scores ``u_mean``, ``u_foreground``, ``u_boundary``, ``area_fraction`` and the
    reference's ``mask_fraction``) and ``volume_features`` (the same array).

    With ``predictions_dir`` each case's class map is written there as ``<case><ending>`` (the plan's reader-writer,
    the file's geometry, class indices); ``max_maps`` > 0 only prints a note (no map pictures of volumes).

    Raises:
        DataError: a case nnU-Net's reader cannot read (naming the site and the file).
    """
    from ..scores.case_scores import array_stats
    from ..nnunet.volume_inference import predict_volume, volume_features
    from .site3d import class_lut, largest_components, reference_classes

    exe, spec = loaded.site, get_task(loaded.task)
    regions = spec.eval_regions or None
    pipeline = exe.make_pipeline(spec, cases.labels.file_ending)
    unc_fn, primary, C = exe.uncertainty_fn(), exe.primary_uncertainty, len(spec.class_names)
    maps_seen, accs, eces, extra = WholeCaseMaps(), {}, [], {}
    if max_maps > 0:
        print(f"note: {site}: no uncertainty-map pictures of a 3D job's volumes (predict writes its uncertainty "
              "volumes)")
    if predictions_dir is not None:
        Path(predictions_dir).mkdir(parents=True, exist_ok=True)
    lut = class_lut(cases.labels.value_to_class)
    bottleneck = getattr(loaded.model, "bottleneck", None) if case_level else None
    features = {}
    for case, files in cases.cases.items():
        try:
            data, pre_seg, props = pipeline.preprocess_files(files["channels"], files["label"])
            label = reference_classes(pipeline, files["label"], cases.labels.value_to_class)
        except Exception as e:  # noqa: BLE001 - nnU-Net's readers raise many kinds on a bad file
            raise DataError(f"site {site!r}: nnU-Net's reader cannot read case {case!r} "
                            f"({Path(files['channels'][0]).name}): {type(e).__name__}: {e}") from None
        with torch.no_grad():
            res = predict_volume(loaded.model, pipeline, data, props, torch.device(exe.device), exe.prob_fn, unc_fn,
                                 largest=largest_components(exe, spec))
            if bottleneck is not None:  # the familiarity part's features, as predict takes them
                features[case] = volume_features(bottleneck, data, pipeline.patch_size, torch.device(exe.device))
        maps_seen.add(case, res["label"], label, props["spacing"])
        if predictions_dir is not None:
            pipeline.pm.image_reader_writer_class().write_seg(
                res["label"].astype(np.uint8), str(Path(predictions_dir) / f"{case}{cases.labels.file_ending}"), props)
        # the case's ECE as the site's test task computes it: on the preprocessed grid
        pre_label = torch.from_numpy(lut[np.asarray(pre_seg, dtype=np.int64)].astype(np.int64)).clamp_min(0)[None]
        eces.append(float(calibration_error(torch.from_numpy(res["probabilities_preprocessed"])[None], pre_label)[0]))
        probs, y = torch.from_numpy(res["probabilities"])[None], torch.from_numpy(label.astype(np.int64))[None, None]
        for name, m in res["maps"].items():
            accs.setdefault(name, PixelAccumulator()).update(probs, y, torch.from_numpy(m)[None])
        stats = array_stats(res["label"], res["maps"], primary, C)
        extra[case] = {"ece": eces[-1], "error_rate": float((res["label"] != label).mean()),
                       **{f"u_{k}": float(v.mean()) for k, v in res["maps"].items()},
                       **({"u_mean": stats["case_uncertainty"], "u_foreground": stats["u_foreground"],
                           "u_boundary": stats["u_boundary"], "area_fraction": stats["area_fraction"],
                           "mask_fraction": float((label > 0).mean())} if case_level else {})}
    metrics, per_case, _ = volume_site_results(maps_seen, np.asarray(eces), spec.class_names, regions, site,
                                               cases.annotated)
    # every structure keeps its Dice, HD95 (mm) and volumes (mL) per case, as the site's per-case test file
    rows = [{"site": r["site"], "image": r["case"], **{k: v for k, v in r.items() if k not in ("site", "case")},
             "hd95_px": float("nan"), **extra[r["case"]]} for r in per_case]
    dice = np.array([r["dice"] for r in rows])
    quality = {name: acc.result(image_dice=dice) for name, acc in accs.items()}
    q = quality[primary]
    summary = {"site": site, "method": loaded.method, "n_images": len(rows), "n_cases": len(rows),
               "dice": metrics["dice"], "dice_std": float(dice.std()), "hd95_px": float("nan"),
               "hd95_mm": metrics["hd95_mm"], "ece_monai": float(np.mean(eces)), "uncertainty": primary,
               "ece15": q["ece"], "brier": q["brier"], "nll": q["nll"], "auroc": q["auroc"], "auprc": q["auprc"],
               "spearman_rho": q.get("spearman_rho", float("nan")), "aurc": q["aurc"], "optimal_aurc": q["optimal_aurc"]}
    for name, r in quality.items():
        summary.update({f"auroc_{name}": r["auroc"], f"auprc_{name}": r["auprc"],
                        f"spearman_rho_{name}": r.get("spearman_rho", float("nan")), f"aurc_{name}": r["aurc"]})
    out = {"per_image": rows, "summary": summary, "quality": quality}
    if case_level:
        stacked = np.stack([features[r["image"]] for r in rows]) if bottleneck is not None and rows else None
        out.update(features=stacked, volumes=rows, volume_features=stacked)
    return out


def volume_case_slice(loaded, files: dict, value_to_class) -> dict:
    """One case of a 3D job predicted whole (the sliding window ``predict`` and the evaluation run) and cut at the
    slice, along the file's first array axis (axial for nnU-Net's reader of an axial series), with the largest
    reference area (the middle slice when the reference is empty): for the site report's pictures.

    Args:
        files: the case's ``{"channels": [paths], "label": path or None}``.
        value_to_class: the site's label values -> the task's classes.

    Returns:
        ``{"image": [H, W] float (the first channel as read), "label": [H, W] int64 classes, "uncertainty": [H, W]
        (the method's primary uncertainty), "reference": [H, W] int64 classes or None, "slice": int}``.

    Raises:
        DataError: nnU-Net's reader cannot read the case (naming the file).
    """
    from ..nnunet.volume_inference import predict_volume
    from .site3d import largest_components, reference_classes

    exe, spec = loaded.site, get_task(loaded.task)
    pipeline = exe.make_pipeline(spec)
    try:
        data, _, props = pipeline.preprocess_files(files["channels"], None)
        image, _ = pipeline.pm.image_reader_writer_class().read_images([str(files["channels"][0])])
        ref = None if files.get("label") is None else reference_classes(pipeline, files["label"], value_to_class)
    except Exception as e:  # noqa: BLE001 - nnU-Net's readers raise many kinds on a bad file
        raise DataError(f"nnU-Net's reader cannot read {Path(files['channels'][0]).name}: {type(e).__name__}: "
                        f"{e}") from None
    with torch.no_grad():
        res = predict_volume(loaded.model, pipeline, data, props, torch.device(exe.device), exe.prob_fn,
                             exe.uncertainty_fn(), largest=largest_components(exe, spec))
    label = np.asarray(res["label"])
    area = (ref > 0).sum(axis=(1, 2)) if ref is not None else np.zeros(label.shape[0])
    z = int(np.argmax(area)) if area.any() else label.shape[0] // 2
    return {"image": np.asarray(image[0][z], dtype=np.float64), "label": label[z].astype(np.int64),
            "uncertainty": np.asarray(res["maps"][exe.primary_uncertainty])[z],
            "reference": None if ref is None else ref[z].astype(np.int64), "slice": z}
