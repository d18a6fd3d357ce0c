"""Local-only and pooled (centralised) reference training, as FLamby reports them (no FLARE).

* ``--mode local``: every site trains its own model on its own train split only and is scored on
  its own test split (the "what a site gets without federation" row).
* ``--mode pooled``: one model trains on all sites' train splits concatenated and is scored on
  every site's test split (the "what pooling the data would give" row).

Everything else is what the federated jobs use, so the rows are comparable with theirs: the same
data API, splits, transforms, network (``--network``, default the jobs' ``fedevi_unet``, with ``init_seed``),
loss (Dice + CE, as FedAvg), Adam and per-round ExponentialLR settings (:mod:`feduq.registry`),
evaluation (:func:`feduq.scores.scoring.evaluate_test`) and table (:func:`feduq.scores.tables.write_results`).
Training runs ``--rounds`` blocks of ``--local-epochs`` epochs, i.e. the same total number of
epochs as the federation, with the learning rate decayed once per block as in the federation.
After each block the model is scored on the validation split (pooled: the mean over sites of
each site's validation Dice, as the federated model selection averages over sites); the best
block's model is tested.

    feduq reference --task polyp --mode local  --image-size 128 --rounds 20 \\
        --local-epochs 2 --data-root /data/feduq --out workspaces/reference/local
    feduq reference --task polyp --mode pooled --image-size 128 --rounds 20 \\
        --local-epochs 2 --data-root /data/feduq --out workspaces/reference/pooled

Writes ``per_client_table.{md,csv}``, ``test_results_tidy.csv`` (method ``local`` or ``pooled``),
the selected model(s) ``best_model_<site|pooled>.pt`` and ``reference_log.jsonl`` (one line per
block: training loss and validation Dice) into ``--out``. A relative ``--data-root`` is resolved and checked to hold
the sites' centers first; any failure (or no table written) ends with the line ``feduq reference failed: <reason>``
and exit code 1.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
import traceback
from pathlib import Path
from feduq.cli import verb_parser

import numpy as np
import torch
from monai.data import DataLoader
from monai.losses import DiceCELoss
from torch.utils.data import ConcatDataset

from feduq.registry import COMMON_CLIENT_ARGS, NUM_ROUNDS  # noqa: E402  (the jobs' settings: one source)

from feduq import data as fdata  # noqa: E402
from feduq.core.training import AMP_OPTIONS, LocalTrainer, resolve_device, softmax_probs  # noqa: E402
from feduq.scores.scoring import evaluate_test, summarize_test_scores, validation_dice  # noqa: E402
from feduq.core.networks import build_network  # noqa: E402
from feduq.scores.tables import write_results  # noqa: E402
from feduq.scores.tables import PER_IMAGE_TEST_FILE, per_image_test_rows, write_rows  # noqa: E402
from feduq.scores.maps import image_stem  # noqa: E402
from feduq.recipes.outcome import check_data_root  # noqa: E402
from feduq.site.settings import training_loader  # noqa: E402  (the sites' training loader)

MODES = ("local", "pooled")


#: what the tool writes into --out (a user's file under one of these names is refused, --force or not)
WRITES = ("reference_log.jsonl", "best_model_*.pt", "per_client_table.csv", "per_client_table.md",
          "test_results_tidy.csv", "*/per_image_test.csv")

def train_and_select(
    model: torch.nn.Module,
    train_loader,
    val_loaders: dict,
    *,
    rounds: int,
    local_epochs: int,
    device: torch.device,
    num_classes: int,
    name: str,
    log,
    regions: dict | None = None,
    amp: str | bool = "auto",
) -> tuple[torch.nn.Module, dict]:
    """Train ``rounds`` blocks of ``local_epochs`` epochs; return the model of the best block.

    Args:
        val_loaders: site -> validation loader; the selection score is the mean of their Dice.
        regions: the task's evaluation regions (fundus disc and cup), scored as the federated sites score them.
        amp: training precision, as a site's (:func:`feduq.core.training.autocast_dtype`).
        name: label of this run in the log records (the site, or ``"pooled"``).
        log: callable taking one JSON-serialisable dict per block.

    Returns:
        (model holding the selected weights, ``{"best_round", "best_val_dice"}``).
    """
    opt = COMMON_CLIENT_ARGS
    trainer = LocalTrainer(
        model, device, lr=opt["lr"], betas=tuple(opt["betas"]), weight_decay=opt["weight_decay"], lr_gamma=opt["lr_gamma"],
        amp=amp,
    )
    loss = DiceCELoss(to_onehot_y=True, softmax=True)
    best_score, best_round, best_state = -math.inf, -1, None
    for r in range(rounds):
        stats = trainer.train_epochs(train_loader, local_epochs, loss)
        val = {s: validation_dice(trainer.model, vl, device, num_classes, regions) for s, vl in val_loaders.items()}
        score = float(np.mean(list(val.values())))
        if score > best_score:  # NaN never wins
            best_score, best_round = score, r
            best_state = copy.deepcopy(trainer.model.state_dict())
        log(
            {
                "run": name,
                "round": r,
                "train_loss": round(stats.mean_loss, 5),
                "steps": stats.num_steps,
                "train_seconds": round(stats.seconds, 3),
                "val_dice": round(score, 5),
                "val_dice_per_site": {s: round(v, 5) for s, v in val.items()},
            }
        )
    if best_state is not None:
        trainer.model.load_state_dict(best_state)
    return trainer.model, {"best_round": best_round, "best_val_dice": best_score}


def site_test_metrics(model, loader, device, num_classes: int, class_names, keep_largest_component: bool,
                      letterbox: bool = False, regions: dict | None = None, site: str | None = None,
                      per_image_file: Path | None = None, volumes: bool = False) -> dict:
    """Per-site means of the test scores, with the keys the federated ``test`` task returns (per evaluation region
    for tasks that have them, fundus disc and cup, as the federated sites; else per class). With ``per_image_file``,
    the per-image Dice and HD95 of ``site`` are written there as a federated site writes its own
    (:func:`feduq.scores.tables.per_image_test_rows`), so ``feduq compare`` pairs the reference with the methods."""
    from feduq.scores.tables import PER_CASE_TEST_FILE
    from feduq.scores.volume_scores import CaseCollector, volume_site_results

    stems: list[str] = []
    cases = CaseCollector(regions, keep_largest_component, 8, letterbox) if volumes else None  # per case, as a site

    def observe(batch, *rest):
        stems.append(image_stem(batch) or "?")
        if cases is not None:
            cases(batch, *rest)

    scores = evaluate_test(model, loader, device, num_classes, softmax_probs, keep_largest_component,
                           letterbox=letterbox, regions=regions, observe=observe)
    if cases is not None:
        metrics, rows, units = volume_site_results(cases, scores["ece"], class_names, regions, site or "?")
        if per_image_file is not None:
            write_rows(per_image_file.with_name(PER_CASE_TEST_FILE), rows)
            write_rows(per_image_file, units)
        return metrics
    if per_image_file is not None:
        write_rows(per_image_file, per_image_test_rows(site, stems, scores,
                                                       list(regions) if regions else list(class_names[1:])))
    return summarize_test_scores(scores, class_names, regions)


def parse_args(argv=None) -> argparse.Namespace:
    p = verb_parser("feduq reference", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--task", default=COMMON_CLIENT_ARGS["task"], help="FedUQ task (default %(default)s)")
    p.add_argument("--mode", choices=MODES, required=True, help="local: one model per site; pooled: one model on all")
    p.add_argument("--image-size", type=int, default=COMMON_CLIENT_ARGS["image_size"])
    p.add_argument("--rounds", type=int, default=NUM_ROUNDS, help="blocks of --local-epochs (the federation's rounds)")
    p.add_argument("--local-epochs", type=int, default=COMMON_CLIENT_ARGS["local_epochs"])
    p.add_argument("--batch-size", type=int, default=COMMON_CLIENT_ARGS["batch_size"])
    p.add_argument("--data-root", default=None, help="folder holding <task>/<center>/ (default $FEDUQ_DATA_ROOT)")
    p.add_argument("--out", type=Path, required=True, help="output folder for the table, models and log")
    p.add_argument("--force", action="store_true", help="write into an --out folder that holds files FedUQ did not "
                                                        "write (they are kept)")
    p.add_argument("--max-items", type=int, default=None, help="use only the first N items of each split")
    p.add_argument("--seed", type=int, default=COMMON_CLIENT_ARGS["seed"])
    p.add_argument("--sites", default=None, help="comma-separated subset of the task's centers (default: all)")
    p.add_argument("--device", default="auto", help="auto (CUDA if available), cpu, cuda:0, ...")
    p.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    p.add_argument("--amp", choices=list(AMP_OPTIONS), default="auto",
                   help="training precision, as the sites' amp: auto (float16 on CUDA; bfloat16 on a CPU with bfloat16 "
                        "hardware for a network without BatchNorm; else float32), off (float32), bf16")
    p.add_argument("--network", default=COMMON_CLIENT_ARGS["network"]["name"],
                   help="network name (default %(default)s, the jobs'; light: CPU smoke tests)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.local_epochs < 1:
        p.error("--rounds and --local-epochs must be >= 1")
    return args


def run(argv=None) -> int:
    """Train and test the reference; exceptions propagate (:func:`main` turns them into exit code 1)."""
    args = parse_args(argv)
    spec = fdata.get_task(args.task)
    centers = args.sites.split(",") if args.sites else list(spec.centers)
    unknown = sorted(set(centers) - set(spec.centers))
    if unknown:
        raise SystemExit(f"unknown sites {unknown} for task {args.task!r} (centers: {list(spec.centers)})")
    try:  # the network, the image size and the device checked before any data is read or anything written
        from feduq.core.networks import check_input_size
        from feduq.core.training import check_device

        if args.device != "auto":
            check_device(args.device)
        options = {k: v for k, v in COMMON_CLIENT_ARGS["network"].items() if k != "name"}
        check_input_size(build_network(args.network, spec.in_channels, len(spec.class_names), **options),
                         args.image_size)
    except ValueError as e:
        print(f"feduq reference: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.num_threads > 0:
        torch.set_num_threads(args.num_threads)
    data_root = check_data_root(fdata.resolve_data_root(args.data_root), args.task, centers)  # absolute, centers there
    from feduq.outputs import OutputFolderError, claim_output_folder, write_marker

    try:  # the output folder checked before anything is read or written (a user's file there is never replaced)
        out, keep = claim_output_folder(args.out, {"data root": data_root}, "feduq reference", force=args.force,
                                        writes=WRITES)
    except OutputFolderError as e:
        print(e, file=sys.stderr)  # "<tool>: <why>", one line
        raise SystemExit(2) from None
    device = resolve_device(args.device)
    num_classes = len(spec.class_names)
    # the jobs' preprocessing (letterbox + x / max, as the official FedEvi code)
    common = dict(data_root=data_root, image_size=args.image_size, max_items=args.max_items,
                  resize=COMMON_CLIENT_ARGS["resize"], intensity=COMMON_CLIENT_ARGS["intensity"])
    partial = [c for c in centers if fdata.annotated_classes(spec.name, data_root, c) is not None]
    if partial:
        raise SystemExit(f"site {partial[0]!r} annotates a subset of task {spec.name!r}'s labels; the local and pooled "
                         "references do not train with the marginal loss yet (the federated jobs do)")
    splits = {c: {s: fdata.get_dataset(args.task, c, s, **common) for s in ("train", "val", "test")} for c in centers}
    for c in centers:
        if len(splits[c]["train"]) == 0 or len(splits[c]["val"]) == 0:
            raise SystemExit(f"site {c!r}: the training and validation splits must not be empty")
    val_loaders = {c: DataLoader(splits[c]["val"], batch_size=1) for c in centers}
    test_loaders = {c: DataLoader(splits[c]["test"], batch_size=1) for c in centers}

    log_path = out / "reference_log.jsonl"
    log_path.write_text("")

    def log(record: dict) -> None:
        line = json.dumps(record)
        print("REFERENCE_TRAIN " + line, flush=True)
        with open(log_path, "a") as f:
            f.write(line + "\n")

    def new_model() -> torch.nn.Module:
        torch.manual_seed(args.seed)  # as a site: same init (init_seed) and same RNG stream per run
        options = {k: v for k, v in COMMON_CLIENT_ARGS["network"].items() if k != "name"}
        return build_network(args.network, spec.in_channels, num_classes, **options, init_seed=args.seed)

    regions = spec.eval_regions or None  # fundus: disc and cup, as the federated sites select and test
    volumes = spec.kind == "3d"
    train_args = dict(
        rounds=args.rounds, local_epochs=args.local_epochs, device=device, num_classes=num_classes, log=log,
        regions=regions, amp=AMP_OPTIONS[args.amp],
    )
    keep_lcc = COMMON_CLIENT_ARGS["keep_largest_component"]
    site_metrics, selection = {}, {}
    start = time.perf_counter()
    if args.mode == "local":
        for c in centers:
            model = new_model()
            loader = training_loader(splits[c]["train"], args.batch_size, args.seed, device)
            model, selection[c] = train_and_select(model, loader, {c: val_loaders[c]}, name=c, **train_args)
            torch.save(model.state_dict(), out / f"best_model_{c}.pt")
            site_metrics[c] = site_test_metrics(model, test_loaders[c], device, num_classes, spec.class_names, keep_lcc,
                                              letterbox=COMMON_CLIENT_ARGS["resize"] == "letterbox", regions=regions,
                                              site=c, per_image_file=out / c / PER_IMAGE_TEST_FILE, volumes=volumes)
    else:
        model = new_model()
        pooled = ConcatDataset([splits[c]["train"] for c in centers])
        loader = training_loader(pooled, args.batch_size, args.seed, device)
        model, selection["pooled"] = train_and_select(model, loader, val_loaders, name="pooled", **train_args)
        torch.save(model.state_dict(), out / "best_model_pooled.pt")
        for c in centers:
            site_metrics[c] = site_test_metrics(model, test_loaders[c], device, num_classes, spec.class_names, keep_lcc,
                                              letterbox=COMMON_CLIENT_ARGS["resize"] == "letterbox", regions=regions,
                                              site=c, per_image_file=out / c / PER_IMAGE_TEST_FILE, volumes=volumes)

    note = (
        f"Reference `{args.mode}`: {args.rounds} x {args.local_epochs} epochs at {args.image_size} px, seed {args.seed}; "
        "selected by validation Dice: "
        + ", ".join(f"{k} round {v['best_round']} ({v['best_val_dice']:.4f})" for k, v in selection.items())
        + "."
    )
    paths = write_results(site_metrics, out, method=args.mode, note=note)
    write_marker(out, "feduq reference", exclude=keep)
    if not (out / "per_client_table.csv").is_file():
        raise RuntimeError(f"no results table was written in {out}")
    print(f"\n{paths['markdown'].read_text()}\nFedUQ reference results written to {paths['markdown']} "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    return 0


def main(argv=None) -> int:
    """:func:`run`, with any failure reported as one last line ``feduq reference failed: <reason>`` and code 1."""
    try:
        return run(argv)
    except SystemExit as e:  # argparse (code 2) and the checks above (a message)
        if isinstance(e.code, int) or e.code is None:
            raise
        reason = str(e.code)
    except fdata.DataError as e:
        reason = str(e)
    except Exception as e:  # noqa: BLE001 -- the traceback first, then the one-line reason
        traceback.print_exc()
        reason = f"{type(e).__name__}: {e}"
    print(f"feduq reference failed: {reason}", file=sys.stderr, flush=True)
    return 1


if __name__ == "__main__":
    from feduq.cli import run_main

    sys.exit(run_main("feduq reference", main))
