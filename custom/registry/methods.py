"""Every FedUQ method's registration, one :func:`feduq.registry.spec.register` call each: a new method adds its
own here (see the README's "Adding a method"). The settings every 2D job shares are :data:`COMMON_CLIENT_ARGS`, the
official FedEvi polyp setting."""

from __future__ import annotations

from ..privacy.ledger import CT_DECLARATION, NAME, SCALAR, SITE_NAME, TRAIN_META, declare, seg2d_declaration
from .spec import MethodSpec, register

# -- 2D segmentation and classification -------------------------------------------------------------------------------
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
    "network": {"name": "fedevi_unet"},  # FedEvi's U-Net (feduq.core.networks.FedEviUNet): the papers' network
    "keep_largest_component": True,
    "resize": "letterbox",  # the official FedEvi polyp pipeline ; "stretch" = each side resized
    "intensity": "max",  # the official code: x / max per image; "minmax" = MONAI ScaleIntensity to [0, 1]
    "seed": 0,
    "device": "auto",
}
NUM_ROUNDS = 200

register(MethodSpec(
    "fedavg", "FedAvg (McMahan et al. 2017) baseline: Dice + CE, weights N_k.", seg2d_declaration()))
register(MethodSpec(
    "fedevi", "FedEvi (Chen et al., MICCAI 2024): evidential training, beta from epistemic/aleatoric.",
    seg2d_declaration({"fedevi_mean_u_ale": SCALAR, "fedevi_mean_inv_u_ale": SCALAR},
                      validate_surrogate=declare(metrics={"u_epi": SCALAR}, meta={"fedevi_mean_u_epi": SCALAR})),
    site_part="feduq.methods.fedevi.FedEviSite", site_args={"kl_weight": 0.01, "annealing_step": 10,
                                                            "dice_variant": "mean"},
    server_part="feduq.methods.fedevi.FedEviServer",
    server_args={"delta": 1.0, "reliability": "code", "clip_min": 1e-3, "renormalize_after_clip": False,
                 "initial_weights": "samples"},
    # FedEvi paper, "Implemental Details": λ = 1e-2 for polyp and prostate (official code); 1e-5 for fundus, set by the
    # fundus task file (feduq/tasks/task_files/fundus.json, feduq.hyperparameters.fedevi)
    tasks=("train", "validate_surrogate", "validate", "test", "submit_model")))
register(MethodSpec(
    "fedprox", "FedProx (Li et al., MLSys 2020): FedAvg plus mu/2 ||theta - theta_global||^2 on the sites.",
    seg2d_declaration(), site_part="feduq.methods.fedprox.FedProxSite", site_args={"mu": 0.01}))
register(MethodSpec(
    "fedbn", "FedBN (Li et al., ICLR 2021): FedAvg with BatchNorm layers kept local on each site.",
    seg2d_declaration(), site_part="feduq.methods.fedbn.FedBNSite",
    server_part="feduq.parts.server.LocalEntriesServer",  # sites send no normalisation entries
    network={"norm": "batch"}))  # overrides COMMON_CLIENT_ARGS["network"] on the sites and the server
register(MethodSpec(
    "feduaa", "FedUAA (Wang et al., MICCAI 2023) as FedEvi's segmentation baseline: softplus evidential "
    "Dice + KL, local output head, weights softmax(Youden uncertainty thresholds).",
    seg2d_declaration({"feduaa_youden_threshold": SCALAR}),
    site_part="feduq.methods.feduaa.FedUAASegSite",
    site_args={"kl_weight": 0.01, "annealing_step": 10, "dice_variant": "mean", "temperature": None,
               "threshold_source": "train", "roc_level": "pixel", "pixels_per_image": 1024, "image_dice_cutoff": 0.5},
    server_part="feduq.methods.feduaa.FedUAAServer",  # softmax(θ) over what the sites send (heads stay local)
    server_args={"default_threshold": 0.5}))

# FedAvgM (Hsu et al. 2019, server momentum): FedAvg's sites, a server part of its own; the worked example of adding a
# method (README, "Adding a method").
register(MethodSpec(
    "fedavgm", "FedAvgM (Hsu et al. 2019): FedAvg's average as a pseudo-gradient step with server momentum.",
    seg2d_declaration(), server_part="feduq.methods.fedavgm.FedAvgMServer",
    server_args={"server_lr": 1.0, "momentum": 0.9}))

# FedPer (Arivazhagan et al. 2019), a site-side method added as one module and this registration: FedAvg on the base
# layers, the output layer kept on each site; the server averages what the sites send (FedBN's server part).
register(MethodSpec(
    "fedper", "FedPer (Arivazhagan et al. 2019): FedAvg on the base layers, the output layer kept on each site.",
    seg2d_declaration(), site_part="feduq.methods.fedper.FedPerSite", site_args={"personal_layers": 1},
    server_part="feduq.parts.server.LocalEntriesServer"))

