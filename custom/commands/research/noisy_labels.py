"""Write a derived dataset whose sites carry FedA3I's CEM annotation noise (feduq.methods.feda3i.annotator_noise, FedA3I §3.2).

Example (from the repository root)::

    # FedA3I SKIN: 50 virtual sites of ISIC-2017, enlarge-dominant noise N_E = M(25, -25, 10, 0.8)
    feduq noisy-labels --data-root /data/feduq --task skin --preset skin_ne \\
        --sites $(python -c "print(','.join(f'ISIC-2017-p{k:02d}of50' for k in range(50)))") --out /data/skin_ne
    # BREAST, both centers, the code's fixed count of shrinking sites and a custom model
    feduq noisy-labels --data-root /data/feduq --task breast --sites all \\
        --model 25,-15,5,0.2 --mode code --out /data/breast_ns

Site parameters C(mu_i, sigma_i) are drawn once for the list of sites, in the order given (``--seed``); every site
then gets its own generator (spawned from the seed by site index) for its masks, training first, then validation.
Output, for a site s of center c, under ``<out>/<task folder>/<c>/``::

    images -> <data_root>/<task folder>/<c>/images      symlinks (absolute) to the clean folders, once per center
    masks  -> <data_root>/<task folder>/<c>/masks
    labels.json, provenance.csv (, classes.csv)          copied
    noisy/<s>/<stem>.png                                 noisy training (and validation, unless --clean-val) masks
    splits/<s>.json                                      decathlon split: training/validation -> noisy/<s>/..., testing -> masks/...
    noise/<s>.json                                       the site's parameters, seed, Dice of noisy vs clean, provenance

``feduq.data.load_split(..., site=s)`` reads ``splits/<s>.json`` first, so pointing a job's data root at ``<out>``
trains site s on its noisy labels and tests it on clean masks. A mask without foreground, or whose every object is
under 15 px, is kept clean (a warning names it; listed under ``kept_clean``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from feduq.cli import verb_parser

import numpy as np
from PIL import Image

from feduq.data import DataError, get_task, read_label_values, resolve_data_root, site_split
from feduq.methods.feda3i.annotator_noise import DRAW_MODES, PRESETS, NoiseModel, SiteNoise, dice, draw_site_noise, noisy_label
from feduq.outputs import check_output_folder, user_files, write_marker
from feduq.sites.centers import site_center

COPIED = ("labels.json", "provenance.csv", "classes.csv")


#: options whose value may start with '-' (a negative number), which argparse would take for an option
NUMBER_OPTIONS = ("--model",)


def joined_negative_values(argv: list[str]) -> list[str]:
    """``argv`` with ``--model -5,-10,3,0.2`` given as ``--model=-5,-10,3,0.2``: argparse takes a separate value
    starting with '-' for an option ("expected one argument"). Only a value that starts as a number does."""
    import re

    out, i = [], 0
    while i < len(argv):
        if argv[i] in NUMBER_OPTIONS and i + 1 < len(argv) and re.match(r"-\.?\d", argv[i + 1]):
            out.append(f"{argv[i]}={argv[i + 1]}")
            i += 2
            continue
        if argv[i] == "--":  # the rest are positional
            return out + list(argv[i:])
        out.append(argv[i])
        i += 1
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    argv = joined_negative_values(list(sys.argv[1:] if argv is None else argv))
    p = verb_parser("feduq noisy-labels", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", default=None, help="clean data root (default: $FEDUQ_DATA_ROOT)")
    p.add_argument("--task", required=True, help="a binary 2D task, e.g. skin, breast, polyp")
    p.add_argument("--sites", required=True,
                   help="comma-separated sites (centers or virtual sites <center>-p<k>of<K>), or 'all' (the task's centers)")
    model = p.add_mutually_exclusive_group(required=True)
    model.add_argument("--preset", choices=sorted(PRESETS), help="the paper's noise model M")
    model.add_argument("--model", metavar="MU_MAX,MU_MIN,SIGMA_MAX,P_D", help="a custom noise model M (pixels)")
    p.add_argument("--mode", choices=DRAW_MODES, default="paper",
                   help="paper: Bernoulli sign per site (Eq. 1); code: exactly floor((1-p_d)K) negative sites")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clean-val", action="store_true", help="keep validation labels clean (default: noisy too)")
    p.add_argument("--out", type=Path, required=True, help="output data root (must differ from the clean one); another "
                                                           "call adds its sites to a root this tool wrote")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (kept; refused where a noisy site's files go)")
    return p.parse_args(argv)


def parse_model(args: argparse.Namespace) -> NoiseModel:
    if args.preset:
        return PRESETS[args.preset]
    parts = args.model.split(",")
    expected = "MU_MAX,MU_MIN,SIGMA_MAX,P_D (pixels, pixels, pixels, probability)"
    try:
        if len(parts) != 4:
            raise ValueError
        values = [float(v) for v in parts]
    except ValueError:
        raise ValueError(f"--model needs 4 comma-separated numbers {expected}, got {args.model!r}") from None
    try:
        return NoiseModel(*values)
    except ValueError as e:  # the parameter the model refuses, e.g. "mu_max must be >= 0, got -5.0"
        raise ValueError(f"--model {args.model}: {e} ({expected}: MU_MAX >= 0, MU_MIN <= 0, SIGMA_MAX > 0, "
                         "P_D in [0, 1])") from None


def link_center(clean_dir: Path, out_dir: Path) -> None:
    """Symlink images/ and masks/ to the clean center (absolute) and copy its metadata files; idempotent."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in ("images", "masks"):
        link, target = out_dir / name, (clean_dir / name).resolve()
        if link.is_symlink() and Path(os.readlink(link)) == target:
            continue
        if link.exists() or link.is_symlink():
            raise DataError(f"{link} exists and is not a symlink to {target}; choose an empty --out")
        link.symlink_to(target, target_is_directory=True)
    for name in COPIED:
        if (clean_dir / name).is_file():
            shutil.copyfile(clean_dir / name, out_dir / name)


