"""Convert HAM10000 (skin lesions) and BUSI / BUS-BRA (breast ultrasound) into binary FedUQ sites.

Accepted download layouts::

    HAM10000  <src>/**/ISIC_<id>.jpg                      images (e.g. HAM10000_images_part_1/ and _part_2/)
              <src>/HAM10000_metadata.csv                 lesion_id, image_id, dx, ..., dataset  (--ham-metadata)
              <src>/HAM10000_segmentations_lesion_tschandl/ISIC_<id>_segmentation.png  lesion masks (--ham-masks;
                                                          ISIC-style <id>_segmentation.png or <id>.png)
    BUSI      <src>/{benign,malignant,normal}/<name>.png + <name>_mask.png [+ <name>_mask_1.png ...]
              (or the same under <src>/Dataset_BUSI_with_GT/); several masks of one image are merged by OR
    BUS-BRA   <src>/Images/bus_<n>-<side>.png + <src>/Masks/mask_<n>-<side>.png [+ <src>/bus_data.csv]

Output (binary masks 0/255, thresholded at 127 before resizing; plain resize, Lanczos image, nearest mask)::

    <dst>/skin_lesion/HAM10000-<dataset>/...   one site per value of the metadata column "dataset"
                                               (vidir_molemax, vidir_modern, rosendahl, vienna_dias); RGB, 384 px
    <dst>/breast_us/BUSI-Baheya-Cairo/...      gray, 256 px; stems benign_001, malignant_042 (BUSI "benign (1)")
    <dst>/breast_us/BUS-BRA-INCa-Brazil/...    gray, 256 px; stems as in the download (bus_0001-l)

each with images/, masks/, labels.json ({"0": "background", "255": "lesion"}) and provenance.csv (HAM10000: with
lesion_id, which the feduq task ``skin`` uses to keep the images of one lesion in one split; BUS-BRA: with the
patient ``case`` from bus_data.csv when present). Breast sites also get classes.csv (image, class).

TIFF files are read with tifffile, the rest with Pillow; a file no reader can decode stops the conversion with one
line naming it (exit 2), and a center folder is written completely or not at all.

Example::

    feduq convert skin-breast --dst /data/feduq --ham10000 ~/dl/HAM10000 \\
        --busi ~/dl/Dataset_BUSI_with_GT --busbra ~/dl/BUSBRA
"""

from __future__ import annotations

import argparse
import csv
import re
import sys
from pathlib import Path
from feduq.cli import verb_parser

import numpy as np
from PIL import Image

from feduq.data import DataError
from feduq.io.image_files import SiteWriter, read_image, resize_pair

LABELS = {"0": "background", "255": "lesion"}
BUSI_CENTER, BUSBRA_CENTER = "BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"
BUSI_CLASSES = ("benign", "malignant", "normal")
SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
BASE_COLUMNS = ["image_file", "mask_file", "original_image_path", "original_mask_path", "orig_width", "orig_height"]


class ConvertError(DataError):
    """A download folder does not have the expected layout (names the dataset and the path it expected)."""


# --------------------------------------------------------------------------------------------------------------------
# Writing a binary site
# --------------------------------------------------------------------------------------------------------------------


def binary_mask(paths: list[Path]) -> Image.Image:
    """Union (OR) of one or more masks, each thresholded at 127 (at 0 for 0/1 masks) -> mode "L" 0/255."""
    union = None
    for path in paths:
        gray = np.asarray(read_image(path).convert("L"))
        fg = gray > (127 if gray.max() > 1 else 0)
        if union is not None and fg.shape != union.shape:
            raise ConvertError(f"mask {path} is {fg.shape[1]}x{fg.shape[0]} but {paths[0]} is "
                               f"{union.shape[1]}x{union.shape[0]}")
        union = fg if union is None else union | fg
    return Image.fromarray(union.astype(np.uint8) * 255, mode="L")


