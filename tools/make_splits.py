#!/usr/bin/env python
"""Write the train/validation/test split of every site of a task as MONAI decathlon JSON files.

Examples (from the repository root)::

    # regenerate the committed splits custom/splits/polyp/<center>.json
    python tools/make_splits.py --data-root ../shared/data --task polyp
    # write <data_root>/polyp/<center>/split.json at each site instead (overrides the packaged split)
    python tools/make_splits.py --data-root /data --task polyp --site-local

Splits are seeded (``--seed``), keep whole groups (``TaskSpec.group_column``, e.g. CVC-ColonDB video sequences) in
one split, and list paths relative to the center folder, so the files contain no data and no absolute paths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from feduq.data import (
    DEFAULT_FRACTIONS,
    PACKAGE_SPLITS_DIR,
    DataError,
    get_task,
    make_center_split,
    resolve_data_root,
    write_split_file,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-root", default=None, help="data root (default: $FEDUQ_DATA_ROOT)")
    p.add_argument("--task", default="polyp")
    p.add_argument("--centers", nargs="+", default=None, help="default: all centers of the task")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fractions", type=float, nargs=3, default=list(DEFAULT_FRACTIONS), metavar=("TRAIN", "VAL", "TEST")
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--out", type=Path, default=None, help="output folder (default: the package's splits/<task>)")
    out.add_argument("--site-local", action="store_true",
                     help="write <data_root>/<task folder>/<center>/split.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Write one split file per center and print a count table; returns 0, or 2 on a :class:`DataError`."""
    args = parse_args(argv)
    try:
        spec = get_task(args.task)
        root = resolve_data_root(args.data_root)
        centers = args.centers or list(spec.centers)
        rows = []
        for center in centers:
            if spec.name == "ct":  # PNG slices and NIfTI volumes by case; the held-out site is all test
                from feduq.ct import make_ct_split

                split = make_ct_split(root, center, fractions=args.fractions, seed=args.seed)
            else:
                split = make_center_split(root, args.task, center, fractions=args.fractions, seed=args.seed)
            if args.site_local:
                path = root / spec.folder / center / "split.json"
            else:
                path = (args.out or PACKAGE_SPLITS_DIR / args.task) / f"{center}.json"
            write_split_file(split, path)
            rows.append((center, split, path))
    except DataError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    header = f"{'site':<22} {'n':>5} {'train':>6} {'val':>5} {'test':>5} {'groups':>7}  grouping"
    print(f"task '{args.task}', seed {args.seed}, fractions {tuple(args.fractions)}")
    print(header)
    print("-" * len(header))
    for center, split, _ in rows:
        counts = [len(split[k]) for k in ("training", "validation", "testing")]
        grouping = split["group_column"] or (f"stem /{split['group_pattern']}/" if split.get("group_pattern") else "-")
        print(f"{center:<22} {sum(counts):>5} {counts[0]:>6} {counts[1]:>5} {counts[2]:>5} {split['num_groups']:>7}  "
              f"{grouping}" + (f"  ({split['group_note']})" if split.get("group_note") else ""))
    for center, _, path in rows:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
