"""Compare FedUQ methods on identical data, splits, model and budget (the comparison harness).

For every (method, seed) the harness configures the method's job (its registered export) with the same task, image size,
rounds, local epochs and seed (``feduq configure``), runs it in the NVFlare simulator, and
collects:

* ``results_tidy.csv``  -- method, seed, client, metric, value (per-client test Dice, HD95, ECE, ...);
* ``results.md``        -- the papers' table: per client, Avg and Std over clients, each as
  mean ± std over seeds, for Dice (%) and HD95 (px); where the task scores several structures (optic disc and cup),
  each structure's Dice and HD95 beside the mean, and its paired tests (``paired_tests_per_structure.csv``: q over
  structures and pairs; :mod:`feduq.results.structures`);
* ``curves.csv`` + ``dice_per_round.png`` -- each client's validation Dice (AUC for the classification
  job) of the received global model per round, the last global model included (round = num_rounds); curves.csv also
  holds the validation loss and, with ``--official-protocol``, each round's test Dice and HD95
  (``test_dice_per_round.png``);
* ``weights.csv`` + ``weights_per_round.png`` -- each method's aggregation weights per round.

A finished run leaves ``DONE`` and ``RUN.json`` (its settings, job hash, data root and split files' hashes:
:mod:`feduq.results.run_records`) in its folder; running the same command again skips finished runs whose record
matches and redoes unfinished ones, so an interrupted sweep resumes. A finished run recorded with other settings or
data stops the sweep before anything runs (exit 2, naming what differs; ``--rerun-changed`` runs it again), and the
report's header is made from the runs' records. A finished run whose RUN.json is missing (a sweep of before records)
or unreadable is checked against the job configuration it holds itself (what FLARE deployed into its workspace) and its
data root, and refused the same way when they differ or when it holds none. Jobs run through ``feduq simulate``
(data root resolved and its centers checked first); a failed run stops the sweep with exit code 1 and prints why: the
server's reason and each failing site's first error.

    feduq compare --task polyp --methods fedavg fedprox fedbn feduaa fedevi --seeds 0 1 \\
        --rounds 20 --image-size 128 --out workspaces/compare/polyp-128 --data-root /data/feduq

``--dp-epsilons 1 10 50 none`` runs every method once per privacy budget (DP-SGD, :mod:`feduq.privacy.dp_sgd`;
``none`` = without DP) and adds ``dp_sweep.csv``, ``dice_vs_epsilon.png`` (GraphFedSeg's Fig. 7) and the ε each
site spent to ``results.md``.

``--methods`` also takes ``local`` and ``pooled``, FLamby's two references (``feduq reference``:
each site alone, and all sites' data pooled), trained for the same rounds x local epochs.
"""

from __future__ import annotations

import argparse
import difflib
import csv
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from feduq.cli import verb_parser

from feduq.common.checks import site_names
from feduq.data import DataError
from feduq.recipes.job_folders import configure
from feduq.scores.tables import PERSONALISED, write_rows
from feduq.core.training import AMP_OPTIONS
from feduq.recipes.outcome import check_data_root
from feduq.recipes.simulation import simulate
from feduq.outputs import write_marker
from feduq.results.run_records import run_name, run_settings
from feduq.results.structures import structure_values
from feduq.results.sweeps import (  # noqa: F401 (the names the tests import from here too)
    REFERENCES, VALIDATION_KEYS, archive_run, classification_rows, collect, collect_ct, collect_table, ct_markdown,
    ct_results, ct_slice_rows, dp_label, dp_sweep_rows, graph_records, markdown_table, plot, plot_dp_sweep, plot_graphs,
    sites_per_image, table_path,
)

from feduq.recipes.jobspec import method_job
from feduq.registry import all_methods


def _is_sweep(folder: Path) -> bool:
    """An output of feduq compare from before its manifest: finished or started runs, or a leave-one-site-out folder."""
    return (folder / "runs").is_dir() or (folder / "jobs").is_dir() or any(folder.glob("holdout-*"))


