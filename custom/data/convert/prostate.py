"""Convert per-case prostate MRI volumes (NIfTI) into FedUQ 2D slice sites.

Accepted download layout (the public 6-site set of SAML / FedDG, "Processed_data_nii"; also any NCI-ISBI 2013 /
PROMISE12 cases exported to NIfTI)::

    <src>/<SITE>/Case00.nii.gz                  T2 volume (.nii or .nii.gz)
    <src>/<SITE>/Case00_segmentation.nii.gz     its mask, label ids (file name case-insensitive: _Segmentation too)

Output, one folder per site (= federated center)::

    <dst>/prostate/<SITE>/images/Case00_z012.png   8-bit gray axial slice z = 12 of the volume
    <dst>/prostate/<SITE>/masks/Case00_z012.png    the slice's label ids, unchanged (whole gland = mask >= 1)
    <dst>/prostate/<SITE>/labels.json              the label ids found in the site's masks
    <dst>/prostate/<SITE>/provenance.csv           image_file, mask_file, original paths, case, slice_z, ...

Per volume: reoriented to LPS (nibabel), intensities clipped to the 0.5 / 99.5 percentiles of the whole volume and
mapped linearly to 0..255; the slices that contain prostate plus ``--margin`` (2) slices on each side are kept;
each slice is stored as ``vol[:, :, z].T`` (radiological view: anterior up, patient right on image left) and resized
to ``--size`` x ``--size`` (default 384; Lanczos image, nearest mask; 0 keeps the in-plane size). Split the sites
at case level (feduq task ``prostate`` groups slices by the ``<case>`` part of ``<case>_z<slice>``).

Example::

    feduq convert prostate --src ~/dl/Processed_data_nii --dst /data/feduq            # every site folder
    feduq convert prostate --src ~/dl/Processed_data_nii --dst /data/feduq --sites RUNMC BMC --size 384
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from feduq.cli import verb_parser

import numpy as np
from PIL import Image

from feduq.data import DataError
from feduq.io.image_files import SiteWriter
from feduq.io.volumes import VolumeError, normalise_volume  # noqa: F401 (normalise_volume: part of this tool's API)
from feduq.io.volumes import load_lps as _load_lps

DATASET = "prostate MRI (NIfTI cases)"
VOLUME_RE = re.compile(r"(?P<case>.+?)\.nii(\.gz)?", re.IGNORECASE)
MASK_SUFFIX = "_segmentation"
PROVENANCE_COLUMNS = [
    "image_file", "mask_file", "original_image_path", "original_mask_path", "orig_width", "orig_height", "case",
    "slice_z", "n_slices_volume", "spacing_mm", "volume_p005", "volume_p995", "prostate_in_slice",
]  # fmt: skip


class ConvertError(DataError):
    """A download folder does not have the expected layout (names the dataset and the path it expected)."""


def find_cases(site_dir: Path) -> list[tuple[str, Path, Path]]:
    """``[(case, volume, mask)]`` of a site folder, sorted by case; every volume needs its segmentation file.

    Raises:
        ConvertError: the folder does not exist, holds no volume, or a volume has no ``<case>_segmentation`` file.
    """
    if not site_dir.is_dir():
        raise ConvertError(f"{DATASET}: expected the site folder '{site_dir}' with <case>.nii.gz volumes")
    volumes, masks = {}, {}
    for path in sorted(site_dir.iterdir()):
        m = VOLUME_RE.fullmatch(path.name)
        if not m or not path.is_file():
            continue
        case = m.group("case")
        if case.lower().endswith(MASK_SUFFIX):
            masks[case[: -len(MASK_SUFFIX)].lower()] = path
        else:
            volumes[case] = path
    if not volumes:
        raise ConvertError(f"{DATASET}: no <case>.nii.gz volumes in '{site_dir}' (expected e.g. "
                           f"'{site_dir / 'Case00.nii.gz'}' + '{site_dir / 'Case00_segmentation.nii.gz'}')")
    cases = []
    for case, volume in sorted(volumes.items()):
        if case.lower() not in masks:
            expected = site_dir / f"{case}_segmentation.nii.gz"
            raise ConvertError(f"{DATASET}: volume '{volume}' has no mask '{expected}' (or _Segmentation, .nii)")
        cases.append((case, volume, masks[case.lower()]))
    return cases


def load_lps(path: Path) -> tuple[np.ndarray, tuple[float, ...], np.ndarray]:
    """Load a 3D NIfTI volume reoriented to LPS: ``(array [x->L, y->P, z->S], voxel size (mm), affine)``
    (:func:`feduq.io.volumes.load_lps`; its error becomes this tool's, naming the dataset)."""
    try:
        return _load_lps(path)
    except VolumeError as e:
        raise ConvertError(f"{DATASET}: {e}") from None


def kept_slices(mask: np.ndarray, margin: int) -> list[int]:
    """Slice indices z from the first to the last slice with prostate, widened by ``margin`` (clipped to the volume)."""
    z_any = np.flatnonzero(mask.reshape(-1, mask.shape[2]).any(axis=0))
    if z_any.size == 0:
        return []
    return list(range(max(0, int(z_any[0]) - margin), min(mask.shape[2] - 1, int(z_any[-1]) + margin) + 1))


def _slice(array: np.ndarray, z: int) -> np.ndarray:
    return np.ascontiguousarray(array[:, :, z].T)  # rows = posterior (anterior up), columns = patient left


def convert_site(site_dir: Path, dst_root: Path, center: str | None = None, size: int = 384, margin: int = 2,
                 overwrite: bool = False) -> Path:
    """Convert one site folder of NIfTI cases into ``<dst_root>/prostate/<center>``; returns the center folder.

    Raises:
        ConvertError: bad layout, unreadable volumes, a mask whose shape differs from its volume or that holds
            non-integer or out-of-range (> 255) label values, or no case with prostate.
        feduq.outputs.OutputFolderError: an existing non-empty output folder without ``overwrite``.

    The folder is written completely or not at all (:class:`~feduq.io.image_files.SiteWriter`).
    """
    site_dir = Path(site_dir).expanduser()
    center = center or site_dir.name
    cases = find_cases(site_dir)
    out = Path(dst_root) / "prostate" / center
    with SiteWriter(out, overwrite=overwrite, what=f"{DATASET} {center}", image_format="png") as site:
        label_ids, skipped = {0}, []
        for case, volume_path, mask_path in cases:
            volume, spacing, _ = load_lps(volume_path)
            mask, _, _ = load_lps(mask_path)
            if mask.shape != volume.shape:
                raise ConvertError(f"{DATASET}: mask '{mask_path}' has shape {mask.shape} but volume '{volume_path}' "
                                   f"has {volume.shape}")
            labels = np.rint(mask).astype(np.int64)
            if not np.allclose(labels, mask) or labels.min() < 0 or labels.max() > 255:
                raise ConvertError(f"{DATASET}: mask '{mask_path}' must hold integer label ids 0..255")
            zs = kept_slices(labels, margin)
            if not zs:
                skipped.append(case)
                continue
            image8, lo, hi = normalise_volume(volume)
            for z in zs:
                image = Image.fromarray(_slice(image8, z), mode="L")
                label = Image.fromarray(_slice(labels, z).astype(np.uint8), mode="L")
                orig_w, orig_h = image.size
                if size:
                    image = image.resize((size, size), Image.Resampling.LANCZOS)
                    label = label.resize((size, size), Image.Resampling.NEAREST)
                label_ids |= set(np.unique(np.asarray(label)).tolist())
                site.add(f"{case}_z{z:03d}", image, label,
                         original_image_path=volume_path.relative_to(site_dir).as_posix(),
                         original_mask_path=mask_path.relative_to(site_dir).as_posix(),
                         orig_width=orig_w, orig_height=orig_h, case=case, slice_z=z,
                         n_slices_volume=volume.shape[2], spacing_mm="x".join(f"{s:g}" for s in spacing),
                         volume_p005=f"{lo:g}", volume_p995=f"{hi:g}",
                         prostate_in_slice=int(bool(labels[:, :, z].any())))
        if not site.rows:
            raise ConvertError(f"{DATASET} {center}: no case in '{site_dir}' has a non-empty mask")
        ids = sorted(label_ids)
        if ids == [0, 1]:
            labels_map = {"0": "background", "1": "prostate"}
        else:
            labels_map = {"0": "background", **{str(v): f"prostate label id {v}" for v in ids if v}}
        resize = f"resized to {size}x{size} (Lanczos image, nearest mask)" if size else "at the original in-plane size"
        note = (f"{center} converted by feduq convert prostate from {len(cases) - len(skipped)} NIfTI cases: "
                f"volumes reoriented to LPS, intensities clipped to the volume's 0.5/99.5 percentiles and mapped to "
                f"0..255, slices with prostate plus {margin} margin slices on each side, stored as vol[:,:,z].T "
                f"(anterior up, patient right on image left), {resize}. Mask label ids kept; whole gland = mask >= 1. "
                f"File name <case>_z<slice>.png; split at case level (provenance column 'case').")
        if skipped:
            note += f" Cases without prostate, skipped: {', '.join(skipped)}."
        site.finish(PROVENANCE_COLUMNS, labels_map, note)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = verb_parser("feduq convert prostate", description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, required=True, help="folder holding one sub-folder of NIfTI cases per site")
    p.add_argument("--dst", type=Path, required=True, help="data root to write (<dst>/prostate/<SITE>/...)")
    p.add_argument("--sites", nargs="+", default=None,
                   help="site folders under --src to convert (default: every sub-folder with .nii[.gz] files)")
    p.add_argument("--size", type=int, default=384, help="square output size; 0 keeps the in-plane size")
    p.add_argument("--margin", type=int, default=2, help="slices kept on each side of the prostate")
    p.add_argument("--overwrite", action="store_true", help="replace existing output center folders")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert the sites; returns 0, or 2 on a conversion error (message on stderr)."""
    args = parse_args(argv)
    src = args.src.expanduser()
    try:
        if args.sites:
            sites = [src / s for s in args.sites]
        else:
            if not src.is_dir():
                raise ConvertError(f"{DATASET}: expected the folder '{src}' with one sub-folder per site "
                                   f"(e.g. '{src / 'RUNMC' / 'Case00.nii.gz'}')")
            sites = [d for d in sorted(src.iterdir()) if d.is_dir() and any(VOLUME_RE.fullmatch(f.name)
                                                                            for f in d.iterdir())]
            if not sites:
                raise ConvertError(f"{DATASET}: no site folder with <case>.nii.gz volumes under '{src}' "
                                   f"(expected e.g. '{src / 'RUNMC' / 'Case00.nii.gz'}')")
        for site in sites:
            out = convert_site(site, args.dst, size=args.size, margin=args.margin, overwrite=args.overwrite)
            n = len(list((out / "images").iterdir()))
            print(f"{site.name}: {n} slices -> {out}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq convert prostate", main))
