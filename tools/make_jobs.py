#!/usr/bin/env python3
"""Generate the committed ``jobs/<method>/`` folders from one spec.

Job folders only wire components with arguments; everything they share lives here, so two jobs
can never drift apart by accident. ``tests/test_jobs.py`` checks that the committed folders equal
what this script generates. Run after changing a default::

    python tools/make_jobs.py            # rewrite jobs/
    python tools/make_jobs.py --check    # exit 1 if jobs/ is stale
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
JOBS_DIR = REPO / "jobs"

def method_sites(method: str) -> list[str]:
    """The job's sites: the method's own list (virtual sites) or its task's centers."""
    return list(METHODS[method].get("sites") or task_settings(method_task(method))["sites"])


def task_settings(task: str) -> dict:
    """Sites (= centers), input channels and classes of a task, from the FedUQ data registry."""
    from feduq.data import get_task

    t = get_task(task)
    return {"sites": list(t.centers), "in_channels": t.in_channels, "num_classes": len(t.class_names)}


# Executor arguments a task changes from the polyp defaults, per executor class (applied by
# configure_job.py --task before any --set). FedEvi paper, "Implemental Details": λ = 1e-5 for fundus
# (1e-2 for polyp and prostate; FedEvi official code).
TASK_EXECUTOR_DEFAULTS: dict[str, dict[str, dict]] = {
    "fundus": {"FedEviExecutor": {"kl_weight": 1e-5}},
}


def task_executor_defaults(task: str, executor_path: str) -> dict:
    """The arguments ``task`` sets for the executor class at ``executor_path`` (``{}`` when none)."""
    return dict(TASK_EXECUTOR_DEFAULTS.get(task, {}).get(executor_path.rsplit(".", 1)[-1], {}))


# FedEvi's official polyp settings (``run_polyp.sh``, ``main_seg_al.py``): 384 px, batch 8, E = 2, 200 rounds,
# Adam 1e-3 (0.9, 0.99), wd 1e-5, ExponentialLR 0.99 per round.
COMMON_CLIENT_ARGS = {
    "task": "polyp",
    "image_size": 384,
    "batch_size": 8,
    "local_epochs": 2,
    "lr": 1e-3,
    "betas": [0.9, 0.99],
    "weight_decay": 1e-5,
    "lr_gamma": 0.99,
    "network": {"name": "fedevi_unet"},  # FedEvi's U-Net (feduq.networks.FedEviUNet): the papers' network
    "keep_largest_component": True,
    "resize": "letterbox",  # the official FedEvi polyp pipeline ; "stretch" = each side resized
    "intensity": "max",  # the official code: x / max per image; "minmax" = MONAI ScaleIntensity to [0, 1]
    "seed": 0,
    "device": "auto",
}
NUM_ROUNDS = 200

