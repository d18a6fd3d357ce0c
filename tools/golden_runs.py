#!/usr/bin/env python3
"""Golden runs: a seeded tiny simulator run of every committed job, recorded so a restructuring can show it changes
no number.

Each job's FLARE Recipe (:class:`feduq.recipes.recipe.FedUQRecipe`) runs configured tiny in ``SimEnv``: 2 sites, 2 rounds,
1 local epoch, 32 px, 4 images per split, one torch thread, seed 0; the ``light`` network for the 2D jobs but FedA3I's,
whose layer-wise weights need its U-Net; nnU-Net's ``ct_2d_slim`` plans for the CT jobs. The record is a fingerprint of the final global model (per entry: sum, sum of |x|, L2 norm, and 16 evenly spaced values)
and every number of the results table. ``tests/golden/golden_runs.json`` holds the record of the committed code;
``tests/integration/test_golden.py`` re-runs FedAvg, FedEvi, GraphFedSeg, FedA3I and FIVA-P and compares.

    python tools/golden_runs.py --data-root ../shared/data --record            # rewrite the record (all jobs)
    python tools/golden_runs.py --data-root ../shared/data --check fedevi      # compare; exit 1 on a difference

Compared with :func:`compare`: sampled model values to ``atol`` (default 1e-6: the same model), sums and norms to a
relative 1e-5, table numbers to 1e-6. Seeded float32 training rounds differently across instruction sets (an AVX-512
FP16 / AMX Xeon against an AVX2 machine: up to 3.8e-3 in FedA3I's model after two rounds), so records are kept per kind
of CPU (:func:`cpu_kind`): ``golden_runs.json`` for the default kind, ``golden_runs.<kind>.json`` for the others.
:func:`check` compares with the record of the machine's kind; a job that kind has no record of raises
:class:`NoRecord` (the suite then skips it, naming the kind and the command that records it).
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
GOLDEN_DIR = REPO / "tests" / "golden"
#: instruction-set flags (``/proc/cpuinfo``) that change training's rounding, per kind of CPU; the first kind whose
#: flags the machine has is its kind, else ``"default"``. A CPU with bfloat16 hardware trains the 2D jobs whose network
#: has no BatchNorm in bfloat16 (``amp="auto"``, :func:`feduq.core.training.autocast_dtype`), so one without AMX is a kind
#: of its own rather than the float32 default's (``avx512bf16`` has a record; a kind without one skips its golden tests,
#: naming the command that records them).
CPU_KINDS = {"avx512fp16-amx": {"avx512_fp16", "amx_tile"}, "avx512bf16": {"avx512_bf16"}, "amxbf16": {"amx_bf16"}}


class NoRecord(LookupError):
    """The machine's kind of CPU has no golden record of a job (the message names both and how to record it)."""


def cpu_kind(cpuinfo: str | None = None) -> str:
    """The kind of CPU whose golden records apply here: a key of :data:`CPU_KINDS` or ``"default"``.

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (read when None; unreadable, e.g. not Linux: ``"default"``).
    """
    from feduq.core.training import cpu_flags

    flags = cpu_flags(cpuinfo)
    return next((kind for kind, needs in CPU_KINDS.items() if needs <= flags), "default")


def record_path(kind: str | None = None) -> Path:
    """The record file of ``kind`` (default: this machine's)."""
    kind = cpu_kind() if kind is None else kind
    return GOLDEN_DIR / ("golden_runs.json" if kind == "default" else f"golden_runs.{kind}.json")


RECORD = record_path()

