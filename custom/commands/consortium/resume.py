"""Resume a FedUQ job from a server checkpoint (e.g. after the server was killed mid-job).

NVFlare 2.9 does not snapshot a running job's server state. FedUQ checkpoints carry what a
restart needs: the global model, the last completed round and the method's own state (FedEvi's β)
in the checkpoint's meta. This tool writes a copy of the job whose persistor starts from the
checkpoint; the job's workflow then continues at the next round and stops at the original
``num_rounds``. Sites need nothing: each restores its learning-rate schedule from the round index.
The best global model so far (``best_FL_global_model.pt`` and ``best_model_selection.json`` beside
the checkpoint) is carried over too, so the final test scores the best model of the whole job.

    feduq resume fedevi --checkpoint WS/server/simulate_job/app_server/FL_global_model.pt \\
        -o workspaces/jobs/fedevi-resumed
    nvflare simulator workspaces/jobs/fedevi-resumed -w WS2 -t 4        # or: nvflare job submit -j ...

The checkpoint path is a path on the **server** machine (it never reaches a site). It is loaded with
``weights_only=True`` (:func:`feduq.core.checkpoints.load_checkpoint`): a file that would need code to load is refused.
The output folder is checked first (:func:`feduq.outputs.check_output_folder`): never the job, the checkpoint's
folder or a folder around them; an existing one only if a FedUQ tool made it (or ``--force``). Every refusal is one
line naming the file or folder, exit 2.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from feduq.cli import verb_parser
from feduq.recipes.jobspec import job_folder


def checkpoint_state(checkpoint: Path) -> dict:
    """The resume-relevant meta of a FedUQ checkpoint (last completed round, FedEvi β, ...).

    Raises:
        ValueError: the file is missing, would need code to load (:class:`feduq.core.checkpoints.CheckpointError`), or is
            not a FedUQ/NVFlare PyTorch checkpoint with a completed round.
    """
    from feduq.core.checkpoints import load_checkpoint

    data = load_checkpoint(checkpoint, what="checkpoint")
    meta = data.get("meta_props") if isinstance(data, dict) else None
    if not meta or "feduq_last_completed_round" not in meta:
        raise ValueError(f"{checkpoint} has no 'feduq_last_completed_round' in its meta_props; not a FedUQ checkpoint")
    return meta


def check_checkpoint_fits(job_dir: Path, checkpoint: Path, meta: dict) -> None:
    """The checkpoint belongs to this job: the same method (the server part the checkpoint records, or for an older
    checkpoint the method's state, e.g. FedEvi's β) and a model with every key and shape of the job's network.

    Raises:
        ValueError: naming the checkpoint's and the job's method, or the first mismatching key.
    """
    from feduq.recipes import jobspec
    from feduq.common.wire import FedUQMetaKey
    from feduq.jobs.jobcheck import JobConfigError, instantiate
    from feduq.common.classpath import current_path
    from feduq.parts.server import part_name
    from feduq.recipes.addons import initial_checkpoint

    files = jobspec.read_job_files(job_dir)
    workflow = json.loads(files[jobspec.SERVER])["workflows"][0]
    try:  # the job's round workflow (a FedUQ class; nothing else is constructed) holds the method's server part
        server = getattr(instantiate(workflow, "server workflow"), "server", None)
    except JobConfigError as e:
        raise ValueError(str(e)) from None
    if server is not None:
        part = type(server)
        recorded = meta.get(FedUQMetaKey.SERVER_PART)
        if recorded is not None and current_path(recorded) != part_name(part):
            raise ValueError(f"{checkpoint} was written by {recorded}; the job {job_dir} runs {part_name(part)}: "
                             "resume a job with the checkpoint of its own method")
        if recorded is None and part.state_key and part.state_key not in meta:
            raise ValueError(f"{checkpoint} has no {part.state_key!r} in its meta: not a checkpoint of the job's method "
                             f"{part_name(part)}")
    initial_checkpoint(files, str(checkpoint), what="checkpoint")
    best = checkpoint.parent / "best_FL_global_model.pt"
    if best.is_file():  # carried over as the resumed run's best so far: it must be a model of this job's network too
        from feduq.core.checkpoints import CheckpointError, load_checkpoint

        what = "the best model beside the checkpoint"  # each message names it once: "<what> <path>: <why>"
        try:  # read (weights only) here, so that a file that is no torch model is named once, not in two prefixes
            load_checkpoint(best, what=what)
        except CheckpointError as e:
            raise ValueError(str(e)) from None
        initial_checkpoint(files, str(best), what=what)


def resume(job_dir: Path, checkpoint: Path, out_dir: Path, force: bool = False) -> dict:
    """Copy ``job_dir`` to ``out_dir`` with the persistor starting from ``checkpoint``; return its meta.

    Raises:
        FileNotFoundError: ``job_dir`` is not a job folder.
        ValueError: ``checkpoint`` is a folder (a checkpoint file is expected); as :func:`checkpoint_state`, or :class:`feduq.outputs.OutputFolderError` for an output that is,
            contains or lies inside the job or the checkpoint's folder, or holds files no FedUQ tool wrote (without
            ``force``); nothing is written or removed then.
    """
    from feduq.outputs import check_output_folder, staged_folder

    job_dir, checkpoint = Path(job_dir), Path(checkpoint).resolve()
    if not (job_dir / "meta.json").is_file() or not (job_dir / "app" / "config").is_dir():
        raise FileNotFoundError(f"{job_dir} is not a FedUQ job folder (meta.json and app/config/ expected)")
    if checkpoint.is_dir():  # before the output check, which keeps clear of the checkpoint's folder
        there = checkpoint / "FL_global_model.pt"
        hint = f"{there}, which is there" if there.is_file() else "FL_global_model.pt in the server's app_server/ folder"
        raise ValueError(f"--checkpoint {checkpoint} is a folder, not a checkpoint file: expected the server's "
                         f"checkpoint file, e.g. {hint}")
    out_dir = check_output_folder(out_dir, {"job": job_dir, "checkpoint's folder": checkpoint.parent},
                                  "feduq resume", force=force)
    meta = checkpoint_state(checkpoint)
    check_checkpoint_fits(job_dir, checkpoint, meta)
    with staged_folder(out_dir, overwrite=True, what="feduq resume", marker="feduq resume") as stage:
        _write_resumed(job_dir, checkpoint, stage, out_dir.name)
    return meta


def _write_resumed(job_dir: Path, checkpoint: Path, out_dir: Path, name: str) -> None:
    shutil.copytree(job_dir, out_dir, dirs_exist_ok=True)
    server_path = out_dir / "app" / "config" / "config_fed_server.json"
    server = json.loads(server_path.read_text())
    for comp in server["components"]:
        if comp["id"] == "persistor":
            comp["args"]["source_ckpt_file_full_name"] = str(checkpoint)
        if comp["id"] == "model_selector" and comp["path"].endswith("BestModelSelector"):
            # the interrupted run's best model and its validation metric set the bar for the resumed rounds
            comp["args"]["resume_from"] = str(checkpoint.parent)
    server_path.write_text(json.dumps(server, indent=2) + "\n")
    job_meta_path = out_dir / "meta.json"
    job_meta = json.loads(job_meta_path.read_text())
    job_meta["name"] = name
    job_meta_path.write_text(json.dumps(job_meta, indent=2) + "\n")


def main(argv=None) -> int:
    p = verb_parser("feduq resume", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("job", type=job_folder, help="the job that was interrupted (same settings): a job folder or a registered method")
    p.add_argument("--checkpoint", type=Path, required=True, help="the server's FL_global_model.pt")
    p.add_argument("-o", "--out", type=Path, required=True, help="the resumed job's folder (made afresh)")
    p.add_argument("--force", action="store_true", help="replace an output folder that holds files no FedUQ tool wrote")
    a = p.parse_args(argv)
    try:
        meta = resume(a.job, a.checkpoint, a.out, force=a.force)
    except (ValueError, FileNotFoundError) as e:
        print(str(e) if str(e).startswith("feduq resume") else f"feduq resume: error: {e}", file=sys.stderr)
        return 2
    state = {k: v for k, v in meta.items() if k.startswith(("feduq_", "fedevi_"))}
    print(f"{a.out}: resumes after round {meta['feduq_last_completed_round']}; state {json.dumps(state)}")
    return 0


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq resume", main))