def read_mask(path: Path) -> np.ndarray:
    with Image.open(path) as img:
        mask = np.array(img)
    if mask.ndim != 2:
        raise DataError(f"mask {path} has shape {mask.shape}; expected a single-channel image")
    return mask


def noisy_site(task: str, site: str, index: int, noise: SiteNoise, root: Path, out: Path, seed_seq, args,
               model: NoiseModel) -> dict:
    """Write one site's noisy masks, split and noise.json; return the noise.json record."""
    split = site_split(task, site, root)
    center = split["center"]
    folder = get_task(task).folder
    clean_dir, out_dir = root / folder / center, out / folder / center
    values = read_label_values(clean_dir)
    if len(values) != 2:
        raise DataError(f"site {site!r}: {clean_dir / 'labels.json'} lists {values}; the CEM needs a binary task")
    link_center(clean_dir, out_dir)
    noisy_dir = out_dir / "noisy" / site
    noisy_dir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed_seq)
    dices, kept_clean, capped = [], [], []
    new_split = {"training": [], "validation": [], "testing": [dict(it) for it in split["testing"]]}
    for key in ("training", "validation"):
        for item in split[key]:
            label = Path(item["label"])
            if label.parts[0] == "noisy":
                raise DataError(f"site {site!r}: {label} is already a noisy label; give the clean data root")
            if key == "validation" and args.clean_val:
                new_split[key].append(dict(item))
                continue
            clean = read_mask(clean_dir / label)
            if not set(np.unique(clean).tolist()) <= set(values):
                raise DataError(f"mask {clean_dir / label} has values {np.unique(clean).tolist()}, "
                                f"not among the labels.json values {values}")
            res = noisy_label(clean, noise, rng)
            mask = res.mask
            if res.evolved == 0:  # no foreground, or every object under 15 px / too short: keep it clean
                mask = clean
                kept_clean.append(label.as_posix())
                print(f"WARNING: site {site}: {label} has no contour to evolve "
                      f"({res.objects} object(s), {res.dropped} under 15 px); kept clean", file=sys.stderr)
            else:
                dices.append(dice(mask, clean))
            if res.capped_draws:
                capped.append(label.as_posix())
            target = noisy_dir / f"{label.stem}.png"
            Image.fromarray(mask).save(target)
            new_split[key].append({**item, "label": target.relative_to(out_dir).as_posix()})
    (out_dir / "splits").mkdir(exist_ok=True)
    (out_dir / "splits" / f"{site}.json").write_text(json.dumps(new_split, indent=1) + "\n")
    record = {
        "site": site, "center": center, "task": task, "site_index": index, "num_sites": len(args.site_list),
        "preset": args.preset, "model": asdict(model), "mode": args.mode, "mu": noise.mu, "sigma": noise.sigma,
        "seed": args.seed, "clean_val": args.clean_val,
        "num_masks": sum(1 for k in ("training", "validation") for it in new_split[k]
                         if it["label"].startswith("noisy/")),
        "dice_mean": float(np.mean(dices)) if dices else None, "dice_min": float(np.min(dices)) if dices else None,
        "kept_clean": kept_clean, "bias_redraws_capped": capped,
        "provenance": {"clean_data_root": str(root), "center_dir": str(clean_dir),
                       "clean_split": f"feduq.data.site_split({task!r}, {site!r}, data_root)",
                       "generator": "feduq.methods.feda3i.annotator_noise (FedA3I CEM, paper §3.2)"},
    }
    (out_dir / "noise").mkdir(exist_ok=True)
    (out_dir / "noise" / f"{site}.json").write_text(json.dumps(record, indent=1) + "\n")
    return record


