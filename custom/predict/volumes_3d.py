"""``predict`` with a volume job's 3D network (``configuration 3d_fullres``): nnU-Net's way, case by case.

Each case (``<case>_0000<ending>``, ... as an nnU-Net raw dataset's ``imagesTs/``) is read with the plan's reader and
preprocessed as the sites preprocessed their training cases (crop, resample to the plan's spacing, the plan's
normalisation; :meth:`feduq.nnunet.pipeline.SitePipeline.preprocess_files`), predicted by Gaussian sliding windows of
the plan's patch, and mapped back onto the input's grid (:func:`feduq.nnunet.volume_inference.predict_volume`).
Written per case:

* ``<out>/<case><ending>``: the label volume as nnU-Net's predictor writes it (the plan's reader-writer, the input's
  geometry, the task's label values);
* ``<out>/<case>/``: ``uncertainty_<map>.nii.gz`` (float32, the map's own unit: nats, or vacuity C/S; the method's
  own map, every map with ``--outputs uncertainty_maps``), ``probability.nii.gz`` (float32 foreground probability)
  and ``probability_<structure>.nii.gz`` with ``--outputs probability``, all on the input's grid;
* ``<out>/<case>/segmentation.dcm`` for a DICOM series (staged as NIfTI in its own geometry,
  :func:`feduq.predict.declared_cases.stage_series`) with ``dicom_seg`` in the outputs: the label volume as a DICOM
  Segmentation referencing the series' instances frame by frame (:mod:`feduq.predict.dicom_seg`);
* its ``predictions.csv`` row: the volume of each structure in mL (voxel count x the input's voxel volume), the case
  uncertainty and the review rule's decision (with a familiarity part, on the volume's pooled bottleneck features:
  :func:`feduq.nnunet.volume_inference.volume_features`, as the calibration took them).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["predict_3d_cases"]


def _write_float(array: np.ndarray, like: dict, path: Path) -> None:
    """A float32 volume in the reader's axis order, with the geometry of nnU-Net's properties ``like`` (SimpleITK)."""
    import SimpleITK as sitk

    image = sitk.GetImageFromArray(np.ascontiguousarray(array, dtype=np.float32))
    stuff = like["sitk_stuff"]
    image.SetSpacing(stuff["spacing"])
    image.SetOrigin(stuff["origin"])
    image.SetDirection(stuff["direction"])
    sitk.WriteImage(image, str(path), True)


def _series_classes(label_file: Path, series, values: np.ndarray) -> np.ndarray:
    """The class map ``[X, Y, Z]`` on a DICOM series' LPS grid (:class:`feduq.io.volumes.Volume`) of the label file
    nnU-Net's writer wrote in the series' geometry (its task values -> class indices), for the series' SEG."""
    from ..io.volumes import read_volume

    written = read_volume(label_file)
    if written.lps.shape != series.lps.shape or not np.allclose(written.lps_affine, series.lps_affine, atol=1e-3):
        raise AssertionError(f"{label_file}: not on the series' grid ({written.lps.shape} vs {series.lps.shape})")
    index = np.zeros(int(values.max()) + 1, np.uint8)
    index[values] = np.arange(len(values))
    return index[np.asarray(written.lps, np.int64)]


def predict_3d_cases(loaded, cases, out: Path, outputs, row, on_case=None, seg_identity=None,
                     mirror: bool = False, features: bool = False) -> list[dict]:
    """Predict each declared case ``(Case, {"channels": [paths], "series": Volume or absent})`` with the loaded 3D
    job (module docstring); ``row(case, stats, shape, primary, class names, voxel volume mm³, True, features=F)``
    makes each ``predictions.csv`` row; returns them. With ``seg_identity``
    (:class:`feduq.predict.dicom_seg.SegIdentity`) a DICOM series case also gets its DICOM Segmentation; with
    ``mirror``, nnU-Net's test-time mirroring over the plan's mirror axes; with ``features``, ``F`` is the volume's
    pooled bottleneck features ``[F]`` float64 (:func:`feduq.nnunet.volume_inference.volume_features`, unmirrored),
    else None.

    Raises:
        feduq.predict.files.PredictError: a case whose files nnU-Net's reader cannot read (naming it).
    """
    import torch

    from ..data import get_task
    from ..nnunet.volume_inference import predict_volume, volume_features
    from ..site.site3d import largest_components
    from ..outputs import usual_permissions
    from .files import PredictError
    from .planes import array_stats
    from .rows import structures

    site, spec = loaded.site, get_task(loaded.task)
    pipeline = site.make_pipeline(spec)
    names, C = spec.class_names, len(spec.class_names)
    parts = structures(names, spec.eval_regions)
    largest = largest_components(site, spec)  # the job's reduction, as its sites' test reduces
    primary = site.primary_uncertainty
    values = np.asarray(spec.label_values)
    writer = pipeline.pm.image_reader_writer_class()
    rows = []
    for case, files in cases:
        try:
            data, _, props = pipeline.preprocess_files(files["channels"], None)
        except Exception as e:  # noqa: BLE001 - nnU-Net's readers raise many kinds on a bad file
            raise PredictError(f"input {Path(files['channels'][0]).parent}: nnU-Net's reader cannot read case "
                               f"{case.name!r}: {type(e).__name__}: {e}") from None
        res = predict_volume(loaded.model, pipeline, data, props, torch.device(site.device), site.prob_fn,
                             site.uncertainty_fn(), mirror_axes=pipeline.augmentation()[3] if mirror else (),
                             largest=largest)
        feats = (volume_features(loaded.model.bottleneck, data, pipeline.patch_size, torch.device(site.device))
                 if features else None)
        label = res["label"]
        final = out / f"{case.name}{spec.label_ending}"
        tmp = out / f".{case.name}.partial{spec.label_ending}"
        writer.write_seg(values[label.astype(np.int64)].astype(np.uint8 if values.max() < 256 else np.uint16),
                         str(tmp), props)
        os.replace(tmp, final)
        stage = usual_permissions(Path(tempfile.mkdtemp(prefix=f".{case.name}.partial-", dir=out)))
        try:
            kept = {k: v for k, v in res["maps"].items() if "uncertainty_maps" in outputs or
                    (k == primary and "uncertainty" in outputs)}
            for name, m in kept.items():
                _write_float(m, props, stage / f"uncertainty_{name}.nii.gz")
            if "probability" in outputs:
                _write_float(1.0 - res["probabilities"][0], props, stage / "probability.nii.gz")
                if len(parts) > 1:
                    for name, classes in parts.items():
                        _write_float(res["probabilities"][list(classes)].sum(0), props,
                                     stage / f"probability_{name}.nii.gz")
            series = files.get("series")
            if seg_identity is not None and series is not None:
                from .dicom_seg import SEG_FILE, write_dicom_seg

                classes = _series_classes(final, series, values)
                write_dicom_seg(stage / SEG_FILE, series.source_files, series.instance_frames(classes), seg_identity)
            if (out / case.name).exists():
                shutil.rmtree(out / case.name)
            os.replace(stage, out / case.name)
        finally:
            if stage.exists():
                shutil.rmtree(stage)
        voxel_mm3 = float(np.prod(props["spacing"]))
        stats = array_stats(label, res["maps"], primary, C)
        # the shape as the file states it (nibabel's x, y, z), not nnU-Net's array order (z, y, x)
        rows.append(row(case, stats, tuple(reversed(label.shape)), primary, names, voxel_mm3, True, features=feats))
        if on_case is not None:
            on_case()
    return rows
