"""3D volumes for FedUQ's 2D models: NIfTI files and DICOM series read in LPS, slices, and results written back in the
volume's own geometry.

FedUQ's 2D MRI sites were made from volumes by ``feduq convert prostate``: each volume reoriented to LPS
(:func:`load_lps`), its intensities clipped to the volume's 0.5 / 99.5 percentiles and mapped to 0..255
(:func:`normalise_volume`), and every axial slice ``vol[:, :, z]`` stored as an 8-bit image. A trained model is applied
to a new volume the same way (:mod:`feduq.predict`), and its per-slice outputs are put back into the input's own
voxel order with :meth:`Volume.to_input_order`, so a written label map has the input's shape and affine (oblique
affines included: the reorientation only permutes and flips axes).

DICOM series are read with SimpleITK (``ImageSeriesReader``; its LPS geometry is turned into a NIfTI affine, RAS).
A series is read only when its folder holds nothing but the series' DICOM images and its slices are evenly spaced:
their positions (ImagePositionPatient projected on the slice normal, the cross product of ImageOrientationPatient's
row and column directions, read by pydicom without the pixel data) must step by the smallest step, within
:func:`spacing_tolerance` (1 % of it, at least 0.01 mm). ITK would otherwise spread the slices evenly over the
series' extent (a missing slice of a 3 mm series: every slice 4 mm apart, two of them 1 mm off, volumes in mL a third
too large) and skip a file it cannot read without a word. ``read_volume(resample_gaps=True)`` resamples such a series
onto an even grid of its own spacing (:func:`nominal_step`) over its true extent instead (:func:`_resample_slices`),
and refuses a gap wider than :data:`MAX_GAP_STEPS` steps or a grid above :data:`MAX_RESAMPLED_SLICES` slices.
"""

from __future__ import annotations

import contextlib
import io
import locale
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..tasks.spec import DataError

__all__ = ["VolumeError", "Volume", "read_volume", "load_lps", "normalise_volume", "NIFTI_SUFFIXES", "is_nifti",
           "is_dicom_series", "spacing_tolerance", "nominal_step", "MAX_GAP_STEPS", "MAX_RESAMPLED_SLICES", "MAX_VOXELS"]

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
        source_slices: for each of :attr:`source_files`, its slice index along the input's slice axis where the series
            was resampled onto an even grid (empty: instance ``i`` is slice ``i``).
        resampled: one line saying how a DICOM series was resampled onto an even grid ("" when it was not).
    """

    path: Path
    lps: np.ndarray
    spacing: tuple[float, float, float]
    affine: np.ndarray
    shape: tuple[int, int, int]
    header: object = None
    lps_affine: np.ndarray | None = None
    source_files: tuple[Path, ...] = ()
    source_slices: tuple[int, ...] = ()
    resampled: str = ""

    def to_input_order(self, array: np.ndarray) -> np.ndarray:
        """An array on the LPS grid ``[X, Y, Z, ...]`` (as :attr:`lps`) -> the input's own voxel order and shape."""
        import nibabel as nib

        back = nib.orientations.ornt_transform(nib.orientations.axcodes2ornt(_LPS),
                                               nib.orientations.io_orientation(self.affine))
        out = nib.orientations.apply_orientation(array, back)
        if out.shape[:3] != self.shape:
            raise AssertionError(f"reorientation gave {out.shape[:3]}, the input has {self.shape}")
        return out

    def instance_frames(self, array: np.ndarray) -> np.ndarray:
        """An LPS-grid array ``[X, Y, Z]`` -> its slices on :attr:`source_files` ``[columns, rows, instances]`` (the
        input's voxel order; a resampled series: the grid slice each instance lies on, nearest within half a step)."""
        out = self.to_input_order(array)
        return out[:, :, list(self.source_slices)] if self.source_slices else out

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
    voxels = int(np.prod([int(n) for n in img.shape], dtype=object))
    if voxels > MAX_VOXELS:
        raise VolumeError(f"{path}: its header claims {' x '.join(map(str, img.shape))} = {voxels:,} voxels, more than "
                          f"FedUQ reads ({MAX_VOXELS:,}, a 1024^3 volume); a damaged header, or a volume to crop first")
    problem = nifti_spacing_problem(path)  # the header as written: nibabel mends a voxel size of 0 to 1
    if problem:
        raise VolumeError(problem)
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


def spacing_tolerance(step: float) -> float:
    """How far (mm) a step between consecutive slice positions may differ from the series' ``step`` (mm) and still
    count as even: 1 % of the step, at least 0.01 mm (scanners round positions to about 1e-4 mm)."""
    return max(0.01, 0.01 * float(step))