def main(argv: list[str] | None = None) -> int:
    """Write the noisy sites; returns 0, or 2 on a :class:`DataError` or a bad option."""
    args = parse_args(argv)
    keep = out = None
    try:
        model = parse_model(args)
        spec = get_task(args.task)
        root = resolve_data_root(args.data_root)
        args.site_list = list(spec.centers) if args.sites == "all" else [s for s in args.sites.split(",") if s]
        if not args.site_list or len(set(args.site_list)) != len(args.site_list):
            raise ValueError(f"--sites must list distinct sites, got {args.sites!r}")
        for site in args.site_list:  # fail before writing anything
            site_center(args.task, site)
        # never inside, around or equal to the clean root; a root this tool wrote gets more sites; a user's file is
        # refused (with --force kept, unless it lies in a center folder a noisy site is written to)
        out = check_output_folder(args.out, {"clean data root": root}, "feduq noisy-labels", force=args.force)
        keep = user_files(out)
        for site in args.site_list:
            prefix = f"{spec.folder}/{site_center(args.task, site)}/"
            clash = [f for f in keep if f.startswith(prefix)]
            if clash:
                raise DataError(f"{out / clash[0]} is not FedUQ's and lies in the folder site {site}'s noisy labels "
                                f"are written to; move it away (nothing was written)")
        out.mkdir(parents=True, exist_ok=True)
        seeds = np.random.SeedSequence(args.seed).spawn(len(args.site_list) + 1)
        site_noise = draw_site_noise(len(args.site_list), model, np.random.default_rng(seeds[0]), mode=args.mode)
        for index, (site, noise) in enumerate(zip(args.site_list, site_noise)):
            rec = noisy_site(args.task, site, index, noise, root, out, seeds[index + 1], args, model)
            dice_text = "n/a" if rec["dice_mean"] is None else f"{rec['dice_mean']:.3f} (min {rec['dice_min']:.3f})"
            print(f"{site}: mu={noise.mu:+.2f} px sigma={noise.sigma:.2f} px masks={rec['num_masks']} "
                  f"kept_clean={len(rec['kept_clean'])} dice={dice_text}")
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if keep is not None and out.is_dir():  # what this call and the ones before wrote, the user's files excepted
            write_marker(out, "feduq noisy-labels", exclude=keep)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq noisy-labels", main))
