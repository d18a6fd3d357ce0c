"""FedUAA's FLARE glue for segmentation (Wang et al., MICCAI 2023): client executor and server controller.

* :class:`FedUAASegExecutor` -- the site side (FedEvi's FedUAA baseline): evidential
  training with softplus evidence, a local segmentation head (:func:`segmentation_head_keys`) and the
  Youden uncertainty threshold θ_k sent after local training.
* :class:`FedUAAController` -- the server side: FedUQ's round loop with :class:`feduq.methods.feduaa.FedUAAServer`,
  ``w = softmax(θ)`` over the accepted sites. The classification form (:mod:`feduq.flare.feduaa_cls`) uses it
  unchanged.

The math is in :mod:`feduq.methods.feduaa`.
"""

from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel

from ..constants import FedUQMetaKey
from ..evidential import dirichlet_from_logits
from ..maps import dirichlet_uncertainty
from ..methods import feduaa as feduaa_math
from ..methods.feduaa import FedUAAServer
from .controller import FedUQController
from .executor import FedUQExecutor, model_digest  # noqa: F401 (model_digest: the name tests use)

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


class FedUAASegExecutor(FedUQExecutor):
    """FedUAA client for segmentation (Wang et al., MICCAI 2023), as FedEvi's baseline.

    * **Loss**: FedEvi's evidential Dice + λ·a(r)·KL with **softplus** evidence
      (:class:`feduq.methods.feduaa.FedUAASegLoss`); optional per-pixel temperature term.
    * **Local head**: the network's output layer (:func:`segmentation_head_keys`: ``head.*`` of FedEvi's U-Net)
      never leaves the site (``train`` and ``submit_model`` send all other entries) and is never
      overwritten by a received model. Validation/test of a received global model use the site's
      own head; the ``test`` task uses the head the site had when it validated that global model
      during training (:class:`feduq.local_entries.LocalEntries`, as for FedBN's normalisation layers), so the test
      scores the model that was selected, and falls back to the current head (logged) for a model it never
      validated. The head and its copies are saved in the site's run folder, so a restarted site keeps them.
    * **Threshold**: after local training the site sends θ_k = the Youden-optimal threshold of the
      pixel uncertainty ``u = C/S`` against the pixel error ``argmax b != y``
      (:class:`feduq.methods.feduaa.YoudenCollector`) in ``meta[FedUQMetaKey.FEDUAA_THRESHOLD]``, or
      None when the ROC is undefined (the server then keeps the site's previous θ).
      ``threshold_source="train"`` (default, the official code's protocol) collects the pixels of
      every training batch of the round as the model trains (train mode, weights changing);
      ``"val"`` runs the trained local model once over the validation split (eval mode).

    Args:
        kl_weight: λ (default 0.01, FedEvi's; FedUAA's segmentation value is not released).
        annealing_step: a(r) = min(1, r / annealing_step), 1-based round (default 10, FedEvi's).
        dice_variant: ``"mean"`` (FedEvi code) or ``"second_moment"``.
        temperature: τ of an optional per-pixel L_Tce on the belief (None: off, as FedEvi's baseline).
        threshold_source: ``"train"`` or ``"val"`` (see above).
        roc_level: ``"pixel"`` (default) or ``"image"`` (image-mean u vs image Dice < cut-off).
        pixels_per_image: pixels drawn per image for the pixel ROC (seeded by seed and round; 0 = all).
        image_dice_cutoff: image-level error cut-off (``roc_level="image"``).
        **kwargs: see :class:`FedUQExecutor`.
    """

    global_model_note = ("FedUAA keeps its segmentation head on the sites: the global model holds the initial head, so "
                         "its scores and uncertainty here are not FedUAA's (each site tests with its own head)")

    def __init__(
        self,
        kl_weight: float = 0.01,
        annealing_step: int = 10,
        dice_variant: str = "mean",
        temperature: float | None = None,
        threshold_source: str = "train",
        roc_level: str = "pixel",
        pixels_per_image: int = 1024,
        image_dice_cutoff: float = 0.5,
        **kwargs,
    ):
        super().__init__(**kwargs)
        if threshold_source not in feduaa_math.THRESHOLD_SOURCES:
            raise ValueError(
                f"FedUAA: threshold_source must be one of {feduaa_math.THRESHOLD_SOURCES}, got {threshold_source!r}"
            )
        self.kl_weight = kl_weight
        self.annealing_step = annealing_step
        self.dice_variant = dice_variant
        self.temperature = temperature
        self.threshold_source = threshold_source
        self.collector = feduaa_math.YoudenCollector(
            level=roc_level, pixels_per_image=pixels_per_image, dice_cutoff=image_dice_cutoff, seed=self.seed
        )
        feduaa_math.FedUAASegLoss(kl_weight, annealing_step, dice_variant, temperature)  # validates early
        self._collect = False
        self._local_keys: frozenset[str] | None = None
        self._last_point: feduaa_math.YoudenPoint | None = None

    # -- method hooks ----------------------------------------------------------------------------
    def local_keys(self) -> frozenset[str]:
        if self._local_keys is None:
            self._local_keys = frozenset(segmentation_head_keys(self.trainer.model))
        return self._local_keys

    def method_loss(self) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``(logits, label, round_index) -> loss`` before collection (segmentation: the evidential Dice form)."""
        # under DP-SGD the Dice is per image: a batch Dice couples the images and voids per-image clipping
        return feduaa_math.FedUAASegLoss(self.kl_weight, self.annealing_step, self.dice_variant, self.temperature,
                                         batch_dice=self.dp is None)

    def prepare_label(self, label: torch.Tensor) -> torch.Tensor:
        """The label as the loss and the Youden collector take it (segmentation: unchanged)."""
        return label

    def build_loss(self):
        method_loss = self.method_loss()

        def loss(logits: torch.Tensor, label: torch.Tensor, round_index: int) -> torch.Tensor:
            label = self.prepare_label(label)
            value = method_loss(logits, label, round_index)
            if self._collect:  # the official protocol: every training sample seen this round
                self.collector.add(logits, label)
            return value

        return loss

    def prob_fn(self, logits: torch.Tensor) -> torch.Tensor:
        return dirichlet_from_logits(logits, evidence="softplus").prob

    def uncertainty_fn(self):
        return dirichlet_uncertainty("softplus")

    primary_uncertainty = "vacuity"  # FedUAA's u = C / S

    def extra_train_meta(self, round_index: int) -> dict:
        if self.threshold_source == "val":
            self.collector.reset(round_index)
            model = self.trainer.model.eval()
            with torch.no_grad():
                for batch in self.val_loader:
                    self.collector.add(model(batch["image"].to(self.device)), batch["label"].to(self.device))
        self._last_point = self.collector.result()
        return {FedUQMetaKey.FEDUAA_THRESHOLD: self._last_point.threshold}

    def extra_train_record(self, round_index: int) -> dict:
        p = self._last_point
        if p is None:
            return {}
        return {
            "feduaa_threshold_reason": p.reason,
            "feduaa_youden_j": None if not np.isfinite(p.youden_j) else round(p.youden_j, 6),
            "feduaa_roc_samples": p.num_samples,
            "feduaa_roc_wrong": p.num_wrong,
        }

    def train(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        round_index = int(received.current_round or 0)
        self.collector.reset(round_index)
        self._last_point = None
        self._collect = self.threshold_source == "train"
        try:
            return super().train(received, fl_ctx)
        finally:
            self._collect = False


class FedUAAController(FedUQController):
    """FedUAA's round: FedUQ's round loop with :class:`feduq.methods.feduaa.FedUAAServer` (softmax(θ) weights).

    Args:
        default_threshold: θ of a site without a usable history (:class:`feduq.methods.feduaa.FedUAAServer`).
        **kwargs: :class:`feduq.flare.controller.FedUQController`.
    """

    def __init__(self, *, num_rounds: int = 200, default_threshold: float = 0.5, **kwargs):
        super().__init__(server=FedUAAServer(default_threshold=default_threshold), num_rounds=num_rounds, **kwargs)