def _dicom(folder: Path, resample_gaps: bool = False):
    """``(array [x, y, z], affine RAS, instances in z order, instance -> slice index, note)`` of the one DICOM series
    in ``folder`` (SimpleITK; the checks and the resampling of the module doc)."""
    with keep_locale():
        return _read_dicom(folder, resample_gaps)


def _foreign_file(folder: Path, files) -> None:
    """VolumeError naming the first file of ``folder`` that is not one of the series' ``files`` (hidden files and a
    DICOMDIR aside): a file ITK would skip without a word."""
    import pydicom
    from pydicom.errors import InvalidDicomError

    taken = {Path(f).resolve() for f in files}
    for p in sorted(folder.iterdir()):
        if p.name.startswith(".") or p.name.upper() == "DICOMDIR" or not p.is_file() or p.resolve() in taken:
            continue
        try:
            ds = pydicom.dcmread(str(p), stop_before_pixels=True)
            what = (f"a DICOM file (SOP class {getattr(ds, 'SOPClassUID', '?')}, series "
                    f"{getattr(ds, 'SeriesInstanceUID', '?')}) that is not an image of this series")
        except InvalidDicomError:
            what = "not a DICOM file"
        except Exception as e:  # noqa: BLE001  pydicom raises OSError, EOFError, ... on damaged files
            reason = (str(e).strip() or type(e).__name__).splitlines()[0]
            what = f"not a readable DICOM file ({type(e).__name__}: {reason})"
        raise VolumeError(f"{folder}: {p.name} is {what}; a series folder must hold only the series' DICOM images "
                          f"(move the file out, or replace a damaged instance)")


def _slice_positions(folder: Path, files):
    """``(order, positions mm, ImagePositionPatient [n, 3] mm)``: the instances sorted along the slice normal, their
    positions on it, ascending (pydicom, no pixel data). VolumeError: no position or orientation, slices not
    parallel, two instances at one position."""
    import pydicom

    ipp, iop = [], []
    for f in files:
        ds = pydicom.dcmread(str(f), stop_before_pixels=True, force=True)
        try:
            position = [float(v) for v in ds.ImagePositionPatient]
            orientation = [float(v) for v in ds.ImageOrientationPatient]
        except (AttributeError, TypeError, ValueError):
            position = orientation = []
        if len(position) != 3 or len(orientation) != 6:
            raise VolumeError(f"{folder}: {Path(f).name} has no usable ImagePositionPatient and "
                              f"ImageOrientationPatient, so the slice positions cannot be checked")
        ipp.append(position)
        iop.append(orientation)
    ipp, iop = np.asarray(ipp), np.asarray(iop)
    tilted = np.flatnonzero(np.abs(iop - iop[0]).max(axis=1) > 1e-3)
    if tilted.size:
        raise VolumeError(f"{folder}: {Path(files[tilted[0]]).name} has ImageOrientationPatient "
                          f"{iop[tilted[0]].tolist()}, {Path(files[0]).name} {iop[0].tolist()}; one series of parallel "
                          f"slices expected")
    normal = np.cross(iop[0, :3], iop[0, 3:])
    positions = ipp @ normal
    order = np.argsort(positions, kind="stable")
    positions, ipp = positions[order], ipp[order]
    same = np.flatnonzero(np.diff(positions) <= 0.01)
    if same.size:
        a, b = (Path(files[order[i]]).name for i in (same[0], same[0] + 1))
        raise VolumeError(f"{folder}: {a} and {b} are both at {positions[same[0]]:g} mm along the slice normal (a "
                          f"repeated slice?); one instance per position expected")
    return order, positions, ipp


#: the most voxels a volume may have (a 1024^3 volume; a header claiming more is damaged or needs cropping first)
MAX_VOXELS = 1024 ** 3
#: ``--resample-gaps`` fills a gap of at most this many of the series' steps (3 missing slices in a row); a wider one
#: is refused: the slices across it would be made up, not measured (a series with a slice at 2,500 mm after three at
#: 3 mm is a wrong position, not a gap)
MAX_GAP_STEPS = 4
#: the largest grid ``--resample-gaps`` makes, in slices (a whole-body CT series holds about 2,000)
MAX_RESAMPLED_SLICES = 4096


def nominal_step(positions: np.ndarray) -> float:
    """The series' slice spacing (mm) from its slices' ``positions`` (mm ascending): the step most steps agree with
    (within :func:`spacing_tolerance`; a tie: the smallest), the median of those agreeing. It is the spacing
    ``--resample-gaps`` resamples onto, never the smallest step (two slices 0.05 mm apart in a 3 mm series)."""
    steps = np.diff(positions)
    agree = np.array([np.sum(np.abs(steps - s) <= spacing_tolerance(s)) for s in steps])
    common = float(steps[agree == agree.max()].min())
    return float(np.median(steps[np.abs(steps - common) <= spacing_tolerance(common)]))


