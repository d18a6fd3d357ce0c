"""Run or export a FedUQ method's FLARE 2.9 Recipe from the command line.

    # the simulator on this machine (FLARE's SimEnv); the data root holds <task>/<center>/
    feduq run fedevi --env sim --data-root /data/feduq --image-size 128 --num-rounds 20
    # (the run goes to workspaces/fedevi/; -w ROOT puts it in ROOT/<name>/)
    # the job folder only (what `python job.py --export` gives in FLARE's examples; FLARE reserves the name
    # --export for its own job scripts, so here it is --export-to)
    feduq run fedevi --export-to exported_jobs --image-size 128
    # a local POC federation (FLARE's PocEnv; sites keep their data root, feduq prepare-site)
    feduq run fedevi --env poc --image-size 128
    # a provisioned project through the admin's startup kit (FLARE's ProdEnv)
    feduq run fedevi --env prod --startup-kit /path/to/admin@org.com --username admin@org.com

Every option not given keeps the method's registered job's value (its export: ``--export-to``); ``--set key=value`` changes any executor
argument (value parsed as JSON when possible). ``--task`` applies the method's settings for that task (the task file's
``feduq.hyperparameters.<method>``) before ``--set``, printed in one line with where each came from. The job is checked before anything runs; a job that cannot run stops
with one line naming the key or value (exit 2), and a run that does not finish exits 1 with the server's reason and
each failing site's first error.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from .cli import verb_parser


def _value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parser() -> argparse.ArgumentParser:
    from .common.checks import site_names
    from .registry import all_methods

    p = verb_parser("feduq run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("method", choices=all_methods(), help="the registered method whose job runs (feduq methods lists them)")
    p.add_argument("--env", choices=["sim", "poc", "prod"], default="sim", help="where the job runs (default sim)")
    p.add_argument("--export-to", type=Path, metavar="DIR", help="write the job folder DIR/<name>/ and stop")
    p.add_argument("--force", action="store_true", help="--export-to: write into a job folder that holds files FedUQ "
                                                        "did not write (they are kept)")
    p.add_argument("--name", help="the job's name (default: the method)")
    p.add_argument("--data-root", help="sim: the folder holding <task>/<center>/ (default $FEDUQ_DATA_ROOT)")
    p.add_argument("-w", "--workspace-root", type=Path, default=Path("workspaces"),
                   help="sim: the run goes to <this>/<name>/ (default workspaces/)")
    p.add_argument("-t", "--threads", type=int, help="sim: simulator processes (default one per site)")
    p.add_argument("--startup-kit", help="prod: the admin's startup kit folder")
    p.add_argument("--username", help="prod: the admin user (default FLARE's)")
    p.add_argument("--poc-workspace", help="poc: the POC workspace (default $NVFLARE_POC_WORKSPACE, else workspaces/poc, "
                                           "as feduq poc)")
    p.add_argument("--no-wait", action="store_true", help="poc/prod: submit the job and return")
    p.add_argument("--timeout", type=float, default=0.0, help="poc/prod: abort the job after this many seconds")
    p.add_argument("--task", help="another task: a built-in name (e.g. prostate) or a task file (nnU-Net's "
                                  "dataset.json with a \"feduq\" object); its sites become the job's")
    p.add_argument("--network", help="network: fedevi_unet (the papers') or light (CPU smoke tests)")
    p.add_argument("--configuration", choices=["2d", "3d_fullres"],
                   help="how a volume task's sites train: 2d (axial slices on the 2D network) or 3d_fullres (nnU-Net's "
                        "3D network of --plans); default the task file's feduq.configuration, else 2d")
    p.add_argument("--plans", help="3d_fullres: the federation's nnU-Net plans file (feduq plan), "
                                   "carried in the job")
    p.add_argument("--select-on", help="the global model the final test scores: val_dice (best mean validation Dice, "
                                       "the jobs' default) or val_loss (the official FedEvi code's)")
    for flag, words in (("--image-size", "square training size in pixels"), ("--num-rounds", "federated rounds"),
                        ("--local-epochs", "local epochs per round"), ("--batch-size", "images per local step"),
                        ("--max-items", "use only the first N images of each split (smoke runs)"),
                        ("--seed", "data-order and model-initialisation seed"),
                        ("--min-clients", "sites that must answer a round (default: all)"),
                        ("--train-timeout", "seconds to wait for a site's answer (0: forever)")):
        p.add_argument(flag, type=int, help=words)
    p.add_argument("--sites", type=site_names, help="comma-separated site names")
    p.add_argument("--resources", action="append", default=[], metavar="SITE=GPUS[:GiB]",
                   help="FLARE resource_spec of a site (GPUs it needs, 0: CPU; GiB per GPU), e.g. Kvasir-SEG=1:16")
    p.add_argument("--official-protocol", action="store_true", help="the official FedEvi code's protocol")
    p.add_argument("--any-site-names", action="store_true", help="sites need not be named after centers")
    p.add_argument("--allow-listed", action="store_true", help="no app/custom (sites that refuse custom code)")
    p.add_argument("--byoc", action="store_true", help="ship FedUQ's code inside the job")
    p.add_argument("--initial-ckpt", help="the global model's starting weights (FedUQ checkpoint or state dict of the "
                                          "job's network; relative: bundled into the job, absolute: on the server)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="an executor argument")
    p.add_argument("--set-workflow", action="append", default=[], metavar="KEY=VALUE",
                   help="a training-workflow argument (e.g. warmup_rounds=3)")
    p.add_argument("--site-set", action="append", default=[], metavar="SITE:KEY=VALUE",
                   help="a setting one site owns (device, batch_size, num_threads, num_workers): FLARE's "
                        "set_per_site_config")
    return p


def _pairs(items: list[str], flag: str, error) -> dict:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            error(f"{flag} expects KEY=VALUE, got {item!r}")
        out[key] = _value(value)
    return out


def main(argv=None) -> int:
    p = parser()
    a = p.parse_args(argv)
    from .jobs.jobcheck import JobConfigError
    from .recipes.recipe import FedUQRecipe

    options = {k: getattr(a, k) for k in ("task", "network", "select_on", "image_size", "num_rounds", "local_epochs",
                                           "batch_size", "max_items", "seed", "min_clients", "train_timeout", "sites",
                                           "configuration", "plans")
               if getattr(a, k) is not None}
    options.update({k: True for k in ("official_protocol", "any_site_names", "allow_listed") if getattr(a, k)})
    if a.set:
        options["executor_args"] = _pairs(a.set, "--set", p.error)
    if a.set_workflow:
        options["workflow_args"] = _pairs(a.set_workflow, "--set-workflow", p.error)
    try:
        if a.resources:
            from .recipes.settings import parse_resources

            options["resource_spec"] = parse_resources(a.resources)
        applied: list = []  # what --task set in the job, with where each came from (printed once, below)
        if a.task is not None:
            options["record"] = applied
        recipe = FedUQRecipe(a.method, name=a.name, data_root=a.data_root, byoc=a.byoc, initial_ckpt=a.initial_ckpt,
                             **options)
        if applied:
            from .recipes.settings import settings_line

            print(settings_line(a.method, _job_task(recipe), applied), flush=True)
        if a.site_set:
            per_site: dict[str, dict] = {}
            for item in a.site_set:
                site, sep, pair = item.partition(":")
                if not sep or not site:
                    p.error(f"--site-set expects SITE:KEY=VALUE, got {item!r}")
                per_site.setdefault(site, {}).update(_pairs([pair], "--site-set", p.error))
            try:
                recipe.set_per_site_config(per_site)
            except ValueError as e:  # the command line's name for it, not the Python method's
                raise ValueError(f"--site-set: {str(e).removeprefix('set_per_site_config: ')}") from None
    except (JobConfigError, ValueError) as e:
        print(f"feduq run: {e}", file=sys.stderr)
        return 2
    if a.export_to:
        from .outputs import OutputFolderError, check_output_folder, write_marker

        try:  # FLARE's export writes <dir>/<name>/: never over an input or a folder FedUQ did not write
            if a.export_to.exists() and not a.export_to.is_dir():
                raise OutputFolderError(f"--export-to {a.export_to} is a file: give the folder the job folder "
                                        f"{recipe.name}/ is written into")
            check_output_folder(a.export_to / recipe.name, {"data root": a.data_root}, "feduq run --export-to",
                                force=a.force)
        except OutputFolderError as e:
            print(f"feduq run: {e}", file=sys.stderr)
            return 2
        recipe.export(str(a.export_to))
        write_marker(a.export_to / recipe.name, "feduq run --export-to")
        print(f"exported {a.export_to / recipe.name}")
        return 0
    if a.env == "sim":
        from nvflare.recipe import SimEnv

        from .outputs import OutputFolderError, check_output_folder

        from .recipes.simulation import is_simulator_workspace

        def earlier_run(folder: Path) -> bool:  # a simulator workspace of an earlier run (FLARE's or feduq simulate's)
            return is_simulator_workspace(folder) or ((folder / "server").is_dir() and (folder / "startup").is_dir())

        try:  # the simulator's workspaces go under -w: never the data root, inside it or around it; and FLARE's
            # simulator removes what it did not make in <-w>/<name>/, so a user's file there is refused
            root = a.data_root or os.environ.get("FEDUQ_DATA_ROOT")
            check_output_folder(a.workspace_root, {"data root": root}, "feduq run -w", force=True)
            ws = check_output_folder(a.workspace_root / recipe.name, {"data root": root}, "feduq run -w", force=True)
            if ws.is_dir() and any(ws.iterdir()) and not earlier_run(ws):
                from .outputs import user_files

                theirs = user_files(ws) or sorted(p.name for p in ws.iterdir())
                raise OutputFolderError(f"feduq run -w: the run's workspace {ws} holds files no FedUQ run wrote (e.g. "
                                        f"{theirs[0]}), which FLARE's simulator would remove; choose another -w or "
                                        f"--name")
        except OutputFolderError as e:
            print(f"feduq run: {e}", file=sys.stderr)
            return 2
        env = SimEnv(clients=recipe.sites, num_threads=a.threads, workspace_root=str(a.workspace_root.resolve()))
    elif a.env == "poc":
        from .recipes.poc import FedUQPocEnv

        if a.poc_workspace:  # FLARE's PocEnv and feduq poc read the workspace from the environment
            os.environ["NVFLARE_POC_WORKSPACE"] = str(Path(a.poc_workspace).resolve())
        root = a.data_root or os.environ.get("FEDUQ_DATA_ROOT")
        env = FedUQPocEnv(clients=recipe.sites, task=_job_task(recipe),
                          data_root=str(Path(root).resolve()) if root else None)
    else:
        from nvflare.recipe import ProdEnv

        if not a.startup_kit:
            p.error("--env prod needs --startup-kit (the admin's startup kit folder)")
        env = ProdEnv(startup_kit_location=a.startup_kit, **({"username": a.username} if a.username else {}))
    try:
        run = recipe.run(env)
    except Exception as e:  # noqa: BLE001 - one line, the reason; FLARE's and FedUQ's errors alike
        print(f"feduq run: {a.method}: {e}", file=sys.stderr)
        return 1
    if a.env == "sim":
        return 0
    print(f"submitted job {run.get_job_id()}")
    if a.no_wait:
        return 0
    started_here = getattr(env, "started_here", False)
    try:
        return follow(env, run.get_job_id(), recipe, a.timeout)
    except KeyboardInterrupt as e:
        from .cli import Interrupted, signal_number

        where = ("the POC this command started is stopped (its logs kept)" if started_here else
                 f"job {run.get_job_id()} goes on in the {a.env.upper()} federation; stop it from the admin console "
                 f"with: abort_job {run.get_job_id()}")
        raise Interrupted(f"stopped following; {where}", signal_number(e)) from None
    finally:
        if started_here:  # a POC this command started is stopped (its logs kept)
            from .recipes.poc import stop

            stop(clean=False)


def _job_task(recipe) -> str:
    from .data import task_name

    return task_name(json.loads(recipe.files["app/config/config_fed_client.json"])["executors"][0]["executor"][
        "args"].get("task", "polyp"))


def follow(env, job_id: str, recipe, timeout: float = 0.0, poll: float = 2.0) -> int:
    """Wait for job ``job_id`` in a POC or provisioned project through one FLARE admin session, print one line per
    round (POC: from the server's and sites' job logs on this machine, with the sites' validation Dice; a provisioned
    project: from FLARE's ``show_stats`` of the server, aggregation weights only) and at the end the per-client table, or the
    server's reason and each failing site's first error (:func:`feduq.recipes.outcome.poc_outcome`). Returns 0 (finished,
    table written) or 1."""
    import time

    from nvflare.fuel.flare_api.flare_api import new_secure_session

    from .recipes.progress import RoundProgress
    from .recipes.outcome import poc_outcome

    from .recipes.poc import ADMIN, FedUQPocEnv, kit_dir, parent_logs, site_job_logs

    poc = isinstance(env, FedUQPocEnv)  # its job logs are on this machine
    if poc:
        session = new_secure_session(ADMIN, str(kit_dir(ADMIN)))
    else:
        session = new_secure_session(env.username, env.startup_kit_location)
    workflows = json.loads(recipe.files["app/config/config_fed_server.json"])["workflows"]
    progress = RoundProgress(int(workflows[0]["args"].get("num_rounds", 0)))
    offsets: dict[Path, int] = {}
    site_logs: dict[str, Path] = {}
    t0 = time.monotonic()
    try:
        while True:
            status = str(session.get_job_meta(job_id).get("status", ""))
            if poc:
                site_logs = site_job_logs(job_id)
                for path in [*site_logs.values(), kit_dir("server") / job_id / "log.txt"]:
                    for line in _new_lines(path, offsets):
                        message = progress.feed(line)
                        if message:
                            print(message, flush=True)
            elif status == "RUNNING":
                for message in _stats_lines(session, job_id, progress):
                    print(message, flush=True)
            if "FINISHED" in status:
                break
            if timeout and time.monotonic() - t0 > timeout:
                session.abort_job(job_id)
                print(f"feduq run: job {job_id} not finished after {timeout:.0f} s (status {status}); aborted",
                      file=sys.stderr)
                return 1
            time.sleep(poll)
        result = session.download_job_result(job_id)
    finally:
        session.close()
    if not poc and result:  # the rounds that ended between the last poll and the job's end, from the server's log
        log = next(iter(sorted(Path(result).rglob("log.txt"), key=lambda p: len(p.parts))), None)
        for line in _new_lines(log, {}) if log else []:
            message = progress.feed(line)  # rounds already printed are skipped by RoundProgress
            if message:
                print(message, flush=True)
    outcome = poc_outcome(result, site_logs, status=status, job_id=job_id, parent_logs=parent_logs() if poc else None)
    if outcome.ok and outcome.table is not None and outcome.table.with_suffix(".md").is_file():
        print(outcome.table.with_suffix(".md").read_text().rstrip() + "\n")
    print(outcome.summary())
    return 0 if outcome.ok else 1


def _stats_lines(session, job_id: str, progress) -> list[str]:
    """The round lines for the rounds the server aggregated since the last call, from FLARE's ``show_stats`` (the
    controller's ``feduq`` group, :meth:`feduq.flare.controller.FedUQController.handle_event`); none while the job
    is not running (not started yet, or ended: its last rounds then come from the downloaded server log)."""
    from nvflare.fuel.flare_api.api_spec import JobNotFound, JobNotRunning, NoReply

    try:
        stats = session.show_stats(job_id, "server")
    except (JobNotFound, JobNotRunning, NoReply):  # between FLARE's RUNNING and the job process answering, or ended
        return []
    group = next((v["feduq"] for v in (stats or {}).values() if isinstance(v, dict) and "feduq" in v), {})
    records = group.get("aggregation", []) if isinstance(group, dict) else []
    lines = [progress.feed("FEDUQ_AGGREGATION " + json.dumps(rec)) for rec in records]
    return [line for line in lines if line]


def _new_lines(path: Path, offsets: dict) -> list[str]:
    """The lines appended to ``path`` since the last call (none when it does not exist)."""
    if not path.is_file():
        return []
    with open(path, errors="replace") as f:
        f.seek(offsets.get(path, 0))
        lines = f.readlines()
        offsets[path] = f.tell()
    return lines


if __name__ == "__main__":
    from .cli import run_main

    sys.exit(run_main("feduq run", main))
