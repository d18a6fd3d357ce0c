"""Run a FedUQ job's rounds over many virtual sites in one process (FedA3I's 50 sites, FedEvi, GraphFedSeg).

Why: the NVFlare simulator runs one process per site. Here a site process holds about 430 MB
(torch, MONAI, FLARE; measured with 50 ISIC-2017 sites, killed at 21.5 GB in use), so the paper's
50 sites do not fit in 24 GB at ``-t 50``. With ``-t`` below the site count the simulator starts a
new process for every task, and each start costs about 10 s of imports. That makes a round 5-9
minutes on 2 cores.

What runs here is the job's own code, in one process:

* each site is the job's 2D site (:class:`feduq.site.site2d.Site2D`, built by the job's executor class, e.g.
  FedA3I's site part, from the job's arguments) started without FLARE: its data, network, loss, local training,
  extra tasks (FedA3I's noise estimate, FedEvi's G_k) and test task;
* the server is the job's method server part (:mod:`feduq.parts.server`) in FedUQ's one round loop
  (:func:`feduq.parts.server.run_rounds`), the same code the FLARE controller runs: the same checks, quorum,
  fusion, extra exchanges and ``FEDUQ_*`` log records;
* the final test is the job's: the last-round global model on every site's test split (or on the job's ``test_sites``),
  written by ``feduq.scores.tables.write_results`` (``per_client_table.csv``/``.md``). Virtual sites share one test
  set, so it is scored once and its scores are given to each tested site that has it. (The FLARE job tests the
  model its selector chose; here it is the last one.)

What FLARE adds and this leaves out: message passing, filters (the privacy ledger), timeouts, model
selection, TensorBoard streaming. **Resume**: after every round the global model, the method's state and the round
go to ``--out``/``checkpoint.pt`` (each site keeps its optimizer state in its run folder, as a FLARE site does), and
``--resume`` continues a run that was stopped or killed from the round after the checkpointed one (the job and data
root must be the run's; a site that had already trained the interrupted round restores that round's optimizer state,
as a restarted FLARE site does). Use this for experiments on many virtual sites. Use
the simulator, POC or a provisioned project for everything else. ``tests/integration/test_feda3i_flare.py`` runs one
small job both ways and checks that q, the weights, the model and the test Dice agree.

    feduq configure feda3i -o /tmp/feda3i-50 --sites ISIC-2017-p00of50,...,ISIC-2017-p49of50 \\
        --image-size 64 --num-rounds 10 --set-workflow warmup_rounds=3
    feduq virtual /tmp/feda3i-50 --data-root /tmp/noisy-isic --out /tmp/vf/feda3i

Output in ``--out``: ``log.txt`` (``FEDUQ_AGGREGATION``, ``FEDUQ_FEDA3I``, ``FEDUQ_TRAIN`` lines as in the
simulator's logs), ``per_client_table.csv``/``.md``, ``state.json`` (the method's checkpointed state, e.g.
FedA3I's frozen estimate) and ``FL_global_model.pt``. Exit code 2 for a job this tool cannot run (a stock
FLARE workflow), a site that fails setup, or rounds that stop (named).
"""

from __future__ import annotations

import json
import time
from pathlib import Path



def _load_class(path: str):
    """The FedUQ class at ``path``; None for anything else (nothing outside feduq is imported)."""
    from feduq.common.classpath import ClassPathError, resolve_class

    try:
        return resolve_class(path)
    except ClassPathError:
        return None


def read_job(job: Path) -> tuple[list[str], dict, dict, dict]:
    """``(sites, executor {path, args}, controller {path, args}, final test args)`` of a FedUQ job folder."""
    meta = json.loads((job / "meta.json").read_text())
    sites = [s for s in meta["deploy_map"]["app"] if s != "server"]
    client = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
    server = json.loads((job / "app" / "config" / "config_fed_server.json").read_text())
    workflows = {w["id"]: w for w in server["workflows"]}
    controller = server["workflows"][0]
    return sites, client["executors"][0]["executor"], controller, workflows.get("final_test", {}).get("args", {})