def _spacing_problem(folder: Path, names, positions: np.ndarray) -> str | None:
    """One line saying where the slices (``positions``, mm ascending, of the instances ``names``) are not evenly
    spaced, or None: the series' step is :func:`nominal_step`, and a step differing from it by more than the
    tolerance is named with the positions around it."""
    steps = np.diff(positions)
    step = nominal_step(positions)
    bad = np.flatnonzero(np.abs(steps - step) > spacing_tolerance(step))
    if not bad.size:
        return None
    j, d = int(bad[0]), float(steps[bad[0]])
    k = d / step
    missing = (f": {round(k) - 1} slice{'s' if round(k) > 2 else ''} missing there?"
               if round(k) >= 2 and abs(d - round(k) * step) <= spacing_tolerance(step) else "")
    more = f"; {bad.size - 1} more uneven step{'s' if bad.size > 2 else ''}" if bad.size > 1 else ""
    return (f"{folder}: slices not evenly spaced: {len(positions)} instances from {positions[0]:g} to "
            f"{positions[-1]:g} mm along the slice normal, {step:g} mm apart but {d:g} mm between {positions[j]:g} mm "
            f"({names[j]}) and {positions[j + 1]:g} mm ({names[j + 1]}){missing}{more}; feduq predict --resample-gaps "
            f"resamples the series onto an even grid of its {step:g} mm spacing over its true extent (gaps up to "
            f"{MAX_GAP_STEPS} steps)")


def _resampling_refusal(folder: Path, names, positions: np.ndarray) -> str | None:
    """One line refusing ``--resample-gaps`` on ``positions`` (mm ascending), or None: a gap wider than
    :data:`MAX_GAP_STEPS` of the series' spacing, or a grid of more than :data:`MAX_RESAMPLED_SLICES` slices."""
    steps, step = np.diff(positions), nominal_step(positions)
    j = int(np.argmax(steps))
    if steps[j] > MAX_GAP_STEPS * step + spacing_tolerance(step):
        return (f"{folder}: cannot resample: {steps[j]:g} mm between {positions[j]:g} mm ({names[j]}) and "
                f"{positions[j + 1]:g} mm ({names[j + 1]}) is {steps[j] / step:.4g} times the series' {step:g} mm "
                f"spacing; --resample-gaps fills gaps of at most {MAX_GAP_STEPS} steps (a wider one is a wrong "
                f"position or another series: check the instances' ImagePositionPatient)")
    m = int(round((positions[-1] - positions[0]) / step)) + 1
    if m > MAX_RESAMPLED_SLICES:
        return (f"{folder}: cannot resample: {positions[-1] - positions[0]:g} mm at the series' {step:g} mm spacing is "
                f"{m} slices, more than --resample-gaps makes ({MAX_RESAMPLED_SLICES})")
    return None


def _resample_slices(array: np.ndarray, positions: np.ndarray):
    """The slices ``array [x, y, n]`` at ``positions`` (mm, ascending) -> ``(float32 [x, y, m] on an even grid from
    the first to the last position, grid step mm, each slice's index on the grid)``.

    The step is the extent divided into the number of equal steps closest to the series' spacing
    (:func:`nominal_step`: a 3 mm series missing a slice: 3 mm, the missing slice filled in), each grid slice linearly
    interpolated between the two true slices around it; a true slice on the grid (within :func:`spacing_tolerance`)
    is copied unchanged."""
    extent = float(positions[-1] - positions[0])
    m = max(2, int(round(extent / nominal_step(positions))) + 1)
    step = extent / (m - 1)
    grid = positions[0] + step * np.arange(m)
    hi = np.clip(np.searchsorted(positions, grid, side="right"), 1, len(positions) - 1)
    lo = hi - 1
    w = np.clip((grid - positions[lo]) / (positions[hi] - positions[lo]), 0.0, 1.0).astype(np.float32)
    data = array.astype(np.float32)
    out = data[:, :, lo] * (1 - w) + data[:, :, hi] * w
    index = np.clip(np.rint((positions - positions[0]) / step).astype(int), 0, m - 1)
    on_grid = np.abs(grid[index] - positions) <= spacing_tolerance(step)
    out[:, :, index[on_grid]] = data[:, :, on_grid]
    return out, step, index