TINY = dict(image_size=32, num_rounds=2, local_epochs=1, max_items=4, seed=0)
CT_SITES = ["KiTS19", "MSD-Task09-Spleen"]
SKIN_SITES = ["ISIC-2017-p00of50", "ISIC-2017-p01of50"]
#: per job: the configure_job.configure arguments beside :data:`TINY`
GOLDEN: dict[str, dict] = {
    **{m: {"sites": ["Kvasir-SEG", "CVC-ColonDB"], "network": "light"}
       for m in ("fedavg", "fedprox", "fedbn", "fedevi", "feduaa", "fedavgm", "fedper", "graphfedseg")},
    "feda3i": {"sites": SKIN_SITES, "workflow_args": {"warmup_rounds": 1}},  # its own U-Net (layer-wise weights)
    "fedavg_ce": {"sites": SKIN_SITES},
    "feduaa_cls": {"sites": ["BUS-BRA-INCa-Brazil", "BUSI-Baheya-Cairo"], "image_size": 64},
    **{m: {"sites": CT_SITES, "image_size": None, "local_epochs": None, "max_items": 3,
           "executor_args": {"plans": "ct_2d_slim", "iterations": 2, "batch_size": 2, "inference_samples": 2,
                             "device": "cpu"}}
       for m in ("fedavg_ct", "fiva_p", "fiva_g", "funavg")},
}
SAMPLES = 16


def fingerprint(state: dict) -> dict[str, list[float]]:
    """Entry name -> ``[sum, sum |x|, L2 norm, 16 evenly spaced values]`` of a state dict (float64 arithmetic)."""
    out = {}
    for name, value in sorted(state.items()):
        x = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value, dtype=np.float64).ravel()
        picks = x[np.linspace(0, x.size - 1, min(SAMPLES, x.size)).astype(int)] if x.size else x
        out[name] = [float(x.sum()), float(np.abs(x).sum()), float(np.sqrt((x * x).sum())), *map(float, picks)]
    return out


def read_tables(results: Path) -> dict[str, dict[str, float]]:
    """``{table file: {"<row>/<column>": value}}`` of the run's CSV tables (numeric cells)."""
    tables = {}
    for path in sorted(results.glob("per_*_table.csv")):
        cells = {}
        with open(path) as f:
            for i, row in enumerate(csv.DictReader(f)):
                key = "/".join(str(row[k]) for k in ("client", "site", "organ") if k in row) or str(i)
                for col, value in row.items():
                    try:
                        cells[f"{key}/{col}"] = float(value)
                    except (TypeError, ValueError):
                        pass
        tables[path.name] = cells
    return tables


def run(method: str, data_root: Path, work: Path, task: str | None = None) -> dict:
    """One golden run of ``jobs/<method>`` in ``work``; its record ``{"model": ..., "tables": ...}``. ``task``: the
    same run on another task (a task file whose sites hold the same data in nnU-Net's layout must give the record).

    Raises:
        RuntimeError: the run failed (its summary).
    """
    from nvflare.recipe import SimEnv

    from feduq.core.checkpoints import load_checkpoint
    from feduq.recipes.recipe import FedUQRecipe

    settings = {**TINY, **GOLDEN[method]}
    settings = {k: v for k, v in settings.items() if v is not None}
    settings["executor_args"] = {"num_threads": 1, **settings.get("executor_args", {})}
    if task is not None:
        settings["task"] = task
    recipe = FedUQRecipe(method, data_root=str(data_root), **settings)
    try:
        recipe.run(SimEnv(clients=recipe.sites, workspace_root=str(work)))
    except RuntimeError as e:  # SimEnv: the simulator run did not finish (its summary was printed)
        raise RuntimeError(f"golden run {method}: {e}") from None
    ws = work / recipe.name
    table = ws / "server" / "simulate_job" / "results" / "per_client_table.csv"
    tested = {r["client"] for r in csv.DictReader(open(table))} - {"Avg", "Std"} if table.is_file() else set()
    if set(recipe.sites) - tested:  # a table without a site would compare as if it were a result
        raise RuntimeError(f"golden run {method}: no test result from {sorted(set(recipe.sites) - tested)} "
                           f"(the table has {sorted(tested)})")
    app = ws / "server" / "simulate_job" / "app_server"
    model = load_checkpoint(app / "FL_global_model.pt")["model"]
    return {"model": fingerprint(model), "tables": read_tables(ws / "server" / "simulate_job" / "results")}


