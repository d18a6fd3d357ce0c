"""``feduq virtual``: a job's rounds over many virtual sites in one process (:mod:`feduq.recipes.virtual`, whose
docstring says what runs and what FLARE adds).

    feduq virtual /tmp/feda3i-50 --data-root /tmp/noisy-isic --out /tmp/vf/feda3i
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path

from feduq.cli import verb_parser
from feduq.recipes.virtual import CHECKPOINT, _read_checkpoint, run


def main(argv=None) -> int:
    ap = verb_parser("feduq virtual", description=__doc__.split("\n\n")[0])
    ap.add_argument("job", type=Path, help="a configured job folder (feduq configure) whose controller is FedUQ's")
    ap.add_argument("--data-root", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--num-threads", type=int, default=0, help="torch threads (0 = the job's setting)")
    ap.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                         "write (they are kept)")
    ap.add_argument("--resume", action="store_true", help=f"continue the run in --out from its {CHECKPOINT} (the "
                                                          "round after the last completed one)")
    args = ap.parse_args(argv)
    from feduq.outputs import (OUTPUT_MARKER, OutputFolderError, check_output_folder, claim_output_folder,
                               edited_since_marker, refuse_clashes, user_files, write_marker)

    if not (args.job / "meta.json").is_file():
        print(f"feduq virtual: error: {args.job} is not a job folder (no meta.json); make one with "
              f"feduq configure", file=sys.stderr)
        return 2
    inputs = {"job": args.job, "data root": args.data_root}
    checkpoint = None
    writes = ("log.txt", CHECKPOINT, "FL_global_model.pt", "state.json", "per_client_table.csv", "per_client_table.md",
              "test_results_tidy.csv", "sites/*")
    try:
        if args.resume:  # the run's own folder: the input rules only, nothing removed
            args.out = check_output_folder(args.out, inputs, "feduq virtual", force=True)
            if not (args.out / CHECKPOINT).is_file():
                raise OutputFolderError(f"feduq virtual: --resume: no {CHECKPOINT} in {args.out} (no round "
                                        "of a run there finished); run without --resume")
            if not (args.out / OUTPUT_MARKER).is_file():
                raise OutputFolderError(f"feduq virtual: --resume: {args.out} is not a folder FedUQ's "
                                        f"feduq virtual wrote (no {OUTPUT_MARKER}); resume only its own runs")
            keep = user_files(args.out)
            theirs = keep + edited_since_marker(args.out)
            refuse_clashes(args.out, [f for f in theirs if f != CHECKPOINT], writes, "feduq virtual")
            try:  # read (weights only; a plain pickle never unpickled) and checked before anything is written, and
                # before the checkpoint's own clash check, so a truncated or foreign checkpoint is named as that
                checkpoint = _read_checkpoint(args.job, args.data_root.resolve(), args.out)
            except SystemExit as e:
                raise OutputFolderError(f"feduq virtual: {e.code}") from None
            refuse_clashes(args.out, theirs, writes, "feduq virtual")
        else:
            args.out, keep = claim_output_folder(args.out, inputs, "feduq virtual", force=args.force,
                                                 writes=writes)
    except OutputFolderError as e:
        print(e, file=sys.stderr)  # "<tool>: <why>", one line
        return 2
    logging.basicConfig(level=logging.WARNING)
    with open(args.out / "log.txt", "a" if args.resume else "w") as f:
        def log(msg):
            line = f"{time.strftime('%H:%M:%S')} {msg}"
            print(line, flush=True)
            f.write(line + "\n")
            f.flush()

        try:
            run(args.job, args.data_root.resolve(), args.out, args.num_threads, log, resume=args.resume,
                checkpoint=checkpoint)
        except SystemExit as e:
            if isinstance(e.code, str):
                print(f"ERROR: {e.code}", file=sys.stderr)
                return 2
            raise
        finally:
            write_marker(args.out, "feduq virtual", exclude=keep)
    return 0


