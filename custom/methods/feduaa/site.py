"""FedUAA's site parts (Wang et al., MICCAI 2023), run by FedUQ's site runner (FLARE-free).

* :class:`FedUAASegSite` -- segmentation, FedEvi's FedUAA baseline: evidential Dice + KL on softplus evidence, the
  network's output layer kept on the site, and the Youden uncertainty threshold θ_k sent after local training.
* :class:`FedUAAClsSite` -- the paper's own image-level classification: FedUAALoss (Eq. 4-8) on the TWEU head, the
  head (and by default the BatchNorm entries named ``bn``) kept on the site.

Their server part is :class:`feduq.methods.feduaa.FedUAAServer` (``w = softmax(θ)``).
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from ...common.wire import FedUQMetaKey
from ...core.evidential import dirichlet_from_logits
from ...scores.maps import dirichlet_uncertainty
from ...parts.site import SitePart
from .losses import FedUAALoss, FedUAASegLoss
from .thresholds import THRESHOLD_SOURCES, YoudenCollector

#: which BatchNorm entries stay on a classification site besides the head
LOCAL_BN_MODES = ("name", "all", "none")


def segmentation_head_keys(model: torch.nn.Module) -> list[str]:
    """State-dict names of a segmentation network's output layer: FedUAA's local segmentation head.

    FedEvi's U-Net (``fedevi_unet``): the final 1×1 convolution ``head.weight`` ``[C, 32, 1, 1]`` and
    ``head.bias`` ``[C]`` (66 parameters for C = 2). The ``light`` MONAI UNet
    (``Sequential(down, skip, up)``): the top-level output block, a 3×3 stride-2 transposed
    convolution ``model.2.conv.weight``/``bias`` (578 parameters for C = 2; with residual units it
    also holds the output residual unit).

    Raises:
        ValueError: the model declares no head and is not MONAI-UNet-like.
    """
    if hasattr(model, "head_keys"):
        return list(model.head_keys())
    seq = getattr(model, "model", None)
    if not isinstance(seq, torch.nn.Sequential) or len(seq) == 0:
        raise ValueError(f"cannot find the output block of {type(model).__name__}: no top-level Sequential 'model'")
    prefix = f"model.{len(seq) - 1}."
    keys = [k for k in model.state_dict() if k.startswith(prefix)]
    if not keys:
        raise ValueError(f"the output block {prefix!r} of {type(model).__name__} has no parameters")
    return keys


class FedUAASegSite(SitePart):
    """FedUAA's site part for segmentation (FedEvi's FedUAA baseline; the segmentation form is **inferred** from
    the bytecode FedEvi released, see :mod:`feduq.methods.feduaa`).

    * **Loss**: FedEvi's evidential Dice + λ·a(r)·KL with softplus evidence (:class:`FedUAASegLoss`); optional
      per-pixel temperature term. Under DP-SGD the Dice is per image (a batch Dice couples the images).
    * **Local head**: :func:`segmentation_head_keys` never leave the site.
    * **Threshold**: after local training the site sends θ_k, the Youden-optimal threshold of the pixel uncertainty
      ``u = C/S`` against the pixel error ``argmax b != y`` (:class:`YoudenCollector`), in
      ``meta[FedUQMetaKey.FEDUAA_THRESHOLD]``, or None when the ROC is undefined (the server keeps the site's previous
      θ). ``threshold_source="train"`` (default, the official code's protocol) collects the pixels of every training
      batch of the round as the model trains (train mode, weights changing); ``"val"`` runs the trained local model
      once over the validation split (eval mode).

    Args:
        kl_weight: λ (default 0.01, FedEvi's; FedUAA's segmentation value is not released).
        annealing_step: a(r) = min(1, r / annealing_step), 1-based round (default 10, FedEvi's).
        dice_variant: ``"mean"`` (FedEvi code) or ``"second_moment"``.
        temperature: τ of an optional per-pixel L_Tce on the belief (None: off, as FedEvi's baseline).
        threshold_source: ``"train"`` or ``"val"`` (see above).
        roc_level: ``"pixel"`` (default) or ``"image"`` (image-mean u vs image Dice < cut-off).
        pixels_per_image: pixels drawn per image for the pixel ROC (seeded by seed and round; 0 = all).
        image_dice_cutoff: image-level error cut-off (``roc_level="image"``).
        seed: the ROC subsample's seed (the job's seed).

    Raises:
        ValueError: a switch out of range (``threshold_source``, ``roc_level``, the loss's arguments).
    """

    primary_uncertainty = "vacuity"  # FedUAA's u = C / S
    global_model_note = ("FedUAA keeps its segmentation head on the sites: the global model holds the initial head, so "
                         "its scores and uncertainty here are not FedUAA's (each site tests with its own head)")

    def __init__(self, kl_weight: float = 0.01, annealing_step: int = 10, dice_variant: str = "mean",
                 temperature: float | None = None, threshold_source: str = "train", roc_level: str = "pixel",
                 pixels_per_image: int = 1024, image_dice_cutoff: float = 0.5, seed: int = 0):
        super().__init__()
        if threshold_source not in THRESHOLD_SOURCES:
            raise ValueError(f"FedUAA: threshold_source must be one of {THRESHOLD_SOURCES}, got {threshold_source!r}")
        self.kl_weight, self.annealing_step, self.temperature = kl_weight, annealing_step, temperature
        self.dice_variant = dice_variant
        self.threshold_source = threshold_source
        self.collector = YoudenCollector(level=roc_level, pixels_per_image=pixels_per_image,
                                         dice_cutoff=image_dice_cutoff, seed=seed)
        self.method_loss(dp=False)  # validates the loss's arguments early
        self.collecting = False  # True while a round's training batches feed the collector
        self.last_point = None  # the YoudenPoint of the last round

    def method_loss(self, dp: bool) -> Callable:
        """``(logits, label, round) -> loss`` on the label as :meth:`prepare_label` gives it."""
        return FedUAASegLoss(self.kl_weight, self.annealing_step, self.dice_variant, self.temperature, batch_dice=not dp)

    def prepare_label(self, label: torch.Tensor) -> torch.Tensor:
        """The label as the loss and the collector take it (segmentation: unchanged)."""
        return label

    def local_keys(self, model: torch.nn.Module) -> frozenset[str]:
        return frozenset(segmentation_head_keys(model))

    def loss(self, site) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        method_loss = self.method_loss(dp=site.dp is not None)

        def loss(logits: torch.Tensor, label: torch.Tensor, round_index: int) -> torch.Tensor:
            label = self.prepare_label(label)
            value = method_loss(logits, label, round_index)
            if self.collecting:  # the official protocol: every training sample seen this round
                self.collector.add(logits, label)
            return value

        return loss

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return dirichlet_from_logits(logits, evidence="softplus").prob

    def uncertainty(self) -> Callable[[torch.Tensor], dict]:
        return dirichlet_uncertainty("softplus")

    def before_round(self, site, round_index: int) -> None:
        self.collector.reset(round_index)
        self.last_point = None
        self.collecting = self.threshold_source == "train"

    def statistics(self, site, round_index: int) -> dict:
        self.collecting = False
        if self.threshold_source == "val":
            self.collector.reset(round_index)
            model = site.model.eval()
            with torch.no_grad():
                for batch in site.val_loader:
                    self.collector.add(model(batch["image"].to(site.device)),
                                       self.prepare_label(batch["label"].to(site.device)))
        self.last_point = self.collector.result()
        return {FedUQMetaKey.FEDUAA_THRESHOLD: self.last_point.threshold}

    def record(self, round_index: int) -> dict:
        p = self.last_point
        if p is None:
            return {}
        return {
            "feduaa_threshold_reason": p.reason,
            "feduaa_youden_j": None if not np.isfinite(p.youden_j) else round(p.youden_j, 6),
            "feduaa_roc_samples": p.num_samples,
            "feduaa_roc_wrong": p.num_wrong,
        }


class FedUAAClsSite(FedUAASegSite):
    """FedUAA's site part for image-level classification (the paper's own form, Alg. 1; official code).

    Loss ``FedUAALoss`` = mean[L_Ice + a(r)·KL] + L_Tce (Eq. 4-8) with softplus evidence on the TWEU head's raw
    output ``[B, K]``; probabilities are the softmax of the raw output (the official code scores AUC on it, not on
    the belief); θ_k is the Youden threshold of ``u = K/S`` over every training image of the round.

    Args:
        annealing_step: a(r) = min(1, r / annealing_step), 1-based round (official code: 101).
        temperature: τ of the temperature cross-entropy (paper: 0.05; None drops the term).
        kl_weight: extra factor on the annealed KL (paper: 1).
        local_bn: which BatchNorm entries stay local besides the head: ``"name"`` (the official code's filter: every
            entry whose name contains ``"bn"``), ``"all"`` (every normalisation layer, by module type) or ``"none"``.
        threshold_source: ``"train"`` (official) or ``"val"``.
        seed: the job's seed.

    Raises:
        ValueError: ``local_bn`` not in :data:`LOCAL_BN_MODES`, or another switch out of range.
    """

    output = "classification"
    global_model_note = ("FedUAA keeps its TWEU head (and, by default, the BatchNorm entries named bn) on the sites: the "
                         "global model holds the initial head, so it is not what the sites test")

    def __init__(self, annealing_step: int = 101, temperature: float | None = 0.05, kl_weight: float = 1.0,
                 local_bn: str = "name", threshold_source: str = "train", seed: int = 0):
        if local_bn not in LOCAL_BN_MODES:
            raise ValueError(f"FedUAA: local_bn must be one of {LOCAL_BN_MODES}, got {local_bn!r}")
        self.local_bn = local_bn
        super().__init__(kl_weight=kl_weight, annealing_step=annealing_step, temperature=temperature,
                         threshold_source=threshold_source, roc_level="image", seed=seed)

    def method_loss(self, dp: bool) -> Callable:
        return FedUAALoss(self.annealing_step, self.temperature, self.kl_weight)

    def prepare_label(self, label: torch.Tensor) -> torch.Tensor:
        return label.reshape(-1).long()  # class index per image

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        return torch.softmax(logits, dim=1)

    def local_keys(self, model: torch.nn.Module) -> frozenset[str]:
        from ...core.networks import normalisation_keys

        keys = set(model.head_keys())
        names = list(model.state_dict())
        if self.local_bn == "name":
            keys |= {k for k in names if "bn" in k}
        elif self.local_bn == "all":
            keys |= set(normalisation_keys(names, model))
        return frozenset(keys)