def _read_dicom(folder: Path, resample_gaps: bool = False):
    import SimpleITK as sitk

    reader = sitk.ImageSeriesReader()
    ids = reader.GetGDCMSeriesIDs(str(folder))
    if not ids:
        _foreign_file(folder, ())
    if len(ids) != 1:
        raise VolumeError(f"{folder}: {len(ids)} DICOM series; put one series per folder")
    files = tuple(Path(f) for f in reader.GetGDCMSeriesFileNames(str(folder), ids[0]))
    _foreign_file(folder, files)
    problem, slices, note = None, (), ""
    if len(files) > 1:
        order, positions, ipp = _slice_positions(folder, files)
        problem = _spacing_problem(folder, [files[i].name for i in order], positions)
        if problem and not resample_gaps:
            raise VolumeError(problem)
        refusal = _resampling_refusal(folder, [files[i].name for i in order], positions) if problem else None
        if refusal:  # before ITK reads a pixel
            raise VolumeError(refusal)
        if problem:
            files = tuple(files[i] for i in order)
    reader.SetFileNames([str(f) for f in files])
    warn = sitk.ProcessObject.GetGlobalWarningDisplay()
    sitk.ProcessObject.SetGlobalWarningDisplay(warn and not problem)  # ITK's uneven-slices warning: said here
    try:
        image = reader.Execute()
    except RuntimeError as e:
        raise VolumeError(f"{folder}: cannot read this DICOM series ({str(e).strip().splitlines()[-1]})") from None
    finally:
        sitk.ProcessObject.SetGlobalWarningDisplay(warn)
    array, affine = _sitk_array_affine(image, folder, "series")
    if problem:
        array, step, index = _resample_slices(array, positions)
        flip = np.diag([-1.0, -1.0, 1.0])  # LPS -> RAS
        affine[:3, 2] = flip @ (ipp[-1] - ipp[0]) / (array.shape[2] - 1)
        affine[:3, 3] = flip @ ipp[0]
        slices = tuple(int(i) for i in index)
        note = (f"{folder}: {len(files)} unevenly spaced slices resampled onto {array.shape[2]} slices {step:g} mm "
                f"apart from {positions[0]:g} to {positions[-1]:g} mm along the slice normal (--resample-gaps)")
    return array, affine, files, slices, note


def _sitk_array_affine(image, where, what: str):
    """``(array [x, y, z], affine RAS)`` of a SimpleITK image: one 3D gray image with a spacing, else VolumeError
    naming ``where``."""
    import SimpleITK as sitk

    if image.GetDimension() != 3 or image.GetNumberOfComponentsPerPixel() != 1:
        raise VolumeError(f"{where}: a {image.GetDimension()}D {what} with {image.GetNumberOfComponentsPerPixel()} "
                          f"components; expected one 3D gray {what}")
    spacing = np.asarray(image.GetSpacing(), float)
    if not np.all(np.isfinite(spacing)) or np.any(spacing <= 0):
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


def read_volume(path: str | os.PathLike, resample_gaps: bool = False) -> Volume:
    """Read a NIfTI file, an NRRD or MHA file (SimpleITK) or a DICOM series folder and reorient it to LPS.

    Args:
        resample_gaps: a DICOM series whose slices are not evenly spaced (a missing slice, see the module doc) is
            resampled onto an even grid over its true extent (float32; :attr:`Volume.resampled` says how) instead of
            refused.

    Raises:
        VolumeError: unreadable file or series, not 3D (a trailing axis of length 1 is dropped), no usable spacing
            (a voxel size not finite or <= 0 as the header writes it, or a NIfTI whose sform and qform codes are both
            0: :func:`feduq.io.volume_checks.nifti_spacing_problem`), several series in one folder;
            a DICOM series folder holding a file that is not one of the series' images (names the file), instances
            without positions, not parallel or at one position, or slices not evenly spaced without
            ``resample_gaps`` (names the folder, the step expected and found and the positions around it, in mm).
    """
    import nibabel as nib

    path = Path(path)
    slices, note = (), ""
    if path.is_dir():
        array, affine, files, slices, note = _dicom(path, resample_gaps)
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
    try:  # the voxels are read here (nibabel reads lazily)
        reoriented = img.as_reoriented(ornt)
        data = np.asanyarray(reoriented.dataobj)
    except MemoryError:
        raise VolumeError(f"{path}: {' x '.join(map(str, shape))} voxels do not fit in this machine's memory") from None
    except (OSError, EOFError, ValueError) as e:  # a file shorter than its header says (nibabel, gzip)
        reason = (str(e).strip() or type(e).__name__).splitlines()[0]
        raise VolumeError(f"{path}: cannot read its voxels ({reason})") from None
    spacing = tuple(float(z) for z in reoriented.header.get_zooms()[:3])
    return Volume(path, data, spacing, affine, shape, header, np.asarray(reoriented.affine, float), files, slices, note)


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