def write_site(dataset: str, out: Path, records: list[dict], src: Path, size: int, mode: str, image_format: str,
               extra_columns: list[str], note: str, overwrite: bool, classes: bool = False) -> Path:
    """Write ``records`` (``stem``, ``image``, ``masks`` [paths], extra columns) as a binary site folder ``out``.

    The folder is written completely or not at all (:class:`~feduq.io.image_files.SiteWriter`); ``classes`` adds
    ``classes.csv`` (image, class).

    Raises:
        ConvertError: mismatched image/mask sizes, or an existing non-empty ``out`` without ``overwrite``.
        UnreadableImageError: an image or mask no reader can decode (names the file).
    """
    with SiteWriter(out, overwrite=overwrite, what=dataset, image_format=image_format) as site:
        for rec in records:
            image, mask, orig = resize_pair(read_image(rec["image"]).convert(mode), binary_mask(rec["masks"]), size,
                                            rec["image"], rec["masks"][0], dataset)
            site.add(rec["stem"], image, mask, original_image_path=Path(rec["image"]).relative_to(src).as_posix(),
                     original_mask_path=";".join(Path(m).relative_to(src).as_posix() for m in rec["masks"]),
                     orig_width=orig[0], orig_height=orig[1], **{c: rec.get(c, "") for c in extra_columns})
        resize = f"{size}x{size} (plain resize: Lanczos image, nearest mask)" if size else "the original size"
        full_note = (f"{out.name} converted by feduq convert skin-breast: {len(site.rows)} pairs, stored at "
                     f"{resize}; masks thresholded to 0/255 before resizing. {note}")
        site.finish(BASE_COLUMNS + extra_columns, LABELS, full_note)
        if classes:
            _write_classes(site.stage, records)
    return out


