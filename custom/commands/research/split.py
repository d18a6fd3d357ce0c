"""Write the train/validation/test split of every site of a task as MONAI decathlon JSON files.

Examples (from the repository root)::

    # regenerate the committed splits feduq/splits/polyp/<center>.json
    feduq split --data-root /data/feduq --task polyp
    # write <data_root>/polyp/<center>/split.json at each site instead (overrides the packaged split)
    feduq split --data-root /data --task polyp --site-local

Splits are seeded (``--seed``), keep whole groups (``TaskSpec.group_column``, e.g. CVC-ColonDB video sequences) in
one split, and list paths relative to the center folder, so the files contain no data and no absolute paths.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from feduq.cli import verb_parser

from feduq.sites.nnunet_raw import make_case_split, site_cases
from feduq.sites.centers import make_partition
from feduq.sites.folder import SiteFolder
from feduq.data import (
    DEFAULT_FRACTIONS,
    PACKAGE_SPLITS_DIR,
    DataError,
    get_task,
    make_center_split,
    read_groups,
    resolve_data_root,
    scan_center,
    write_split_file,
)


def fixed_test_split(root, task, center, where: str, fractions, seed: int) -> dict:
    """The images whose provenance ``COLUMN == VALUE`` test; the rest is shuffled (seeded) into train/val."""
    import numpy as np

    column, _, value = where.partition("=")
    center_dir = root / get_task(task).folder / center
    table = read_groups(center_dir, column)
    items = scan_center(root, task, center)
    test = [it for it in items if table.get(it["id"]) == value]
    rest = [it for it in items if table.get(it["id"]) != value]
    if not test:
        raise DataError(f"site {center!r}: no image has {column} == {value!r} in {center_dir / 'provenance.csv'}")
    rest = [rest[i] for i in np.random.default_rng(seed).permutation(len(rest))]
    n_val = round(len(rest) * fractions[1] / (fractions[0] + fractions[1]))

    def rel(its):
        return sorted(({"image": os.path.relpath(it["image"], center_dir), "label": os.path.relpath(it["label"], center_dir)}
                       for it in its), key=lambda d: d["image"])

    return {"name": f"{task}/{center}", "description": "FedUQ split; paths are relative to the center folder",
            "seed": seed, "fractions": list(fractions), "test_where": where, "group_column": None,
            "num_groups": len(items), "training": rel(rest[n_val:]), "validation": rel(rest[:n_val]), "testing": rel(test)}


def stems_split(root, task, center, stems_file: Path) -> dict:
    """The split a file of file stems gives ``center``: ``{"splits": {center: {"train"|"val"|"test": [stem, ...]}}}``
    (or the same mapping without the ``"splits"`` level), e.g. the official FedEvi run's ``split_seed0.json``.

    Raises:
        DataError: the file is not such JSON, lists no split for ``center``, or names a stem the site lacks (named).
    """
    try:
        data = json.loads(Path(stems_file).read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"--stems {stems_file}: cannot read it as JSON ({e})") from None
    splits = data.get("splits", data) if isinstance(data, dict) else None
    parts = splits.get(center) if isinstance(splits, dict) else None
    if not isinstance(parts, dict) or not all(isinstance(parts.get(k), list) for k in ("train", "val", "test")):
        raise DataError(f"--stems {stems_file}: no train/val/test stem lists for site {center!r}")
    center_dir = root / get_task(task).folder / center
    by_stem = {it["id"]: it for it in scan_center(root, task, center)}
    out = {"name": f"{task}/{center}", "description": f"FedUQ split from the stems in {Path(stems_file).name}; paths "
           "are relative to the center folder", "seed": None, "fractions": None, "group_column": None,
           "stems_file": Path(stems_file).name, "num_groups": sum(len(parts[k]) for k in ("train", "val", "test"))}
    for key, name in (("train", "training"), ("val", "validation"), ("test", "testing")):
        missing = [s for s in parts[key] if s not in by_stem]
        if missing:
            raise DataError(f"site {center!r}: {len(missing)} {key} stem(s) of {stems_file} are not in {center_dir} "
                            f"(first: {missing[0]!r})")
        out[name] = [{"image": os.path.relpath(by_stem[s]["image"], center_dir),
                      "label": os.path.relpath(by_stem[s]["label"], center_dir)} for s in parts[key]]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = verb_parser("feduq split", description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", default=None, help="data root (default: $FEDUQ_DATA_ROOT)")
    p.add_argument("--task", default="polyp")
    p.add_argument("--centers", nargs="+", default=None, help="default: all centers of the task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fractions", type=float, nargs=3, default=list(DEFAULT_FRACTIONS), metavar=("TRAIN", "VAL", "TEST")
    )
    p.add_argument("--per-image", action="store_true",
                   help="ignore the task's groups (video sequences, cases) and split image by image, as the official "
                        "FedEvi code splits its polyp sites; neighbouring near-identical frames may then straddle "
                        "train/val/test")
    p.add_argument("--stems", type=Path, metavar="FILE",
                   help="take each site's train/val/test file stems from a JSON file ({center: {train, val, test}}, "
                        "optionally under \"splits\"), e.g. the official FedEvi run's split_seed0.json; usually with "
                        "--site-local")
    p.add_argument("--test-where", metavar="COLUMN=VALUE",
                   help="a fixed test set: the images whose provenance.csv COLUMN equals VALUE (ISIC-2017: "
                        "isic2017_split=validation, the 150 official validation images); the rest is split "
                        "train/val by the first two fractions")
    p.add_argument("--virtual", type=int, metavar="K",
                   help="also write the IID partition of each center into K virtual sites <center>-p<k>of<K> "
                        "(feduq/splits/<task>/<center>.iid<K>.json; the center's test list is their common test set)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="validation share of each virtual site")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--out", type=Path, default=None, help="output folder (default: the package's splits/<task>)")
    out.add_argument("--site-local", action="store_true",
                     help="write <data_root>/<task folder>/<center>/split.json")
    p.add_argument("--force", action="store_true",
                   help="with --site-local: replace a site's existing split.json; without it an existing one is "
                        "refused, so a curated split is never overwritten")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write one split file per center and print a count table; returns 0, or 2 on a :class:`DataError`."""
    args = parse_args(argv)
    try:
        if args.virtual is not None and args.virtual < 1:
            raise DataError(f"--virtual {args.virtual}: expected an integer >= 1 (virtual sites per center)")
        if min(args.fractions) < 0 or abs(sum(args.fractions) - 1.0) > 1e-6:
            raise DataError(f"--fractions {' '.join(map(str, args.fractions))}: expected three shares >= 0 that sum "
                            f"to 1 (train, validation, test)")
        spec = get_task(args.task)
        root = resolve_data_root(args.data_root)
        centers = args.centers or list(spec.centers)
        folders = [SiteFolder.of(args.task, c, root) for c in centers]
        if args.virtual and any(f.nnunet for f in folders):
            raise DataError(f"--virtual: task {spec.name!r} has sites in nnU-Net's raw layout; virtual sites of them "
                            "are not built yet")
        nnunet = all(f.nnunet for f in folders)
        if nnunet and not args.out:  # a declared task's sites keep their own split.json (case lists)
            args.site_local = True
        keep = None
        if args.site_local:  # every file checked before any is written (feduq.outputs)
            from feduq.outputs import check_output_file

            for center in centers:
                check_output_file(root / spec.folder / center / "split.json", {}, "feduq split", force=args.force,
                                  in_data_root=True)
        elif args.out:  # a folder of split files: a user's file there is kept, never replaced
            from feduq.outputs import check_output_folder, user_files

            args.out = check_output_folder(args.out, {"data root": root}, "feduq split", force=args.force)
            keep = user_files(args.out)
            names = {f"{c}.json" for c in centers} | {f"{c}.iid{args.virtual}.json" for c in centers}
            clash = [f for f in keep if f in names]
            if clash:
                raise DataError(f"{args.out / clash[0]} is not FedUQ's and feduq split would write it; move it away")
        rows = []
        for center in centers:
            if nnunet:  # an nnU-Net raw site: its cases, grouped by the task's group_pattern
                split = make_case_split(root / spec.folder / center, spec, center,
                                        site_cases(spec.name, root, center), fractions=args.fractions, seed=args.seed)
            elif spec.name == "ct":  # PNG slices and NIfTI volumes by case; the held-out site is all test
                from feduq.data.ct import make_ct_split

                split = make_ct_split(root, center, fractions=args.fractions, seed=args.seed)
            elif args.stems:
                split = stems_split(root, args.task, center, args.stems)
            elif args.test_where:
                split = fixed_test_split(root, args.task, center, args.test_where, args.fractions, args.seed)
            else:
                split = make_center_split(root, args.task, center, fractions=args.fractions, seed=args.seed,
                                          per_image=args.per_image)
            if args.virtual:  # the partition deals the center's training + validation lists
                part = make_partition(split, center, args.virtual, seed=args.seed, val_fraction=args.val_fraction)
                ppath = (args.out or PACKAGE_SPLITS_DIR / args.task) / f"{center}.iid{args.virtual}.json"
                ppath.parent.mkdir(parents=True, exist_ok=True)
                ppath.write_text(json.dumps(part, indent=1) + "\n")
                sizes = sorted({len(v["training"]) for v in part["sites"].values()})
                print(f"{center}: {args.virtual} virtual sites, {sizes} training images each, "
                      f"{len(part['testing'])} common test images -> {ppath}")
            if args.site_local:
                path = root / spec.folder / center / "split.json"
            else:
                path = (args.out or PACKAGE_SPLITS_DIR / spec.name) / f"{center}.json"
            write_split_file(split, path)
            rows.append((center, split, path))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if keep is not None:
        from feduq.outputs import write_marker

        write_marker(args.out, "feduq split", exclude=keep)

    header = f"{'site':<22} {'n':>5} {'train':>6} {'val':>5} {'test':>5} {'groups':>7}  grouping"
    print(f"task '{spec.name}', seed {args.seed}, fractions {tuple(args.fractions)}")
    print(header)
    print("-" * len(header))
    for center, split, _ in rows:
        counts = [len(split[k]) for k in ("training", "validation", "testing")]
        grouping = split["group_column"] or (f"stem /{split['group_pattern']}/" if split.get("group_pattern")
                                             else "per image (--per-image)" if split.get("per_image")
                                             else f"stems of {split['stems_file']}" if split.get("stems_file") else "-")
        print(f"{center:<22} {sum(counts):>5} {counts[0]:>6} {counts[1]:>5} {counts[2]:>5} {split['num_groups']:>7}  "
              f"{grouping}" + (f"  ({split['group_note']})" if split.get("group_note") else ""))
    for center, _, path in rows:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq split", main))