METHODS = {
    "fedavg": {
        "description": "FedAvg (McMahan et al. 2017) baseline: Dice + CE, weights N_k.",
        "executor": "feduq.flare.executor.FedAvgExecutor",
        "executor_args": {},
        "tasks": ["train", "validate", "test", "submit_model"],
        "workflow": "scatter_and_gather",
    },
    "fedevi": {
        "description": "FedEvi (Chen et al., MICCAI 2024): evidential training, beta from epistemic/aleatoric.",
        "executor": "feduq.flare.fedevi.FedEviExecutor",
        "executor_args": {"kl_weight": 0.01, "annealing_step": 10, "dice_variant": "mean"},
        "tasks": ["train", "validate_surrogate", "validate", "test", "submit_model"],
        "workflow": "fedevi",
        "workflow_args": {
            "delta": 1.0,
            "reliability": "code",
            "clip_min": 1e-3,
            "renormalize_after_clip": False,
            "initial_weights": "samples",
        },
    },
    "fedprox": {
        "description": "FedProx (Li et al., MLSys 2020): FedAvg plus mu/2 ||theta - theta_global||^2 on the sites.",
        "executor": "feduq.flare.fedprox.FedProxExecutor",
        "executor_args": {"mu": 0.01},
        "tasks": ["train", "validate", "test", "submit_model"],
        "workflow": "scatter_and_gather",
    },
    "fedbn": {
        "description": "FedBN (Li et al., ICLR 2021): FedAvg with BatchNorm layers kept local on each site.",
        "executor": "feduq.flare.fedbn.FedBNExecutor",
        "executor_args": {},
        "network": {"norm": "batch"},  # overrides COMMON_CLIENT_ARGS["network"] on the sites and the server
        "aggregator_args": {"partial_updates": True},  # sites send no normalisation entries
        "tasks": ["train", "validate", "test", "submit_model"],
        "workflow": "scatter_and_gather",
    },
    "feduaa": {
        "description": "FedUAA (Wang et al., MICCAI 2023) as FedEvi's segmentation baseline: softplus evidential "
        "Dice + KL, local output head, weights softmax(Youden uncertainty thresholds).",
        "executor": "feduq.flare.feduaa.FedUAASegExecutor",
        "executor_args": {
            "kl_weight": 0.01,
            "annealing_step": 10,
            "dice_variant": "mean",
            "temperature": None,
            "threshold_source": "train",
            "roc_level": "pixel",
            "pixels_per_image": 1024,
            "image_dice_cutoff": 0.5,
        },
        "aggregator": "feduq.flare.feduaa.FedUAAAggregator",
        "aggregator_args": {"default_threshold": 0.5, "partial_updates": True},  # heads stay on the sites
        "tasks": ["train", "validate", "test", "submit_model"],
        "workflow": "scatter_and_gather",
    },
}

# GraphFedSeg (Acta Electronica Sinica 2026) on the four polyp centers: Adam 5e-4, batch 4, 250 rounds x 2 local
# epochs, 384 px, the 2D U-Net; gamma 0.4, lambda 0.2, alpha 0.08 K (GraphFedSeg §3).
METHODS["graphfedseg"] = {
    "description": "GraphFedSeg: uncertainty collaboration graph W (simplex QP per row) and dual-layer aggregation.",
    "executor": "feduq.flare.graphfedseg.GraphFedSegExecutor",
    "executor_args": {"lam1": 0.01, "align_sign": 1, "uncertainty_split": "train"},
    "client_args": {"lr": 5e-4, "batch_size": 4},
    "num_rounds": 250,
    "tasks": ["train", "validate", "test", "submit_model"],
    "workflow": "graphfedseg",
    "workflow_args": {"gamma": 0.4, "alpha": None, "lam": 0.2, "similarity": "model", "send_neighbour": True},
}

# FedA3I (AAAI 2024) SKIN: ISIC-2017 as 50 IID virtual sites of 40 (feduq.sites), each with its annotator's noise
# (tools/make_noisy_labels.py writes the derived dataset); the FedA3I U-Net, BCE, Adam 5e-3 constant and recreated
# every round, batch 8, 5 local epochs, 100 rounds, 256 px, raw 0-255 inputs, FedAvg warm-up T1 = 10, r = 0.5, the
# last-round model tested (FedA3I §4).
METHODS["feda3i"] = {
    "description": "FedA3I: noise estimation from boundary-band losses, GMM groups, frozen layer-wise quality weights.",
    "task": "skin",
    "sites": [f"ISIC-2017-p{k:02d}of50" for k in range(50)],
    "executor": "feduq.flare.feda3i.FedA3IExecutor",
    "executor_args": {"loss": "ce", "reset_optimizer": True},
    "client_args": {"lr": 5e-3, "lr_gamma": 1.0, "weight_decay": 0.0, "batch_size": 8, "local_epochs": 5,
                    "image_size": 256, "resize": "stretch", "intensity": "raw", "keep_largest_component": False},
    "network": {"name": "feda3i_unet"},
    "num_rounds": 100,
    "tasks": ["train", "estimate_noise", "validate", "test", "submit_model"],
    "workflow": "feda3i",
    "workflow_args": {"warmup_rounds": 10, "r": 0.5, "layer_weight": 1.0, "layer_power": 1.0, "layer_bias": 0.0,
                      "gmm_seed": 0},
    "final_test_args": {"model_file": "FL_global_model.pt"},  # the paper reports the last round
}