class InProcessFederation:
    """:class:`feduq.parts.server.Federation` over executors in this process (no messages, no timeouts).

    A task goes to the handler of the same name in each site's :meth:`feduq.site.site2d.Site2D.tasks`;
    an exception there is that site's failure, with its message. The quorum is the job's ``min_clients``
    (None: every site must answer).
    """

    def __init__(self, executors: dict, num_rounds: int, run_dir: Path, min_clients: int | None, log):
        self.executors, self.num_rounds, self.run_dir = executors, num_rounds, run_dir
        self.min_clients, self._log = min_clients, log
        self.round: int | None = None
        self.failures: dict[str, str] = {}

    def send(self, task, payload, sites, *, own=False, timeout="train_timeout", meta=None, quorum=True):
        import numpy as np
        from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

        from feduq.parts.server import Answer

        self.failures, answers = {}, {}
        for site in sites:
            ex = self.executors[site]
            handler = ex.tasks()[task]
            data = FLModel(params=dict(payload[site] if own else payload), params_type=ParamsType.FULL,
                           current_round=self.round, total_rounds=self.num_rounds, meta=dict(meta or {}))
            try:
                res = handler(data)
            except Exception as e:  # the site's failure, named; the quorum decides
                self.failures[site] = f"{type(e).__name__}: {e}"
                self.warn(f"site {site!r} failed {task!r}: {self.failures[site]}")
                continue
            answers[site] = Answer(site=site, params={k: np.asarray(v) for k, v in (res.params or {}).items()},
                                   meta={**(res.meta or {}), "client_name": site}, metrics=dict(res.metrics or {}))
        return answers

    def require(self, task, expected, valid, rejected):
        from feduq.parts.server import Stop

        need = len(expected) if self.min_clients is None else min(int(self.min_clients), len(expected))
        if len(valid) < max(need, 1):
            why = {**self.failures, **dict(rejected)}
            raise Stop(f"round {self.round} task {task!r}: {len(valid)} valid answer(s), {need} required; "
                       f"failed: {why or 'none'}", why)

    def log(self, line: str) -> None:
        self._log(line)

    def warn(self, line: str) -> None:
        self._log(f"WARNING {line}")


#: the run's checkpoint in ``--out`` (global model, method state, last completed round, the run's inputs)
CHECKPOINT = "checkpoint.pt"


def run(job: Path, data_root: Path, out: Path, num_threads: int = 0, log=print, resume: bool = False,
        checkpoint: dict | None = None) -> dict:
    """Run ``job``'s rounds in this process; returns ``{"state", "table", "model"}`` (see module docstring).

    Args:
        resume: continue from ``out/checkpoint.pt`` (the round after its last completed one).
        checkpoint: with ``resume``, that checkpoint already read by :func:`_read_checkpoint` (``main`` reads it
            before it writes anything); None: read here.

    Raises:
        SystemExit(2): the job's controller is not a FedUQController, a site fails setup, the rounds stop, or
            ``resume`` finds no checkpoint or one of another job or data root (the message names the site, task,
            round or file).
    """
    from feduq.flare.controller import FedUQController

    sites, executor_cfg, controller_cfg, test_args = read_job(job)
    controller_cls = _load_class(controller_cfg["path"])
    if controller_cls is None or not issubclass(controller_cls, FedUQController):
        raise SystemExit(f"{job}: controller {controller_cfg['path']} is not a FedUQController; this tool runs the jobs "
                         "whose round is FedUQ's own (FedEvi, GraphFedSeg, FedA3I, FedAvg-CE)")
    wf_args = {k: v for k, v in controller_cfg["args"].items() if k != "persistor_id" and not k.endswith("_timeout")}
    min_clients = wf_args.pop("min_clients", None)
    controller = controller_cls(**wf_args)
    server, num_rounds = controller.server, controller.num_rounds
    ex_args = dict(executor_cfg["args"])
    if num_threads:
        ex_args["num_threads"] = num_threads
    executor_cls = _load_class(executor_cfg["path"])
    from feduq.site.site2d import Site2D

    if executor_cls is None or not issubclass(executor_cls, Site2D):
        raise SystemExit(f"{job}: executor {executor_cfg['path']} does not run a FedUQ 2D site; this tool runs the 2D "
                         "methods' sites (CT's nnU-Net sites need the simulator)")

    import contextlib

    from feduq.core.threads import HostCoreShare

    # num_threads 0: one share of the host's cores for this process among the FedUQ processes computing now (another
    # sweep beside it, a simulator's sites), re-read every training step; with torch's own threads, two runs side by
    # side on 2 cores made each site 15-40 x slower
    share = HostCoreShare(member=f"virtual-{job.name}") if not ex_args.get("num_threads") else None
    with share.computing() if share is not None else contextlib.nullcontext():
        return _run(job, data_root, out, log, sites, executor_cls, ex_args, server, num_rounds,
                    min_clients, test_args, share,
                    (checkpoint if checkpoint is not None else _read_checkpoint(job, data_root, out)) if resume else None)


