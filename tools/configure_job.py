#!/usr/bin/env python3
"""Copy a FedUQ job folder with changed settings (image size, rounds, sites, ...).

The committed ``jobs/<method>`` folders carry the papers' settings. This tool writes a variant
without editing them, e.g. a CPU-sized run or a federation with other site names::

    python tools/configure_job.py jobs/fedevi -o workspaces/jobs/fedevi-128 \\
        --image-size 128 --num-rounds 20
    nvflare simulator workspaces/jobs/fedevi-128 -w workspaces/fedevi-128

    # POC / production with differently named sites, shipping FedUQ inside the job (BYOC):
    python tools/configure_job.py jobs/fedevi -o /tmp/fedevi --sites site-a,site-b --any-site-names --byoc

    # sites that refuse custom code and allow-list FedUQ's classes (tools/prepare_site.py): no app/custom
    python tools/configure_job.py jobs/fedevi -o /tmp/fedevi --allow-listed

Options that are not given keep the job's value. ``--set key=value`` changes any executor argument
(value parsed as JSON when possible). The result is validated before it is written (unknown keys with
the closest valid one, values out of range, image sizes the network cannot take, sites that are not
centers of the task); an invalid job is not written and the tool exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from feduq.jobspec import SELECTION_METRICS
from feduq.outputs import check_output_folder, staged_folder

REPO = Path(__file__).resolve().parents[1]


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def configure(
    job_dir: Path,
    out_dir: Path,
    *,
    task: str | None = None,
    image_size: int | None = None,
    num_rounds: int | None = None,
    local_epochs: int | None = None,
    batch_size: int | None = None,
    max_items: int | None = None,
    seed: int | None = None,
    sites: list[str] | None = None,
    min_clients: int | None = None,
    train_timeout: int | None = None,
    executor_args: dict | None = None,
    byoc: bool = False,
    allow_listed: bool = False,
    any_site_names: bool = False,
    network: str | None = None,
    workflow_args: dict | None = None,
    force: bool = False,
    select_on: str | None = None,
    official_protocol: bool = False,
    resource_spec: dict | None = None,
) -> Path:
    """Write a modified copy of ``job_dir`` to ``out_dir`` and return it (absolute).

    ``out_dir`` is replaced only if a FedUQ tool made it (or ``force``), and never when it is, contains or lies inside
    ``job_dir`` (:func:`feduq.outputs.check_output_folder`); the new job is built beside it and moved into place only
    when it is complete and valid, so a refused call leaves an existing ``out_dir`` untouched.

    The result is validated before it is written (:func:`feduq.flare.jobcheck.validate_configs`,
    the same check every FedUQ workflow runs at start-up): unknown keys, values out of range, an
    image size the network cannot take, sites that are not centers of the task (unless
    ``any_site_names``), a server model that does not fit the task. Nothing is written then.

    ``workflow_args`` updates the training workflow's arguments (the first workflow; e.g. FedA3I's
    ``warmup_rounds``, GraphFedSeg's ``gamma``); unknown names are refused by the job check.

    The committed jobs carry ``app/custom/README.md`` (no code), which makes them bring-your-own-code for FLARE, so
    the simulator and POC sites build FedUQ's classes without an allow-list. ``byoc`` ships FedUQ's code there as
    well; ``allow_listed`` drops the folder, for sites whose policy refuses custom code and allow-lists ``feduq.``.

    ``select_on`` picks the global model the final test scores: ``"val_dice"`` (the jobs' default: the highest mean
    validation Dice over the sites) or ``"val_loss"`` (the lowest mean validation Dice loss on the probabilities, as
    the official FedEvi code selects). ``official_protocol`` sets the official FedEvi code's whole protocol
    (:data:`feduq.jobspec.OFFICIAL_PROTOCOL`): selection on ``val_loss``, plain resize and x / max, the test at the training
    resolution with 4-connected components and a test every round, and for executors with FedAvg's loss the
    official FedAvg loss (``loss="dice"``); explicit arguments still win.

    ``network`` replaces the network's name (``fedevi_unet``, ``light``; its other options stay); the
    server's persistor model always follows the sites' network (``--set network=...`` included).

    Raises:
        FileNotFoundError: ``job_dir`` is not a job folder (no meta.json / app/config).
        feduq.outputs.OutputFolderError: ``out_dir`` must not be written (see above); nothing is touched.
        feduq.flare.jobcheck.JobConfigError: the configured job would not run (message names the key or value).
    """
    from feduq import jobspec

    job_dir, out_dir = Path(job_dir), Path(out_dir)
    files = jobspec.read_job_files(job_dir)  # FileNotFoundError: not a job folder
    out_dir = check_output_folder(out_dir, {"job": job_dir}, "configure_job.py", force=force)
    files = jobspec.configure(  # JobConfigError before anything is written
        files, out_dir.name, task=task, image_size=image_size, num_rounds=num_rounds, local_epochs=local_epochs,
        batch_size=batch_size, max_items=max_items, seed=seed, sites=sites, min_clients=min_clients,
        train_timeout=train_timeout, executor_args=executor_args, any_site_names=any_site_names, network=network,
        workflow_args=workflow_args, select_on=select_on, official_protocol=official_protocol,
        allow_listed=allow_listed, resource_spec=resource_spec)
    with staged_folder(out_dir, overwrite=True, what="configure_job.py", marker="configure_job.py") as stage:
        shutil.copytree(job_dir, stage, dirs_exist_ok=True)  # the job's other files (its README, shipped code)
        if allow_listed:  # not bring-your-own-code: no app/custom at all
            shutil.rmtree(stage / "app" / "custom", ignore_errors=True)
        jobspec.write_job(files, stage, byoc=byoc)
    return out_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", type=Path, help="job folder, e.g. jobs/fedevi")
    p.add_argument("-o", "--out", type=Path, required=True,
                   help="output job folder (replaced only if a FedUQ tool made it; never the job or a folder around it)")
    p.add_argument("--force", action="store_true", help="replace an output folder that holds files no FedUQ tool wrote")
    p.add_argument("--task", help="another FedUQ task (e.g. prostate); its centers become the sites")
    p.add_argument("--image-size", type=int)
    p.add_argument("--num-rounds", type=int)
    p.add_argument("--local-epochs", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--max-items", type=int, help="use only the first N images of each split (smoke runs)")
    p.add_argument("--seed", type=int, help="data-order and model-initialisation seed")
    p.add_argument("--sites", help="comma-separated site names (default: the task's centers)")
    p.add_argument("--min-clients", type=int, help="sites that must answer a round (default: all)")
    p.add_argument("--train-timeout", type=int, help="seconds to wait for a site's answer (0 = forever)")
    p.add_argument("--network", help="network name: fedevi_unet (the papers') or light (CPU smoke tests)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any executor argument")
    code = p.add_mutually_exclusive_group()
    code.add_argument("--byoc", action="store_true", help="copy FedUQ's code into app/custom (bring-your-own-code)")
    code.add_argument("--allow-listed", action="store_true",
                      help="drop app/custom, so the job is not bring-your-own-code: for sites whose policy refuses "
                           "custom code; each site must allow-list FedUQ's classes (tools/prepare_site.py)")
    p.add_argument("--any-site-names", action="store_true",
                   help="allow --sites that are not centers of the task (each such site names its center in "
                        "its local/feduq_site.json: tools/prepare_site.py --center)")
    p.add_argument("--select-on", choices=SELECTION_METRICS,
                   help="the global model the final test scores: best mean validation Dice (the jobs' default) or "
                        "lowest mean validation Dice loss (the official FedEvi code's selection)")
    p.add_argument("--official-protocol", action="store_true",
                   help="the official FedEvi code's protocol: select on val_loss, plain resize and x/max, test at the "
                        "training resolution with 4-connected components, a test every round, FedAvg's Dice loss")
    p.add_argument("--resources", action="append", default=[], metavar="SITE=GPUS[:GiB]",
                   help="FLARE resource_spec of a site: GPUs it needs (0: CPU) and GiB per GPU, e.g. Kvasir-SEG=1:16")
    p.add_argument("--set-workflow", action="append", default=[], metavar="KEY=VALUE",
                   help="any argument of the training workflow (e.g. warmup_rounds=1 for FedA3I)")
    a = p.parse_args(argv)
    a.workflow_args = {}
    for item in a.set_workflow:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set-workflow expects KEY=VALUE, got {item!r}")
        a.workflow_args[key] = _parse_value(value)
    extra = {}
    for item in a.set:
        key, sep, value = item.partition("=")
        if not sep:
            p.error(f"--set expects KEY=VALUE, got {item!r}")
        extra[key] = _parse_value(value)
    from feduq.data import DataError
    from feduq.jobspec import parse_resources
    from feduq.flare.jobcheck import JobConfigError

    try:
        a.resource_spec = parse_resources(a.resources) if a.resources else None
        out = _configure_from_args(a, extra)
    except (JobConfigError, FileNotFoundError, DataError) as e:  # DataError: an unknown --task, an output folder
        p.exit(2, f"{e}\n" if str(e).startswith("configure_job.py") else f"configure_job: error: {e}\n")
    print(out)
    return 0


def _configure_from_args(a, extra: dict) -> Path:
    return configure(
        a.job,
        a.out,
        task=a.task,
        image_size=a.image_size,
        num_rounds=a.num_rounds,
        local_epochs=a.local_epochs,
        batch_size=a.batch_size,
        max_items=a.max_items,
        seed=a.seed,
        sites=a.sites.split(",") if a.sites else None,
        min_clients=a.min_clients,
        train_timeout=a.train_timeout,
        executor_args=extra,
        byoc=a.byoc,
        allow_listed=a.allow_listed,
        any_site_names=a.any_site_names,
        network=a.network,
        workflow_args=a.workflow_args,
        force=a.force,
        select_on=a.select_on,
        official_protocol=a.official_protocol,
        resource_spec=a.resource_spec,
    )


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("configure_job.py", main))
