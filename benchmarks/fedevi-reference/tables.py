"""The tables of jobs/fedevi/README.md "FedUQ's FedEvi next to the authors' own run", made from ``per_round.csv``.

``per_round.csv`` (tidy, one row per code, seed, round and center) holds what each run logged on the authors' setting
(their split, 128 px, 8 rounds x 2 local epochs): the global model's test Dice after the round, and FedEvi's aggregation
weight β after the round's update with the two statistics it was computed from, G_k (the surrogate model's mean
epistemic uncertainty on the site's validation images) and A_k (the local model's mean aleatoric uncertainty). Rows
``authors``: the FedEvi authors' code (commit 547ecb9, ``main_seg_al.py``) with seeds 0 (the reference run, 4 decimals
as its log prints them), 1 and 2; rows ``feduq``: FedUQ's ``jobs/fedevi`` with ``--official-protocol``, seeds 0-3.

Each cell compares the two codes with the run as the unit: the difference of the means (FedUQ - authors) and an exact
two-sided permutation test over every way to split the runs into groups of the two sizes (35 for 3 and 4 runs):
p = share of splits whose |difference of means| is at least the observed one (1/35 = 0.029 is the smallest).

    python benchmarks/fedevi-reference/tables.py            # markdown to stdout
"""

from __future__ import annotations

import csv
import math
import statistics as st
import sys
from pathlib import Path

CENTERS = ["Kvasir-SEG", "ETIS-LaribPolypDB", "CVC-ColonDB", "CVC-ClinicDB"]
ROUNDS = range(1, 9)


def load(path: Path) -> dict:
    """``{(code, quantity): {seed: {(round, center): value}}}`` for the quantities test_dice, beta, G, A."""
    runs: dict = {}
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            for q in ("test_dice", "beta", "G", "A"):
                runs.setdefault((row["code"], q), {}).setdefault(int(row["seed"]), {})[
                    (int(row["round"]), row["center"])] = float(row[q])
    return runs


def permutation_p(a: list[float], b: list[float]) -> float:
    """Exact two-sided p of the difference of means of ``b`` and ``a`` (module doc): SciPy's permutation test of
    |mean(b) - mean(a)| over every split of the pooled runs into groups of the two sizes."""
    import numpy as np
    from scipy.stats import permutation_test

    def abs_difference(x, y, axis):
        return np.abs(np.mean(y, axis=axis) - np.mean(x, axis=axis))

    return float(permutation_test((a, b), abs_difference, permutation_type="independent", alternative="greater",
                                  n_resamples=np.inf, vectorized=True).pvalue)


def cell(values: list[float]) -> str:
    return f"{st.mean(values):.3f} ({min(values):.3f}–{max(values):.3f})"


def values(runs: dict, code: str, q: str, rnd: int, center: str | None) -> list[float]:
    """One value per seed; ``center`` None: the mean over the four centers."""
    by_seed = runs[(code, q)]
    if center is None:
        return [st.mean(by_seed[s][(rnd, c)] for c in CENTERS) for s in sorted(by_seed)]
    return [by_seed[s][(rnd, center)] for s in sorted(by_seed)]


def spread_table(runs: dict, q: str, with_avg: bool) -> list[str]:
    cols = CENTERS + ([None] if with_avg else [])
    out = ["| round | | " + " | ".join(c or "Avg" for c in cols) + " |", "|---|---|" + "---|" * len(cols)]
    for r in ROUNDS:
        for code, label in (("authors", f"{r} | authors' code"), ("feduq", "| FedUQ")):
            out.append(f"| {label} | " + " | ".join(cell(values(runs, code, q, r, c)) for c in cols) + " |")
    return out


def difference_table(runs: dict, q: str) -> list[str]:
    out = ["| round | " + " | ".join(CENTERS) + " |", "|---|" + "---|" * len(CENTERS)]
    for r in ROUNDS:
        cells = []
        for c in CENTERS:
            a, b = values(runs, "authors", q, r, c), values(runs, "feduq", q, r, c)
            d, p = st.mean(b) - st.mean(a), permutation_p(a, b)
            text = f"{d:+.3f}, {p:.2f}".replace("-", "−")
            cells.append(f"**{text}**" if p <= 0.05 else text)
        out.append(f"| {r} | " + " | ".join(cells) + " |")
    return out


def statistics_summary(runs: dict) -> list[str]:
    """How often FedUQ's G_k and A_k exceed the authors', and their ratio per run (log-mean over centers and rounds)."""
    out = []
    for q in ("G", "A"):
        higher = sum(st.mean(values(runs, "feduq", q, r, c)) > st.mean(values(runs, "authors", q, r, c))
                     for r in ROUNDS for c in CENTERS)
        per_run = {code: [st.mean(math.log(runs[(code, q)][s][(r, c)]) for r in ROUNDS for c in CENTERS)
                          for s in sorted(runs[(code, q)])] for code in ("authors", "feduq")}
        ratio = math.exp(st.mean(per_run["feduq"]) - st.mean(per_run["authors"]))
        out.append(f"- {q}_k: FedUQ higher at {higher} of {len(ROUNDS) * len(CENTERS)} site-rounds; per run "
                   f"{ratio:.2f}× the authors', p = {permutation_p(per_run['authors'], per_run['feduq']):.2f}")
    return out


def main(argv: list[str] | None = None) -> int:
    path = Path(argv[0]) if argv else Path(__file__).with_name("per_round.csv")
    runs = load(path)
    md = ["Test Dice of the global model after each round, mean (min–max) over each code's seeds:", "",
          *spread_table(runs, "test_dice", True), "",
          "β after each round's update:", "", *spread_table(runs, "beta", False),
          "", "FedUQ − authors' code, difference of the means and exact permutation p; test Dice:", "",
          *difference_table(runs, "test_dice"), "", "β:", "", *difference_table(runs, "beta"), "",
          "The statistics β is computed from:", "", *statistics_summary(runs)]
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