def _inputs(job: Path, data_root: Path) -> dict:
    """What a checkpoint must have been made from: the job folder's configuration (its text) and the data root."""
    import hashlib

    configs = sorted((job / "app" / "config").glob("*.json")) if (job / "app" / "config").is_dir() else []
    digest = hashlib.sha256(b"".join(p.name.encode() + p.read_bytes() for p in configs)).hexdigest()
    return {"job_config_sha256": digest, "data_root": str(Path(data_root).resolve())}


def _read_checkpoint(job: Path, data_root: Path, out: Path) -> dict:
    """The checkpoint to resume from; SystemExit with one line naming the file when it is missing, truncated or
    damaged, not a torch checkpoint (a plain pickle: never unpickled), one whose unpickling would need code (refused
    by ``torch.load(weights_only=True)``, nothing of it run), not this tool's (no model and completed round), or was
    made from another job configuration or data root."""
    import zipfile

    from feduq.common.wire import FedUQMetaKey
    from feduq.core.checkpoints import CheckpointError, load_checkpoint

    path = out / CHECKPOINT
    if not path.is_file():
        raise SystemExit(f"--resume: no {CHECKPOINT} in {out} (no round of this run finished); run without --resume")
    expected = f"expected the {CHECKPOINT} this tool writes after each round (torch.save's zip archive)"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError as e:
        raise SystemExit(f"--resume: {path} cannot be read ({e.strerror or e}); {expected}") from None
    if head != b"PK\x03\x04":  # torch.save's zip archive; anything else (a plain pickle) is never unpickled
        kind = "a plain pickle" if head[:1] == b"\x80" else ("an empty file" if not head else "another format")
        raise SystemExit(f"--resume: {path} is not a torch checkpoint (it is {kind}, not read); {expected}")
    if not zipfile.is_zipfile(path):
        raise SystemExit(f"--resume: {path} is truncated or damaged (its zip archive has no end); {expected}; "
                         "run without --resume to start over")
    try:  # weights only: tensors and plain containers; a global that would run code is refused, not called
        ckpt = load_checkpoint(path, what="--resume: checkpoint")
    except CheckpointError as e:
        raise SystemExit(str(e).splitlines()[0]) from None
    meta = ckpt.get("meta") if isinstance(ckpt, dict) else None
    if (not isinstance(ckpt.get("model") if isinstance(ckpt, dict) else None, dict) or not isinstance(meta, dict)
            or not isinstance(meta.get(FedUQMetaKey.LAST_COMPLETED_ROUND), int)
            or not isinstance(ckpt.get("inputs", {}), dict)):
        found = sorted(map(str, ckpt))[:8] if isinstance(ckpt, dict) else type(ckpt).__name__
        raise SystemExit(f"--resume: {path} is a torch file but not this tool's checkpoint (expected 'model', 'meta' "
                         f"with {FedUQMetaKey.LAST_COMPLETED_ROUND!r} and 'inputs'; found {found})")
    made_from = ckpt.get("inputs", {})
    for key, now in _inputs(job, data_root).items():
        if made_from.get(key) != now:
            raise SystemExit(f"--resume: {path} was made with another {key.replace('_', ' ')} "
                             f"({made_from.get(key)!r}, now {now!r}); resume with the run's own job and data root")
    return ckpt


