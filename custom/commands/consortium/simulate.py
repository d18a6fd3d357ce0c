"""Run a FedUQ job in the NVFlare simulator and say whether it worked (the one way FedUQ tools run the simulator).

    feduq simulate fedevi -w workspaces/fedevi --data-root /data/feduq
    FEDUQ_DATA_ROOT=/data/feduq feduq simulate fedevi -w workspaces/fedevi [--log FILE]

Before FLARE starts, the data root (``--data-root``, else ``$FEDUQ_DATA_ROOT``) is resolved to an absolute path
(each simulated site runs in its own workspace folder, where a relative path means nothing) and checked to hold the
job's centers (``<root>/<task folder>/<center>/``); a missing center stops here with its name. The workspace is
then made afresh, FedUQ is allow-listed and the absolute root is written into the sites' ``local/feduq_site.json``
(``feduq prepare-site``), and FLARE 2.9's simulator runs the job (:mod:`feduq.recipes.simulation`: the entry point
FLARE's ``SimEnv`` runs; the ``nvflare simulator`` command is deprecated).

The workspace is removed first only when that is safe (:func:`feduq.outputs.check_output_folder`): never when it is,
contains or lies inside the job or the data root, and when it is not empty only if FedUQ wrote every file in it (the
manifest written at the end of each run); FLARE's simulator empties its workspace, so a file of the user's there is
refused even with ``--force``: the tool stops with one line naming it. ``--log`` is never the job's or the data root's
file, nor an existing file without ``--force``.

The terminal shows one line per round (round r/R, the sites' mean validation Dice of the global model, the aggregation
weights, elapsed time and ETA; :class:`feduq.recipes.progress.RoundProgress`) and the per-client table at the end; FLARE's
whole output goes to ``WS/simulator.log`` (``--log`` elsewhere, ``-v`` to the terminal as well).

The simulator's exit code alone does not say that the job finished, so the outcome is read from the workspace
(:func:`feduq.recipes.outcome.simulator_outcome`): the exit code is 0 only when the per-client table was written and the
server logged no fatal error; otherwise the server's reason and each failing site's first error are printed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from feduq.cli import verb_parser
from feduq.recipes.jobspec import job_folder

from feduq.data import DATA_ROOT_ENV, DataError
from feduq.outputs import OutputFolderError
from feduq.jobs.jobcheck import JobConfigError
from feduq.recipes.simulation import simulate


def main(argv=None) -> int:
    p = verb_parser("feduq simulate", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", type=job_folder, help="a registered method (e.g. fedevi: its job as FedUQ exports it) or a job folder")
    p.add_argument("-w", "--workspace", type=Path, required=True,
                   help="simulator workspace (made afresh; an existing one only if a FedUQ tool made it)")
    p.add_argument("--force", action="store_true",
                   help="replace an existing --log file")
    p.add_argument("--data-root", help=f"folder holding <task>/<center>/ (default ${DATA_ROOT_ENV})")
    p.add_argument("-t", "--threads", type=int, help="simulator threads (default: one per site)")
    p.add_argument("--log", type=Path, help="the file for the simulator's whole output (default WS/simulator.log)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the simulator's whole output (default: one line per round, the summary at the end)")
    a = p.parse_args(argv)
    if a.threads is not None and a.threads < 1:  # FLARE would start no site and wait
        print(f"feduq simulate: error: -t/--threads {a.threads}: expected an integer >= 1 (sites run at once)",
              file=sys.stderr)
        return 2
    try:
        outcome = simulate(a.job, a.workspace, a.data_root, threads=a.threads, log=a.log, force=a.force,
                           verbose=a.verbose)
    except OutputFolderError as e:  # the workspace refused before anything ran (the message names the tool)
        print(str(e) if str(e).startswith("feduq simulate:") else f"feduq simulate: {e}", file=sys.stderr)
        return 2
    except (DataError, FileNotFoundError, JobConfigError) as e:
        print(f"feduq simulate: {e}", file=sys.stderr)
        return 1
    if outcome.ok and outcome.table is not None and outcome.table.with_suffix(".md").is_file():
        print(outcome.table.with_suffix(".md").read_text().rstrip() + "\n")
    print(outcome.summary())
    if outcome.ok:
        ws = a.workspace.resolve()
        print(f"Models: {ws}/server/simulate_job/app_server/ ; logs: {ws}/server/log.txt, {ws}/<site>/log.txt")
        return 0
    print(f"Simulator output: {a.log or a.workspace.resolve() / 'simulator.log'}")
    return 1


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq simulate", main))
