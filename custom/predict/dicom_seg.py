"""A predicted label map of a DICOM series as a DICOM Segmentation (SEG) that a hospital's viewer opens beside the
series (PACS, OHIF, 3D Slicer), written with highdicom.

The SEG is a binary segmentation with one segment per reported structure: each foreground class under its name, or,
for a task with nested regions (nnU-Net's ``"gland": [1, 2], "TZ": 2``), each region holding every class inside it,
so segments overlap as the regions do (a viewer shows the gland whole, the TZ within it); one frame per slice of the source series in the series' own slice order (empty slices kept, so
frame ``i`` lies on source instance ``i``), each frame referencing its source instance (SOP instance UID, image
position); the study, patient and frame of reference are the series'. The algorithm is identified as
``FedUQ <method>`` (FedUQ's version, the model file's SHA-256 among its parameters), of the family "Artificial
Intelligence" (DCM 123110); the segments' property codes are SNOMED CT's for the organs FedUQ's tasks segment
(prostate, liver, kidney, spleen, pancreas) and "Tissue" otherwise.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["SegIdentity", "seg_problem", "write_dicom_seg", "SEG_FILE"]

#: the file name of the SEG in a case's output folder (beside ``label.nii.gz``)
SEG_FILE = "segmentation.dcm"
#: what a source instance must hold for its frame to be referenced (highdicom's requirements for a 3D series)
_REQUIRED = ("StudyInstanceUID", "SeriesInstanceUID", "SOPInstanceUID", "SOPClassUID", "FrameOfReferenceUID",
             "ImagePositionPatient", "ImageOrientationPatient", "PixelSpacing", "Rows", "Columns")
#: SNOMED CT organs by FedUQ's class names (pydicom's code dictionary)
_ORGANS = {"prostate": "Prostate", "liver": "Liver", "kidney": "Kidney", "spleen": "Spleen", "pancreas": "Pancreas"}


@dataclass(frozen=True)
class SegIdentity:
    """Who made the segmentation and what its segments are: ``method`` (FedUQ's method name), ``class_names``
    (index -> name, background first), ``parameters`` (e.g. ``{"model_sha256": ...}``, stored in the algorithm
    identification), ``structures`` (segment name -> the class indices it covers, in segment order:
    :func:`feduq.predict.rows.structures`; None: one segment per foreground class)."""

    method: str
    class_names: Sequence[str]
    parameters: dict = field(default_factory=dict)
    structures: dict | None = None

    def segments(self) -> list[tuple[str, tuple[int, ...]]]:
        """``[(segment label, class indices)]``, segment number = position + 1."""
        if self.structures:
            return [(name, tuple(int(c) for c in classes)) for name, classes in self.structures.items()]
        return [(name, (c,)) for c, name in enumerate(self.class_names) if c > 0]


def _read_headers(files: Sequence[Path]):
    import pydicom

    return [pydicom.dcmread(str(f), stop_before_pixels=True) for f in files]


def seg_problem(files: Sequence[Path]) -> str | None:
    """Why a SEG cannot reference this series (``files``: its instances in slice order), or None when it can: an
    attribute a frame reference needs is missing from an instance, or the instances are of several studies, series
    or frames of reference."""
    try:
        headers = _read_headers(files)
    except Exception as e:  # pydicom raises InvalidDicomError, OSError, ... on unreadable files
        return f"an instance cannot be read ({type(e).__name__}: {e})"
    for f, ds in zip(files, headers):
        missing = [k for k in _REQUIRED if not str(getattr(ds, k, "") or "").strip()]
        if missing:
            return f"{Path(f).name} has no {', '.join(missing)}, which a DICOM SEG must reference"
    for k in ("StudyInstanceUID", "SeriesInstanceUID", "FrameOfReferenceUID"):
        if len({str(getattr(ds, k)) for ds in headers}) > 1:
            return f"its instances have several {k} values (one series of one frame of reference expected)"
    return None


def _codes(name: str):
    from pydicom.sr.codedict import codes

    organ = _ORGANS.get(name.strip().lower())
    return (codes.SCT.Organ, getattr(codes.SCT, organ)) if organ else (codes.SCT.Tissue, codes.SCT.Tissue)


def write_dicom_seg(path: str | Path, files: Sequence[Path], label: np.ndarray, identity: SegIdentity) -> Path:
    """Write ``label`` as a DICOM SEG of the series ``files`` at ``path``.

    Args:
        path: the SEG file to write.
        files: the source series' instances, in the order of the label's slice axis.
        label: class indices ``[columns, rows, slices]`` (the series' own voxel order, as SimpleITK reads it:
            x = column, y = row, z = instance), integer.
        identity: the method, class names and algorithm parameters.

    Returns:
        ``path``.

    Raises:
        ValueError: the label's shape is not the series' (names both), or a class index has no name.
    """
    import highdicom as hd
    from pydicom.sr.codedict import codes

    from .. import __version__

    headers = _read_headers(files)
    frames = np.ascontiguousarray(np.asarray(label).transpose(2, 1, 0)).astype(np.uint8)  # [instance, row, column]
    rows, cols = int(headers[0].Rows), int(headers[0].Columns)
    if frames.shape != (len(headers), rows, cols):
        raise ValueError(f"{path}: the label map [slices, rows, columns] = {list(frames.shape)} does not fit the "
                           f"series' {len(headers)} instances of {rows} x {cols}")
    names = list(identity.class_names)
    if int(frames.max(initial=0)) >= len(names):
        raise ValueError(f"{path}: class index {int(frames.max())} has no name ({len(names)} classes)")
    algorithm = hd.AlgorithmIdentificationSequence(
        name=f"FedUQ {identity.method}", version=__version__, family=codes.cid7162.ArtificialIntelligence,
        parameters={k: str(v) for k, v in identity.parameters.items()} or None)
    segments, masks = [], []
    for number, (name, classes) in enumerate(identity.segments(), start=1):
        category, kind = _codes(name)
        segments.append(hd.seg.SegmentDescription(
            segment_number=number, segment_label=name, segmented_property_category=category,
            segmented_property_type=kind, algorithm_type=hd.seg.SegmentAlgorithmTypeValues.AUTOMATIC,
            algorithm_identification=algorithm))
        masks.append(np.isin(frames, classes))  # a region holds every class inside it
    pixels = np.stack(masks, axis=-1).astype(np.uint8)  # [instance, row, column, segment], segments may overlap
    seg = hd.seg.Segmentation(
        source_images=headers, pixel_array=pixels, segmentation_type=hd.seg.SegmentationTypeValues.BINARY,
        segment_descriptions=segments, series_instance_uid=hd.UID(), series_number=9901, sop_instance_uid=hd.UID(),
        instance_number=1, manufacturer="FedUQ", manufacturer_model_name=f"FedUQ {identity.method}",
        software_versions=__version__, device_serial_number="none", series_description=f"FedUQ {identity.method}",
        omit_empty_frames=False)
    seg.save_as(str(path))
    return Path(path)
