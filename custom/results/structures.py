"""Every structure's numbers in a comparison (``feduq compare``'s ``results.md``) where the task scores several
(fundus: optic disc and cup; a declared task's labels or regions): Dice and HD95 per structure beside the mean over
structures, and the paired tests per structure with q-values over structures and pairs.

The names are those the sites send (:func:`feduq.scores.scoring.summarize_test_scores`): ``dice_<s>`` (fraction) and
``hd95_<s>`` (stored pixels; ``hd95_mm_<s>`` in mm on volume sites) per client, ``dice_<s>`` and ``hd95_px_<s>`` per
image (:func:`feduq.scores.tables.per_image_test_rows`). A site with partial labels reports only the structures it
annotates: a structure's figures are over the sites (and images) that report it.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path
from typing import Iterable, Mapping, Sequence

import numpy as np

from ..scores.tables import structure_names
from .sweeps import markdown_table

__all__ = ["structure_values", "structure_summary", "structure_tests", "structure_tables", "structure_paired"]


def structure_values(row: Mapping) -> dict[str, float]:
    """A per-image CSV row's per-structure figures (``dice_<s>``, ``hd95_px_<s>``) as floats; blank or non-finite
    values (a structure the image's site does not annotate) left out."""
    out = {}
    for s in structure_names(row):
        for key in (f"dice_{s}", f"hd95_px_{s}"):
            if row.get(key) not in (None, "") and np.isfinite(float(row[key])):
                out[key] = float(row[key])
    return out


def _hd95(metrics: set[str], s: str | None = None) -> str:
    """The HD95 key of a structure (``s``) or of the mean (None): ``hd95_mm[_s]`` on volume sites, else ``hd95[_s]``."""
    mm = "hd95_mm" if "hd95_mm" in metrics else "hd95"
    return mm if s is None else f"{mm}_{s}"


def structure_summary(tidy: Sequence[Mapping], methods: Sequence[str]) -> str:
    """Rows = methods; columns = Dice (%) as the mean over structures and per structure, then HD95 likewise (pixels
    of the stored mask; mm on volume sites). A cell: the Avg over the clients that report that figure, mean ± std
    over seeds. ``tidy``: rows ``{method, seed, client, metric, value}`` (``results_tidy.csv``)."""
    from .sweeps import _mean_std

    metrics = {r["metric"] for r in tidy}
    names = structure_names(r["metric"] for r in tidy)
    unit = "mm" if "hd95_mm" in metrics else "px"
    columns = [("dice", "Dice (%) mean", 100.0), *[(f"dice_{s}", f"Dice {s}", 100.0) for s in names],
               (_hd95(metrics), f"HD95 ({unit}) mean", 1.0), *[(_hd95(metrics, s), f"HD95 {s}", 1.0) for s in names]]
    by = defaultdict(lambda: defaultdict(list))  # (method, seed) -> metric -> client values
    for r in tidy:
        by[(r["method"], r["seed"])][r["metric"]].append(float(r["value"]))
    lines = ["| Method | " + " | ".join(h for _, h, _ in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for method in methods:
        runs = [v for (m, _), v in sorted(by.items(), key=lambda kv: str(kv[0])) if m == method and v.get("dice")]
        if runs:
            cells = [_mean_std([statistics.mean(v[k]) for v in runs if v.get(k)], scale)
                     if any(v.get(k) for v in runs) else "" for k, _, scale in columns]
            lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def structure_tests(rows: Iterable[Mapping], baseline: str, structures: Sequence[str],
                    clusters: Mapping[tuple[str, str], str] | None = None, units: Mapping[str, str] | None = None,
                    n_boot: int = 10_000) -> list[dict]:
    """The paired tests of :func:`feduq.results.paired.clustered_tests` on each structure's per-image Dice
    (``dice_<s>``, over the images that have it: a site not annotating ``s`` is left out of its tests), each row
    with its ``structure``; ``q_value``: Benjamini–Hochberg over every returned row (structures × methods × scopes).
    """
    from .paired import clustered_tests, with_q_values

    rows = list(rows)
    out = []
    for s in structures:
        key = f"dice_{s}"
        have = [r for r in rows if key in r]
        out += [dict(t, structure=s) for t in clustered_tests(have, baseline, clusters, units, key, n_boot)]
    return with_q_values([{k: v for k, v in t.items() if k != "q_value"} for t in out])


def structure_tables(tidy: Sequence[Mapping], methods: Sequence[str]) -> list[str]:
    """The Markdown lines ``results.md`` adds for a task with several structures (none for one): the summary of
    :func:`structure_summary`, then each structure's per-client Dice (%) and HD95 tables (:func:`feduq.results.
    sweeps.markdown_table`: a site that does not annotate the structure has no column there)."""
    names = structure_names(r["metric"] for r in tidy)
    if len(names) < 2:
        return []
    metrics = {r["metric"] for r in tidy}
    unit = "mm" if "hd95_mm" in metrics else "px"
    md = ["Per structure: Dice (%) and HD95 beside their mean over structures (Avg over the clients that report a "
          "structure; a site with partial labels reports only the structures it annotates); mean ± std over seeds.",
          "", structure_summary(tidy, methods), ""]
    for s in names:
        md += [f"{s}: Dice (%) per client:", "", markdown_table(tidy, methods, f"dice_{s}", 100.0), "",
               f"{s}: HD95 ({unit}) per client:", "", markdown_table(tidy, methods, _hd95(metrics, s), 1.0), ""]
    return md


def structure_paired(per_image: Sequence[Mapping], baseline: str, clusters=None, units=None,
                     out: Path | None = None) -> list[str]:
    """The Markdown lines of the paired tests per structure (:func:`structure_tests` on every structure of the
    per-image rows, none when they have fewer than two), also written to ``<out>/paired_tests_per_structure.csv``."""
    from .paired import clustered_markdown

    names = structure_names(k for r in per_image for k in r)
    if len(names) < 2:
        return []
    tests = structure_tests(per_image, baseline, names, clusters, units)
    if out is not None:
        from ..scores.tables import write_rows

        write_rows(Path(out) / "paired_tests_per_structure.csv", tests)
    md = [f"Paired against {baseline} per structure (units and tests as above, on each structure's Dice over the "
          "images whose site annotates it); q = p adjusted over every structure and pair in these tables "
          "(Benjamini–Hochberg; `paired_tests_per_structure.csv`):", ""]
    for s in names:
        md += [f"{s}:", "", clustered_markdown([t for t in tests if t["structure"] == s]), ""]
    return md