def _run(job, data_root, out, log, sites, executor_cls, ex_args, server, num_rounds, min_clients,
         test_args, share, ckpt) -> dict:
    import numpy as np
    import torch
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from feduq.parts.server import Stop, run_rounds
    from feduq.scores.tables import write_results
    from feduq.core.checkpoints import tensors_of

    executors = {}
    testing = set(test_args.get("test_sites") or sites) if test_args else set()
    for site in sites:
        ex = executor_cls(**ex_args)  # the job's arguments mapped onto the method's site part; used as a Site2D only
        ex.check_test_split = site in testing  # a site another scores the shared test list for: not read twice
        ex.log, ex.warn = log, (lambda line: log(f"WARNING {line}"))  # the site's lines go to this tool's log
        try:
            ex.start(site, {"data_root": str(data_root)}, out / "sites" / site / "virtual_job")
        except Exception as e:  # the site's own reason, named
            raise SystemExit(f"setup failed: site {site!r}: {e}") from None
        if share is not None:
            ex.trainer.step_hook = share.refresh
        executors[site] = ex
    log(f"{len(sites)} sites set up ({executor_cls.__module__}.{executor_cls.__name__}), {num_rounds} rounds, server part {type(server).__name__}")

    out.mkdir(parents=True, exist_ok=True)
    fed = InProcessFederation(executors, num_rounds, out, min_clients, log)
    model = {k: v.detach().cpu().numpy().copy() for k, v in next(iter(executors.values())).trainer.model.state_dict().items()}
    clock = {}

    def round_started(r: int) -> None:
        fed.round, clock["t0"] = r, time.time()

    inputs = _inputs(job, data_root)

    def save(r: int, params: dict, meta: dict) -> None:
        partial = out / f".{CHECKPOINT}.partial"  # written whole, then moved over the last one
        torch.save({"model": tensors_of(params), "meta": json.loads(json.dumps(meta, default=lambda v: np.asarray(v).tolist())),
                    "inputs": inputs}, partial)
        partial.replace(out / CHECKPOINT)
        log(f"round {r} done in {time.time() - clock['t0']:.1f} s")

    first, state = 0, None
    if ckpt is not None:
        from feduq.common.wire import FedUQMetaKey

        model = {k: v.numpy() for k, v in ckpt["model"].items()}
        first = int(ckpt["meta"][FedUQMetaKey.LAST_COMPLETED_ROUND]) + 1
        state = ckpt["meta"].get(server.state_key) if server.state_key else None
        log(f"resumed from {out / CHECKPOINT}: round {first - 1} completed, continuing with round {first}")
    try:
        server.start(fed, model, server.training_sites(sites), state)
        model = run_rounds(server, fed, model, sites, first, round_started=round_started, save=save)
    except Stop as e:
        raise SystemExit(f"the rounds stopped: {e.reason}") from None

    site_metrics = {}
    if test_args:  # the job's final test: the last-round model on each site's test split (shared test sets once)
        final = FLModel(params=model, params_type=ParamsType.FULL, meta={"evaluated_model": "FL_global_model.pt"})
        scored = {}
        tested = test_args.get("test_sites") or list(executors)  # the job's test_sites (configure_job --test-sites)
        unknown = [s for s in tested if s not in executors]
        if unknown:
            raise SystemExit(f"final test: test_sites {unknown[:8]} are not sites of this job")
        for s, ex in ((s, executors[s]) for s in tested):
            key = tuple(sorted(str(item.get("image")) for item in getattr(ex.test_ds, "data", [])))
            if key not in scored:
                scored[key] = ex.test(final).metrics
            if scored[key]:
                site_metrics[s] = scored[key]
        paths = write_results(site_metrics, out, method=test_args.get("method", job.name),
                              note=f"Model evaluated: last round ({num_rounds} rounds), in one process "
                                   "(feduq virtual).")
        log(paths["markdown"].read_text())
    state = server.state()
    # tensors, as FLARE's PT persistor saves them: FedUQ's loader (weights_only) reads no numpy arrays
    torch.save({"model": tensors_of(model), "meta_props": {server.state_key: state} if server.state_key else {}},
               out / "FL_global_model.pt")
    (out / "state.json").write_text(json.dumps(state, indent=1, default=lambda v: np.asarray(v).tolist()))
    return {"state": state, "table": site_metrics, "model": model}
