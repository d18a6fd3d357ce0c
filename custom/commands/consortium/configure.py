"""Copy a FedUQ job folder with changed settings (image size, rounds, sites, ...).

The committed ``jobs/<method>`` folders carry the papers' settings. This tool writes a variant
without editing them, e.g. a CPU-sized run or a federation with other site names::

    feduq configure fedevi -o workspaces/jobs/fedevi-128 \\
        --image-size 128 --num-rounds 20
    nvflare simulator workspaces/jobs/fedevi-128 -w workspaces/fedevi-128

    # POC / production with differently named sites, shipping FedUQ inside the job (BYOC):
    feduq configure fedevi -o /tmp/fedevi --sites site-a,site-b --any-site-names --byoc

    # sites that refuse custom code and allow-list FedUQ's classes (feduq prepare-site): no app/custom
    feduq configure fedevi -o /tmp/fedevi --allow-listed

Options that are not given keep the job's value. ``--set key=value`` changes any executor argument
(value parsed as JSON when possible). The result is validated before it is written (unknown keys with
the closest valid one, values out of range, image sizes the network cannot take, sites that are not
centers of the task); an invalid job is not written and the tool exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from feduq.cli import verb_parser

from feduq.recipes.job_folders import configure  # noqa: F401 (tests and users call it from here too)
from feduq.recipes.jobspec import job_folder
from feduq.common.checks import site_names
from feduq.recipes.settings import SELECTION_METRICS


def _parse_value(text: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main(argv=None) -> int:
    p = verb_parser("feduq configure", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", help="a registered method (its job as FedUQ exports it, e.g. fedevi) or a job folder")
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
    p.add_argument("--sites", type=site_names, help="comma-separated site names (default: the task's centers)")
    p.add_argument("--min-clients", type=int, help="sites that must answer a round (default: all)")
    p.add_argument("--train-timeout", type=int, help="seconds to wait for a site's answer (0 = forever)")
    p.add_argument("--network", help="network name: fedevi_unet (the papers') or light (CPU smoke tests)")
    p.add_argument("--configuration", choices=["2d", "3d_fullres"],
                   help="how a volume task's sites train: 2d (axial slices) or 3d_fullres (nnU-Net's 3D network of "
                        "--plans); default the task file's feduq.configuration, else 2d")
    p.add_argument("--plans", help="3d_fullres: the federation's nnU-Net plans file (feduq plan)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any executor argument")
    code = p.add_mutually_exclusive_group()
    code.add_argument("--byoc", action="store_true", help="copy FedUQ's code into app/custom (bring-your-own-code)")
    code.add_argument("--allow-listed", action="store_true",
                      help="drop app/custom, so the job is not bring-your-own-code: for sites whose policy refuses "
                           "custom code; each site must allow-list FedUQ's classes (feduq prepare-site)")
    p.add_argument("--any-site-names", action="store_true",
                   help="allow --sites that are not centers of the task (each such site names its center in "
                        "its local/feduq_site.json: feduq prepare-site --center)")
    p.add_argument("--select-on", choices=SELECTION_METRICS,
                   help="the global model the final test scores: best mean validation Dice (the jobs' default) or "
                        "lowest mean validation Dice loss (the official FedEvi code's selection)")
    p.add_argument("--official-protocol", action="store_true",
                   help="the official FedEvi code's protocol: select on val_loss, plain resize and x/max, test at the "
                        "training resolution with 4-connected components, a test every round, FedAvg's Dice loss")
    p.add_argument("--resources", action="append", default=[], metavar="SITE=GPUS[:GiB]",
                   help="FLARE resource_spec of a site: GPUs it needs (0: CPU) and GiB per GPU, e.g. Kvasir-SEG=1:16")
    p.add_argument("--test-sites", metavar="per-center|SITE,SITE,...",
                   help="the sites that run the final test (default: every site); per-center: every real site and "
                        "one virtual site <center>-p<k>of<K> per center, which all test on the center's test list")
    p.add_argument("--set-workflow", action="append", default=[], metavar="KEY=VALUE",
                   help="any argument of the training workflow (e.g. warmup_rounds=1 for FedA3I)")
    a = p.parse_args(argv)
    a.job = job_folder(a.job)
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
    from feduq.recipes.settings import parse_resources
    from feduq.jobs.jobcheck import JobConfigError

    try:
        a.resource_spec = parse_resources(a.resources) if a.resources else None
        kept = _kept_files(a.job, a.out) if a.force else []
        out = _configure_from_args(a, extra)
    except (JobConfigError, FileNotFoundError, DataError) as e:  # DataError: an unknown --task, an output folder
        p.exit(2, f"{e}\n" if str(e).startswith("feduq configure") else f"feduq configure: error: {e}\n")
    if kept:  # on stderr: stdout is the job folder alone (scripts read it)
        shown = ", ".join(kept[:5]) + (f" and {len(kept) - 5} more" if len(kept) > 5 else "")
        print(f"feduq configure: kept {len(kept)} file(s) in {out} that it does not write: {shown}", file=sys.stderr)
    print(out)
    return 0


def _kept_files(job: Path, out: Path) -> list[str]:
    """The files of an existing output folder that ``--force`` keeps (:func:`feduq.outputs.user_files`): not listed
    by FedUQ's manifest, or, under an older manifest without a file list, changed since it or under a name a job
    folder does not have (the job's own files and :data:`feduq.outputs.JOB_FOLDER_LAYOUT`)."""
    import glob

    from feduq.outputs import JOB_FOLDER_LAYOUT, OUTPUT_MARKER, user_files

    out = Path(out).expanduser()
    if not out.is_dir() or not Path(job).is_dir():
        return []
    own = [glob.escape(p.relative_to(job).as_posix()) for p in Path(job).rglob("*")
           if p.is_file() and p.name != OUTPUT_MARKER]
    return user_files(out, writes=[*own, *JOB_FOLDER_LAYOUT])


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
        sites=a.sites,
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
        configuration=a.configuration,
        plans=a.plans,
        official_protocol=a.official_protocol,
        resource_spec=a.resource_spec,
        test_sites=None if a.test_sites is None else (a.test_sites if a.test_sites == "per-center"
                                                      else a.test_sites.split(",")),
    )


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq configure", main))