def run_reference(method: str, seed: int, args, ws: Path) -> None:
    """``feduq reference --mode <method>`` with the sweep's task, size, budget and seed, into ``ws``."""
    cmd = [sys.executable, "-m", "feduq.commands.research.reference", "--mode", method, "--task", args.task,
           *(["--network", args.network] if args.network else []),
           "--image-size", str(args.image_size), "--rounds", str(args.rounds), "--local-epochs", str(args.local_epochs),
           "--seed", str(seed), "--data-root", str(Path(args.data_root).resolve()), "--out", str(ws),
           "--force",  # ws is the sweep's own folder; its reference.log (written here) is kept
           # the jobs' precision: --amp, float32 under the official protocol
           "--amp", "off" if getattr(args, "official_protocol", False) else getattr(args, "amp", "auto")]
    if args.max_items:
        cmd += ["--max-items", str(args.max_items)]
    ws.mkdir(parents=True)
    with open(ws / "reference.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0 or not table_path(method, ws).is_file():
        lines = [line for line in (ws / "reference.log").read_text(errors="replace").splitlines() if line.strip()]
        reason = lines[-1] if lines else "no output"  # feduq reference ends a failure with a one-line reason
        raise RuntimeError(f"{method} seed {seed} failed (rc={rc}): {reason}\n(full output: {ws / 'reference.log'})")


def is_ct(method: str) -> bool:
    """A multi-head CT job (FIVA Table 2): its server writes a per-organ table."""
    from feduq.registry import is_ct as registered_ct

    return method in all_methods() and registered_ct(method)


def ct_job(method: str, seed: int, args, jobs: Path | None = None) -> Path:
    """``jobs/<method>`` configured with the sweep's CT budget (plans, iterations, rounds, K samples), into ``jobs``
    (default ``--out/jobs``)."""
    ex = {"seed": seed, "plans": args.plans, "inference_samples": args.samples}
    if args.iterations:
        ex["iterations"] = json.loads(args.iterations)
    if args.num_threads:
        ex["num_threads"] = args.num_threads
    return configure(method_job(method), (jobs or args.out / "jobs") / f"{method}_s{seed}", num_rounds=args.rounds,
                     max_items=args.max_items, executor_args=ex)


def sweep_job(method: str, seed: int, args, epsilon: float | None, jobs: Path) -> Path:
    """``jobs/<method>`` configured with the sweep's settings (task, size, budget, seed, precision, DP budget ε, ...)
    into ``jobs/<run>`` (:func:`run_name`); a CT job with its CT budget (:func:`ct_job`). Returns the job folder."""
    if is_ct(method):
        return ct_job(method, seed, args, jobs)
    executor_args = {"num_threads": args.num_threads} if args.num_threads else {}
    if getattr(args, "amp", "auto") != "auto":
        executor_args["amp"] = AMP_OPTIONS[args.amp]
    if epsilon is not None:  # DP-SGD for the whole run's rounds x local epochs (feduq.privacy.dp_sgd)
        executor_args["dp"] = {"epsilon": epsilon, "delta": args.dp_delta, "max_grad_norm": args.dp_max_grad_norm}
    return configure(method_job(method), jobs / run_name(method, seed, epsilon), task=args.task,
                     image_size=args.image_size, num_rounds=args.rounds, local_epochs=args.local_epochs, seed=seed,
                     max_items=args.max_items, executor_args=executor_args, network=args.network, sites=args.sites,
                     workflow_args=args.workflow_args.get(method),
                     official_protocol=getattr(args, "official_protocol", False),
                     select_on=getattr(args, "select_on", None))


def say(message: str) -> None:
    """Print a line above the sweep's progress bar (``tqdm.write``)."""
    from tqdm import tqdm

    tqdm.write(message)
    sys.stdout.flush()


def run_one(method: str, seed: int, args, epsilon: float | None = None, check_only: bool = False) -> Path:
    """Run one (method, seed[, DP budget ε]) unless it already finished with the same settings and data; return its
    workspace (with ``RUN.json``, :mod:`feduq.results.run_records`). ``check_only``: only check a finished run's
    record (raises ``RunChanged``), run nothing."""
    from feduq.results.run_records import finished_run, job_configuration, run_record, write_record

    ws = args.out / "runs" / run_name(method, seed, epsilon)
    settings = run_settings(method, seed, args, epsilon, is_ct(method))
    rerun = getattr(args, "rerun_changed", False)
    if method in REFERENCES:
        from feduq.data import get_task

        record = run_record(settings, args.data_root, args.task, args.sites or get_task(args.task).centers)
        if (ws / "DONE").is_file() and finished_run(ws, record, f"{method} seed {seed}", rerun,
                                                     (lambda m: None) if check_only else say) or check_only:
            return ws
        if ws.exists():
            shutil.rmtree(ws)
        t0 = time.time()
        say(f"[run ] {method} seed {seed} (reference) ...")
        if epsilon is not None:
            raise RuntimeError(f"--dp-epsilons: the reference {method!r} has no DP training")
        run_reference(method, seed, args, ws)
        write_record(ws, record)
        (ws / "DONE").write_text(f"{time.time() - t0:.1f} s\n")
        say(f"[done] {method} seed {seed} in {time.time() - t0:.0f} s")
        return ws
    # a check writes nothing into --out: its job is configured in a temporary folder (the record hashes its contents)
    jobs = Path(tempfile.mkdtemp(prefix="feduq-check-")) if check_only else args.out / "jobs"
    try:
        job = sweep_job(method, seed, args, epsilon, jobs)
        deploy = json.loads((job / "meta.json").read_text()).get("deploy_map", {})
        record = run_record(settings, args.data_root, args.task,
                            [x for v in deploy.values() for x in v if x != "server"], job)
        expected = job_configuration(job)  # what a run without a readable RUN.json is checked against
    finally:
        if check_only:
            shutil.rmtree(jobs, ignore_errors=True)
    if (ws / "DONE").is_file() and finished_run(ws, record, f"{method} seed {seed}", rerun,
                                                 (lambda m: None) if check_only else say, expected) or check_only:
        return ws
    t0 = time.time()
    say(f"[run ] {method} seed {seed}{'' if epsilon is None else f' epsilon {epsilon:g}'} ...")
    # checks the data root, removes an unfinished earlier attempt, runs the simulator, reads the outcome
    outcome = simulate(job, ws, args.data_root, log=ws / "simulator.log", threads=getattr(args, "threads", None),
                       label=f"{method} s{seed}", echo=say)
    if not outcome.ok:
        raise RuntimeError(f"{method} seed {seed}: {outcome.summary()}\n(full output: {ws / 'simulator.log'})")
    write_record(ws, record)
    (ws / "DONE").write_text(f"{time.time() - t0:.1f} s\n")
    say(f"[done] {method} seed {seed}{'' if epsilon is None else f' epsilon {epsilon:g}'} in {time.time() - t0:.0f} s")
    return ws


def global_model_is_what_sites_test(method: str) -> bool:
    """False for a method whose sites test the global model with entries they keep (FedBN's normalisation layers,
    FedUAA's head): its global model scored off the sites is not the method's result."""
    from feduq.registry import method_site_part

    return not method_site_part(method).global_model_note


def per_image_scores(method: str, label: str, seed: int, ws: Path, args) -> list[dict]:
    """Per-image test Dice of one run's best global model on its sites' test splits: what each site's own test task
    scored (``per_image_test.csv``, written since the sites write it), else ``feduq evaluate`` on the best
    global model (the job's own preprocessing and post-processing), cached in ``<ws>/per_image_test/``. A reference
    (local: each site's own model; pooled: the one model) pairs on the files it wrote, and is left out when it wrote
    none (runs from before it did). Empty for runs whose job folder is not in the sweep (CT), and for a method whose sites
    test with entries they keep when its sites wrote no file (an older run: the global model alone is not its
    result)."""
    files = sites_per_image(ws)
    if is_ct(method):  # per slice, with its patient (feduq.flare.ct.slice_row)
        return ct_slice_rows(label, seed, files.values())
    if method in REFERENCES and not files:
        return []
    if files:  # + the scores of the personalised models a server tested (GraphFedSeg's) as "<label> (personalised)"
        rows = []
        for name, path in [(label, p) for p in files.values()] + [
                (f"{label} ({PERSONALISED})", p) for p in sites_per_image(ws, PERSONALISED).values()]:
            with open(path) as f:  # a classification site's rows (label, p_k, correct) have no Dice: not paired here
                rows += [{"method": name, "seed": seed, "site": r["site"], "image": r["image"], "dice": float(r["dice"]),
                          **structure_values(r)} for r in csv.DictReader(f) if r.get("dice") not in (None, "")]
        return rows
    cache = ws / "per_image_test" / "per_image.csv"
    if not cache.is_file() and not global_model_is_what_sites_test(method):
        say(f"[note] {label} seed {seed}: its sites wrote no per-image test scores and its global model is not what "
            "they test; left out of the paired test")
        return []
    if not cache.is_file():
        from feduq.site.evaluation import evaluate_job as evaluate

        from feduq.recipes.simulation import job_task_and_sites

        _, sites = job_task_and_sites(args.out / "jobs" / ws.name)
        evaluate(ws, out=cache.parent, sites=sites, data_root=args.data_root, split="test", which="best",
                 max_items=args.max_items, maps=0)
    with open(cache) as f:
        return [{"method": label, "seed": seed, "site": r["site"], "image": r["image"], "dice": float(r["dice"]),
                 **structure_values(r)} for r in csv.DictReader(f)]


def main(argv=None) -> int:
    p = verb_parser("feduq compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default="polyp")
    p.add_argument("--methods", nargs="+", default=["fedavg", "fedevi"], metavar="METHOD[:SEEDS]",
                   help="jobs (or local, pooled); METHOD:0,1 runs that method with its own seeds instead of --seeds")
    p.add_argument("--seeds", nargs="+", type=int, default=[0])
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--local-epochs", type=int, default=2)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--max-items", type=int, help="first N images per split (quick demonstrations only)")
    p.add_argument("--num-threads", type=int, default=0,
                   help="torch threads per simulated site (default 0: each site's share of the cores among the sites "
                        "computing at the moment, feduq.core.threads)")
    p.add_argument("--amp", choices=list(AMP_OPTIONS), default="auto",
                   help="2D jobs' training precision: auto (the jobs' default: float16 on CUDA; bfloat16 on a CPU with "
                        "bfloat16 hardware for a network without BatchNorm; else float32), off (float32 everywhere: "
                        "the archived polyp-96 runs), bf16")
    p.add_argument("--network", help="network name for every method (default: each job's own, fedevi_unet; "
                                     "light: a CPU smoke-test network, not the papers')")
    p.add_argument("--plans", default="ct_2d", help="CT jobs: nnU-Net plans (ct_2d: the paper's; ct_2d_slim: CPU demos)")
    p.add_argument("--iterations", help='CT jobs: iterations per round, JSON, e.g. \'{"NIH-Pancreas-CT": 16, "default": 6}\'')
    p.add_argument("--samples", type=int, default=10, help="CT jobs: inference samples K")
    p.add_argument("--sites", type=site_names,
                   help="comma-separated sites for every method (e.g. virtual sites ISIC-2017-p00of10,...; "
                        "default: each job's own)")
    p.add_argument("-t", "--threads", type=int,
                   help="simulator processes (default: one per site; fewer for many virtual sites: they take turns)")
    p.add_argument("--set-workflow", action="append", default=[], metavar="METHOD:KEY=VALUE",
                   help="a training-workflow argument of one method, e.g. feda3i:warmup_rounds=3")
    p.add_argument("--dp-epsilons", nargs="+", metavar="EPS",
                   help="a DP sweep: run every method once per privacy budget ε ('none' = without DP), e.g. 1 10 50 none; "
                        "writes dp_sweep.csv and dice_vs_epsilon.png (GraphFedSeg Fig. 7)")
    p.add_argument("--dp-delta", type=float, default=1e-5, help="δ of the DP sweep (default 1e-5, GraphFedSeg's)")
    p.add_argument("--dp-max-grad-norm", type=float, default=1.0, help="per-image clipping norm C of the DP sweep")
    p.add_argument("--holdout", metavar="SITE|all", help="leave-one-site-out: train on the other sites and score "
                   "SITE's whole folder (feduq evaluate); 'all' rotates over the sites (FedDG protocol); holdout.md")
    p.add_argument("--review-target", type=float, metavar="DICE",
                   help="with --holdout: also judge the review flag at the held-out site (feduq.results.review_holdout): "
                        "the rule chosen on the training sites' validation images for this target mean Dice (a "
                        "fraction, e.g. 0.75), then scored on the held-out site's images with their masks; "
                        "holdout_review.md/csv and a risk-coverage picture per run")
    p.add_argument("--report", action="store_true", help="also write report.md (feduq compare-report): uncertainty "
                   "quality, reliability diagrams, risk-coverage curves, test images per site")
    p.add_argument("--official-protocol", action="store_true",
                   help="every job with the official FedEvi code's protocol (feduq configure --official-protocol)")
    p.add_argument("--select-on", choices=["val_dice", "val_loss"], help="the selection of every job (default: its own)")
    p.add_argument("--paired-baseline", default=None, metavar="METHOD",
                   help="test every other method against this one on the same test images (Wilcoxon signed-rank on "
                        "per-image Dice, per seed, pooled over sites and per site; paired_tests.csv); 'none' skips it")
    p.add_argument("--archive", type=Path, metavar="DIR",
                   help="also copy each finished run's summary (tables, per-image scores, the FEDUQ lines of its logs, "
                        "DONE; no models) to DIR/runs/<run>/: a sweep with --out DIR then skips those runs and reports "
                        "them, so a long sweep can be kept in a repository and continued elsewhere")
    p.add_argument("--data-root", default=os.environ.get("FEDUQ_DATA_ROOT"),
                   help="the folder holding <task>/<center>/ (default $FEDUQ_DATA_ROOT)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (they are kept)")
    p.add_argument("--rerun-changed", action="store_true",
                   help="run again a finished run of --out whose recorded settings or data differ from this sweep's "
                        "(default: the sweep stops at once and names what differs)")
    argv = list(sys.argv[1:] if argv is None else argv)
    a = p.parse_args(argv)
    a.out = a.out.resolve()
    try:  # a task file that does not check: one line naming the file and the key
        from feduq.data import get_task

        get_task(a.task)
    except DataError as e:
        print(f"feduq compare: {e}", file=sys.stderr)
        return 2
    try:  # before anything is written: never the data root or around it; a user's folder only with --force
        from feduq.outputs import check_output_folder, user_files

        check_output_folder(a.out, {"data root": a.data_root}, "feduq compare", force=a.force, recognise=_is_sweep)
        a.keep = user_files(a.out, _is_sweep)
        a.archive_keep = None
        if a.archive is not None and a.archive.resolve() != a.out:  # checked as every output, before the sweep
            from feduq.outputs import refuse_clashes

            # no guessing from the layout: an archive without FedUQ's marker is the user's (runs/<run>/DONE included)
            a.archive = check_output_folder(a.archive, {"data root": a.data_root, "output folder": a.out},
                                            "feduq compare --archive", force=a.force)
            a.archive_keep = user_files(a.archive)
            refuse_clashes(a.archive, a.archive_keep, ["runs/*"], "feduq compare --archive")
    except DataError as e:  # "feduq compare: <why>", one line
        print(e, file=sys.stderr)
        return 2
    if a.review_target is not None and not (a.holdout and 0.0 < a.review_target <= 1.0):
        p.error(f"--review-target {a.review_target}: a mean Dice in (0, 1], with --holdout" if a.holdout else
                "--review-target judges the review flag at a held-out site: give --holdout SITE|all too")
    if a.holdout:
        from feduq.results.holdout import run_holdout

        return run_holdout(a, argv, main, p.error)
    a.method_seeds = {}
    for i, spec in enumerate(a.methods):  # METHOD:SEEDS -> the method's own seeds
        name, sep, seeds = spec.partition(":")
        if sep:
            try:
                a.method_seeds[name] = sorted({int(s) for s in seeds.split(",")})
            except ValueError:
                p.error(f"--methods: METHOD or METHOD:SEED,SEED,..., got {spec!r}")
            a.methods[i] = name
    for name in a.methods:  # every method's seeds; a.seeds becomes all of them
        a.method_seeds.setdefault(name, sorted(set(a.seeds)))
    a.seeds = sorted(set().union(*a.method_seeds.values()))
    a.workflow_args = {}
    for item in a.set_workflow:
        method, _, kv = item.partition(":")
        key, sep, value = kv.partition("=")
        if not sep:
            p.error(f"--set-workflow expects METHOD:KEY=VALUE, got {item!r}")
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = value
        a.workflow_args.setdefault(method, {})[key] = parsed
    for m in a.methods:
        if m not in REFERENCES and m not in all_methods():
            near = difflib.get_close_matches(m, [*all_methods(), *REFERENCES], n=1)
            p.error(f"--methods: {m} is not a registered method (feduq methods) nor one of the references "
                    f"{list(REFERENCES)}" + (f"; did you mean {near[0]}?" if near else ""))
    if a.data_root is None:
        p.error("--data-root: give the folder holding <task>/<center>/ (or set FEDUQ_DATA_ROOT)")
    if a.rounds is not None and a.rounds < 1:  # checked before any run starts, not under the progress bar
        p.error(f"--rounds {a.rounds}: expected an integer >= 1")
    if a.paired_baseline not in (None, "none") and a.paired_baseline not in a.methods:
        p.error(f"--paired-baseline {a.paired_baseline}: not one of --methods ({', '.join(a.methods)}); the baseline "
                f"must run in the same sweep")
    try:
        from feduq.sites.centers import site_center

        check_data_root(a.data_root, a.task,
                        sorted({site_center(a.task, s) for s in a.sites}) if a.sites else None)
    except DataError as e:
        print(f"feduq compare: {e}", file=sys.stderr)
        return 1
    try:
        epsilons = [None if e.lower() == "none" else float(e) for e in a.dp_epsilons or []]
    except ValueError:
        p.error(f"--dp-epsilons: numbers > 0 or 'none', got {a.dp_epsilons}")
    if any(e is not None and not e > 0 for e in epsilons):
        p.error(f"--dp-epsilons: numbers > 0 or 'none', got {a.dp_epsilons}")
    sweep = bool(epsilons)
    runs = [(m, e) for m in a.methods for e in (epsilons or [None])]
    labels = [dp_label(m, e, sweep) for m, e in runs]
    tidy, curves, weights, per_image, per_image_cls = [], [], [], [], []
    baseline = a.paired_baseline or ("fedavg_ct" if a.task == "ct" else "fedavg")  # FedAvg when the sweep runs it
    paired = baseline if baseline in a.methods and not sweep else None
    from tqdm import tqdm

    todo = [(seed, method, eps) for seed in a.seeds for method, eps in runs
            if seed in a.method_seeds[method]]
    from feduq.jobs.jobcheck import JobConfigError  # a job that cannot run (e.g. a network that does not fit the task)

    from feduq.results.run_records import RunChanged, read_record

    if not a.rerun_changed:  # every finished run checked before any runs: the sweep stops at once
        for seed, method, eps in todo:
            if (a.out / "runs" / run_name(method, seed, eps) / "DONE").is_file():
                try:
                    run_one(method, seed, a, eps, check_only=True)
                except RunChanged as e:
                    print(f"feduq compare: {e}", file=sys.stderr)
                    return 2
    from feduq.outputs import mark_running

    mark_running(a.out, "feduq compare", a.keep)  # a sweep that fails or is stopped midway leaves a folder still FedUQ's
    records = []
    bar = tqdm(total=len(todo), desc="sweep", unit="run", dynamic_ncols=True)
    for seed, method, eps in todo:
        label = dp_label(method, eps, sweep)
        bar.set_postfix_str(f"{label} s{seed}")
        try:
            ws = run_one(method, seed, a, eps)  # a run without a readable record: checked against its own job
            records.append(read_record(ws) or {"settings": run_settings(method, seed, a, eps, is_ct(method)),
                                               "checked": "job configuration"})
        except RunChanged as e:  # a finished run of other settings: nothing of it is reported as this sweep's
            bar.close()
            print(f"feduq compare: {e}", file=sys.stderr, flush=True)
            return 2
        except (RuntimeError, DataError, JobConfigError) as e:  # its reason; finished runs are kept and skipped
            bar.close()
            print(f"[FAIL] {label} seed {seed}: {e}", file=sys.stderr, flush=True)
            return 1
        except KeyboardInterrupt as e:  # the run's simulator is stopped; finished runs are skipped next time
            from feduq.cli import Interrupted, signal_number

            bar.close()
            raise Interrupted(f"{label} seed {seed} stopped, {bar.n} finished runs kept in {a.out / 'runs'}; the same "
                              "command continues from them", signal_number(e)) from None
        bar.update(1)
        if bar.n == bar.total:
            bar.close()
        if a.archive_keep is not None:  # CT runs too
            archive_run(ws, a.archive / "runs" / ws.name)
            write_marker(a.archive, "feduq compare", exclude=a.archive_keep)
        if is_ct(method):
            tidy += collect_ct(method, seed, ws)
            per_image += per_image_scores(method, label, seed, ws, a) if paired else []
            continue
        t, c, w = collect(method, seed, ws)
        t, c, w = ([dict(r, method=label) for r in rows] for rows in (t, c, w))
        if paired:
            per_image += per_image_scores(method, label, seed, ws, a)
            per_image_cls += classification_rows(label, seed, ws)
        graphs = graph_records(ws)
        if graphs:  # GraphFedSeg: W per round as heat maps, and the personalised table beside the global one
            plot_graphs(graphs, a.out / f"graph_W_{ws.name}.png")
            personal = ws / "server" / "simulate_job" / "results" / PERSONALISED / "per_client_table.csv"
            if personal.is_file():
                t += [dict(r, method=f"{label} ({PERSONALISED})") for r in collect_table(personal, method, seed)]
        tidy += t
        curves += c
        weights += w
    methods = labels + sorted({r["method"] for r in tidy} - set(labels))  # + "<m> (personalised)" rows
    write_rows(a.out / "results_tidy.csv", tidy)
    write_rows(a.out / "curves.csv", curves)
    write_rows(a.out / "weights.csv", weights)
    if a.task == "ct" or all(is_ct(m) for m in a.methods):
        title = (f"# FedUQ CT comparison: plans {a.plans}, {a.rounds} rounds, iterations {a.iterations or 'as the jobs'}, "
                 f"K = {a.samples}, seeds {a.seeds}")
        print(ct_results(a.out, title, tidy, per_image, a.methods, paired))
        write_marker(a.out, "feduq compare", exclude=a.keep)
        return 0
    from feduq.results.comparison import results_markdown

    md = results_markdown(a, tidy, methods, labels, records, per_image, per_image_cls, paired, sweep, epsilons)
    (a.out / "results.md").write_text("\n".join(md))
    plot([r for r in curves if r["metric"] in (*VALIDATION_KEYS, "val_dice")], "value", "validation Dice (AUC: classif.)",
         a.out / "dice_per_round.png", labels)
    tested = [r for r in curves if r["metric"] == "test_dice_global"]
    if tested:
        plot(tested, "value", "test Dice", a.out / "test_dice_per_round.png", labels)
    plot(weights, "weight", "aggregation weight", a.out / "weights_per_round.png", labels)
    print("\n".join(md))
    print(f"written: {a.out / 'results.md'}, results_tidy.csv, curves.csv, weights.csv, dice_per_round.png, "
          f"weights_per_round.png")
    if a.report:
        from feduq.results.report import write_report

        write_report(a.out, a.data_root, max_items=a.max_items)
    write_marker(a.out, "feduq compare", exclude=a.keep)
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq compare", main))
