"""Generate a small SYNTHETIC multi-center polyp-like sample in the FedUQ site layout.

The images are NOT medical data: a smooth random texture with 1-2 brighter or darker ellipses ("polyps") whose pixels
form the 0/255 mask. Each center gets its own colour and brightness shift, so the sites differ (feature shift). Use
it to try the pipeline (README quickstart, CI) when the real data is not at hand; never report numbers on it.

    feduq synthetic --out /tmp/feduq_synth            # 4 polyp sites x 24 images, 96x96
    FEDUQ_DATA_ROOT=/tmp/feduq_synth python -c "from feduq.data import get_dataset; print(len(get_dataset('polyp', 'Kvasir-SEG', 'train')))"

Writes, per center: images/*.png, masks/*.png, labels.json, provenance.csv and a site-local split.json (70/10/20).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path
from feduq.cli import verb_parser

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from feduq.data import DataError, get_task, make_center_split, write_split_file

BANNER = "SYNTHETIC DATA (random textures and ellipses, not medical images) - for pipeline tests only"


def center_style(index: int) -> tuple[np.ndarray, float]:
    """Per-center (RGB tint in [0, 1], brightness factor): a fixed, clearly different look per site."""
    tints = [(0.85, 0.45, 0.40), (0.75, 0.55, 0.35), (0.90, 0.60, 0.55), (0.65, 0.40, 0.45)]
    brightness = [1.0, 0.8, 1.15, 0.7]
    return np.array(tints[index % len(tints)]), brightness[index % len(brightness)]


def make_sample(rng: np.random.Generator, size: int, tint: np.ndarray, brightness: float):
    """One (RGB image, L mask 0/255) pair of side ``size``."""
    coarse = rng.random((max(size // 12, 2), max(size // 12, 2)))
    texture = Image.fromarray((coarse * 255).astype(np.uint8)).resize((size, size), Image.Resampling.BICUBIC)
    noise = rng.normal(0.0, 0.04, (size, size))
    base = 0.35 + 0.4 * np.asarray(texture, dtype=np.float64) / 255.0 + noise

    mask = Image.new("L", (size, size), 0)
    lesion = np.zeros((size, size))
    for _ in range(rng.integers(1, 3)):
        rx, ry = rng.uniform(0.08, 0.22, 2) * size
        cx, cy = rng.uniform(0.25, 0.75, 2) * size
        blob = Image.new("L", (size, size), 0)
        ImageDraw.Draw(blob).ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=255)
        ImageDraw.Draw(mask).ellipse([cx - rx, cy - ry, cx + rx, cy + ry], fill=255)
        soft = np.asarray(blob.filter(ImageFilter.GaussianBlur(1.0)), dtype=np.float64) / 255.0
        lesion += soft * rng.choice([0.3, -0.25])  # brighter or darker polyp

    rgb = (base + lesion)[..., None] * tint[None, None, :] * brightness
    image = Image.fromarray((np.clip(rgb, 0, 1) * 255).astype(np.uint8), mode="RGB")
    return image, mask


def write_center(out: Path, task: str, center: str, index: int, n: int, size: int, seed: int) -> Path:
    """Write one synthetic center folder (images, masks, labels.json, provenance.csv); returns it.

    If the task groups this center (``TaskSpec.group_column``, e.g. CVC-ColonDB ``sequence``), provenance.csv gets
    that column with consecutive blocks of 4 images per group, so grouped splitting is exercised too.
    """
    group_column = get_task(task).group_column.get(center)
    center_dir = out / task / center
    (center_dir / "images").mkdir(parents=True, exist_ok=True)
    (center_dir / "masks").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng([seed, index])
    tint, brightness = center_style(index)
    rows = []
    for i in range(n):
        stem = f"synth_{i:03d}"
        image, mask = make_sample(rng, size, tint, brightness)
        image.save(center_dir / "images" / f"{stem}.png")
        mask.save(center_dir / "masks" / f"{stem}.png")
        rows.append({"image_file": f"images/{stem}.png", "mask_file": f"masks/{stem}.png",
                     "source": "SYNTHETIC (feduq synthetic)", "seed": seed})
        if group_column:
            rows[-1][group_column] = str(i // 4 + 1)
    with (center_dir / "provenance.csv").open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    note = f"{BANNER}. {n} RGB PNG {size}x{size}, mask 0/255, generated with seed {seed}."
    labels = {"labels": {"0": "background", "255": "polyp"}, "note": note}
    (center_dir / "labels.json").write_text(json.dumps(labels, indent=1) + "\n")
    return center_dir


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = verb_parser("feduq synthetic", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="data root to create (<out>/<task>/<center>/...)")
    p.add_argument("--task", default="polyp", help="a registered binary task (default polyp)")
    p.add_argument("--n-per-center", type=int, default=24)
    p.add_argument("--counts", default="", help="images per center instead of --n-per-center, e.g. Kvasir-SEG=1000,"
                                                "CVC-ClinicDB=612,CVC-ColonDB=380,ETIS-LaribPolypDB=30 (the real polyp "
                                                "counts); a center not named keeps --n-per-center")
    p.add_argument("--size", type=int, default=96)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (they are kept)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write the synthetic sites and their site-local split.json; returns 0, or 2 on bad arguments."""
    args = parse_args(argv)
    try:
        spec = get_task(args.task)
        if spec.num_classes != 2 or spec.in_channels != 3:
            raise DataError(f"make_synthetic only draws binary RGB tasks; '{args.task}' has "
                            f"{spec.num_classes} classes and {spec.in_channels} channel(s)")
        counts = {center: args.n_per_center for center in spec.centers}
        for item in filter(None, (v.strip() for v in args.counts.split(","))):
            center, _, n = item.partition("=")
            if center not in counts or not n.isdigit():
                raise DataError(f"--counts {item!r}: expected CENTER=N with CENTER one of {', '.join(spec.centers)}")
            counts[center] = int(n)
        if min(counts.values()) < 3 or args.size < 16:
            raise DataError("need >= 3 images per center (--n-per-center, --counts) and --size >= 16")
        from feduq.outputs import claim_output_folder

        out, keep = claim_output_folder(args.out, {}, "feduq synthetic", force=args.force, env_data_root=False)
        clash = [f for f in keep if f.startswith(f"{spec.folder}/")]
        if clash:  # a user's file where the sites are written is never replaced
            raise DataError(f"{out / clash[0]} is not FedUQ's and lies where the synthetic sites are written; move it "
                            f"away")
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"*** {BANNER} ***")
    for index, center in enumerate(spec.centers):
        center_dir = write_center(args.out, args.task, center, index, counts[center], args.size, args.seed)
        split = make_center_split(args.out, args.task, center, seed=args.seed)
        split["description"] = "SYNTHETIC data; " + split["description"]
        write_split_file(split, center_dir / "split.json")
        sizes = "/".join(str(len(split[k])) for k in ("training", "validation", "testing"))
        print(f"  {center:<20} {counts[center]} synthetic pairs (train/val/test {sizes}) -> {center_dir}")
    from feduq.outputs import write_marker

    write_marker(out, "feduq synthetic", exclude=keep)
    print(f"*** SYNTHETIC data written to {args.out.resolve()}; set FEDUQ_DATA_ROOT={args.out.resolve()} ***")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq synthetic", main))