def compare(got: dict, want: dict, atol: float = 1e-6) -> list[str]:
    """What differs between two records (empty: the same run); the first line reports the max abs difference."""
    problems = []
    if set(got["model"]) != set(want["model"]):
        problems.append(f"model entries differ: {sorted(set(got['model']) ^ set(want['model']))[:5]}")
    worst = 0.0
    for name in sorted(set(got["model"]) & set(want["model"])):
        g, w = np.array(got["model"][name]), np.array(want["model"][name])
        if g.shape != w.shape:
            problems.append(f"{name}: fingerprint length {g.size} vs {w.size}")
            continue
        worst = max(worst, float(np.abs(g[3:] - w[3:]).max(initial=0.0)))
        if not np.allclose(g[3:], w[3:], rtol=0, atol=atol):
            problems.append(f"{name}: sampled values differ by {np.abs(g[3:] - w[3:]).max():.3g} > {atol:g}")
        if not np.allclose(g[:3], w[:3], rtol=1e-5, atol=atol):
            problems.append(f"{name}: sum/|x|/norm {g[:3].tolist()} vs {w[:3].tolist()}")
    for table, cells in want["tables"].items():
        mine = got["tables"].get(table, {})
        for key, value in cells.items():
            if key not in mine or not np.isclose(mine[key], value, rtol=0, atol=1e-6, equal_nan=True):
                problems.append(f"{table} {key}: {mine.get(key)} vs {value}")
    return [f"max abs difference of the sampled model values: {worst:.3g}"] + problems


def check(got: dict, method: str, kind: str | None = None) -> list[str]:
    """:func:`compare` against the record of ``method`` made on this kind of CPU (``kind``: default this machine's);
    ``[]`` when it matches, else the difference lines.

    Raises:
        NoRecord: that kind has no record of ``method`` (the message names the kind and the command that records it).
    """
    want = record_of(method, kind)
    if want is None:
        kind = cpu_kind() if kind is None else kind
        raise NoRecord(f"no golden record of {method!r} for this kind of CPU ({kind!r}, "
                       f"{record_path(kind).relative_to(REPO)}): record it with python tools/golden_runs.py "
                       f"--data-root DATA --record {method}")
    lines = compare(got, want)
    return [] if len(lines) == 1 else lines


def record_of(method: str, kind: str | None = None) -> dict | None:
    """The record of ``method`` for ``kind`` of CPU (default: this machine's), or None."""
    path = record_path(kind)
    return json.loads(path.read_text()).get(method) if path.is_file() else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("methods", nargs="*", help=f"jobs (default: all of {sorted(GOLDEN)})")
    p.add_argument("--data-root", required=True)
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", action="store_true",
                      help=f"write the records to {RECORD.relative_to(REPO)} (this machine's kind of CPU: {cpu_kind()})")
    mode.add_argument("--check", action="store_true", help="compare with the records; exit 1 on a difference")
    a = p.parse_args(argv)
    methods = a.methods or sorted(GOLDEN)
    unknown = sorted(set(methods) - set(GOLDEN))
    if unknown:
        p.error(f"no golden configuration for {unknown}; known: {sorted(GOLDEN)}")
    record = json.loads(RECORD.read_text()) if RECORD.is_file() else {}
    failed = 0
    for method in methods:
        work = Path(tempfile.mkdtemp(prefix=f"golden-{method}-"))
        try:
            got = run(method, Path(a.data_root), work)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 1
        shutil.rmtree(work, ignore_errors=True)
        if a.record:
            record[method] = got
            RECORD.parent.mkdir(parents=True, exist_ok=True)
            RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
            print(f"{method}: recorded ({len(got['model'])} model entries)", flush=True)
        else:
            try:
                lines = check(got, method)
            except NoRecord as e:
                print(f"{method}: {e}")
                failed += 1
                continue
            failed += bool(lines)
            print(f"{method}: " + (f"same (the {cpu_kind()!r} CPU record)" if not lines else
                                   "DIFFERENT; " + "\n  ".join(lines)))
    return 1 if failed else 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("golden_runs.py", main))
