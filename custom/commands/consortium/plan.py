"""Make a volume federation's nnU-Net plan from its sites' fingerprints, federated: no voxel leaves a site.

Each training site (the task's sites but the held-out ones) counts its training cases, then fingerprints them as
nnU-Net's ``DatasetFingerprintExtractor`` does (its reader, crop and foreground sampling with the pooled case
count) and sends only the numbers FedUQ's privacy ledger declares for this job: per case its spacing, shape after
cropping and relative crop size, per channel the count, mean, sum of squared deviations, minimum, maximum and 2001
quantiles of its foreground samples. The server merges them into nnU-Net's ``dataset_fingerprint.json`` and runs
nnU-Net's planner once (:mod:`feduq.nnunet.federated_plans`, :mod:`feduq.flare.planning`). Written:

* ``--out`` (e.g. ``plans.json``): nnU-Net's plan with its ``3d_fullres`` configuration, what ``python -m feduq.run
  <method> --task TASK --configuration 3d_fullres --plans plans.json`` trains with;
* ``<out stem>_slim.json`` beside it: the same plan with the slim architecture (CPU demonstrations and tests; not
  nnU-Net's network) and ``<out stem>_fingerprint.json``: the merged fingerprint.

    feduq plan --task my_task.json --data-root /data --out plans.json

It runs FLARE's simulator here (``-w``: its workspace). For real sites, ``--export-to DIR`` writes the job folder to
submit to a POC or provisioned project (each site's data root from its ``local/feduq_site.json``); the plan is then
in the server's run folder, ``plans/``.
"""

from __future__ import annotations

import argparse
import shutil
import sys
from pathlib import Path
from feduq.cli import verb_parser


def main(argv=None) -> int:
    p = verb_parser("feduq plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, help="the task file (nnU-Net's dataset.json with a \"feduq\" object)")
    p.add_argument("--out", type=Path, help="the plans file to write (not an existing file)")
    p.add_argument("--data-root", help="the sites' data root (simulator; default $FEDUQ_DATA_ROOT)")
    p.add_argument("-w", "--workspace", type=Path, help="the simulator's workspace (default: a temporary folder)")
    p.add_argument("--foreground-voxels", type=float, default=None,
                   help="foreground voxels sampled over the federation (default nnU-Net's 10e7)")
    p.add_argument("--export-to", type=Path, help="write the FLARE job folder into this folder instead of running it")
    p.add_argument("--force", action="store_true", help="replace existing plan files, or write into an output folder "
                                                        "that holds files FedUQ did not write (they are kept)")
    a = p.parse_args(argv)
    from feduq.data import DataError, get_task
    from feduq.outputs import OutputFolderError, check_output_file, check_output_folder, user_files, write_marker
    from feduq.recipes.fingerprint import run_in_workspace
    from feduq.recipes.jobspec import write_job
    from feduq.recipes.planning import JOB_NAME, check_plan_sites, plan_job, run_plan

    tool = "feduq plan"
    try:
        inputs = {"task file": a.task, "data root": a.data_root}
        job_args = {} if a.foreground_voxels is None else {"foreground_voxels": a.foreground_voxels}
        if a.export_to is not None:
            export = check_output_folder(a.export_to, inputs, tool, force=a.force)
            files = plan_job(get_task(a.task).name, **job_args)
            keep = user_files(export)
            write_job(files, export / JOB_NAME)
            write_marker(export, tool, exclude=keep)
            print(f"wrote the job folder {export / JOB_NAME}; submit it: the plan is then in the server's run folder, "
                  "plans/plans.json")
            return 0
        if a.out is None:
            raise DataError("--out is needed (the plans file to write)")
        outs = {"plan": a.out, "slim": a.out.with_name(a.out.stem + "_slim.json"),
                "fingerprint": a.out.with_name(a.out.stem + "_fingerprint.json")}
        outs = {k: check_output_file(v, inputs, tool, force=a.force) for k, v in outs.items()}
        ws = check_output_folder(a.workspace, inputs, tool, force=a.force) if a.workspace else None
        spec = get_task(a.task)
        plan_job(spec.name, **job_args)  # DataError (a 2D task) before anything runs
        check_plan_sites(spec.name, a.data_root)  # a volume without a spacing: one line naming it, nothing written
        outs["plan"].parent.mkdir(parents=True, exist_ok=True)  # before the run, not after it
        found = run_in_workspace(spec.name, a.data_root, ws, tool,
                                 lambda root, w: run_plan(spec.name, root, w, **job_args))
        for key, name in (("plan", "plans.json"), ("slim", "plans_slim.json"), ("fingerprint",
                                                                                "dataset_fingerprint.json")):
            shutil.copyfile(found / name, outs[key])
    except (DataError, OutputFolderError, ValueError, OSError) as e:
        print(str(e) if str(e).startswith(tool) else f"{tool}: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {outs['plan']} (nnU-Net's 3d_fullres plan of the federation), {outs['slim'].name} (slim: CPU "
          f"demonstrations) and {outs['fingerprint'].name}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq plan", main))