# GraphFedSeg (Acta Electronica Sinica 2026) on the four polyp centers: Adam 5e-4, batch 4, 250 rounds x 2 local
# epochs, 384 px, the 2D U-Net; gamma 0.4, lambda 0.2, alpha 0.08 K (GraphFedSeg §3).
register(MethodSpec(
    "graphfedseg", "GraphFedSeg: uncertainty collaboration graph W (simplex QP per row) and dual-layer aggregation.",
    seg2d_declaration({"graphfedseg_mean_vacuity": SCALAR}),
    site_part="feduq.methods.graphfedseg.GraphFedSegSite",
    site_args={"lam1": 0.01, "align_sign": 1, "uncertainty_split": "train"},
    server_part="feduq.methods.graphfedseg.GraphFedSegServer",
    server_args={"gamma": 0.4, "alpha": None, "lam": 0.2, "similarity": "model", "send_neighbour": True},
    client_args={"lr": 5e-4, "batch_size": 4}, num_rounds=250))

# FedA3I (AAAI 2024) SKIN: ISIC-2017 as 50 IID virtual sites of 40 (feduq.sites.centers), each with its annotator's noise
# (feduq noisy-labels writes the derived dataset); the FedA3I U-Net, BCE, Adam 5e-3 constant and recreated
# every round, batch 8, 5 local epochs, 100 rounds, 256 px, raw 0-255 inputs, FedAvg warm-up T1 = 10, r = 0.5, the
# last-round model tested (FedA3I §4).
_FEDA3I = dict(
    ledger=seg2d_declaration(estimate_noise=declare(metrics={"feda3i_q_in": SCALAR, "feda3i_q_out": SCALAR},
                                                    meta={"feda3i_q": "vector:2", "feduq_num_samples": SCALAR,
                                                          **SITE_NAME})),
    task="skin", sites=tuple(f"ISIC-2017-p{k:02d}of50" for k in range(50)),
    site_part="feduq.methods.feda3i.FedA3ISite", site_args={"loss": "ce", "reset_optimizer": True},
    client_args={"lr": 5e-3, "lr_gamma": 1.0, "weight_decay": 0.0, "batch_size": 8, "local_epochs": 5,
                 "image_size": 256, "resize": "stretch", "intensity": "raw", "keep_largest_component": False},
    network={"name": "feda3i_unet"}, num_rounds=100,
    tasks=("train", "estimate_noise", "validate", "test", "submit_model"),
    server_part="feduq.methods.feda3i.FedA3IServer",
    final_test_args={"model_file": "FL_global_model.pt"},  # the paper reports the last round
)
_FEDA3I_SERVER = {"warmup_rounds": 10, "r": 0.5, "layer_weight": 1.0, "layer_power": 1.0, "layer_bias": 0.0,
                  "gmm_seed": 0}
register(MethodSpec(
    "feda3i", "FedA3I: noise estimation from boundary-band losses, GMM groups, frozen layer-wise quality weights.",
    server_args=_FEDA3I_SERVER, foreground_classes=1, volumes_3d=False, **_FEDA3I))  # binary: q_k scores z = l1 - l0 against label > 0
# FedAvg-CE, the FedAvg (CE) row of FedA3I's Table 3 (its ablation): FedA3I's sites, network, loss and optimiser,
# n-weighted FedAvg in every round (the controller never estimates when warmup_rounds >= num_rounds).
register(MethodSpec(
    "fedavg_ce", "FedAvg-CE (FedA3I's baseline): FedA3I's training and sites, FedAvg weights n_k in every round.",
    server_args={**_FEDA3I_SERVER, "warmup_rounds": 1_000_000}, volumes_3d=False, **_FEDA3I))