def _write_classes(out: Path, records: list[dict]) -> None:
    with (out / "classes.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["image", "class"])
        writer.writerows((r["stem"], r.get("class", "")) for r in records)


# --------------------------------------------------------------------------------------------------------------------
# HAM10000
# --------------------------------------------------------------------------------------------------------------------

HAM_COLUMNS = ["lesion_id", "image_id", "dx", "dx_type", "age", "sex", "localization", "dataset"]


def find_ham10000(src: Path, metadata: Path | None = None, masks_dir: Path | None = None,
                  allow_missing: bool = False) -> dict[str, list[dict]]:
    """Center name -> records of the HAM10000 images with a lesion mask, split by the metadata column ``dataset``.

    Raises:
        ConvertError: the metadata CSV or the mask folder is missing, the CSV lacks ``image_id``/``dataset``, or
            (without ``allow_missing``) a listed image or its mask does not exist.
    """
    dataset = "HAM10000"
    metadata = metadata or src / "HAM10000_metadata.csv"
    masks_dir = masks_dir or src / "HAM10000_segmentations_lesion_tschandl"
    if not metadata.is_file():
        raise ConvertError(f"{dataset}: metadata file '{metadata}' is missing (or give --ham-metadata)")
    if not masks_dir.is_dir():
        raise ConvertError(f"{dataset}: lesion mask folder '{masks_dir}' is missing (ISIC-style "
                           f"<image_id>_segmentation.png masks; or give --ham-masks)")
    mask_root = masks_dir.resolve()
    images = {p.stem: p for p in src.rglob("ISIC_*") if p.suffix.lower() in (".jpg", ".jpeg", ".png")
              and not p.stem.endswith("_segmentation") and mask_root not in p.resolve().parents}
    masks = {}
    for p in masks_dir.iterdir():
        if p.suffix.lower() in SUFFIXES:
            masks[p.stem[: -len("_segmentation")] if p.stem.endswith("_segmentation") else p.stem] = p
    with metadata.open(newline="") as f:
        reader = csv.DictReader(f)
        if not {"image_id", "dataset"} <= set(reader.fieldnames or []):
            raise ConvertError(f"{dataset}: metadata file '{metadata}' needs the columns image_id and dataset")
        rows = list(reader)
    centers: dict[str, list[dict]] = {}
    skipped = 0
    for row in rows:
        image_id = Path(row["image_id"]).stem
        if image_id not in images or image_id not in masks:
            if allow_missing:
                skipped += 1
                continue
            what = f"image '{src}/**/{image_id}.jpg'" if image_id not in images else \
                f"mask '{masks_dir / (image_id + '_segmentation.png')}'"
            raise ConvertError(f"{dataset}: {what} listed in '{metadata}' does not exist (--allow-missing skips it)")
        rec = {"stem": image_id, "image": images[image_id], "masks": [masks[image_id]],
               **{c: row.get(c, "") for c in HAM_COLUMNS}, "image_id": image_id}
        centers.setdefault(f"HAM10000-{row['dataset']}", []).append(rec)
    if not centers:
        raise ConvertError(f"{dataset}: no image of '{metadata}' has both an image under '{src}' and a mask in "
                           f"'{masks_dir}'")
    if skipped:
        print(f"HAM10000: skipped {skipped} metadata rows without image or mask")
    return centers


def convert_ham10000(src: Path, dst_root: Path, size: int = 384, image_format: str = "jpg",
                     metadata: Path | None = None, masks_dir: Path | None = None, allow_missing: bool = False,
                     overwrite: bool = False) -> list[Path]:
    """Convert HAM10000 into one ``<dst_root>/skin_lesion/HAM10000-<dataset>`` site per acquisition source."""
    src = Path(src).expanduser()
    outs = []
    for center, records in sorted(find_ham10000(src, metadata, masks_dir, allow_missing).items()):
        note = ("Site = HAM10000 metadata column 'dataset'; provenance has the metadata row (lesion_id groups the "
                "images of one lesion for splitting).")
        outs.append(write_site("HAM10000", Path(dst_root) / "skin_lesion" / center, records, src, size, "RGB",
                               image_format, HAM_COLUMNS, note, overwrite))
    return outs


# --------------------------------------------------------------------------------------------------------------------
# BUSI and BUS-BRA
# --------------------------------------------------------------------------------------------------------------------


def busi_stem(cls: str, name: str) -> str:
    """``benign (12)`` -> ``benign_012``; other names: spaces and brackets replaced by ``_``."""
    m = re.fullmatch(r"\s*\w+\s*\((\d+)\)\s*", name)
    return f"{cls}_{int(m.group(1)):03d}" if m else re.sub(r"[^\w\-]+", "_", name).strip("_")


def find_busi(src: Path, include_normal: bool = False) -> list[dict]:
    """Records of BUSI: one per image, with all its ``_mask*`` files (merged by OR when written)."""
    dataset = "BUSI"
    root = src if (src / "benign").is_dir() else src / "Dataset_BUSI_with_GT"
    if not (root / "benign").is_dir() and not (root / "malignant").is_dir():
        raise ConvertError(f"{dataset}: expected folders '{src / 'benign'}' and '{src / 'malignant'}' (or under "
                           f"'{src / 'Dataset_BUSI_with_GT'}')")
    records = []
    for cls in BUSI_CLASSES:
        folder = root / cls
        if not folder.is_dir() or (cls == "normal" and not include_normal):
            continue
        files = [p for p in sorted(folder.iterdir()) if p.suffix.lower() in SUFFIXES]
        masks: dict[str, list[Path]] = {}
        for p in files:
            m = re.fullmatch(r"(.+)_mask(?:_\d+)?", p.stem)
            if m:
                masks.setdefault(m.group(1), []).append(p)
        for p in files:
            if re.fullmatch(r".+_mask(?:_\d+)?", p.stem):
                continue
            if p.stem not in masks:
                raise ConvertError(f"{dataset}: image '{p}' has no mask '{folder / (p.stem + '_mask.png')}'")
            records.append({"stem": busi_stem(cls, p.stem), "image": p, "masks": sorted(masks[p.stem]), "class": cls})
    if not records:
        raise ConvertError(f"{dataset}: no images in '{root}/{{benign,malignant}}'")
    stems = [r["stem"] for r in records]
    if len(set(stems)) != len(stems):
        dup = next(s for s in stems if stems.count(s) > 1)
        raise ConvertError(f"{dataset}: two images map to the output name '{dup}'")
    return records


def find_busbra(src: Path) -> list[dict]:
    """Records of BUS-BRA (Images/bus_*.png + Masks/mask_*.png), with case and pathology from bus_data.csv if there."""
    dataset = "BUS-BRA"
    images_dir, masks_dir = src / "Images", src / "Masks"
    if not images_dir.is_dir() or not masks_dir.is_dir():
        raise ConvertError(f"{dataset}: expected folders '{images_dir}' and '{masks_dir}'")
    masks = {p.stem: p for p in masks_dir.iterdir() if p.suffix.lower() in SUFFIXES}
    meta = {}
    if (src / "bus_data.csv").is_file():
        with (src / "bus_data.csv").open(newline="") as f:
            meta = {row.get("ID", ""): row for row in csv.DictReader(f)}
    records = []
    for p in sorted(images_dir.iterdir()):
        if p.suffix.lower() not in SUFFIXES:
            continue
        mask_stem = "mask_" + p.stem[4:] if p.stem.startswith("bus_") else p.stem
        mask = masks.get(mask_stem, masks.get(p.stem))
        if mask is None:
            raise ConvertError(f"{dataset}: image '{p}' has no mask '{masks_dir / (mask_stem + '.png')}'")
        row = meta.get(p.stem, {})
        records.append({"stem": p.stem, "image": p, "masks": [mask], "case": row.get("Case", ""),
                        "class": row.get("Pathology", "")})
    if not records:
        raise ConvertError(f"{dataset}: no images in '{images_dir}'")
    return records


def convert_busi(src: Path, dst_root: Path, size: int = 256, include_normal: bool = False,
                 overwrite: bool = False) -> Path:
    """Convert BUSI into ``<dst_root>/breast_us/BUSI-Baheya-Cairo`` (+ classes.csv)."""
    src = Path(src).expanduser()
    records = find_busi(src, include_normal)
    note = ("BUSI (Baheya Hospital, Cairo); several masks of one image merged by OR; class (benign/malignant"
            f"{'/normal' if include_normal else ''}) in classes.csv. BUSI has no patient ids: split per image.")
    return write_site("BUSI", Path(dst_root) / "breast_us" / BUSI_CENTER, records, src, size, "L", "png", ["class"],
                      note, overwrite, classes=True)


def convert_busbra(src: Path, dst_root: Path, size: int = 256, overwrite: bool = False) -> Path:
    """Convert BUS-BRA into ``<dst_root>/breast_us/BUS-BRA-INCa-Brazil`` (+ classes.csv)."""
    src = Path(src).expanduser()
    records = find_busbra(src)
    note = ("BUS-BRA (INCa, Rio de Janeiro); stems as in the download (bus_<n>-<side>, n = patient); case and "
            "pathology from bus_data.csv when present.")
    return write_site("BUS-BRA", Path(dst_root) / "breast_us" / BUSBRA_CENTER, records, src, size, "L", "png",
                      ["case", "class"], note, overwrite, classes=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = verb_parser("feduq convert skin-breast", description=__doc__.split("\n\n")[0])
    p.add_argument("--dst", type=Path, required=True, help="data root to write")
    p.add_argument("--ham10000", type=Path, default=None, metavar="SRC", help="unpacked HAM10000 folder")
    p.add_argument("--ham-metadata", type=Path, default=None, help="default: SRC/HAM10000_metadata.csv")
    p.add_argument("--ham-masks", type=Path, default=None,
                   help="lesion masks folder (default: SRC/HAM10000_segmentations_lesion_tschandl)")
    p.add_argument("--allow-missing", action="store_true", help="HAM10000: skip metadata rows without image or mask")
    p.add_argument("--busi", type=Path, default=None, metavar="SRC", help="unpacked BUSI folder")
    p.add_argument("--busi-normal", action="store_true", help="also convert BUSI normal/ (empty masks)")
    p.add_argument("--busbra", type=Path, default=None, metavar="SRC", help="unpacked BUS-BRA folder")
    p.add_argument("--skin-size", type=int, default=384, help="HAM10000 output size (0 = original)")
    p.add_argument("--breast-size", type=int, default=256, help="BUSI / BUS-BRA output size (0 = original)")
    p.add_argument("--image-format", choices=("jpg", "png"), default="jpg", help="HAM10000 images (jpg = q90)")
    p.add_argument("--overwrite", action="store_true", help="replace existing output center folders")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert every dataset given; returns 0, 1 if none was given, 2 on a conversion error (message on stderr)."""
    a = parse_args(argv)
    if not (a.ham10000 or a.busi or a.busbra):
        print("error: give at least one of --ham10000, --busi, --busbra", file=sys.stderr)
        return 1
    try:
        outs = []
        if a.ham10000:
            outs += convert_ham10000(a.ham10000, a.dst, a.skin_size, a.image_format, a.ham_metadata, a.ham_masks,
                                     a.allow_missing, a.overwrite)
        if a.busi:
            outs.append(convert_busi(a.busi, a.dst, a.breast_size, a.busi_normal, a.overwrite))
        if a.busbra:
            outs.append(convert_busbra(a.busbra, a.dst, a.breast_size, a.overwrite))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for out in outs:
        print(f"{out.name}: {len(list((out / 'images').iterdir()))} pairs -> {out}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq convert skin-breast", main))
