"""Compute a declared task's CT window from its sites' intensity fingerprints, federated, and write it into the task
file: nnU-Net's CT normalisation (clip to the 0.5 / 99.5 percentiles of the foreground intensities, then z-score with
their mean and standard deviation) without any site showing another its voxels.

Every ``"CT"`` channel of the task file without a window (a channel named ``CT`` without a ``feduq.normalization``
entry, or ``"normalization": {"0": "CT"}``) is fingerprinted: each training site (the task's sites but the held-out
ones) samples up to ``--voxels-per-case`` foreground voxels (label > 0) of each of its cases and sends FLARE's
federated statistics workflow only their count, sum, mean, standard deviation and a t-digest for the two
percentiles (FLARE's privacy filter refuses a site with fewer than ``--min-count`` samples); the server combines them
(:mod:`feduq.recipes.fingerprint`). The output task file is the input with ``{"scheme": "CT", "window": [p0.5,
p99.5], "mean": m, "std": s}`` for those channels; train with it (``feduq run <method> --task OUT``).

    feduq fingerprint --task my_ct_task.json --data-root /data --out my_ct_task.fp.json

It runs FLARE's simulator here (``-w``: its workspace). For real sites, ``--export-to DIR`` writes the job folder to
submit to a POC or provisioned project (each site's data root from its ``local/feduq_site.json``); then
``--from-stats <server run folder>/statistics/intensity_fingerprint.json --out ...`` writes the task file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from feduq.cli import verb_parser


def read_stats(path: Path) -> dict:
    """The server's statistics file (JSON object). Raises ValueError naming the file and the cause."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ValueError(f"--from-stats {path}: cannot read it ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ValueError(f"--from-stats {path}: not a text file (FLARE's statistics file is JSON)") from None
    try:
        stats = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--from-stats {path}: not FLARE's JSON statistics file (invalid JSON: {e})") from None
    if not isinstance(stats, dict):
        raise ValueError(f"--from-stats {path}: not FLARE's statistics file (a JSON {type(stats).__name__}, "
                         "not an object of features)")
    return stats


def main(argv=None) -> int:
    p = verb_parser("feduq fingerprint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", required=True, help="the task file (nnU-Net's dataset.json with a \"feduq\" object)")
    p.add_argument("--out", type=Path, help="the task file to write, with the windows (not an existing file)")
    p.add_argument("--data-root", help="the sites' data root (simulator; default $FEDUQ_DATA_ROOT)")
    p.add_argument("-w", "--workspace", type=Path, help="the simulator's workspace (default: a temporary folder)")
    p.add_argument("--voxels-per-case", type=int, default=10000, help="foreground voxels sampled per case")
    p.add_argument("--min-count", type=int, default=10, help="FLARE's privacy filter: fewest samples a site may send")
    p.add_argument("--export-to", type=Path, help="write the FLARE job folder into this folder instead of running it")
    p.add_argument("--from-stats", type=Path, help="the server's statistics file of a job run elsewhere")
    a = p.parse_args(argv)

    from feduq.data import DataError, get_task
    from feduq.outputs import OutputFolderError, check_output_file, check_output_folder, user_files, write_marker
    from feduq.recipes.fingerprint import JOB_NAME, STATS_FILE, fingerprint_job, run_fingerprint, \
        run_in_workspace, window_declaration, write_declaration
    from feduq.recipes.jobspec import write_job

    tool = "feduq fingerprint"
    try:
        inputs = {"task file": a.task, "data root": a.data_root, "statistics file": a.from_stats}
        if a.export_to is not None:  # every output checked before anything runs or is written
            export = check_output_folder(a.export_to, inputs, tool)
        else:
            if a.out is None:
                raise DataError("--out is needed (the task file with the windows)")
            out = check_output_file(a.out, inputs, tool)
            ws = check_output_folder(a.workspace, inputs, tool) if a.workspace else None
        spec = get_task(a.task)
        job_args = dict(min_count=a.min_count, voxels_per_case=a.voxels_per_case)
        files = fingerprint_job(spec.name, **job_args)  # DataError: nothing to fingerprint
        if a.export_to is not None:
            keep = user_files(export)
            write_job(files, export / JOB_NAME)
            write_marker(export, tool, exclude=keep)
            print(f"wrote the job folder {export / JOB_NAME}; submit it, then: --from-stats <server run folder>/"
                  f"{STATS_FILE} --out ...")
            return 0
        if a.from_stats is not None:
            stats = read_stats(a.from_stats)
        else:
            stats = run_in_workspace(spec.name, a.data_root, ws, tool,
                                     lambda root, w: run_fingerprint(spec.name, root, w, **job_args))
        try:
            raw = window_declaration(spec.name, stats)
        except ValueError as e:
            raise ValueError(f"--from-stats {a.from_stats}: {e}" if a.from_stats is not None else str(e)) from None
        write_declaration(raw, out)
    except (DataError, OutputFolderError, ValueError, OSError) as e:
        print(str(e) if str(e).startswith(tool) else f"{tool}: error: {e}", file=sys.stderr)
        return 2
    for c, entry in raw["feduq"]["normalization"].items():
        print(f"channel {c} ({spec.channel_names[int(c)]}): {entry}")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