# FedAvg-CE, the baseline of FedA3I's Table 2: FedA3I's sites, network, loss and optimiser, n-weighted FedAvg in every
# round (the controller never estimates when warmup_rounds >= num_rounds).
METHODS["fedavg_ce"] = {
    **METHODS["feda3i"],
    "description": "FedAvg-CE (FedA3I's baseline): FedA3I's training and sites, FedAvg weights n_k in every round.",
    "workflow_args": {**METHODS["feda3i"]["workflow_args"], "warmup_rounds": 1_000_000},
}

# FedUAA in its original, image-level form (Wang et al., MICCAI 2023) on breast ultrasound benign/malignant: ResNet-18
# backbone (shared) + TWEU head FC-BN-ReLU-FC (local), SGD lr 0.01 without momentum recreated every round, batch 32,
# 1 local epoch, 256 px, 100 rounds, KL annealed over 101 rounds, tau = 0.05; best round by validation AUC.
METHODS["feduaa_cls"] = {
    "description": "FedUAA (Wang et al., MICCAI 2023) in its original image-level classification form: "
    "ResNet-18 + local TWEU head, EDL + annealed KL + temperature CE, weights softmax(Youden thresholds).",
    "task": "breast",
    "num_rounds": 100,
    "network": {"name": "resnet_tweu", "backbone": "resnet18", "hidden": 128},  # replaces COMMON_CLIENT_ARGS["network"]
    # FedUAA's own image pipeline (resize each image to 256, scale to [0, 1]); letterbox/max are segmentation settings
    "client_args": {"image_size": 256, "batch_size": 32, "local_epochs": 1, "lr": 0.01, "resize": "stretch",
                    "intensity": "minmax"},
    "executor": "feduq.flare.feduaa_cls.FedUAAClsExecutor",
    "executor_args": {
        "annealing_step": 101,
        "temperature": 0.05,
        "kl_weight": 1.0,
        "local_bn": "name",
        "momentum": 0.0,
        "threshold_source": "train",
    },
    "aggregator": "feduq.flare.feduaa.FedUAAAggregator",
    "aggregator_args": {"default_threshold": 0.5, "partial_updates": True},  # heads and 'bn' entries stay local
    "key_metric": "val_auc",
    "tasks": ["train", "validate", "test", "submit_model"],
    "workflow": "scatter_and_gather",
}


def method_task(method: str) -> str:
    """The FedUQ task a method's job runs on (``COMMON_CLIENT_ARGS["task"]`` unless the method names one)."""
    return METHODS[method].get("task", COMMON_CLIENT_ARGS["task"])


def network_args(method: str) -> dict:
    """The method's ``network`` (``{"name": ..., **options}``): the common one with the method's overrides; a method
    naming another network gets only its own options."""
    own = METHODS[method].get("network", {})
    if "name" in own:
        return dict(own)
    return {**COMMON_CLIENT_ARGS["network"], **own}


def persistor_model(network: dict, in_channels: int, out_channels: int, seed: int) -> dict:
    """The server's model spec for the sites' ``network``: the registered class with the same options."""
    from feduq.networks import DEFAULT_NETWORK, network_class_path

    options = {k: v for k, v in network.items() if k != "name"}
    return {
        "path": network_class_path(network.get("name", DEFAULT_NETWORK)),
        "args": {"in_channels": in_channels, "out_channels": out_channels, **options, "init_seed": seed},
    }


def persistor(task: dict, network: dict, seed: int) -> dict:
    return {
        "id": "persistor",
        "path": "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
        "args": {"model": persistor_model(network, task["in_channels"], task["num_classes"], seed)},
    }


