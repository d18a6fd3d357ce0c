"""Checks of a volume file before its voxels are used: a spacing as the file writes it, and no undefined voxel.

Two readers mend a bad file without a word. nibabel's loader and SimpleITK (nnU-Net's reader, ``SimpleITKIO``) read
a NIfTI voxel size (``pixdim``) of 0 or NaN as 1 mm and a negative one as its absolute value, so a volume without a
spacing is measured (HD95, mL) and planned (the federation's target spacing and patch) at a made-up 1 mm; and
SimpleITK's NIfTI reader reads a NaN voxel as 0, so a case whose intensities are undefined moves the plan's intensity
properties and is trained on. :func:`check_volume_file` reads the header as written (:func:`nifti_spacing_problem`:
the same rule :func:`feduq.io.volumes.read_volume` applies to the slice-wise path) and, for a floating-point
volume, its voxels, and refuses such a file in one line naming it; :func:`check_case_files` does so for a case's
files, naming the site, and refuses a case whose label (or another channel) is on another voxel grid than its image,
naming both files.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..tasks.spec import site_error
from .volumes import VolumeError, _first_line, _nifti_header_as_written, is_nifti, keep_locale, nifti_spacing_problem

__all__ = ["nifti_spacing_problem", "check_volume_file", "check_case_files", "volume_shape"]


def _floating(dtype) -> bool:
    return bool(np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.complexfloating))


def check_volume_file(path: str | os.PathLike, voxels: bool = True) -> None:
    """Refuse a volume file that a reader would read wrong without a word (module doc): a header whose spacing is not
    finite and > 0 as the file writes it (NIfTI: ``pixdim`` and the sform/qform codes, read raw,
    :func:`nifti_spacing_problem`; NRRD/MHA: the spacing SimpleITK reads from the header) and, with ``voxels``, a NaN
    or infinite voxel. Only a floating-point volume (or a NIfTI with an infinite scale) has its voxels read; any
    other file than NIfTI, NRRD and MHA (a 2D image, a DICOM folder) is not looked at.

    Raises:
        VolumeError: one line naming the file: no usable spacing, a NaN or infinite voxel, an unreadable header or
            voxels.
    """
    path = Path(path)
    if is_nifti(path):
        problem = nifti_spacing_problem(path)
        if problem:
            raise VolumeError(problem)
        header = _nifti_header_as_written(path)
        scales = [float(header[k]) for k in ("scl_slope", "scl_inter")]
        if not voxels or not (_floating(header.get_data_dtype()) or any(np.isinf(v) for v in scales)):
            return
        import nibabel as nib

        def read():
            return np.asanyarray(nib.load(str(path)).dataobj)
    elif path.name.lower().endswith((".nrrd", ".mha")):
        import SimpleITK as sitk

        reader = _sitk_header(path)
        spacing = np.asarray(reader.GetSpacing(), dtype=float)
        if not (np.all(np.isfinite(spacing)) and np.all(spacing > 0)):
            raise VolumeError(f"{path}: the volume has no spacing (voxel sizes {spacing.tolist()} mm in its header); "
                              "FedUQ needs the scanner geometry to measure in mm and to write results in it")
        kind = sitk.GetPixelIDValueAsString(reader.GetPixelID())
        if not voxels or not ("float" in kind or "double" in kind):
            return

        def read():
            return sitk.GetArrayFromImage(reader.Execute())
    else:
        return
    try:
        with keep_locale():
            data = read()
    except MemoryError:
        raise VolumeError(f"{path}: its voxels do not fit in this machine's memory") from None
    except (OSError, EOFError, ValueError, RuntimeError) as e:  # a file shorter than its header says (nibabel, gzip)
        raise VolumeError(f"{path}: cannot read its voxels ({_first_line(e)})") from None
    bad = int(np.count_nonzero(~np.isfinite(data)))
    if bad:
        raise VolumeError(f"{path}: {bad:,} of its {data.size:,} voxels are NaN or infinite; FedUQ reads no volume "
                          "with undefined intensities (nnU-Net's reader would take them as 0): fill them or leave the "
                          "case out")


def check_case_files(files: dict, site: str | None = None, voxels: bool = True) -> None:
    """:func:`check_volume_file` on a case's files (``{"channels": [paths], "label": path or None}``, as
    :func:`feduq.sites.nnunet_raw.list_cases` gives them), its error naming ``site`` when given.

    Raises:
        DataError: ``"site '<site>': <file>: ..."`` (a :class:`~feduq.io.volumes.VolumeError` without ``site``).
    """
    paths = [*(files.get("channels") or ()), *([files["label"]] if files.get("label") is not None else [])]
    try:
        for path in paths:
            check_volume_file(path, voxels)
        shapes = [(path, volume_shape(path)) for path in paths]
        known = [(p, sh) for p, sh in shapes if sh is not None]
        for path, shape in known[1:]:  # nnU-Net's reader fails on it only when the case is scored, minutes later
            if shape != known[0][1]:
                what = "label" if files.get("label") is not None and path == files["label"] else "channel"
                raise VolumeError(f"{path}: this {what} volume is {' x '.join(map(str, shape))} voxels but its image "
                                  f"{known[0][0]} is {' x '.join(map(str, known[0][1]))}: a case's files must lie "
                                  "on one grid")
    except VolumeError as e:
        if site is None:
            raise
        raise site_error(site, str(e)) from None


def volume_shape(path: str | os.PathLike) -> tuple[int, ...] | None:
    """A volume file's voxel grid as its header gives it (the first three axes, i j k: nibabel's and SimpleITK's
    order alike), without reading its voxels; None for a file that is not NIfTI, NRRD or MHA.

    Raises:
        VolumeError: an unreadable NRRD/MHA header (naming the file)."""
    path = Path(path)
    if is_nifti(path):
        return tuple(int(n) for n in _nifti_header_as_written(path).get_data_shape()[:3])
    if path.name.lower().endswith((".nrrd", ".mha")):
        return tuple(int(n) for n in _sitk_header(path).GetSize()[:3])
    return None


def _sitk_header(path: Path):
    """SimpleITK's reader of an NRRD/MHA file with its header read (no voxels).

    Raises:
        VolumeError: the header cannot be read (naming the file)."""
    import SimpleITK as sitk

    reader = sitk.ImageFileReader()
    reader.SetFileName(str(path))
    try:
        with keep_locale():
            reader.ReadImageInformation()
    except RuntimeError as e:
        raise VolumeError(f"{path}: cannot read this file ({str(e).strip().splitlines()[-1]})") from None
    return reader
