"""FedEvi's FLARE glue (Chen et al., MICCAI 2024): the client executor and the server workflow.

* :class:`FedEviExecutor` -- the site side: evidential training, and the statistics A_k (after
  training) and G_k (the ``validate_surrogate`` task).
* :class:`FedEviController` -- FedEvi's round (§2.3, Eq. 6-8) as it must run in a real federation:
  clients train and return θ_k, N_k and A_k; the server sends the surrogate
  θ̂ = Σ_k β_k^{r-1} θ_k out as a second task; clients return G_k; the server updates β and
  aggregates θ^r = Σ_k β_k^r θ_k.

The weight math is in :mod:`feduq.methods.fedevi`; the evidential loss and uncertainties in
:mod:`feduq.evidential`.
"""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel

from ..constants import FedUQMetaKey, FedUQTask
from ..engine import per_image_statistics
from ..evidential import FedEviLoss, dirichlet_from_logits, image_uncertainty_means
from ..maps import dirichlet_uncertainty
from ..methods.fedevi import FedEviConfig, FedEviServer
from .controller import FedUQController
from .executor import FedUQExecutor


class FedEviExecutor(FedUQExecutor):
    """FedEvi client (Chen et al., MICCAI 2024): evidential training plus the two statistics.

    After local training the site sends A_k = mean over its validation images of U_ale under θ_k
    (and R_k = mean of 1/U_ale, for the paper's form of the reliability term); in the same round it
    answers ``validate_surrogate`` with G_k = mean U_epi of the surrogate model θ̂ on its validation
    images (FedEvi Eq. 5-8, official code).

    Args:
        kl_weight: λ of the KL regulariser (0.01 for polyp and prostate; 1e-5 for fundus).
        annealing_step: a(r) = min(1, r / annealing_step) with 1-based round r (official code).
        dice_variant: ``"mean"`` (official code) or ``"second_moment"`` (Dirichlet E[ρ²]).
        clamp_max: upper clamp of the logits before exp (official code: 80).
        **kwargs: see :class:`FedUQExecutor`.
    """

    def __init__(
        self,
        kl_weight: float = 0.01,
        annealing_step: int = 10,
        dice_variant: str = "mean",
        clamp_max: float = 80.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.kl_weight = kl_weight
        self.annealing_step = annealing_step
        self.dice_variant = dice_variant
        self.clamp_max = clamp_max
        try:
            self.build_loss()  # validates kl_weight, annealing_step, dice_variant, clamp_max now, not at round 0
        except (TypeError, ValueError) as e:
            raise ValueError(f"FedEvi: {e}") from None

    def build_loss(self):
        return FedEviLoss(
            kl_weight=self.kl_weight,
            annealing_step=self.annealing_step,
            dice_variant=self.dice_variant,
            clamp_max=self.clamp_max,
            batch_dice=self.dp is None,  # DP-SGD: per-image Dice, so the loss is a mean of per-image losses
        )

    def prob_fn(self, logits: torch.Tensor) -> torch.Tensor:
        return dirichlet_from_logits(logits, clamp_max=self.clamp_max).prob

    def uncertainty_fn(self):
        return dirichlet_uncertainty("exp", self.clamp_max)

    def _uncertainty(self, model: torch.nn.Module) -> dict[str, np.ndarray]:
        return per_image_statistics(
            model, self.val_loader, self.device, lambda lo: image_uncertainty_means(lo, clamp_max=self.clamp_max)
        )

    def extra_train_meta(self, round_index: int) -> dict:
        u_ale = self._uncertainty(self.trainer.model)["aleatoric"]
        return {
            FedUQMetaKey.MEAN_ALEATORIC: float(u_ale.mean()),
            FedUQMetaKey.MEAN_INV_ALEATORIC: float((1.0 / u_ale).mean()),
        }

    def extra_tasks(self):
        return {FedUQTask.VALIDATE_SURROGATE: self.validate_surrogate}

    def validate_surrogate(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        start = time.perf_counter()
        g = float(self._uncertainty(self._load_eval_model(received))["epistemic"].mean())
        record = {"site": self.site, "round": received.current_round, "u_epi": g,
                  "seconds": round(time.perf_counter() - start, 3)}
        self.log_info(fl_ctx, "FEDEVI_SURROGATE " + json.dumps(record))
        return FLModel(metrics={"u_epi": g}, meta={FedUQMetaKey.MEAN_EPISTEMIC: g})


class FedEviController(FedUQController):
    """FedEvi's two-exchange round: FedUQ's round loop with :class:`feduq.methods.fedevi.FedEviServer`.

    Per round r (0-based here; FedEvi's 1-based r is r + 1): ``train`` -> θ_k, N_k, A_k, R_k; every update is
    checked; ``validate_surrogate`` with θ̂ = Σ β_k^{r-1} θ_k -> G_k; β^r by Eq. 8; θ^r = Σ β_k^r θ_k. A site that
    fails or times out in either exchange is left out of that round (its β carried forward, the others
    renormalised); fewer valid answers than the quorum stops the job with ``FEDUQ_JOB_FAILED`` naming every
    failed site and why. β is logged (``FEDEVI_BETA``) and checkpointed with the model.

    Args:
        num_rounds, persistor_id, min_clients, train_timeout: :class:`feduq.flare.controller.FedUQController`.
        surrogate_timeout: seconds to wait for ``validate_surrogate`` (0 = no limit).
        delta, reliability, clip_min, renormalize_after_clip, initial_weights: FedEvi switches,
            see :class:`feduq.methods.fedevi.FedEviConfig` for meanings and defaults.
        aggregator_id: accepted for jobs written before FedUQ's one controller; unused.
    """

    timeout_args = FedEviServer.timeout_args

    def __init__(self, *, num_rounds: int = 200, surrogate_timeout: int = 0, delta: float = 1.0,
                 reliability: str = "code", clip_min: float = 1e-3, renormalize_after_clip: bool = False,
                 initial_weights: str = "samples", aggregator_id: str = "aggregator", **kwargs):
        config = FedEviConfig(delta=delta, reliability=reliability, clip_min=clip_min,
                              renormalize_after_clip=renormalize_after_clip, initial=initial_weights)
        super().__init__(server=FedEviServer(config), num_rounds=num_rounds, **kwargs)
        self.surrogate_timeout = surrogate_timeout
        self.aggregator_id = aggregator_id