# FedUAA in its original, image-level form (Wang et al., MICCAI 2023) on breast ultrasound benign/malignant: ResNet-18
# backbone (shared) + TWEU head FC-BN-ReLU-FC (local), SGD lr 0.01 without momentum recreated every round, batch 32,
# 1 local epoch, 256 px, 100 rounds, KL annealed over 101 rounds, tau = 0.05; best round by validation AUC.
register(MethodSpec(
    "feduaa_cls", "FedUAA (Wang et al., MICCAI 2023) in its original image-level classification form: "
    "ResNet-18 + local TWEU head, EDL + annealed KL + temperature CE, weights softmax(Youden thresholds).",
    {"train": declare(model=True, metrics={"val_auc": SCALAR, "val_accuracy": SCALAR, "train_loss": SCALAR},
                      meta={**TRAIN_META, "feduaa_youden_threshold": SCALAR}),
     "validate": declare(metrics={"val_auc": SCALAR, "val_accuracy": SCALAR}, meta={"feduq_num_val_samples": SCALAR}),
     "test": declare(metrics={"auc": SCALAR, "accuracy": SCALAR, "num_images": SCALAR}, meta={"feduq_site": NAME}),
     "submit_model": declare(model=True)},
    task="breast", num_rounds=100,
    network={"name": "resnet_tweu", "backbone": "resnet18", "hidden": 128},  # replaces COMMON_CLIENT_ARGS["network"]
    # FedUAA's own image pipeline (resize each image to 256, scale to [0, 1]); letterbox/max are segmentation settings
    client_args={"image_size": 256, "batch_size": 32, "local_epochs": 1, "lr": 0.01, "resize": "stretch",
                 "intensity": "minmax"},
    site_class="feduq.methods.feduaa.classification.FedUAAClassificationSite",  # its own image-level training loop
    site_args={"annealing_step": 101, "temperature": 0.05, "kl_weight": 1.0, "local_bn": "name", "momentum": 0.0,
               "threshold_source": "train"},
    server_part="feduq.methods.feduaa.FedUAAServer",  # heads and 'bn' entries stay local
    server_args={"default_threshold": 0.5}, key_metric="val_auc"))

# FedAvg on the same image-level task, the baseline of FedUAA's classification table: FedUAA's network (the whole
# ResNet-18 + FC-BN-ReLU-FC head averaged), data, SGD recreated every round, schedule and selection; cross-entropy;
# n-weighted FedAvg.
register(MethodSpec(
    "fedavg_cls", "FedAvg on image-level classification (FedUAA's baseline): FedUAA's network, data and optimiser, "
    "cross-entropy, every entry averaged with weights n_k.",
    {"train": declare(model=True, metrics={"val_auc": SCALAR, "val_accuracy": SCALAR, "train_loss": SCALAR},
                      meta=dict(TRAIN_META)),
     "validate": declare(metrics={"val_auc": SCALAR, "val_accuracy": SCALAR}, meta={"feduq_num_val_samples": SCALAR}),
     "test": declare(metrics={"auc": SCALAR, "accuracy": SCALAR, "num_images": SCALAR}, meta={"feduq_site": NAME}),
     "submit_model": declare(model=True)},
    task="breast", num_rounds=100,
    network={"name": "resnet_tweu", "backbone": "resnet18", "hidden": 128},
    client_args={"image_size": 256, "batch_size": 32, "local_epochs": 1, "lr": 0.01, "resize": "stretch",
                 "intensity": "minmax"},
    site_class="feduq.site.classification.ClassificationSite",  # FedUQ's image-level loop with FedAvg's part
    site_args={"momentum": 0.0}, key_metric="val_auc"))

# -- multi-head abdominal CT (FIVA Table 2 rows) ---------------------------------------------------------------------
#: FIVA iterations per round per site: large sites more (TS 300, A1k 200), small ones 50 (FIVA §4).
CT_ITERATIONS = {"NIH-Pancreas-CT": 200, "default": 50}
CT_ROUNDS = 1500  # FIVA's reported rounds (the poly schedule spans them)
_CT = dict(kind="ct", ledger=CT_DECLARATION, tasks=("train", "submit_head", "test"), task="ct", num_rounds=CT_ROUNDS)
_FIVA_SERVER = {"eps": 1e-5, "forgetting": 0.95, "floor": 1e-8, "mode": "full"}
register(MethodSpec("fedavg_ct", "FedAvg on multi-head CT (FIVA's baseline): backbone by training cases, naive merge.",
                    **_CT))
register(MethodSpec(
    "fiva_p", "FIVA-P (MLHC 2025): inverse-variance fusion of the backbone with parameter variances, K sampled "
    "backbones at test time.", site_part="feduq.methods.fiva.site.FIVASite",
    site_args={"variance": "parameter", "divisor": "n", "sample_scale": "std"},
    server_part="feduq.methods.fiva.FIVAServer", server_args=_FIVA_SERVER, ct_variance=True, **_CT))
register(MethodSpec(
    "fiva_g", "FIVA-G (MLHC 2025): as FIVA-P with gradient variances.", site_part="feduq.methods.fiva.site.FIVASite",
    site_args={"variance": "gradient", "divisor": "n", "g_mode": "strong", "sample_scale": "std"},
    server_part="feduq.methods.fiva.FIVAServer", server_args=_FIVA_SERVER, ct_variance=True, **_CT))
register(MethodSpec(
    "funavg", "FUNAvg (MICCAI 2024): FedAvg with Dropout2d 0.3, MC-dropout passes at test time.",
    site_part="feduq.methods.fiva.site.FUNAvgSite", site_args={"dropout": 0.3}, **_CT))
