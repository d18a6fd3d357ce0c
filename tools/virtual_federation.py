#!/usr/bin/env python
"""Run a FedA3I job (``jobs/feda3i``, ``jobs/fedavg_ce``) over many virtual sites in one process.

Why: the NVFlare simulator runs one process per site. Here a site process holds about 430 MB
(torch, MONAI, FLARE; measured with 50 ISIC-2017 sites, killed at 21.5 GB in use), so the paper's
50 sites do not fit in 24 GB at ``-t 50``. With ``-t`` below the site count the simulator starts a
new process for every task, and each start costs about 10 s of imports. That makes a round 5-9
minutes on 2 cores.

What runs here is the job's own code, in one process:

* each site is the job's executor class (``FedA3IExecutor``), set up as FLARE sets it up: its data,
  network, loss, local training, noise estimate (q_k) and test task;
* the server steps are the job's ``FedA3IController`` (``fuse`` each round, ``estimate`` once), on the
  same schedule: FedAvg for T1 rounds, the noise estimate after round T1 - 1, then frozen layer-wise
  weights;
* the final test is the job's: the last-round global model on every site's test split, written by
  ``feduq.reporting.write_results`` (``per_client_table.csv``/``.md``). Virtual sites share one test
  set, so it is scored once and its scores are given to each site that has it.

What FLARE adds and this leaves out: message passing, filters (the privacy ledger), timeouts and
quorum, TensorBoard streaming. Use this for experiments on many virtual sites. Use the simulator,
POC or a provisioned project for everything else.
``tests/test_feda3i_flare.py`` runs one small job both ways and checks that q, the weights and the
test Dice agree.

    python tools/configure_job.py jobs/feda3i -o /tmp/feda3i-50 --sites ISIC-2017-p00of50,...,ISIC-2017-p49of50 \\
        --image-size 64 --num-rounds 10 --set-workflow warmup_rounds=3
    python tools/virtual_federation.py /tmp/feda3i-50 --data-root /tmp/noisy-isic --out /tmp/vf/feda3i

Output in ``--out``: ``log.txt`` (``FEDUQ_AGGREGATION``, ``FEDUQ_FEDA3I``, ``FEDUQ_TRAIN`` lines as in the
simulator's logs), ``per_client_table.csv``/``.md``, ``estimate.json`` and ``FL_global_model.pt``.
Exit code 2 for a job this tool cannot run (another controller) or a site that fails setup.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time
from pathlib import Path

from feduq.constants import SITE_CONFIG_FILE


class _Workspace:
    """The two folders a FedUQ executor's setup asks FLARE's workspace for."""

    def __init__(self, root: Path):
        self.root = root

    def get_site_config_dir(self) -> str:
        return str(self.root / "local")

    def get_run_dir(self, job_id: str) -> str:
        return str(self.root / job_id)


class _Engine:
    def __init__(self, root: Path):
        self.workspace = _Workspace(root)

    def get_workspace(self) -> _Workspace:
        return self.workspace

    def get_component(self, _id: str):
        return None  # no TensorBoard writer

    def fire_event(self, _event_type: str, _fl_ctx) -> None:
        return None  # no other components listen


def site_context(site: str, root: Path, data_root: Path):
    """An FLContext for ``site`` whose engine serves ``root/local/feduq_site.json`` (the data root) and ``root/<job>``."""
    from nvflare.apis.fl_constant import ReservedKey
    from nvflare.apis.fl_context import FLContext

    (root / "local").mkdir(parents=True, exist_ok=True)
    (root / "virtual_job").mkdir(exist_ok=True)
    (root / "local" / SITE_CONFIG_FILE).write_text(json.dumps({"data_root": str(data_root)}))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.IDENTITY_NAME, site, private=False, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "virtual_job", private=False, sticky=False)
    ctx.set_prop(ReservedKey.ENGINE, _Engine(root), private=False, sticky=False)
    return ctx


def _load_class(path: str):
    module, name = path.rsplit(".", 1)
    return getattr(importlib.import_module(module), name)


def read_job(job: Path) -> tuple[list[str], dict, dict, dict]:
    """``(sites, executor {path, args}, controller {path, args}, final test args)`` of a FedUQ job folder."""
    meta = json.loads((job / "meta.json").read_text())
    sites = [s for s in meta["deploy_map"]["app"] if s != "server"]
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    workflows = {w["id"]: w for w in server["workflows"]}
    controller = server["workflows"][0]
    return sites, client["executors"][0]["executor"], controller, workflows.get("final_test", {}).get("args", {})


def run(job: Path, data_root: Path, out: Path, num_threads: int = 0, log=print) -> dict:
    """Run ``job``'s rounds in this process; returns ``{"estimate", "table", "model"}`` (see module docstring).

    Raises:
        SystemExit(2): the job's controller is not ``FedA3IController`` or a site fails setup (message names it).
    """
    import numpy as np
    import torch
    from nvflare.apis.event_type import EventType
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from feduq.constants import FedUQMetaKey
    from feduq.flare.feda3i import NOISE_Q, FedA3IController
    from feduq.methods import feda3i as fm
    from feduq.reporting import write_results

    sites, executor_cfg, controller_cfg, test_args = read_job(job)
    controller_cls = _load_class(controller_cfg["path"])
    if not issubclass(controller_cls, FedA3IController):
        raise SystemExit(f"{job}: controller {controller_cfg['path']} is not FedA3IController; this tool runs "
                         "FedA3I jobs (jobs/feda3i, jobs/fedavg_ce)")
    wf_args = {k: v for k, v in controller_cfg["args"].items() if k not in ("persistor_id", "min_clients", "train_timeout")}
    controller = controller_cls(**wf_args)
    num_rounds, warmup = controller.num_rounds, controller.warmup_rounds
    ex_args = dict(executor_cfg["args"])
    if num_threads:
        ex_args["num_threads"] = num_threads
    executor_cls = _load_class(executor_cfg["path"])

    executors = {}
    for site in sites:
        ex = executor_cls(**ex_args)
        ex.tracking_writer_id = None
        ex.handle_event(EventType.START_RUN, site_context(site, out / "sites" / site, data_root))  # as FLARE starts a site
        if ex.trainer is None:  # the executor's own site-named setup error
            raise SystemExit(f"setup failed: {ex._setup_error}")
        executors[site] = ex
    log(f"{len(sites)} sites set up ({executor_cfg['path']}), {num_rounds} rounds, T1 = {warmup}")

    model = {k: v.detach().cpu().numpy().copy() for k, v in next(iter(executors.values())).trainer.model.state_dict().items()}
    try:
        controller._layer_names = fm.layer_names_of(list(model))
    except ValueError as e:
        raise SystemExit(f"{job}: {e}") from None
    estimate = None
    for r in range(num_rounds):
        t0 = time.time()
        sent = FLModel(params=model, params_type=ParamsType.FULL, current_round=r, total_rounds=num_rounds)
        results = {s: ex.train(sent, None) for s, ex in executors.items()}
        model, logged = controller.fuse(results, list(sites), estimate)
        losses = [float(res.metrics.get("train_loss", float("nan"))) for res in results.values()]
        log("FEDUQ_AGGREGATION " + json.dumps({"round": r, "weights": logged, "rejected": [],
                                               "mean_train_loss": round(float(np.mean(losses)), 5),
                                               "seconds": round(time.time() - t0, 1)}))
        if estimate is None and r == warmup - 1:
            sent = FLModel(params=model, params_type=ParamsType.FULL, current_round=r)
            answers = {}
            for s, ex in executors.items():
                res = ex.estimate_noise(sent, None)
                answers[s] = (res.meta[NOISE_Q], res.meta[FedUQMetaKey.NUM_SAMPLES])
            estimate = controller.estimate(answers, sites)
            log("FEDUQ_FEDA3I " + json.dumps({"round": r, **estimate}))

    # the job's final test: the last-round model on each site's test split (shared test sets scored once)
    final = FLModel(params=model, params_type=ParamsType.FULL, meta={"evaluated_model": "FL_global_model.pt"})
    site_metrics, scored = {}, {}
    for s, ex in executors.items():
        key = tuple(sorted(str(item.get("image")) for item in getattr(ex.test_ds, "data", [])))
        if key not in scored:
            scored[key] = ex.test(final, None).metrics
        if scored[key]:
            site_metrics[s] = scored[key]
    out.mkdir(parents=True, exist_ok=True)
    torch.save({"model": model, "meta_props": {"feda3i_weights": estimate}}, out / "FL_global_model.pt")
    (out / "estimate.json").write_text(json.dumps(estimate, indent=1))
    method = test_args.get("method", job.name)
    paths = write_results(site_metrics, out, method=method,
                          note=f"Model evaluated: last round ({num_rounds} rounds), in one process (tools/virtual_federation.py).")
    log(paths["markdown"].read_text())
    return {"estimate": estimate, "table": site_metrics, "model": model}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("job", type=Path, help="a configured FedA3I job folder (tools/configure_job.py)")
    ap.add_argument("--data-root", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = the job's setting)")
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    logging.basicConfig(level=logging.WARNING)
    with open(args.out / "log.txt", "w") as f:
        def log(msg):
            line = f"{time.strftime('%H:%M:%S')} {msg}"
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        try:
            run(args.job, args.data_root.resolve(), args.out, args.num_threads, log)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(f"ERROR: {e.code}", file=sys.stderr)
                return 2
            raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
