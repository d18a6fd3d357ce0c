"""3D volumes for FedUQ's 2D models: NIfTI files and DICOM series read in LPS, slices, and results written back in the
volume's own geometry.

FedUQ's 2D MRI sites were made from volumes by ``tools/convert_prostate.py``: each volume reoriented to LPS
(:func:`load_lps`), its intensities clipped to the volume's 0.5 / 99.5 percentiles and mapped to 0..255
(:func:`normalise_volume`), and every axial slice ``vol[:, :, z]`` stored as an 8-bit image. A trained model is applied
to a new volume the same way (:mod:`feduq.predict`), and its per-slice outputs are put back into the input's own
voxel order with :meth:`Volume.to_input_order`, so a written label map has the input's shape and affine (oblique
affines included: the reorientation only permutes and flips axes).

DICOM series are read with SimpleITK (``ImageSeriesReader``; its LPS geometry is turned into a NIfTI affine, RAS).
"""

from __future__ import annotations

import contextlib
import locale
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .tasks import DataError

__all__ = ["VolumeError", "Volume", "read_volume", "load_lps", "normalise_volume", "NIFTI_SUFFIXES", "is_nifti",
           "is_dicom_series"]

NIFTI_SUFFIXES = (".nii", ".nii.gz")
_LPS = ("L", "P", "S")


class VolumeError(DataError):
    """A volume that cannot be used; one line naming the file and the reason."""


def is_nifti(path: str | os.PathLike) -> bool:
    """True for a ``.nii`` or ``.nii.gz`` file name."""
    return str(path).lower().endswith(NIFTI_SUFFIXES)


def is_dicom_series(path: str | os.PathLike) -> bool:
    """True for a folder holding ``.dcm`` files (one series; read with :func:`read_volume`)."""
    path = Path(path)
    return path.is_dir() and any(p.suffix.lower() == ".dcm" for p in path.iterdir())


@dataclass
class Volume:
    """A volume reoriented to LPS, with what is needed to write results back in the input's geometry.

    Attributes:
        path: the file or DICOM folder read.
        lps: the voxel array ``[x -> L, y -> P, z -> S]`` in its stored dtype.
        spacing: voxel size in mm along the LPS axes ``(sx, sy, sz)``.
        affine: the input's own 4 x 4 voxel-to-world affine (RAS, NIfTI convention).
        shape: the input's own array shape.
        header: the input's NIfTI header (None for DICOM).
        lps_affine: the affine of :attr:`lps`.
        source_files: a DICOM series' instances in the order of the input's slice axis (empty for NIfTI).
    """

    path: Path
    lps: np.ndarray
    spacing: tuple[float, float, float]
    affine: np.ndarray
    shape: tuple[int, int, int]
    header: object = None
    lps_affine: np.ndarray | None = None
    source_files: tuple[Path, ...] = ()

    def to_input_order(self, array: np.ndarray) -> np.ndarray:
        """An array on the LPS grid ``[X, Y, Z, ...]`` (as :attr:`lps`) -> the input's own voxel order and shape."""
        import nibabel as nib

        back = nib.orientations.ornt_transform(nib.orientations.axcodes2ornt(_LPS),
                                               nib.orientations.io_orientation(self.affine))
        out = nib.orientations.apply_orientation(array, back)
        if out.shape[:3] != self.shape:
            raise AssertionError(f"reorientation gave {out.shape[:3]}, the input has {self.shape}")
        return out

    def save_nifti(self, array: np.ndarray, path: str | os.PathLike, dtype) -> None:
        """Write an LPS-grid ``[X, Y, Z]`` array as NIfTI with the input's shape, affine (and header, where the input
        is NIfTI), in ``dtype`` (no intensity scaling)."""
        import nibabel as nib

        data = np.ascontiguousarray(self.to_input_order(array)).astype(dtype)
        header = self.header.copy() if self.header is not None else None
        img = nib.Nifti1Image(data, self.affine, header=header)
        img.set_data_dtype(dtype)
        img.header["scl_slope"], img.header["scl_inter"] = 1.0, 0.0
        if header is None:
            img.set_qform(self.affine, code=1)
            img.set_sform(self.affine, code=1)
        nib.save(img, str(path))


def _nifti(path: Path):
    import nibabel as nib

    try:
        img = nib.load(str(path))
    except Exception as e:  # nibabel raises ImageFileError, OSError, EOFError, ... on bad files
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise VolumeError(f"{path}: cannot read this NIfTI file ({reason})") from None
    if len(img.shape) == 4 and img.shape[3] == 1:
        img = img.slicer[..., 0]
    if len(img.shape) != 3:
        raise VolumeError(f"{path}: shape {tuple(img.shape)}; expected a 3D volume")
    zooms = np.asarray(img.header.get_zooms()[:3], dtype=float)
    codes = (int(img.header["sform_code"]), int(img.header["qform_code"]))
    if not np.all(np.isfinite(zooms)) or np.any(zooms <= 0) or codes == (0, 0):
        raise VolumeError(f"{path}: the volume has no spacing (voxel sizes {zooms.tolist()}, sform/qform codes "
                          f"{codes}); FedUQ needs the scanner geometry to write results in it")
    return img


