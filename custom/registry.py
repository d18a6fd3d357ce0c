"""The registration of every FedUQ job: one entry per method, the single source its job folder, its Recipe
(:class:`feduq.recipe.FedUQRecipe`) and its exported ``jobs/<method>/`` are made from (:mod:`feduq.jobspec`).

A 2D method's entry (:data:`METHODS`) names its site executor, its server workflow and their arguments. The
workflow is the dotted path of the method's :class:`feduq.flare.controller.FedUQController` subclass (FedUQ's round
with the method's server part; FedAvg's for the methods that change only the sites), its arguments in
``"workflow_args"``. The settings every 2D
job shares are :data:`COMMON_CLIENT_ARGS`, the official FedEvi polyp setting. A multi-head CT method's entry
(:data:`CT_METHODS`) names its executor and controller with FIVA's schedule. Adding a method's job is one entry
here (see the README's "Adding a method").
"""

from __future__ import annotations

def method_sites(method: str) -> list[str]:
    """The job's sites: the method's own list (virtual sites) or its task's centers."""
    return list(METHODS[method].get("sites") or task_settings(method_task(method))["sites"])


def task_settings(task: str) -> dict:
    """Sites (= centers), input channels and classes of a task, from the FedUQ data registry."""
    from feduq.data import get_task

    t = get_task(task)
    return {"sites": list(t.centers), "in_channels": t.in_channels, "num_classes": len(t.class_names)}


def registered_method(executor_path: str, site_part: str | None = None) -> str | None:
    """The method registered with the executor at ``executor_path`` (and, for FedUQ's generic 2D executor, the
    ``site_part`` argument); None when none is."""
    for name, entry in METHODS.items():
        if entry["executor"] == executor_path and entry.get("executor_args", {}).get("site_part") == site_part:
            return name
    return None


def method_site_part(method: str) -> type:
    """The site part class of a 2D method (its ``site_part`` argument, or its executor class's ``SITE_PART``;
    :class:`feduq.methods.site.SitePart`, FedAvg's, when neither names one)."""
    import importlib

    from feduq.methods.site import job_site_part

    entry = METHODS[method]
    module, _, name = entry["executor"].rpartition(".")
    return job_site_part(getattr(importlib.import_module(module), name), entry.get("executor_args", {}).get("site_part"))


def task_executor_defaults(task: str, executor_path: str, site_part: str | None = None) -> dict:
    """The executor arguments ``task`` changes from the polyp defaults for the method registered with the executor at
    ``executor_path`` and ``site_part`` (its entry's ``"task_executor_args"``, applied by ``configure_job.py --task``
    before any ``--set``); ``{}`` when none."""
    method = registered_method(executor_path, site_part)
    return dict(METHODS[method].get("task_executor_args", {}).get(task, {})) if method else {}


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
        "workflow": "feduq.flare.controller.FedAvgController",
        "workflow_args": {},
    },
    "fedevi": {
        "description": "FedEvi (Chen et al., MICCAI 2024): evidential training, beta from epistemic/aleatoric.",
        "executor": "feduq.flare.fedevi.FedEviExecutor",
        "executor_args": {"kl_weight": 0.01, "annealing_step": 10, "dice_variant": "mean"},
        # FedEvi paper, "Implemental Details": λ = 1e-5 for fundus (1e-2 for polyp and prostate; official code)
        "task_executor_args": {"fundus": {"kl_weight": 1e-5}},
        "tasks": ["train", "validate_surrogate", "validate", "test", "submit_model"],
        "workflow": "feduq.flare.fedevi.FedEviController",
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
        "executor": "feduq.flare.executor.FedUQExecutor",  # FedProx changes only the sites: no FLARE class of its own
        "executor_args": {"site_part": "feduq.methods.fedprox.FedProxSite", "mu": 0.01},
        "tasks": ["train", "validate", "test", "submit_model"],
        "workflow": "feduq.flare.controller.FedAvgController",  # FedProx changes only the sites
        "workflow_args": {},
    },
    "fedbn": {
        "description": "FedBN (Li et al., ICLR 2021): FedAvg with BatchNorm layers kept local on each site.",
        "executor": "feduq.flare.executor.FedUQExecutor",
        "executor_args": {"site_part": "feduq.methods.fedbn.FedBNSite"},
        "network": {"norm": "batch"},  # overrides COMMON_CLIENT_ARGS["network"] on the sites and the server
        "tasks": ["train", "validate", "test", "submit_model"],
        "workflow": "feduq.flare.controller.FedAvgController",
        "workflow_args": {"partial_updates": True},  # sites send no normalisation entries
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
        "tasks": ["train", "validate", "test", "submit_model"],
        "workflow": "feduq.flare.feduaa.FedUAAController",  # softmax(θ) over what the sites send (heads stay local)
        "workflow_args": {"default_threshold": 0.5},
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
    "workflow": "feduq.flare.graphfedseg.GraphFedSegController",
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
    "workflow": "feduq.flare.feda3i.FedA3IController",
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
    "key_metric": "val_auc",
    "tasks": ["train", "validate", "test", "submit_model"],
    "workflow": "feduq.flare.feduaa.FedUAAController",  # heads and 'bn' entries stay local
    "workflow_args": {"default_threshold": 0.5},
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


def all_methods() -> list[str]:
    """Every registered job, 2D first, in registration order."""
    return [*METHODS, *CT_METHODS]
