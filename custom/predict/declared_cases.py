"""``predict`` on a declared task's inputs, named as nnU-Net names them (:mod:`feduq.tasks.declared`).

An input folder holds ``<case>_0000<ending>``, ``<case>_0001<ending>``, ... (one file per channel, the task's
``file_ending``), as an nnU-Net raw dataset's ``imagesTs/``; the files of a case are read together, stacked in the
declared channel order and normalised as the sites normalised them (:func:`feduq.sites.nnunet_raw.read_case`). Each
case's label map is written as nnU-Net's predictor writes it, ``<out>/<case><ending>`` in the input's geometry
(volumes: the input's shape and affine; 2D: the image's width x height) holding the task's label values, beside
FedUQ's own case folder (uncertainty maps, overlay) and ``predictions.csv``.

A volume task with one channel also takes **DICOM series**, a folder per case beside (or instead of) the
nnU-Net-named files, the folder's name the case's: each series is read (:func:`feduq.io.volumes.read_volume`,
``--resample-gaps`` as for FedUQ's own layout) and staged as ``<case>_0000.nii.gz`` in a scratch folder in the
series' own geometry (:func:`stage_series`), so the declared pipeline (2D slice-wise or the 3D network) reads it as
it reads any case; the label NIfTI is then in the series' geometry and, with ``dicom_seg`` in the outputs, a DICOM
Segmentation referencing the series' instances is written beside the case's other files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..data import get_task
from ..sites.nnunet_raw import SiteLabels, list_cases, read_case
from .files import Case, PredictError

__all__ = ["find_declared_cases", "stage_series", "predict_declared_case", "predict_declared_cases",
           "write_nnunet_label"]


def find_declared_cases(path: str | os.PathLike, task) -> list[tuple[Case, dict]]:
    """The cases of an input folder of nnU-Net-named files (or of its ``imagesTs/``) and, for a one-channel volume
    task, of DICOM series folders in it: ``[(Case, {"channels": [path per channel]}), ...]`` (a series:
    ``{"channels": None, "series": its folder}``, to be staged by :func:`stage_series`) sorted by case.

    Raises:
        PredictError: the folder is missing or empty, holds a file of another ending, a case lacks a channel file, a
            DICOM series for a 2D or multi-channel task, or a series and files of one case name, a volume whose
            header gives no spacing (one line naming the folder and the file).
        feduq.io.volumes.VolumeError: a volume with a NaN or infinite voxel (naming the file; every volume of a
            floating-point type is read: :func:`feduq.io.volume_checks.check_volume_file`).
    """
    from ..data import DataError
    from ..io.volumes import is_dicom_series

    spec, path = get_task(task), Path(path)
    if path.is_dir() and (path / "imagesTs").is_dir():
        path = path / "imagesTs"
    d = spec
    if not path.is_dir():
        raise PredictError(f"input {path}: a declared task's input is a folder of <case>_0000{d.file_ending} "
                           "files (nnU-Net's naming)" + (" or of DICOM series folders" if d.kind == "3d" else ""))
    series = sorted(p for p in path.iterdir() if not p.name.startswith(".") and is_dicom_series(p))
    if series and (d.kind != "3d" or len(d.channel_names) != 1):
        what = ("declares 2D images" if d.kind != "3d" else
                f"declares {len(d.channel_names)} channels {list(d.channel_names)}; give each case as nnU-Net-named "
                f"files <case>_0000{d.file_ending}, <case>_0001{d.file_ending}, ...")
        raise PredictError(f"input {series[0]}: a DICOM series is one volume of one channel; task {spec.name!r} {what}")
    found: dict[str, tuple[Case, dict]] = {}
    if len(series) < sum(1 for p in path.iterdir() if not p.name.startswith(".")):
        try:
            cases = list_cases(path.parent, spec, "input", SiteLabels(d.file_ending, {}, ()), folder=path.name,
                               skip={p.name for p in series})
        except DataError as e:
            raise PredictError(str(e).replace("site 'input': ", f"input {path}: ", 1)) from None
        kind = "volume" if d.kind == "3d" else "image"
        for name, files in cases.items():  # every header before anything runs (bad input: nothing written)
            _check_headers(files["channels"], path)
            found[name] = (Case(name, files["channels"][0], kind), files)
        if d.kind == "3d":  # and every voxel: a NaN one (read as 0 by nnU-Net's reader) refused before any output
            from ..io.volume_checks import check_case_files

            for _, files in found.values():
                check_case_files(files)
    for folder in series:
        if folder.name in found:
            raise PredictError(f"input {folder}: case {folder.name!r} is given twice, as a DICOM series and as "
                               f"{found[folder.name][1]['channels'][0].name}")
        found[folder.name] = (Case(folder.name, folder, "volume"), {"channels": None, "series": folder})
    return [found[k] for k in sorted(found)]


def stage_series(cases: list[tuple[Case, dict]], scratch: Path, resample_gaps: bool = False,
                 seg: bool = False) -> list[tuple[Case, dict]]:
    """Read each DICOM series case of :func:`find_declared_cases` and write it as ``scratch/<case>_0000.nii.gz`` in
    the series' geometry (its stored values, e.g. CT in HU as the scanner's rescale gives them); returns the cases
    with ``{"channels": [that file], "series": its feduq.io.volumes.Volume}`` (other cases unchanged).

    Raises:
        feduq.io.volumes.VolumeError: a series that cannot be read (:func:`feduq.io.volumes.read_volume`), or with
            a NaN or infinite voxel.
        PredictError: with ``seg``, a series no DICOM Segmentation can reference (naming it; leave ``dicom_seg`` out).
    """
    from ..io.volumes import VolumeError, read_volume
    from .dicom_seg import seg_problem

    out = []
    for case, files in cases:
        if files.get("series") is None:
            out.append((case, files))
            continue
        vol = read_volume(files["series"], resample_gaps)
        if np.issubdtype(vol.lps.dtype, np.floating) and not np.isfinite(vol.lps).all():
            raise VolumeError(f"{case.path}: {int((~np.isfinite(vol.lps)).sum()):,} of the series' voxels are NaN or "
                              "infinite; FedUQ reads no volume with undefined intensities")
        if vol.resampled:
            print(f"note: {vol.resampled}")
        problem = seg_problem(vol.source_files) if seg else None
        if problem:
            raise PredictError(f"input {case.path}: no DICOM Segmentation can be written for this series: {problem} "
                               f"(leave dicom_seg out of --outputs to write the NIfTI label map only)")
        staged = scratch / f"{case.name}_0000.nii.gz"
        vol.save_nifti(vol.lps, staged, vol.lps.dtype)
        out.append((case, {"channels": [staged], "series": vol}))
    return out


def _check_headers(files, folder: Path) -> None:
    """A case's channel files open and share one grid (NIfTI: shape and affine; 2D: size); PredictError naming the
    file otherwise. Only headers are read."""
    grids = []
    for f in files:
        try:
            if str(f).lower().endswith((".nii", ".nii.gz")):
                import nibabel as nib

                img = nib.load(str(f))
                grids.append((tuple(img.shape), np.round(np.asarray(img.affine, float), 4).tolist()))
            elif str(f).lower().endswith((".png", ".bmp", ".jpg", ".jpeg")):
                from PIL import Image

                with Image.open(f) as im:
                    grids.append((im.size, None))
        except Exception as e:  # noqa: BLE001 - nibabel and Pillow raise many kinds on a bad header
            raise PredictError(f"input {folder}: cannot read {Path(f).name}: {str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__}") from None
        if grids[-1] != grids[0]:
            raise PredictError(f"input {folder}: {Path(f).name} is not on the grid of {Path(files[0]).name} "
                               f"({grids[-1][0]} vs {grids[0][0]}); a case's channel files share one grid")


def write_nnunet_label(out: Path, name: str, classes: np.ndarray, task, volume=None) -> Path:
    """Write a case's class map as ``<out>/<name><ending>`` holding the task's label values (class ``i`` -> the
    ``i``-th declared value): a volume ``[X, Y, Z]`` on ``volume``'s LPS grid in the input's geometry (NIfTI, or
    SimpleITK for NRRD/MHA), a 2D map ``[W, H]`` as an 8- or 16-bit PNG/TIFF of the image's size. Written to a hidden
    name first, then renamed into place."""
    d = get_task(task)
    values = np.asarray(d.label_values)[np.asarray(classes, np.int64)]
    dtype = np.uint8 if values.max(initial=0) < 256 else np.uint16
    final = out / f"{name}{d.label_ending}"
    tmp = out / f".{name}.partial{d.label_ending}"
    if volume is None:
        from PIL import Image

        Image.fromarray(np.ascontiguousarray(values.T).astype(dtype)).save(tmp)
    elif d.file_ending.lower().endswith((".nii", ".nii.gz")):
        volume.save_nifti(values, tmp, dtype)
    else:
        import SimpleITK as sitk

        data = np.ascontiguousarray(volume.to_input_order(values)).astype(dtype)
        image = sitk.GetImageFromArray(data.transpose(2, 1, 0))
        lps = np.diag([-1.0, -1.0, 1.0, 1.0]) @ np.asarray(volume.affine, float)
        spacing = np.linalg.norm(lps[:3, :3], axis=0)
        image.SetSpacing([float(s) for s in spacing])
        image.SetDirection([float(v) for v in (lps[:3, :3] / spacing).ravel()])
        image.SetOrigin([float(v) for v in lps[:3, 3]])
        sitk.WriteImage(image, str(tmp))
    os.replace(tmp, final)
    return final


def predict_declared_case(predictor, case: Case, files: dict) -> dict:
    """One declared case through ``predictor`` (:class:`feduq.predict.planes.Predictor`) plane by plane.

    Returns:
        ``{"label": [W, H] or [X, Y, Z] class indices, "probability", "maps": {name: array}, "shown": the first
        channel of the plane an overlay shows [W, H], "volume": the input's geometry or None, "planes": the per-plane
        results (stats, features)}``.
    """
    spec = predictor.spec
    data = read_case(case.name, {"channels": files["channels"], "label": None}, spec,
                     SiteLabels(spec.file_ending, {}, ()), "input")
    image, volume = data["image"], data["volume"]
    planes = [image] if image.ndim == 3 else [np.ascontiguousarray(image[..., z]) for z in range(image.shape[-1])]
    res = predictor.planes(planes)
    if volume is None:
        return {"label": res[0]["label"], "probability": res[0].get("probability"), "maps": res[0]["maps"],
                "probabilities": res[0].get("probabilities"), "shown": image[0], "volume": None, "planes": res}
    label = np.stack([r["label"] for r in res], axis=-1)
    z = int(np.argmax((label > 0).sum(axis=(0, 1)))) if label.any() else label.shape[2] // 2
    return {"label": label, "probability": np.stack([r["probability"] for r in res], axis=-1),
            "probabilities": ({k: np.stack([r["probabilities"][k] for r in res], axis=-1) for k in res[0]["probabilities"]}
                              if "probabilities" in res[0] else None),
            "maps": {k: np.stack([r["maps"][k] for r in res], axis=-1) for k in res[0]["maps"]},
            "shown": image[0, :, :, z], "shown_z": z, "volume": volume, "planes": res}


def predict_declared_cases(predictor, cases: list[tuple[Case, dict]], out: Path, outputs, row, pixel_spacing=None,
                           on_case=None, seg_identity=None) -> list[dict]:
    """Predict each declared case (:func:`predict_declared_case`) and write, per case, the nnU-Net-named label file
    (:func:`write_nnunet_label`, always) and FedUQ's case folder (:func:`feduq.predict.files.write_case`, what
    ``outputs`` names; a staged DICOM series with ``seg_identity`` also its DICOM Segmentation). ``row(case, stats,
    shape, primary, class names, unit area or voxel volume, is volume, features=...)`` makes each
    ``predictions.csv`` row; returns them."""
    from .files import map_scale, overlay, write_case
    from .planes import array_stats

    C, primary, rows = predictor.num_classes, predictor.primary, []
    scale = map_scale(primary, C)
    for case, files in cases:
        r = predict_declared_case(predictor, case, files)
        volume = r["volume"]
        write_nnunet_label(out, case.name, r["label"], predictor.spec.name, volume)
        at = (lambda a: a) if volume is None else (lambda a: a[:, :, r["shown_z"]])  # the plane an overlay shows
        pic = overlay(r["shown"].T, at(r["label"]).T, at(r["maps"][primary]).T, scale) if "overlay" in outputs else None
        kept = {k: v for k, v in r["maps"].items() if "uncertainty_maps" in outputs or
                (k == primary and "uncertainty" in outputs)}
        series = files.get("series")  # the staged file's grid is the series' own: its Volume references instances
        write_case(out, case, r["label"] if "label" in outputs else None,
                   r["probability"] if "probability" in outputs else None, kept, primary, C, pic,
                   volume=volume if series is None else series, seg_identity=seg_identity, seg_label=r["label"],
                   probabilities=r.get("probabilities") if "probability" in outputs else None)
        feats = np.mean([p["features"] for p in r["planes"]], axis=0) if "features" in r["planes"][0] else None
        unit = float(np.prod(volume.spacing)) if volume is not None else (
            None if pixel_spacing is None else pixel_spacing ** 2)
        rows.append(row(case, array_stats(r["label"], r["maps"], primary, C), r["label"].shape, primary,
                        predictor.spec.class_names, unit, volume is not None, features=feats))
        if on_case is not None:
            on_case()
    return rows
