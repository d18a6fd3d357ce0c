"""Sites of a federation: real centers, and *virtual sites* (a seeded IID partition of one center).

FedA3I (AAAI 2024) splits ISIC-2017's 2000 training images IID into 50 sites of 40 and tests every site on one
common held-back set; FedUQ does the same for any center. A virtual site is named
``<center>-p<k>of<K>`` (``ISIC-2017-p07of50``: part 7 of 50, k counted from 0) and reads the center's folder;
its split comes from the committed partition file ``feduq/splits/<task>/<center>.iid<K>.json``::

    {"center": "ISIC-2017", "num_sites": 50, "seed": 0, "val_fraction": 0.1,
     "sites": {"ISIC-2017-p00of50": {"training": [...], "validation": [...]}, ...},
     "testing": [...]}                      # the common test set of every part

written by :func:`make_partition` (``feduq split --virtual K``). The pool that is dealt out is the center's
training + validation lists of its own split; the test set is the center's test list, shared by all parts
(ISIC-2017: the 2000 official training images are dealt, the 150 official validation images test).

Any site, real or virtual, can carry a *site-local* split ``<center folder>/splits/<site>.json`` (written by
``feduq noisy-labels`` for a derived, noisy dataset); it comes first (:func:`site_split_file`).
"""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import numpy as np

from ..tasks.spec import DataError, get_task

#: ``<center>-p<k>of<K>``: part k (0-based) of a K-site IID partition of ``center``.
VIRTUAL_SITE = re.compile(r"(?P<center>.+)-p(?P<part>\d+)of(?P<num>\d+)")
PACKAGE_SPLITS_DIR = Path(__file__).resolve().parents[1] / "splits"


def virtual_site_name(center: str, part: int, num_sites: int) -> str:
    """``("ISIC-2017", 7, 50) -> "ISIC-2017-p07of50"`` (k zero-padded to the width of K - 1)."""
    width = len(str(num_sites - 1))
    return f"{center}-p{part:0{width}d}of{num_sites}"


def parse_site(site: str) -> tuple[str, int | None, int | None]:
    """``site -> (center, part, num_sites)``; a real center gives ``(site, None, None)``.

    Raises:
        DataError: a virtual name whose part is not below its number of sites.
    """
    m = VIRTUAL_SITE.fullmatch(site)
    if not m:
        return site, None, None
    part, num = int(m["part"]), int(m["num"])
    if not 0 <= part < num:
        raise DataError(f"site {site!r}: part {part} is not in 0..{num - 1}")
    return m["center"], part, num


def site_center(task: str, site: str) -> str:
    """The center folder a site reads (``ISIC-2017-p07of50 -> ISIC-2017``).

    Raises:
        DataError: the center is not one of the task's centers or partition centers.
    """
    spec = get_task(task)
    center = parse_site(site)[0]
    known = tuple(spec.centers) + tuple(spec.partition_centers)
    if center not in known:
        raise DataError(f"site {site!r} is not a center of task {task!r} nor a virtual site of one "
                        f"(centers: {list(known)}; virtual sites: <center>-p<k>of<K>)")
    return center


def partition_file(task: str, center: str, num_sites: int) -> Path:
    return PACKAGE_SPLITS_DIR / task / f"{center}.iid{num_sites}.json"


def site_split_file(task: str, site: str, center_dir: Path) -> Path | None:
    """The site-local split ``<center folder>/splits/<site>.json`` when present, else None."""
    path = center_dir / "splits" / f"{site}.json"
    return path if path.is_file() else None


def virtual_split(task: str, site: str, center_dir: Path) -> dict:
    """The decathlon split of a virtual site (its part + the common test set), paths relative to ``center_dir``.

    Raises:
        DataError: no partition file for the site's K, or the site is not in it.
    """
    center, _, num = parse_site(site)
    path = partition_file(task, center, num)
    if not path.is_file():
        raise DataError(f"site {site!r}: no partition of {center!r} into {num} sites ({path}); write it with "
                        f"feduq split --task {task} --centers {center} --virtual {num}")
    part = json.loads(path.read_text())
    name = virtual_site_name(center, parse_site(site)[1], num)  # p7of10 and p07of10 are the same part
    if name not in part["sites"]:
        raise DataError(f"site {site!r}: not in {path}")
    return {"training": part["sites"][name]["training"], "validation": part["sites"][name]["validation"],
            "testing": part["testing"]}


def make_partition(split: dict, center: str, num_sites: int, seed: int = 0, val_fraction: float = 0.1) -> dict:
    """Deal a center's training + validation items IID into ``num_sites`` parts (seeded shuffle, sizes differ by ≤ 1).

    Within a part the first ⌈val_fraction · n⌉ items validate (at least 1 when val_fraction > 0), the rest train.
    FedA3I trains on all 40 images of a part and reports the last round (no validation); FedUQ keeps
    ``val_fraction`` for its model selection (``val_fraction=0`` gives the paper's parts, then the job must
    select the last round).

    Args:
        split: the center's decathlon split (``training``, ``validation``, ``testing`` lists, relative paths).

    Raises:
        ValueError: ``num_sites`` < 1 or more sites than images, ``val_fraction`` outside [0, 1).
    """
    pool = list(split["training"]) + list(split["validation"])
    if not 1 <= num_sites <= len(pool):
        raise ValueError(f"num_sites={num_sites}: expected 1..{len(pool)} (the images of {center!r})")
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction}: expected a number in [0, 1)")
    order = np.random.default_rng(seed).permutation(len(pool))
    sites = {}
    for k in range(num_sites):
        items = [pool[i] for i in order[k::num_sites]]
        n_val = math.ceil(val_fraction * len(items)) if val_fraction > 0 else 0
        sites[virtual_site_name(center, k, num_sites)] = {"training": items[n_val:], "validation": items[:n_val]}
    return {"center": center, "num_sites": num_sites, "seed": seed, "val_fraction": val_fraction,
            "sites": sites, "testing": list(split["testing"])}


def relative_split(split: dict, center_dir: str | os.PathLike) -> dict:
    """A loaded split (absolute paths) with every path made relative to ``center_dir``."""
    return {key: [{k: os.path.relpath(v, center_dir) for k, v in item.items()} for item in items]
            for key, items in split.items()}