def server_config(method: str) -> dict:
    spec, task = METHODS[method], task_settings(method_task(method))
    num_rounds = spec.get("num_rounds", NUM_ROUNDS)
    n_sites = len(method_sites(method))
    if spec["workflow"] == "scatter_and_gather":
        train = {
            "id": "scatter_and_gather",
            "path": "feduq.flare.workflows.ResumableScatterAndGather",
            "args": {
                "min_clients": n_sites,
                "num_rounds": num_rounds,
                "start_round": 0,
                "wait_time_after_min_received": 0,
                "aggregator_id": "aggregator",
                "persistor_id": "persistor",
                "shareable_generator_id": "shareable_generator",
                "train_task_name": "train",
                "train_timeout": 0,
            },
        }
    elif spec["workflow"] == "feda3i":
        train = {
            "id": "feda3i_controller",
            "path": "feduq.flare.feda3i.FedA3IController",
            "args": {"num_rounds": num_rounds, "persistor_id": "persistor", **spec["workflow_args"]},
        }
    elif spec["workflow"] == "graphfedseg":
        train = {
            "id": "graphfedseg_controller",
            "path": "feduq.flare.graphfedseg.GraphFedSegController",
            "args": {"num_rounds": num_rounds, "persistor_id": "persistor", **spec["workflow_args"]},
        }
    else:
        train = {
            "id": "fedevi_controller",
            "path": "feduq.flare.fedevi.FedEviController",
            "args": {"num_rounds": num_rounds, "aggregator_id": "aggregator", "persistor_id": "persistor",
                     **spec["workflow_args"]},
        }
    return {
        "format_version": 2,
        "workflows": [
            train,
            {"id": "final_test", "path": "feduq.flare.workflows.FinalTestEvaluation",
             "args": {"method": method, **spec.get("final_test_args", {})}},
        ],
        "components": [
            persistor(task, network_args(method), COMMON_CLIENT_ARGS["seed"]),
            {"id": "shareable_generator", "path": "feduq.flare.aggregators.GuardedShareableGenerator", "args": {}},
            {
                "id": "aggregator",
                "path": spec.get("aggregator", "feduq.flare.aggregators.WeightedAggregator"),
                "args": dict(spec.get("aggregator_args", {})),
            },
            {
                "id": "model_selector",
                "path": "feduq.flare.selection.BestModelSelector",  # IntimeModelSelector + a record that survives resume
                "args": {"key_metric": spec.get("key_metric", "val_dice")},
            },
            {  # per-round site metrics streamed by each site's TBWriter -> <run dir>/tb_events/<site>/
                "id": "tb_receiver",
                "path": "nvflare.app_opt.tracking.tb.tb_receiver.TBAnalyticsReceiver",
                "args": {"tb_folder": "tb_events", "events": ["fed.analytix_log_stats"]},
            },
        ],
        "task_data_filters": [],
        "task_result_filters": [],
    }


def ledger_filters(method: str, tasks: list[str]) -> dict:
    """The client's privacy-ledger filters (feduq.flare.ledger) on every task of the job: the data filter notes the
    model the server sent, the result filter records and enforces what the site sends (feduq.ledger.LEDGER)."""
    path = "feduq.flare.ledger.PrivacyLedgerFilter"
    return {
        "task_data_filters": [{"tasks": list(tasks), "filters": [{"path": path, "args": {"method": method, "direction": "in"}}]}],
        "task_result_filters": [{"tasks": list(tasks), "filters": [{"path": path, "args": {"method": method, "direction": "out"}}]}],
    }


