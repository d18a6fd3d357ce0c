"""Convert the FedDG / DoFE fundus ROI domains into FedUQ optic disc / cup sites.

Accepted download layout (the preprocessed "Fundus" set of FedDG-ELCFS / DoFE: 800x800 ROI crops)::

    <src>/Domain1/train/ROIs/image/<name>.png   + <src>/Domain1/train/ROIs/mask/<name>.png
    <src>/Domain1/test/ROIs/image/<name>.png    + <src>/Domain1/test/ROIs/mask/<name>.png
    ... Domain2, Domain3, Domain4 (a domain may lack train/ or test/, not both)

Domains become centers: Domain1 Drishti-GS, Domain2 RIM-ONE-r3, Domain3 REFUGE-train (Zeiss), Domain4 REFUGE-val
(Canon); ``--domain Domain5=BinRushed`` adds or renames one. Output per center::

    <dst>/fundus/<Center>/images/<name>.png     RGB ROI (train and test images of the domain together)
    <dst>/fundus/<Center>/masks/<name>.png      0 background, 1 optic disc rim (disc without cup), 2 optic cup
    <dst>/fundus/<Center>/labels.json           {"0": "background", "1": "optic disc (rim, excluding cup)", "2": ...}
    <dst>/fundus/<Center>/provenance.csv        image_file, mask_file, original paths and size, source_split

Mask coding (``--mask-coding``), each pixel read as gray and mapped to the nearest of the three levels before any
resizing: ``feddg`` (default; Drishti-GS, RIM-ONE, REFUGE in FedDG/DoFE) 255 background, 128 disc, 0 cup;
``riga`` (RIGA as FedEvi prepares it) 0 background, 255 disc, 128 cup. The whole disc is mask >= 1 and the cup
mask == 2, which the feduq task ``fundus`` scores separately. Images and masks are resized to ``--size`` (384;
Lanczos image, nearest mask; 0 keeps the size). TIFF files are read with tifffile, the rest with Pillow; a file no
reader can decode stops the conversion with one line naming it (exit 2), and a center folder is written completely or
not at all.

Example::

    feduq convert fundus --src ~/dl/FedDG/Fundus --dst /data/feduq
    feduq convert fundus --src ~/dl/RIGA_rois --dst /data/feduq --mask-coding riga \\
        --domain Domain5=BinRushed --domain Domain6=Magrabia --only Domain5 Domain6
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from feduq.cli import verb_parser

import numpy as np
from PIL import Image

from feduq.data import DataError
from feduq.io.image_files import SiteWriter, read_image

DATASET = "fundus ROI (FedDG/DoFE layout)"
DOMAINS = {"Domain1": "Drishti-GS", "Domain2": "RIM-ONE-r3", "Domain3": "REFUGE-train", "Domain4": "REFUGE-val"}
#: mask coding -> (gray level, class) pairs; a pixel takes the class of the nearest level.
CODINGS = {
    "feddg": ((255, 0), (128, 1), (0, 2)),  # 255 background, 128 disc, 0 cup
    "riga": ((0, 0), (255, 1), (128, 2)),  # 0 background, 255 disc, 128 cup
}
LABELS = {"0": "background", "1": "optic disc (rim, excluding cup)", "2": "optic cup"}
SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
PROVENANCE_COLUMNS = [
    "image_file", "mask_file", "original_image_path", "original_mask_path", "orig_width", "orig_height", "source_split"
]  # fmt: skip


class ConvertError(DataError):
    """A download folder does not have the expected layout (names the dataset and the path it expected)."""


def map_mask(mask: Image.Image, coding: str) -> np.ndarray:
    """Gray mask -> uint8 class map 0/1/2 under ``coding`` (nearest gray level)."""
    gray = np.asarray(mask.convert("L"), dtype=np.int16)
    levels = np.array([lv for lv, _ in CODINGS[coding]], np.int16)
    classes = np.array([c for _, c in CODINGS[coding]], np.uint8)
    return classes[np.abs(gray[..., None] - levels).argmin(axis=-1)]


def find_pairs(domain_dir: Path) -> list[tuple[str, str, Path, Path]]:
    """``[(source split, name, image, mask)]`` of one domain folder.

    Raises:
        ConvertError: neither ``train/ROIs`` nor ``test/ROIs`` with ``image/`` + ``mask/`` exists, or an image has no
            mask of the same stem.
    """
    pairs = []
    found = False
    for split in ("train", "test"):
        image_dir, mask_dir = domain_dir / split / "ROIs" / "image", domain_dir / split / "ROIs" / "mask"
        if not (image_dir.is_dir() and mask_dir.is_dir()):
            continue
        found = True
        masks = {p.stem: p for p in mask_dir.iterdir() if p.suffix.lower() in SUFFIXES}
        for image in sorted(p for p in image_dir.iterdir() if p.suffix.lower() in SUFFIXES and p.name[0] != "."):
            if image.stem not in masks:
                raise ConvertError(f"{DATASET}: image '{image}' has no mask '{mask_dir / (image.stem + '.png')}'")
            pairs.append((split, image.stem, image, masks[image.stem]))
    if not found:
        raise ConvertError(f"{DATASET}: expected '{domain_dir / 'train/ROIs/image'}' + "
                           f"'{domain_dir / 'train/ROIs/mask'}' (and/or the same under test/)")
    if not pairs:
        raise ConvertError(f"{DATASET}: no images under '{domain_dir}/{{train,test}}/ROIs/image'")
    return pairs


def convert_domain(domain_dir: Path, dst_root: Path, center: str, size: int = 384, coding: str = "feddg",
                   prefix_split: bool = False, overwrite: bool = False) -> Path:
    """Convert one domain folder into ``<dst_root>/fundus/<center>``; returns the center folder.

    Raises:
        ConvertError: bad layout, a missing mask, image/mask size mismatch, two files that would share an output
            name (use ``prefix_split``), or an existing non-empty output folder.
    """
    domain_dir = Path(domain_dir).expanduser()
    pairs = find_pairs(domain_dir)
    names = [f"{split}_{name}" if prefix_split else name for split, name, _, _ in pairs]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise ConvertError(f"{DATASET}: '{dup}' exists in both train/ and test/ of '{domain_dir}' (use --prefix-split)")
    out = Path(dst_root) / "fundus" / center
    with SiteWriter(out, overwrite=overwrite, what=f"{DATASET} {center}", image_format="png") as site:
        for name, (split, _, image_path, mask_path) in zip(names, pairs):
            image = read_image(image_path).convert("RGB")
            m = read_image(mask_path)
            if m.size != image.size:
                raise ConvertError(f"{DATASET}: mask '{mask_path}' is {m.size[0]}x{m.size[1]} but image "
                                   f"'{image_path}' is {image.size[0]}x{image.size[1]}")
            mask = Image.fromarray(map_mask(m, coding), mode="L")
            orig = image.size
            if size:
                image = image.resize((size, size), Image.Resampling.LANCZOS)
                mask = mask.resize((size, size), Image.Resampling.NEAREST)
            site.add(name, image, mask, original_image_path=image_path.relative_to(domain_dir).as_posix(),
                     original_mask_path=mask_path.relative_to(domain_dir).as_posix(), orig_width=orig[0],
                     orig_height=orig[1], source_split=split)
        levels = ", ".join(f"{lv} -> {LABELS[str(c)]}" for lv, c in CODINGS[coding])
        resize = f"{size}x{size} (plain resize: Lanczos image, nearest mask)" if size else "the original size"
        note = (f"{center} ({domain_dir.name}) converted by feduq convert fundus: {len(site.rows)} ROI pairs (train and "
                f"test of the source together), stored at {resize}. Source mask coding '{coding}' ({levels}, nearest "
                f"level, before resizing). Optic disc = mask >= 1, optic cup = mask == 2.")
        site.finish(PROVENANCE_COLUMNS, LABELS, note)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = verb_parser("feduq convert fundus", description=__doc__.split("\n\n")[0])
    p.add_argument("--src", type=Path, required=True, help="folder holding Domain1..Domain4")
    p.add_argument("--dst", type=Path, required=True, help="data root to write (<dst>/fundus/<Center>/...)")
    p.add_argument("--domain", action="append", default=[], metavar="FOLDER=CENTER",
                   help="add or rename a domain -> center mapping (repeatable)")
    p.add_argument("--only", nargs="+", default=None, metavar="FOLDER", help="convert only these domain folders")
    p.add_argument("--mask-coding", choices=sorted(CODINGS), default="feddg",
                   help="feddg: 255 bg / 128 disc / 0 cup (default); riga: 0 bg / 255 disc / 128 cup")
    p.add_argument("--size", type=int, default=384, help="square output size; 0 keeps the original size")
    p.add_argument("--prefix-split", action="store_true", help="name outputs <train|test>_<name>")
    p.add_argument("--overwrite", action="store_true", help="replace existing output center folders")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert the domains; returns 0, 1 on a bad ``--domain``, or 2 on a conversion error (message on stderr)."""
    args = parse_args(argv)
    mapping = dict(DOMAINS)
    for item in args.domain:
        folder, sep, center = item.partition("=")
        if not sep or not folder or not center:
            print(f"error: --domain expects FOLDER=CENTER, got '{item}'", file=sys.stderr)
            return 1
        mapping[folder] = center
    src = args.src.expanduser()
    folders = args.only or [f for f in mapping if (src / f).is_dir()]
    try:
        if not folders:
            raise ConvertError(f"{DATASET}: none of {', '.join(str(src / f) for f in mapping)} exists "
                               f"(expected e.g. '{src / 'Domain1/train/ROIs/image'}')")
        for folder in folders:
            if folder not in mapping:
                raise ConvertError(f"{DATASET}: no center name for '{folder}' (add --domain {folder}=CENTER)")
            out = convert_domain(src / folder, args.dst, mapping[folder], args.size, args.mask_coding,
                                 args.prefix_split, args.overwrite)
            print(f"{folder} -> {mapping[folder]}: {len(list((out / 'images').iterdir()))} pairs -> {out}")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq convert fundus", main))
