"""Convert the public polyp datasets from their download layouts into the FedUQ site layout.

Output, one folder per dataset (= federated site)::

    <dst>/polyp/<Center>/images/<stem>.jpg      RGB image (JPEG q90; --image-format png for lossless)
    <dst>/polyp/<Center>/masks/<stem>.png       mask 0/255 (binarised BEFORE resizing, nearest resize)
    <dst>/polyp/<Center>/labels.json            {"labels": {"0": "background", "255": "polyp"}, "note": ...}
    <dst>/polyp/<Center>/provenance.csv         image_file, mask_file, original paths, original size (+ frame, sequence)

Accepted download layouts (``--kvasir``, ``--clinicdb``, ``--etis``, ``--colondb`` point at the unpacked folder)::

    Kvasir-SEG         <src>/images/*.jpg + <src>/masks/*.jpg (JPEG masks, thresholded at 127)
    CVC-ClinicDB       <src>/Original/*.tif + <src>/Ground Truth/*.tif   (or PNG/Original + PNG/Ground Truth, *.png;
                       or TIF/Original + TIF/Ground Truth)
    ETIS-LaribPolypDB  <src>/images/*.png + <src>/masks/*.png            (or <src>/ETIS-LaribPolypDB/<n>.tif +
                       <src>/Ground Truth/p<n>.tif)
    CVC-ColonDB        <src>/<n>.tif[f] images + <src>/p<n>.tif[f] masks (cp<n> contour files are ignored); written as
                       seq<SS>_frame<NNN> with the frame -> video sequence table of the official CVC README

Example::

    feduq convert polyp --dst /data --kvasir ~/dl/Kvasir-SEG --colondb ~/dl/CVC-ColonDB --size 384

``--size 384`` resizes to 384x384 without keeping the aspect ratio (Lanczos image, nearest mask), like the shared
sample data; ``--size 0`` keeps the original size. TIFF files are read with tifffile (Pillow cannot open the
release's colour TIFFs, which are tagged as 3-sample grayscale), everything else with Pillow
(:func:`feduq.io.image_files.read_image`). A file no reader can decode stops the conversion with one line naming it
(exit 2); a center folder is written completely or not at all.

CVC-ClinicDB's 612 frames are numbered in video order and come from about 29-31 colonoscopy sequences, but the
release does not list the boundaries. The converter writes an **estimate** in the ``sequence`` column
(``est00``, ``est01``, ...; :func:`estimate_sequences`), so that a split keeps neighbouring, near-identical frames
together (``feduq split`` groups by it; ``--per-image`` there splits per image as the official FedEvi
code does).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path
from typing import Callable
from feduq.cli import verb_parser

import numpy as np
from PIL import Image

from feduq.data import DataError
from feduq.io.image_files import SiteWriter, read_image, resize_pair

# CVC-ColonDB: frame ranges (inclusive) of the 15 video sequences, from the official CVC README (README.txt.txt),
# as recorded in the provenance of the shared sample data. Metadata only.
COLONDB_SEQUENCES: dict[int, tuple[int, int]] = {
    1: (1, 38), 2: (39, 60), 3: (61, 76), 5: (77, 97), 6: (98, 148), 7: (149, 155), 9: (156, 203),
    10: (204, 208), 11: (209, 263), 14: (264, 273), 15: (274, 300), 4: (301, 320), 8: (321, 340),
    12: (341, 360), 13: (361, 380),
}  # fmt: skip

LABELS = {"0": "background", "255": "polyp"}
PROVENANCE_COLUMNS = [
    "image_file", "mask_file", "original_image_path", "original_mask_path", "orig_width", "orig_height"
]  # fmt: skip


# CVC-ClinicDB sequence estimate (see estimate_sequences): frames compared in gray at 48x48 (Lanczos), a new
# group starts where the mean absolute difference to the previous frame exceeds 33 grey levels (median 14).
SEQUENCE_THUMBNAIL = 48
SEQUENCE_CUT = 33.0


class ConvertError(DataError):
    """A download folder does not have the expected layout (names the dataset and the path it expected)."""


def colondb_sequence(frame: int) -> int:
    """Video sequence id (1..15) of a CVC-ColonDB frame number (1..380); raises ConvertError outside that range."""
    for seq, (first, last) in COLONDB_SEQUENCES.items():
        if first <= frame <= last:
            return seq
    raise ConvertError(f"CVC-ColonDB: frame {frame} is outside the 380 frames of the official release")


def estimate_sequences(images: list[Path], thumbnail: int = SEQUENCE_THUMBNAIL, cut: float = SEQUENCE_CUT) -> list[str]:
    """Estimated video-sequence label of each frame of a video-ordered list (CVC-ClinicDB), deterministic.

    Each frame is read (:func:`~feduq.io.image_files.read_image`), converted to gray (Pillow ``"L"``) and resized to
    ``thumbnail`` x ``thumbnail`` with Lanczos; a new group starts at frame ``i`` when the mean absolute difference
    between the thumbnails of frames ``i - 1`` and ``i`` exceeds ``cut`` grey levels (0..255). Consecutive frames of
    one sequence differ by about 14 (the median over CVC-ClinicDB); a change of scene or sequence by more than 33.
    On the 612 stored frames of the shared copy (384x384 JPEG) this gives 44 groups of 1-59 frames, the release
    having about 29-31 sequences: the estimate over-cuts (a sequence may be split in two), which is safe for a
    split, and it never joins two real sequences unless their junction looks like a continuation.

    Args:
        images: frame files in video order (CVC-ClinicDB: ``1``, ``2``, ... ``612``).
        thumbnail: side of the gray thumbnail in pixels.
        cut: threshold on the mean absolute difference, grey levels.

    Returns:
        One label per frame, ``"est00"``, ``"est01"``, ... (zero-padded to two digits or more), non-decreasing.

    Raises:
        UnreadableImageError: a frame cannot be decoded (names the file).
    """
    labels, group, previous = [], 0, None
    for path in images:
        gray = read_image(path).convert("L").resize((thumbnail, thumbnail), Image.Resampling.LANCZOS)
        thumb = np.asarray(gray, dtype=np.float64)
        if previous is not None and float(np.abs(thumb - previous).mean()) > cut:
            group += 1
        labels.append(group)
        previous = thumb
    width = max(2, len(str(labels[-1]))) if labels else 2
    return [f"est{g:0{width}d}" for g in labels]


# --------------------------------------------------------------------------------------------------------------------
# Finding pairs in the download layouts: each returns [(stem, image path, mask path, extra provenance columns)]
# --------------------------------------------------------------------------------------------------------------------

Pair = tuple[str, Path, Path, dict]


def _glob(folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in suffixes and p.name[0] != ".")


def _pick_layout(dataset: str, src: Path, layouts: list[tuple[str, str]]) -> tuple[Path, Path]:
    """First (images, masks) folder pair under ``src`` that exists."""
    for images, masks in layouts:
        if (src / images).is_dir() and (src / masks).is_dir():
            return src / images, src / masks
    expected = " or ".join(f"'{src / i}' + '{src / m}'" for i, m in layouts)
    raise ConvertError(f"{dataset}: expected folders {expected}")


def _images(dataset: str, folder: Path, suffixes: tuple[str, ...]) -> list[Path]:
    images = _glob(folder, suffixes)
    if not images:
        raise ConvertError(f"{dataset}: no {' / '.join('*' + s for s in suffixes)} images in '{folder}'")
    return images


def _pair_by_stem(dataset: str, images: list[Path], masks: dict[str, Path]) -> list[Pair]:
    """Pair each image with ``masks[image stem]``; an image without a mask raises ConvertError."""
    pairs = []
    for img in images:
        if img.stem not in masks:
            raise ConvertError(f"{dataset}: image {img} has no mask (no mask file with the stem '{img.stem}')")
        pairs.append((img.stem, img, masks[img.stem], {}))
    return pairs


def find_kvasir(src: Path) -> list[Pair]:
    images_dir, masks_dir = _pick_layout("Kvasir-SEG", src, [("images", "masks")])
    images = _images("Kvasir-SEG", images_dir, (".jpg", ".jpeg", ".png"))
    return _pair_by_stem("Kvasir-SEG", images, {p.stem: p for p in _glob(masks_dir, (".jpg", ".jpeg", ".png"))})


def find_clinicdb(src: Path) -> list[Pair]:
    layouts = [("Original", "Ground Truth"), ("PNG/Original", "PNG/Ground Truth"), ("TIF/Original", "TIF/Ground Truth")]
    images_dir, masks_dir = _pick_layout("CVC-ClinicDB", src, layouts)
    images = _images("CVC-ClinicDB", images_dir, (".tif", ".tiff", ".png"))
    return _pair_by_stem("CVC-ClinicDB", images, {p.stem: p for p in _glob(masks_dir, (".tif", ".tiff", ".png"))})


def find_etis(src: Path) -> list[Pair]:
    images_dir, masks_dir = _pick_layout(
        "ETIS-LaribPolypDB", src, [("images", "masks"), ("ETIS-LaribPolypDB", "Ground Truth")]
    )
    images = _images("ETIS-LaribPolypDB", images_dir, (".png", ".tif", ".tiff"))
    masks = {p.stem: p for p in _glob(masks_dir, (".png", ".tif", ".tiff"))}
    if images_dir.name == "ETIS-LaribPolypDB":  # original release: mask of <n>.tif is Ground Truth/p<n>.tif
        masks = {stem[1:]: p for stem, p in masks.items() if stem.startswith("p")}
    return _pair_by_stem("ETIS-LaribPolypDB", images, masks)


def find_colondb(src: Path) -> list[Pair]:
    if not src.is_dir():
        raise ConvertError(f"CVC-ColonDB: expected folder '{src}' with <n>.tiff images and p<n>.tiff masks")
    files = _glob(src, (".tif", ".tiff"))
    images = {int(p.stem): p for p in files if re.fullmatch(r"\d+", p.stem)}
    masks = {int(p.stem[1:]): p for p in files if re.fullmatch(r"p\d+", p.stem)}
    if not images:
        raise ConvertError(f"CVC-ColonDB: no <n>.tiff images in '{src}'")
    pairs = []
    for frame in sorted(images):
        if frame not in masks:
            raise ConvertError(f"CVC-ColonDB: image {images[frame]} has no mask p{frame}.tiff")
        seq = colondb_sequence(frame)
        pairs.append((f"seq{seq:02d}_frame{frame:03d}", images[frame], masks[frame], {"frame": frame, "sequence": seq}))
    return pairs


DATASETS: dict[str, tuple[str, Callable[[Path], list[Pair]]]] = {
    "kvasir": ("Kvasir-SEG", find_kvasir),
    "clinicdb": ("CVC-ClinicDB", find_clinicdb),
    "etis": ("ETIS-LaribPolypDB", find_etis),
    "colondb": ("CVC-ColonDB", find_colondb),
}


# --------------------------------------------------------------------------------------------------------------------
# Writing a site
# --------------------------------------------------------------------------------------------------------------------


def binarise_mask(mask: Image.Image) -> Image.Image:
    """Mask -> mode "L" with values 0/255: threshold at 127 (JPEG/8-bit masks), or at 0 for 0/1 masks."""
    gray = mask.convert("L")
    threshold = 127 if gray.getextrema()[1] > 1 else 0
    return gray.point(lambda v: 255 if v > threshold else 0)


def convert_pair(image_path: Path, mask_path: Path, size: int) -> tuple[Image.Image, Image.Image, tuple[int, int]]:
    """Load, binarise the mask, then (optionally) resize both; returns (RGB image, L mask, original (W, H)).

    Raises:
        UnreadableImageError: the image or the mask cannot be decoded (names the file).
        DataError: the mask's size differs from the image's.
    """
    return resize_pair(read_image(image_path).convert("RGB"), binarise_mask(read_image(mask_path)), size, image_path,
                       mask_path)


def _frame_number(stem: str) -> int:
    return int(stem) if stem.isdigit() else -1


def convert_dataset(key: str, src: Path, dst_root: Path, size: int = 384, image_format: str = "jpg",
                    overwrite: bool = False) -> Path:
    """Convert one download folder into ``<dst_root>/polyp/<Center>``; returns the center folder.

    The folder is written completely or not at all (:class:`~feduq.io.image_files.SiteWriter`). CVC-ClinicDB gets
    the ``sequence`` estimate of :func:`estimate_sequences` (frames in numeric order, computed on the stored images);
    CVC-ColonDB the official ``frame`` and ``sequence``.

    Raises:
        ConvertError: unexpected layout, a missing mask, mismatched sizes, or an existing non-empty output folder
            (without ``overwrite``).
        UnreadableImageError: an image or mask no reader can decode (names the file).
    """
    center, find = DATASETS[key]
    src = Path(src).expanduser()
    pairs = find(src)
    if key == "clinicdb":  # video order, so that neighbouring frames are compared
        pairs = sorted(pairs, key=lambda p: (_frame_number(p[0]), p[0]))
    out = Path(dst_root) / "polyp" / center
    with SiteWriter(out, overwrite=overwrite, what=center, image_format=image_format) as site:
        for stem, image_path, mask_path, extra in pairs:
            image, mask, (w, h) = convert_pair(image_path, mask_path, size)
            site.add(stem, image, mask, original_image_path=image_path.relative_to(src).as_posix(),
                     original_mask_path=mask_path.relative_to(src).as_posix(), orig_width=w, orig_height=h, **extra)
        rows = site.rows
        extra_columns = {"colondb": ["frame", "sequence"], "clinicdb": ["sequence"]}.get(key, [])
        if key == "clinicdb":
            sequences = estimate_sequences([site.stage / r["image_file"] for r in rows])
            for row, seq in zip(rows, sequences):
                row["sequence"] = seq
        resize = f"{size}x{size} (plain resize: Lanczos image, nearest mask)" if size else "the original size"
        note = (f"{center} converted by feduq convert polyp: {len(rows)} pairs, stored at {resize}; masks binarised "
                f"to 0/255 before resizing; images {image_format.upper()}. Pair by file stem.")
        if key == "colondb":
            note += " 'sequence' column = video sequence id from the official README (split by it)."
        if key == "clinicdb":
            note += (f" 'sequence' column = an ESTIMATE of the video sequence ({len(set(sequences))} groups): a new "
                     f"group starts where the mean absolute difference of consecutive frames (gray, "
                     f"{SEQUENCE_THUMBNAIL}x{SEQUENCE_THUMBNAIL} Lanczos) exceeds {SEQUENCE_CUT:g}; the release "
                     f"does not list its sequences.")
        site.finish(PROVENANCE_COLUMNS + extra_columns, LABELS, note)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = verb_parser("feduq convert polyp", description=__doc__.split("\n\n")[0])
    p.add_argument("--dst", type=Path, required=True, help="data root to write (<dst>/polyp/<Center>/...)")
    for key, (center, _) in DATASETS.items():
        p.add_argument(f"--{key}", type=Path, default=None, metavar="SRC", help=f"unpacked {center} download folder")
    p.add_argument("--size", type=int, default=384, help="square output size; 0 keeps the original size")
    p.add_argument("--image-format", choices=("jpg", "png"), default="jpg", help="jpg = JPEG quality 90")
    p.add_argument("--overwrite", action="store_true", help="replace existing output center folders")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Convert every dataset given on the command line; returns 0, 1 if none was given, 2 on a conversion error."""
    args = parse_args(argv)
    todo = [(key, getattr(args, key)) for key in DATASETS if getattr(args, key) is not None]
    if not todo:
        print("error: give at least one of " + ", ".join(f"--{k}" for k in DATASETS), file=sys.stderr)
        return 1
    from feduq.outputs import check_output_folder

    try:  # checked before anything is read or written
        if args.size < 0:
            raise DataError(f"--size {args.size}: expected a side in pixels >= 1, or 0 for the original size")
        if args.dst.exists() and not args.dst.is_dir():
            raise DataError(f"--dst {args.dst} is a file: give the data root folder <dst>/polyp/<Center>/ is "
                            f"written into")
        for key, src in todo:  # a center folder never over, inside or around its own download (nor another's)
            check_output_folder(Path(args.dst) / "polyp" / DATASETS[key][0],
                                {f"--{k} download": s for k, s in todo}, "feduq convert polyp", force=True)
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for key, src in todo:
        try:
            out = convert_dataset(key, src, args.dst, args.size, args.image_format, args.overwrite)
        except DataError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"{DATASETS[key][0]}: {len(list((out / 'images').iterdir()))} pairs -> {out}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq convert polyp", main))
