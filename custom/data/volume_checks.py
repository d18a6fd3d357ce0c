"""Checks of a volume file before its voxels are used: a spacing as the file writes it, and no undefined voxel.

Two readers mend a bad file without a word. nibabel's loader and SimpleITK (nnU-Net's reader, ``SimpleITKIO``) read
a NIfTI voxel size (``pixdim``) of 0 or NaN as 1 mm and a negative one as its absolute value, so a volume without a
spacing is measured (HD95, mL) and planned (the federation's target spacing and patch) at a made-up 1 mm; and
SimpleITK's NIfTI reader reads a NaN voxel as 0, so a case whose intensities are undefined moves the plan's intensity
properties and is trained on. :func:`check_volume_file` reads the header as written (:func:`nifti_spacing_problem`:
the same rule :func:`feduq.data.volumes.read_volume` applies to the slice-wise path) and, for a floating-point
volume, its voxels, and refuses such a file in one line naming it; :func:`check_case_files` does so for a case's
files, naming the site.
"""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np

from .tasks import site_error
from .volumes import VolumeError, is_nifti, keep_locale

__all__ = ["nifti_spacing_problem", "check_volume_file", "check_case_files"]


def _first_line(e: BaseException) -> str:
    return (str(e).strip() or type(e).__name__).splitlines()[0]


def _nifti_header_as_written(path: Path):
    """The NIfTI-1 or -2 header of ``path`` as the file holds it (``check=False``: nibabel's loader would mend a voxel
    size of 0 to 1 and a negative one to its absolute value)."""
    import nibabel as nib
    from nibabel.openers import ImageOpener

    try:
        with ImageOpener(str(path)) as f:
            raw = f.read(540)
    except (OSError, EOFError) as e:
        raise VolumeError(f"{path}: cannot read this NIfTI file ({_first_line(e)})") from None
    sizes = {int(np.frombuffer(raw[:4], dtype=f"{e}i4")[0]) for e in "<>"} if len(raw) >= 4 else set()
    klass = nib.Nifti2Header if 540 in sizes else nib.Nifti1Header
    try:
        return klass.from_fileobj(io.BytesIO(raw), check=False)
    except Exception as e:  # noqa: BLE001 - nibabel raises HeaderDataError, ValueError, ... on a bad header
        raise VolumeError(f"{path}: not a NIfTI header ({_first_line(e)})") from None


def nifti_spacing_problem(path: str | os.PathLike) -> str | None:
    """One line saying why the NIfTI file ``path`` has no usable spacing as written, or None: a voxel size in its
    header (``pixdim``) not finite or <= 0, or sform and qform codes both 0 (no scanner geometry).

    Raises:
        VolumeError: the header cannot be read (naming the file).
    """
    header = _nifti_header_as_written(Path(path))
    zooms = np.asarray(header["pixdim"][1:4], dtype=float)
    codes = (int(header["sform_code"]), int(header["qform_code"]))
    sized = bool(np.all(np.isfinite(zooms)) and np.all(zooms > 0))
    if sized and codes != (0, 0):
        return None
    mended = "" if sized else "; SimpleITK, nnU-Net's reader, would read such a size as 1 mm or as its absolute value"
    return (f"{path}: the volume has no spacing (voxel sizes {zooms.tolist()} mm in its header, sform/qform codes "
            f"{codes}){mended}; FedUQ needs the scanner geometry to measure in mm and to write results in it (set the "
            "voxel sizes and the qform or sform in the header)")


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

        reader = sitk.ImageFileReader()
        reader.SetFileName(str(path))
        try:
            with keep_locale():
                reader.ReadImageInformation()
        except RuntimeError as e:
            raise VolumeError(f"{path}: cannot read this file ({str(e).strip().splitlines()[-1]})") from None
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
    :func:`feduq.data.nnunet_raw.list_cases` gives them), its error naming ``site`` when given.

    Raises:
        DataError: ``"site '<site>': <file>: ..."`` (a :class:`~feduq.data.volumes.VolumeError` without ``site``).
    """
    for path in [*(files.get("channels") or ()), *([files["label"]] if files.get("label") is not None else [])]:
        try:
            check_volume_file(path, voxels)
        except VolumeError as e:
            if site is None:
                raise
            raise site_error(site, str(e)) from None