def client_config(method: str) -> dict:
    spec = METHODS[method]
    return {
        "format_version": 2,
        "executors": [
            {
                "tasks": spec["tasks"],
                "executor": {
                    "id": "executor",
                    "path": spec["executor"],
                    "args": {
                        **COMMON_CLIENT_ARGS,
                        **spec.get("client_args", {}),
                        "task": method_task(method),
                        "network": network_args(method),
                        **spec["executor_args"],
                    },
                },
            }
        ],
        "components": [
            {"id": "tb_writer", "path": "nvflare.app_opt.tracking.tb.tb_writer.TBWriter", "args": {}},
            {
                "id": "event_to_fed",
                "path": "nvflare.app_common.widgets.convert_to_fed_event.ConvertToFedEvent",
                "args": {"events_to_convert": ["analytix_log_stats"], "fed_event_prefix": "fed."},
            },
        ],
        **ledger_filters(method, spec["tasks"]),
    }


def meta(method: str) -> dict:
    sites = method_sites(method)
    return {
        "name": method,
        "resource_spec": {},
        "min_clients": len(sites),
        "deploy_map": {"app": ["server", *sites]},
    }


#: ``app/custom/README.md`` of every job. FLARE 2.9 builds a job's components only from the site's
#: ``class_allow_list`` unless the job brings its own code; an app with a ``custom/`` folder is bring-your-own-code
#: (BYOC) and is admitted by the site's ``byoc`` right instead, as FLARE's own exported jobs are. So the committed
#: jobs run in ``nvflare simulator`` and POC with no site preparation.
CUSTOM_README = """# Why this job has a `custom/` folder

FedUQ's components (`feduq.flare.*`, `feduq.networks.*`) are not NVIDIA FLARE classes. FLARE 2.9 builds
a job's components only from the site's `class_allow_list`, unless the job brings its own code (BYOC): an
app with a `custom/` folder is BYOC, and a site admits it by its `byoc` right instead, as it admits the jobs
FLARE's own Job API exports. This folder makes the job BYOC, so `nvflare simulator jobs/<method> -w ws -t 4`
and a POC federation run it with no site preparation.

It holds no code: every site runs the `feduq` package installed on it, the version of this checkout.

- For sites whose authorization policy refuses custom code, make the job without this folder:
  `python tools/configure_job.py jobs/<method> -o OUT --allow-listed`; each such site then allow-lists
  FedUQ's classes once: `python tools/prepare_site.py <site kit> --data-root DIR`.
- To ship FedUQ's code inside the job instead of installing it on the sites: `--byoc`.
"""


def render(method: str) -> dict[str, str]:
    """Relative path -> file text for one job folder."""

    def dump(obj):
        return json.dumps(obj, indent=2) + "\n"

    return {
        "meta.json": dump(meta(method)),
        "app/config/config_fed_server.json": dump(server_config(method)),
        "app/config/config_fed_client.json": dump(client_config(method)),
        "app/custom/README.md": CUSTOM_README,
    }


# -- multi-head abdominal CT (FIVA Table 2 rows) ---------------------------------------------------
#: FIVA iterations per round per site: large sites more (TS 300, A1k 200), small ones 50 (FIVA §4).
CT_ITERATIONS = {"NIH-Pancreas-CT": 200, "default": 50}
CT_ROUNDS = 1500  # FIVA's reported rounds (the poly schedule spans them)
CT_METHODS = {
    "fedavg_ct": ("feduq.flare.ct.CTExecutor", {}, "feduq.flare.ct.CTController", {}, False),
    "fiva_p": ("feduq.flare.fiva.FIVAExecutor", {"variance": "parameter", "divisor": "n", "sample_scale": "std"},
               "feduq.flare.fiva.FIVAController", {"eps": 1e-5, "forgetting": 0.95, "floor": 1e-8, "mode": "full"}, True),
    "fiva_g": ("feduq.flare.fiva.FIVAExecutor", {"variance": "gradient", "divisor": "n", "g_mode": "strong",
                                                  "sample_scale": "std"},
               "feduq.flare.fiva.FIVAController", {"eps": 1e-5, "forgetting": 0.95, "floor": 1e-8, "mode": "full"}, True),
    "funavg": ("feduq.flare.funavg.FUNAvgExecutor", {"dropout": 0.3}, "feduq.flare.ct.CTController", {}, False),
}