@contextlib.contextmanager
def keep_locale():
    """Restore the process locale afterwards: GDCM (SimpleITK's DICOM I/O) can switch it to "C", after which Python
    opens text files as ASCII and any later non-ASCII write (a README, a label name) fails."""
    saved = locale.setlocale(locale.LC_ALL)
    try:
        yield
    finally:
        locale.setlocale(locale.LC_ALL, saved)


def _dicom(folder: Path):
    """``(array [x, y, z], affine RAS, instances in z order)`` of the one DICOM series in ``folder`` (SimpleITK)."""
    with keep_locale():
        return _read_dicom(folder)


def _read_dicom(folder: Path):
    import SimpleITK as sitk

    reader = sitk.ImageSeriesReader()
    ids = reader.GetGDCMSeriesIDs(str(folder))
    if len(ids) != 1:
        raise VolumeError(f"{folder}: {len(ids)} DICOM series; put one series per folder")
    files = tuple(Path(f) for f in reader.GetGDCMSeriesFileNames(str(folder), ids[0]))
    reader.SetFileNames([str(f) for f in files])
    try:
        image = reader.Execute()
    except RuntimeError as e:
        raise VolumeError(f"{folder}: cannot read this DICOM series ({str(e).strip().splitlines()[-1]})") from None
    return (*_sitk_array_affine(image, folder, "series"), files)


def _sitk_array_affine(image, where, what: str):
    """``(array [x, y, z], affine RAS)`` of a SimpleITK image: one 3D gray image with a spacing, else VolumeError
    naming ``where``."""
    import SimpleITK as sitk

    if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
        raise VolumeError(f"{where}: a {image.GetDimension()}D {what} with {image.GetNumberOfComponentsPerPixel()} "
                          f"components; expected one 3D gray {what}")
    spacing = np.asarray(image.GetSpacing(), float)
    if np.any(spacing <= 0):
        raise VolumeError(f"{where}: the {what} has no spacing ({spacing.tolist()})")
    lps = np.eye(4)
    lps[:3, :3] = np.asarray(image.GetDirection(), float).reshape(3, 3) * spacing
    lps[:3, 3] = image.GetOrigin()
    affine = np.diag([-1.0, -1.0, 1.0, 1.0]) @ lps  # DICOM/ITK LPS world -> NIfTI RAS world
    return np.ascontiguousarray(sitk.GetArrayFromImage(image).transpose(2, 1, 0)), affine


def _sitk_file(path: Path):
    """``(array [x, y, z], affine RAS)`` of a single-file 3D image SimpleITK reads (NRRD, MHA)."""
    import SimpleITK as sitk

    try:
        with keep_locale():
            image = sitk.ReadImage(str(path))
    except RuntimeError as e:
        raise VolumeError(f"{path}: cannot read this file ({str(e).strip().splitlines()[-1]})") from None
    return _sitk_array_affine(image, path, "volume")


def read_volume(path: str | os.PathLike) -> Volume:
    """Read a NIfTI file, an NRRD or MHA file (SimpleITK) or a DICOM series folder and reorient it to LPS.

    Raises:
        VolumeError: unreadable file or series, not 3D (a trailing axis of length 1 is dropped), no usable spacing
            (a voxel size <= 0, or a NIfTI whose sform and qform codes are both 0), several series in one folder.
    """
    import nibabel as nib

    path = Path(path)
    if path.is_dir():
        array, affine, files = _dicom(path)
        img = nib.Nifti1Image(array, affine)
        header = None
    elif path.name.lower().endswith((".nrrd", ".mha")):
        array, affine = _sitk_file(path)
        img, header, files = nib.Nifti1Image(array, affine), None, ()
    else:
        img = _nifti(path)
        header, files = img.header, ()
    affine = np.asarray(img.affine, float)
    shape = tuple(int(n) for n in img.shape[:3])
    ornt = nib.orientations.ornt_transform(nib.orientations.io_orientation(affine), nib.orientations.axcodes2ornt(_LPS))
    reoriented = img.as_reoriented(ornt)
    spacing = tuple(float(z) for z in reoriented.header.get_zooms()[:3])
    return Volume(path, np.asanyarray(reoriented.dataobj), spacing, affine, shape, header,
                  np.asarray(reoriented.affine, float), files)


def load_lps(path: str | os.PathLike) -> tuple[np.ndarray, tuple[float, ...], np.ndarray]:
    """A 3D NIfTI volume reoriented to LPS: ``(array [x->L, y->P, z->S], voxel size (mm), LPS affine)``.

    Raises:
        VolumeError: as :func:`read_volume`.
    """
    vol = read_volume(path)
    return vol.lps, vol.spacing, vol.lps_affine


def normalise_volume(volume: np.ndarray) -> tuple[np.ndarray, float, float]:
    """Clip to the 0.5 / 99.5 percentiles of the whole volume and map linearly to uint8 0..255 (how FedUQ's 2D MRI
    slices were made). Returns ``(uint8 array, low, high)``; a constant volume gives zeros."""
    lo, hi = (float(v) for v in np.percentile(volume.astype(np.float64), [0.5, 99.5]))
    if hi <= lo:  # constant volume: nothing to stretch
        return np.zeros(volume.shape, np.uint8), lo, hi
    scaled = (np.clip(volume.astype(np.float64), lo, hi) - lo) / (hi - lo) * 255.0
    return np.rint(scaled).astype(np.uint8), lo, hi
