"""The server part of multi-head abdominal CT (FedAvg on the FIVA setting; FIVA's base): FLARE-free.

Run by FedUQ's round loop (:func:`feduq.parts.server.run_rounds`; on FLARE :class:`feduq.flare.ct.CTController`).
Only the training sites train (held-out sites, :data:`feduq.data.ct.HELD_OUT`, never do); the backbone is fused
weighted by each site's training cases N_k. After the last round each training site sends its final
segmentation head once (``submit_head``), the multi-head model (backbone + every head) is saved as
``<run dir>/multi_head_model.pt``, and every site, held-out sites included, tests it (``test``); the per-client
table (``per_client_table.csv``: mean organ Dice naive and +UN, HD95 in pixels of the plan's grid, ECE with 15
bins) and the per-organ table (``per_organ_table.csv``, ``.md``) are written under ``<run dir>/results``.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path

import numpy as np
import torch

from ..common.saving import save_torch
from ..data import ct as fct
from ..common.wire import FedUQTask
from .server import ServerPart

SUBMIT_HEAD = "submit_head"
VAR_PREFIX = "variance::"  # FIVA: sigma^2 of backbone tensor <name> travels as "variance::<name>"
HEAD_WIRE_PREFIX = "head::"  # test task: "head::<site>::weight|bias" (last seg layer of each site)
META_HEAD_ORGANS = "feduq_head_organs"  # test task meta: site -> its organs (global order)


class CTServer(ServerPart):
    """FedAvg of the backbone over the training sites, then heads and the multi-head test (module docstring).

    Args:
        method: method name in the result files.
        results_dir: folder under the run directory for the tables.
    """

    label = "CT"
    timeout_args = ("train_timeout", "test_timeout")

    def __init__(self, method: str = "fedavg_ct", results_dir: str = "results"):
        self.method, self.results_dir = method, results_dir

    def training_sites(self, sites: list[str]) -> list[str]:
        return [s for s in sites if s not in fct.HELD_OUT]

    def finish(self, fed, global_params, sites) -> None:
        train_sites = self.training_sites(sites)
        heads = fed.send(SUBMIT_HEAD, {}, train_sites, timeout="test_timeout")
        got = {s: a for s, a in heads.items() if a.params}
        fed.require(SUBMIT_HEAD, train_sites, list(got), {})
        params, organs = dict(global_params), {}
        for site, answer in got.items():
            organs[site] = list(answer.meta[META_HEAD_ORGANS])
            params[f"{HEAD_WIRE_PREFIX}{site}::weight"] = np.asarray(answer.params["weight"])
            params[f"{HEAD_WIRE_PREFIX}{site}::bias"] = np.asarray(answer.params["bias"])
        released = fed.run_dir / "multi_head_model.pt"
        save_torch({"params": {k: torch.as_tensor(v) for k, v in params.items()}, "head_organs": organs}, released)
        fed.log(f"multi-head model (backbone + {len(organs)} heads) saved to {released}")
        results = fed.send(FedUQTask.TEST, params, list(sites), timeout="test_timeout", meta={META_HEAD_ORGANS: organs})
        metrics = {s: a.metrics for s, a in results.items() if a.metrics}
        fed.require(FedUQTask.TEST, list(sites), list(metrics), {})
        self.write_tables(fed, {s: metrics[s] for s in sites if s in metrics})

    def write_tables(self, fed, metrics: dict[str, dict]) -> None:
        """``per_client_table.csv`` (Avg and Std over the training sites) and ``per_organ_table.csv``/``.md``."""
        out = Path(fed.run_dir) / self.results_dir
        out.mkdir(parents=True, exist_ok=True)
        cols = ["dice", "dice_un", "hd95", "ece", "frac_sum_u_over_1"]
        train = [s for s in metrics if s not in fct.HELD_OUT]
        with open(out / "per_client_table.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["client", *cols, "num_images", "held_out"])
            for s, m in metrics.items():
                w.writerow([s, *(f"{m.get(c, float('nan')):.6f}" for c in cols), int(m.get("num_images", 0)), int(s in fct.HELD_OUT)])
            for name, fn in (("Avg", np.nanmean), ("Std", np.nanstd)):
                w.writerow([name, *(f"{fn([metrics[s].get(c, np.nan) for s in train]):.6f}" for c in cols), "", "training sites"])
        lines = [f"# Test results: {self.method}", "", "| Site | Organ | Dice (%) | Dice +UN (%) | HD95 (px) |", "|---|---|---|---|---|"]
        with open(out / "per_organ_table.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["method", "site", "held_out", "organ", "dice", "dice_un", "hd95"])
            for s, m in metrics.items():
                for organ in fct.ORGANS[1:]:
                    if f"dice_{organ}" in m:
                        row = [m[f"dice_{organ}"], m.get(f"dice_un_{organ}", math.nan), m.get(f"hd95_{organ}", math.nan)]
                        w.writerow([self.method, s, int(s in fct.HELD_OUT), organ, *(f"{v:.6f}" for v in row)])
                        tag = " (held out)" if s in fct.HELD_OUT else ""
                        lines.append(f"| {s}{tag} | {organ} | {100 * row[0]:.2f} | {100 * row[1]:.2f} | {row[2]:.2f} |")
        table = "\n".join(lines)
        (out / "per_client_table.md").write_text(table + "\n")
        fed.log(f"FedUQ per-organ test results:\n{table}")
        print(f"\n{table}\nFedUQ results written to {out / 'per_client_table.md'}\n", flush=True)
