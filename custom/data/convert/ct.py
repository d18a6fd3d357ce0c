"""Convert public abdominal CT datasets (NIfTI) into FedUQ 3D sites, one volume per case.

Accepted download layouts (``--layout``)::

    msd               <src>/dataset.json, imagesTr/<case>.nii.gz, labelsTr/<case>.nii.gz   (Decathlon task folder)
    btcv              <src>/img/img0001.nii.gz, <src>/label/label0001.nii.gz   (BTCV / Synapse RawData/Training)
    kits              <src>/case_00000/imaging.nii.gz, segmentation.nii.gz      (KiTS19 / KiTS21 / KiTS23)
    amos              <src>/dataset.json, imagesTr + labelsTr, imagesVa + labelsVa         (AMOS22)
    totalsegmentator  <src>/s0001/ct.nii.gz, <src>/s0001/segmentations/<structure>.nii.gz

Output, one folder per center (``<out>`` is usually ``<data_root>/<task folder>``)::

    <out>/<center>/images/<case>.nii.gz   the CT volume, bytes unchanged (a .nii source is gzipped, [x,y,z,1] -> 3D)
    <out>/<center>/masks/<case>.nii.gz    its label ids as published (uint8, int16 above 255), the mask's affine
    <out>/<center>/labels.json            {"labels": {"0": "background", "1": "spleen", ...}, "note": "..."}
    <out>/<center>/provenance.csv         stem, case, image_file, mask_file, original paths, shape, spacing, ...

Label names: FedUQ's CT organs are liver, kidney, spleen, pancreas; other structures keep their dataset's name in
snake_case (BTCV right_kidney / left_kidney, KiTS kidney / kidney_tumor / kidney_cyst, AMOS typos fixed: arota ->
aorta, gall bladder -> gallbladder, postcava -> inferior_vena_cava; an MSD lesion label "cancer"/"tumour" of an organ
task becomes "<organ>_tumor"). TotalSegmentator's per-structure binary masks are merged into one label map, ids 1..n
in the ``--structures`` order (a voxel in two structures takes the later id). Skipped with a note in labels.json:
KiTS cases without segmentation (test cases), AMOS MRI cases (id > 500; ``--include-mri`` keeps them).

Example::

    feduq convert ct --layout msd --src ~/dl/Task09_Spleen --out /data/feduq/abdomen_ct --center msd_spleen
    feduq convert ct --layout kits --src ~/dl/kits21/dataset --out /data/feduq/abdomen_ct --limit 5
    feduq convert ct --layout totalsegmentator --src ~/dl/Totalsegmentator_dataset_v201 \\
        --out /data/feduq/abdomen_ct --structures liver,spleen,kidney_left,kidney_right,pancreas
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from feduq.cli import verb_parser

import numpy as np

from feduq.data import DataError

LAYOUTS = ("msd", "btcv", "kits", "amos", "totalsegmentator")
DEFAULT_STRUCTURES = "liver,spleen,kidney_left,kidney_right,pancreas"
FEDUQ_ORGANS = ("liver", "kidney", "spleen", "pancreas")
BTCV_LABELS = {i: n for i, n in enumerate(
    ["background", "spleen", "right_kidney", "left_kidney", "gallbladder", "esophagus", "liver", "stomach", "aorta",
     "inferior_vena_cava", "portal_vein_and_splenic_vein", "pancreas", "right_adrenal_gland", "left_adrenal_gland"])}
KITS_LABELS = {0: "background", 1: "kidney", 2: "kidney_tumor", 3: "kidney_cyst"}  # 3: KiTS21+ only
NAME_ALIASES = {"gall_bladder": "gallbladder", "arota": "aorta", "postcava": "inferior_vena_cava", "tumour": "tumor"}
AMOS_MRI_FROM = 501  # AMOS22 case ids 1..500 are CT, 501..600 MRI
NIFTI_RE = re.compile(r"(?P<case>[^.].*?)\.nii(\.gz)?")  # no hidden / macOS '._*' files
PROVENANCE_COLUMNS = [
    "stem", "case", "image_file", "mask_file", "original_image_path", "original_mask_path", "source_split", "shape",
    "spacing_mm", "labels_present", "mask_affine_matches_image", "overlap_voxels",
]  # fmt: skip


class ConvertError(DataError):
    """Bad input (names the layout and the offending file or folder)."""


@dataclass
class Case:
    case: str
    image: Path
    mask: Path | list[tuple[str, Path]]  # totalsegmentator: [(structure, binary mask)]
    split: str = ""


def snake(name: str) -> str:
    """``"Right Kidney"`` -> ``"right_kidney"``, with the aliases of :data:`NAME_ALIASES` applied."""
    name = re.sub(r"[^0-9a-z]+", "_", str(name).strip().lower()).strip("_")
    return NAME_ALIASES.get(name, name)


def read_dataset_labels(path: Path, layout: str) -> dict[int, str]:
    """``{id: name}`` of a decathlon ``dataset.json`` (``{"0": "background"}``, or nnU-Net v2 ``{"background": 0}``)."""
    try:
        labels = json.loads(path.read_text())["labels"]
        pairs = [(int(k), v) if str(k).isdigit() else (int(v), k) for k, v in labels.items()]
    except FileNotFoundError:
        raise ConvertError(f"{layout}: '{path}' is missing (the task folder needs its dataset.json)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise ConvertError(f"{layout}: cannot read the labels of '{path}' (expected \"labels\": "
                           f"{{\"0\": \"background\", \"1\": ...}}): {e}") from None
    out = {i: ("background" if i == 0 else snake(n)) for i, n in sorted(pairs)}
    if 0 not in out or len(out) < 2:
        raise ConvertError(f"{layout}: '{path}' must list background 0 and at least one label, got {labels}")
    return out


def nifti_files(folder: Path) -> dict[str, Path]:
    """``{case: path}`` of the ``.nii[.gz]`` files of a folder (hidden and macOS ``._*`` files skipped)."""
    matches = ((NIFTI_RE.fullmatch(p.name), p) for p in sorted(folder.iterdir()) if p.is_file())
    return {m.group("case"): p for m, p in matches if m}


def pair_folders(src: Path, layout: str, image_dir: str, mask_dir: str, split: str, mask_name=lambda c: c):
    """Cases of ``<src>/<image_dir>`` paired by name with ``<src>/<mask_dir>``; every image needs its mask."""
    images, masks = src / image_dir, src / mask_dir
    if not images.is_dir():
        raise ConvertError(f"{layout}: expected the folder '{images}' with .nii.gz volumes")
    if not masks.is_dir():
        raise ConvertError(f"{layout}: expected the label folder '{masks}' next to '{images}'")
    found = nifti_files(masks)
    cases = []
    for case, image in nifti_files(images).items():
        mask = found.get(mask_name(case))
        if mask is None:
            raise ConvertError(f"{layout}: image '{image}' has no mask '{masks / (mask_name(case) + '.nii.gz')}'")
        cases.append(Case(case, image, mask, split))
    return cases


def find_cases(layout: str, src: Path, structures: list[str], include_mri: bool = False):
    """``(cases, labels {id: name}, optional ids (listed only when present), notes)`` of a download folder."""
    if not src.is_dir():
        raise ConvertError(f"{layout}: source folder '{src}' does not exist")
    notes, optional = [], set()
    if layout in ("msd", "amos"):
        labels = read_dataset_labels(src / "dataset.json", layout)
        if layout == "msd" and labels.get(1) in FEDUQ_ORGANS:  # Task03 liver/cancer, Task07 pancreas/cancer
            labels = {i: f"{labels[1]}_tumor" if n in ("cancer", "tumor", "lesion") else n for i, n in labels.items()}
        cases = pair_folders(src, layout, "imagesTr", "labelsTr", "imagesTr")
        if layout == "amos":
            if (src / "imagesVa").is_dir() and not (src / "labelsVa").is_dir():
                notes.append("imagesVa skipped: no labelsVa folder")
            elif (src / "imagesVa").is_dir():
                cases += pair_folders(src, layout, "imagesVa", "labelsVa", "imagesVa")
            mri = [c.case for c in cases if int(re.sub(r"\D", "", c.case) or 0) >= AMOS_MRI_FROM]
            if mri and not include_mri:
                cases = [c for c in cases if c.case not in mri]
                notes.append(f"{len(mri)} MRI cases (id > 500) skipped")
    elif layout == "btcv":
        labels = dict(BTCV_LABELS)
        cases = pair_folders(src, layout, "img", "label", "", mask_name=lambda c: re.sub(r"^img", "label", c))
        for c in cases:
            c.case = re.sub(r"^img", "", c.case)
    elif layout == "kits":
        labels, optional, cases, unlabelled = dict(KITS_LABELS), {3}, [], []
        for folder in sorted(d for d in src.iterdir() if d.is_dir() and d.name.startswith("case_")):
            image, mask = folder / "imaging.nii.gz", folder / "segmentation.nii.gz"
            if not image.is_file():
                raise ConvertError(f"{layout}: '{image}' is missing (KiTS21+: run the dataset's download script)")
            if mask.is_file():
                cases.append(Case(folder.name, image, mask))
            else:
                unlabelled.append(folder.name)
        if unlabelled:
            notes.append(f"{len(unlabelled)} cases without segmentation.nii.gz (test cases) skipped: "
                         f"{', '.join(unlabelled[:10])}{' ...' if len(unlabelled) > 10 else ''}")
        if not cases and not unlabelled:
            raise ConvertError(f"{layout}: no case_XXXXX folder under '{src}' (expected "
                               f"'{src / 'case_00000' / 'imaging.nii.gz'}')")
    elif layout == "totalsegmentator":
        labels = {0: "background", **{i: s for i, s in enumerate(structures, 1)}}
        cases = []
        for folder in sorted(d for d in src.iterdir() if d.is_dir() and (d / "ct.nii.gz").is_file()):
            cases.append(Case(folder.name, folder / "ct.nii.gz",
                              [(s, folder / "segmentations" / f"{s}.nii.gz") for s in structures]))
        if not cases:
            raise ConvertError(f"{layout}: no subject folder with ct.nii.gz under '{src}' (expected "
                               f"'{src / 's0001' / 'ct.nii.gz'}')")
    else:
        raise ConvertError(f"unknown layout '{layout}' (one of {', '.join(LAYOUTS)})")
    if not cases:
        raise ConvertError(f"{layout}: no labelled case found under '{src}'")
    return cases, labels, optional, notes


def load(path: Path, layout: str):
    """nibabel image of a 3D volume (a trailing singleton 4th axis is dropped); header only, data read lazily."""
    import nibabel as nib

    if not path.is_file():
        raise ConvertError(f"{layout}: file '{path}' is missing")
    try:
        img = nib.load(str(path))
    except Exception as e:  # nibabel raises ImageFileError, OSError, EOFError, ... on bad files
        raise ConvertError(f"{layout}: cannot read '{path}': {e}") from None
    if len(img.shape) == 4 and img.shape[3] == 1:
        img = img.slicer[..., 0]
    if len(img.shape) != 3:
        raise ConvertError(f"{layout}: '{path}' has shape {img.shape}; expected a 3D volume")
    return img


def mask_data(img, path: Path, layout: str, shape, allowed: set[int]) -> tuple[np.ndarray, set[int]]:
    """Label array (uint8, or int16 for ids > 255) of a mask checked against the image ``shape`` and the declared
    ids ``allowed``, and the set of ids present."""
    if tuple(img.shape) != tuple(shape):
        raise ConvertError(f"{layout}: mask '{path}' has shape {tuple(img.shape)} but its image has {tuple(shape)}")
    try:
        data = np.asanyarray(img.dataobj)
    except Exception as e:  # truncated / corrupt data block
        raise ConvertError(f"{layout}: cannot read the data of '{path}': {e}") from None
    if not np.issubdtype(data.dtype, np.integer):
        rounded = np.rint(data)
        if not np.array_equal(rounded, data):
            raise ConvertError(f"{layout}: mask '{path}' holds non-integer values; expected label ids")
        data = rounded
    lo, hi = (int(v) for v in (data.min(), data.max())) if data.size else (0, 0)
    if lo < 0 or hi > max(allowed):
        present = {lo, hi}
    else:  # bincount per slice: no full-volume int64 copy
        labels = data.astype(np.uint8 if hi <= 255 else np.int16)
        counts = np.zeros(hi + 1, np.int64)
        for z in range(labels.shape[2]):
            counts += np.bincount(labels[:, :, z].ravel(), minlength=hi + 1)
        present = {int(v) for v in np.flatnonzero(counts)}
    bad = sorted(present - allowed)
    if bad:
        raise ConvertError(f"{layout}: mask '{path}' holds value(s) {bad} not declared in the labels "
                           f"{sorted(allowed)}")
    return labels, present


def copy_image(image, src: Path, dst: Path, layout: str) -> None:
    """Copy a volume to ``dst`` (.nii.gz) byte for byte, gzipping a .nii (a 4D [..., 1] one is rewritten as 3D);
    a corrupt gzip stream is an error."""
    try:
        if image.get_filename() is None:  # squeezed by load()
            image.to_filename(str(dst))
        elif src.name.endswith(".gz"):
            with gzip.open(src, "rb") as f:  # the header is fine; check the whole stream (CRC, truncation)
                while f.read(1 << 24):
                    pass
            shutil.copyfile(src, dst)
        else:
            with src.open("rb") as f, gzip.open(dst, "wb") as g:
                shutil.copyfileobj(f, g)
    except (OSError, EOFError, ValueError) as e:
        raise ConvertError(f"{layout}: cannot read '{src}': {e}") from None


def save_mask(labels: np.ndarray, ref, dst: Path) -> None:
    """Write integer ``labels`` with the affine and header of ``ref`` (uint8, or int16 when an id is > 255)."""
    hdr = ref.header.copy()
    dtype = np.uint8 if labels.max(initial=0) <= 255 else np.int16
    hdr.set_data_dtype(dtype)
    img = type(ref)(np.asarray(labels, dtype=dtype), ref.affine, hdr)
    img.header.set_slope_inter(1.0, 0.0)
    img.to_filename(str(dst))


def convert(layout: str, src: Path, out: Path, center: str | None = None, limit: int | None = None,
            overwrite: bool = False, structures: list[str] | None = None, include_mri: bool = False) -> Path:
    """Convert a download folder into ``<out>/<center>``; returns the center folder.

    Raises:
        ConvertError: bad layout, missing or unreadable files, a mask whose shape differs from its image or that holds
            an undeclared value, or an existing output folder without ``overwrite``.
    """
    src, out = Path(src).expanduser(), Path(out).expanduser()
    structures = [s.strip() for s in (structures or DEFAULT_STRUCTURES.split(",")) if s.strip()]
    if layout == "totalsegmentator" and len(set(structures)) != len(structures):
        raise ConvertError(f"{layout}: --structures lists a structure twice: {structures}")
    center = center or (src.name if layout == "msd" else layout)
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", center):
        raise ConvertError(f"{layout}: center name '{center}' must be a plain folder name ([A-Za-z0-9_.-])")
    final = out / center
    if final.exists() and not overwrite:
        raise ConvertError(f"{layout}: output folder '{final}' exists (use --overwrite)")
    cases, labels, optional, notes = find_cases(layout, src, structures, include_mri)
    if limit:
        cases = cases[:limit]
    work = out / f".{center}.partial"
    shutil.rmtree(work, ignore_errors=True)
    (work / "images").mkdir(parents=True)
    (work / "masks").mkdir()
    rows, seen = [], set()
    try:
        for c in cases:
            image = load(c.image, layout)
            overlap = 0
            if isinstance(c.mask, list):  # totalsegmentator: merge binary masks
                data, present, ref = np.zeros(image.shape, np.uint8 if len(c.mask) <= 255 else np.int16), {0}, None
                for i, (_, path) in enumerate(c.mask, 1):
                    m = load(path, layout)
                    ref = m if ref is None else ref
                    binary = mask_data(m, path, layout, image.shape, {0, 1})[0] > 0
                    overlap += int(np.count_nonzero(data[binary]))
                    data[binary] = i
                present |= {i for i in range(1, len(c.mask) + 1) if np.any(data == i)}
                mask_src = c.mask[0][1].parent
            else:
                ref = load(c.mask, layout)
                data, present = mask_data(ref, c.mask, layout, image.shape, set(labels))
                mask_src = c.mask
            seen |= present
            copy_image(image, c.image, work / "images" / f"{c.case}.nii.gz", layout)
            save_mask(data, ref, work / "masks" / f"{c.case}.nii.gz")
            same = bool(np.allclose(image.affine, ref.affine, rtol=1e-4, atol=1e-3))
            if not same:
                print(f"warning: {layout}: affine of '{mask_src}' differs from '{c.image}'", file=sys.stderr)
            rows.append({
                "stem": c.case, "case": c.case, "image_file": f"images/{c.case}.nii.gz",
                "mask_file": f"masks/{c.case}.nii.gz", "original_image_path": c.image.relative_to(src).as_posix(),
                "original_mask_path": mask_src.relative_to(src).as_posix(), "source_split": c.split,
                "shape": "x".join(str(s) for s in image.shape),
                "spacing_mm": "x".join(f"{z:g}" for z in image.header.get_zooms()[:3]),
                "labels_present": ";".join(str(v) for v in sorted(present)), "mask_affine_matches_image": int(same),
                "overlap_voxels": overlap,
            })  # fmt: skip
        with (work / "provenance.csv").open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=PROVENANCE_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        kept = {str(i): n for i, n in labels.items() if i not in optional or i in seen}
        note = (f"{center} converted by feduq convert ct --layout {layout} from '{src}': {len(rows)} cases; CT "
                f"volumes copied unchanged as images/<case>.nii.gz, masks/<case>.nii.gz hold the dataset's label ids "
                f"(names in snake_case) with the mask's affine. Split at case level (stem = case).")
        if layout == "totalsegmentator":
            note += f" Merged binary masks of {', '.join(structures)} (ids in this order; overlaps take the later id)."
        if limit:
            note += f" Limited to the first {limit} cases (--limit)."
        for extra in notes:
            note += f" {extra[0].upper()}{extra[1:]}."
        (work / "labels.json").write_text(json.dumps({"labels": kept, "note": note}, indent=1) + "\n")
        if final.exists():
            shutil.rmtree(final)
        work.rename(final)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return final


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = verb_parser("feduq convert ct", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=LAYOUTS, required=True, help="layout of the download folder")
    p.add_argument("--src", type=Path, required=True, help="the dataset's download folder (see the layouts above)")
    p.add_argument("--out", type=Path, required=True, help="folder to write <out>/<center>/... into")
    p.add_argument("--center", default=None,
                   help="output center folder name (default: the dataset name; msd: the task folder name)")
    p.add_argument("--limit", type=int, default=None, help="convert only the first N cases (smoke runs)")
    p.add_argument("--structures", default=DEFAULT_STRUCTURES,
                   help="totalsegmentator: comma-separated structures, label ids 1..n in this order")
    p.add_argument("--include-mri", action="store_true", help="amos: keep the MRI cases (id > 500)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output center folder")
    args = p.parse_args(argv)
    return args if args.limit is None or args.limit >= 1 else p.error("--limit must be >= 1")


def main(argv: list[str] | None = None) -> int:
    """Convert one dataset; returns 0, or 2 on a conversion error (message on stderr)."""
    args = parse_args(argv)
    try:
        out = convert(args.layout, args.src, args.out, center=args.center, limit=args.limit,
                      overwrite=args.overwrite, structures=args.structures.split(","), include_mri=args.include_mri)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    n = len(list((out / "images").iterdir()))
    print(f"{args.layout}: {n} cases -> {out}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq convert ct", main))