def render_ct(method: str) -> dict[str, str]:
    """Job files of a multi-head CT method: nnU-Net's full 2D plan, FIVA's schedule (FIVA Table 2)."""
    from feduq.ct import training_centers, HELD_OUT

    executor, ex_args, workflow, wf_args, variance = CT_METHODS[method]
    sites = [*training_centers(), *HELD_OUT]
    dropout = ex_args.get("dropout", 0.0)
    client = {"format_version": 2, "executors": [{"tasks": ["train", "submit_head", "test"], "executor": {
        "id": "executor", "path": executor, "args": {
            "plans": "ct_2d", "intensity": "site", "iterations": CT_ITERATIONS, "batch_size": None, "lr": 0.01,
            "weight_decay": 3e-5, "num_rounds": CT_ROUNDS, "inference_samples": 10, "seed": 0, "device": "auto",
            "amp": "auto", **ex_args}}}], "components": [], **ledger_filters(method, ["train", "submit_head", "test"])}
    server = {"format_version": 2, "workflows": [{"id": "ct_controller", "path": workflow, "args": {
        "num_rounds": CT_ROUNDS, "persistor_id": "persistor", "method": method, **wf_args}}],
        "components": [{"id": "persistor", "path": "nvflare.app_opt.pt.file_model_persistor.PTFileModelPersistor",
                        "args": {"model": {"path": "feduq.flare.ct.BackboneModel",
                                           "args": {"plans": "ct_2d", "dropout": dropout, "variance": variance}}}}],
        "task_data_filters": [], "task_result_filters": []}
    dump = lambda obj: json.dumps(obj, indent=2) + "\n"  # noqa: E731
    return {"meta.json": dump({"name": method, "resource_spec": {}, "min_clients": len(sites),
                               "deploy_map": {"app": ["server", *sites]}}),
            "app/config/config_fed_server.json": dump(server), "app/config/config_fed_client.json": dump(client),
            "app/custom/README.md": CUSTOM_README}


LEDGER_START, LEDGER_END = "<!-- privacy-ledger:start (tools/make_jobs.py) -->", "<!-- privacy-ledger:end -->"


def readme_with_ledger(text: str) -> str:
    """README text with the block between the ledger markers replaced by :func:`feduq.ledger.ledger_markdown`."""
    from feduq.ledger import ledger_markdown

    head, sep, rest = text.partition(LEDGER_START)
    _, sep2, tail = rest.partition(LEDGER_END)
    if not sep or not sep2:
        raise SystemExit(f"docs/privacy.md lacks the markers {LEDGER_START} ... {LEDGER_END}")
    return f"{head}{LEDGER_START}\n{ledger_markdown()}\n{LEDGER_END}{tail}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only check that jobs/ is up to date")
    parser.add_argument("--out", type=Path, default=JOBS_DIR)
    args = parser.parse_args(argv)
    stale = []
    for method in [*METHODS, *CT_METHODS]:
        for rel, text in (render(method) if method in METHODS else render_ct(method)).items():
            path = args.out / method / rel
            if args.check:
                if not path.is_file() or path.read_text() != text:
                    stale.append(str(path))
            else:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    readme = REPO / "docs" / "privacy.md"
    if args.out == JOBS_DIR:  # docs/privacy.md's "What leaves a site" table comes from the same declarations
        text = readme_with_ledger(readme.read_text())
        if args.check and text != readme.read_text():
            stale.append(str(readme))
        elif not args.check:
            readme.write_text(text)
    if stale:
        print("stale job files (run python tools/make_jobs.py):\n  " + "\n  ".join(stale))
        return 1
    if not args.check:
        print(f"wrote {len(METHODS) + len(CT_METHODS)} jobs to {args.out}: {', '.join([*METHODS, *CT_METHODS])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
