"""Labelled cases for the review rule: each image of labelled sites scored as a site's test scores it, with the case
scores, area fractions and bottleneck features the rule is chosen on (``predict --calibrate``) and judged on (a
held-out site, :mod:`feduq.results.review_holdout`)."""

from __future__ import annotations

import hashlib
import re
import tempfile
from pathlib import Path

import numpy as np

__all__ = ["CASE_KEYS", "labelled_cases", "case_files", "case_hashes"]

#: the per-case numbers :func:`labelled_cases` returns (fractions; the scores in the primary map's unit)
CASE_KEYS = ("u_mean", "u_foreground", "u_boundary", "area_fraction", "mask_fraction", "dice")


def labelled_cases(loaded, *, site_dirs=(), sites=(), data_root=None, split: str = "val",
                   max_items: int | None = None, quality: dict | None = None, center_dirs: dict | None = None
                   ) -> tuple[dict, np.ndarray, list[str], list[dict]]:
    """Score every labelled image of ``site_dirs`` (all their images) and ``sites`` (their ``split``) with
    ``loaded``'s model, as :func:`feduq.site.evaluation.evaluate_site` scores them (``case_level``).

    Returns:
        ``(cases, features, where, rows)``: ``cases`` maps each of :data:`CASE_KEYS` to ``[N]`` float64, ``features``
        ``[N, F]`` the pooled bottleneck features, ``where`` the ``site:split`` sources, ``rows`` the per-image rows
        (``site``, ``image``, ``sha256`` of the case's files (:func:`case_hashes`), ...), in one order. ``quality``
        and ``center_dirs``, dicts when given, receive each site's pixel-level figures (``evaluate_site``'s
        ``quality``: map name -> figures with the reliability ``bins``) and its folder (resolved).

    Raises:
        ValueError: neither site folders nor sites given. feduq.data.DataError / EvaluationError: as ``evaluate_site``.
    """
    from ..site.evaluation import evaluate_site, site_dataset

    targets = [dict(site_dir=d) for d in site_dirs] + [dict(site=s, data_root=data_root) for s in sites]
    if not targets:
        raise ValueError("labelled cases need a site folder (images/, masks/, labels.json) or a site with a split")
    rows, features, where = [], [], []
    with tempfile.TemporaryDirectory(prefix="feduq-calibrate-") as work:
        for target in targets:
            split_here = "all" if "site_dir" in target else split
            name, dataset, center_dir = site_dataset(loaded, split=split_here, work_dir=work, max_items=max_items,
                                                     **target)
            result = evaluate_site(loaded, dataset, name, center_dir, case_level=True)
            hashes = case_hashes(center_dir, [r["image"] for r in result["per_image"]])
            if quality is not None:
                quality[name] = result["quality"]
            if center_dirs is not None:
                center_dirs[name] = Path(center_dir).resolve()
            rows += [{**r, "sha256": hashes[r["image"]]} for r in result["per_image"]]
            features.append(result["features"])
            where.append(f"{target.get('site_dir') or name}:{split_here}")
    cases = {k: np.array([r[k] for r in rows], dtype=np.float64) for k in CASE_KEYS}
    return cases, np.concatenate(features), where, rows


def case_files(center_dir, stems) -> dict[str, list[Path]]:
    """Each case's files under ``center_dir`` (image channels and mask, sorted by path): those whose name up to the
    first dot, less an nnU-Net channel suffix ``_0000``, is the case's stem (a volume's slice ``<case>_z012`` falls
    back to its volume's files); an empty list when none is found."""
    index: dict[str, set[Path]] = {}
    for f in Path(center_dir).resolve().rglob("*"):
        if f.is_file():
            key = f.name.split(".")[0]
            index.setdefault(key, set()).add(f)
            channel = re.fullmatch(r"(.+)_\d{4}", key)
            if channel:
                index.setdefault(channel.group(1), set()).add(f)
    return {stem: sorted(index.get(stem) or index.get(re.sub(r"_z?\d+$", "", stem)) or ()) for stem in stems}


def case_hashes(center_dir, stems) -> dict:
    """Each case's SHA-256 over its files' bytes (:func:`case_files`, in path order); None when no file is found."""
    out = {}
    for stem, files in case_files(center_dir, stems).items():
        h = hashlib.sha256()
        for f in files:
            h.update(f.read_bytes())
        out[stem] = h.hexdigest() if files else None
    return out
