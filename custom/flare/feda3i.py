"""FedA3I's FLARE glue (Wu et al., AAAI 2024): annotation-quality-aware, layer-wise aggregation.

* :class:`FedA3IExecutor` -- FedAvg's site with the paper's training (BCE, "CE", or 0.5·BCE + 0.5·Dice, "DC";
  Adam recreated every round) and one extra task, ``estimate_noise``: the received global model is scored on
  the site's own (noisy) training images without augmentation, and the site returns q_k = (mean BCE inside the
  inner boundary band, mean BCE in the outer band) (paper Eq. 3, :func:`feduq.methods.feda3i.band_losses`).
* :class:`FedA3IController` -- FedAvg (n-weighted) for the ``warmup_rounds`` T1; right after round T1 − 1 is
  aggregated, a **noise-estimation exchange** sends that global model to every site; the server groups the sites
  with a 2-component GMM on q, computes each site's strength, the Intra/InterGW quality weights w̄ (r) and the
  quantity weights w̃ = n/Σn, and from then on aggregates every state-dict entry of layer j with
  w_ij = L(j)·w̄_i + (1 − L(j))·w̃_i (Eq. 6–7), the weights **frozen** (official code). A site whose q is NaN, or
  that did not answer, is left out of the grouping (w̄ = 0, named in the log); the weights and the estimate are
  logged (``FEDUQ_FEDA3I``) and checkpointed with the model, so a resumed job keeps them.
"""

from __future__ import annotations

import json

import numpy as np
import torch
import torch.nn.functional as F
from monai.data import DataLoader
from monai.losses import DiceLoss
from nvflare.app_common.abstract.fl_model import FLModel

from .. import data as fdata
from ..constants import FedUQMetaKey
from ..methods import feda3i as fm
from ..methods.feda3i import ESTIMATE_NOISE, FEDA3I_WEIGHTS, NOISE_Q  # noqa: F401 (the names jobs and tools use)
from .controller import FedUQController
from .executor import FedAvgExecutor

LOSSES = ("ce", "dc")


class FedA3IExecutor(FedAvgExecutor):
    """FedA3I site.

    Args:
        loss: ``"ce"`` (BCE; the paper's main rows) or ``"dc"`` (0.5·BCE + 0.5·soft Dice, smooth 1, per image).
        reset_optimizer: recreate Adam every round (official code; no moments across rounds).
        **kwargs: :class:`feduq.flare.executor.FedUQExecutor` (the job: lr 5e-3, lr_gamma 1, batch 8, 5 local epochs,
            256 px, ``intensity: raw``, network ``feda3i_unet``).

    The binary networks' two logits are ``[0, z]`` (``feda3i_unet``), so cross entropy is BCE-with-logits on z
    and softmax is σ(z); other networks give the two-class softmax form of the same loss.
    """

    def __init__(self, loss: str = "ce", reset_optimizer: bool = True, **kwargs):
        super().__init__(**kwargs)
        if loss not in LOSSES or not isinstance(reset_optimizer, bool):
            raise ValueError(f"executor arguments loss={loss!r} (one of {LOSSES}), reset_optimizer={reset_optimizer!r} "
                             "(true or false) out of range")
        self.loss_name, self.reset_optimizer = loss, reset_optimizer
        self._noise_loader = None

    def build_loss(self):
        dice = DiceLoss(include_background=False, to_onehot_y=True, softmax=True, smooth_nr=1.0, smooth_dr=1.0)

        def loss(logits: torch.Tensor, label: torch.Tensor, round_index: int) -> torch.Tensor:
            ce = F.cross_entropy(logits, label[:, 0].long())
            return ce if self.loss_name == "ce" else 0.5 * ce + 0.5 * dice(logits, label)

        return loss

    def train(self, received: FLModel, fl_ctx) -> FLModel:
        if self.reset_optimizer:  # official code: a new Adam every round (constant lr)
            t = self.trainer
            group = t.optimizer.param_groups[0]
            t.optimizer = torch.optim.Adam(t.model.parameters(), lr=group["initial_lr"] if "initial_lr" in group else group["lr"],
                                           betas=group["betas"], weight_decay=group["weight_decay"])
            t.scheduler = torch.optim.lr_scheduler.ExponentialLR(t.optimizer, gamma=t.scheduler.gamma)
        return super().train(received, fl_ctx)

    def extra_tasks(self) -> dict:
        return {ESTIMATE_NOISE: self.estimate_noise}

    def estimate_noise(self, received: FLModel, fl_ctx) -> FLModel:
        """q_k of the received global model on this site's training images (its own labels, no augmentation).

        Returns:
            ``FLModel(meta={feda3i_q: [q_in, q_out], feduq_num_samples: N_k, ...})``; q is NaN when every
            training mask is empty (the server then leaves the site out of the grouping).
        """
        if self._noise_loader is None:
            ds = fdata.get_dataset(self.task_name, self.center, "train", stage="val", site=self.site, **self._common)
            self._noise_loader = DataLoader(ds, batch_size=self.batch_size)
        model = self._load_eval_model(received)
        rows = []
        with torch.no_grad():
            for batch in self._noise_loader:
                logits = model(batch["image"].to(self.device)).float()
                z = logits[:, 1] - logits[:, 0]  # the foreground logit: softmax([0, z]) = sigmoid(z)
                rows.append(fm.band_losses(z.cpu(), (batch["label"][:, 0] > 0).cpu().numpy()))
        per_image = np.concatenate(rows)
        q = fm.site_noise_statistic(per_image)
        skipped = int(np.isnan(per_image).any(axis=1).sum())
        self.log_info(fl_ctx, "FEDUQ_FEDA3I_Q " + json.dumps({"site": self.site, "q": [float(v) for v in q],
                                                               "images": len(per_image), "skipped_empty": skipped}))
        return FLModel(metrics={"feda3i_q_in": float(q[0]), "feda3i_q_out": float(q[1])},
                       meta={NOISE_Q: [float(v) for v in q], FedUQMetaKey.NUM_SAMPLES: len(self.train_ds),
                             FedUQMetaKey.SITE: self.site})


class FedA3IController(FedUQController):
    """FedA3I's rounds: FedUQ's round loop with :class:`feduq.methods.feda3i.FedA3IServer`.

    Args:
        num_rounds, persistor_id, min_clients, train_timeout: :class:`feduq.flare.controller.FedUQController`
            (paper: 100 rounds).
        warmup_rounds, r, layer_weight, layer_power, layer_bias, gmm_seed: :class:`feduq.methods.feda3i.FedA3IServer`.
        aggregator_id: accepted for jobs written before FedUQ's one controller; unused.

    Raises:
        ValueError: a setting out of range (named).
    """

    def __init__(self, *, num_rounds: int = 100, warmup_rounds: int = 10, r: float = 0.5, layer_weight: float = 1.0,
                 layer_power: float = 1.0, layer_bias: float = 0.0, gmm_seed: int = 0,
                 aggregator_id: str = "aggregator", **kwargs):
        server = fm.FedA3IServer(warmup_rounds=warmup_rounds, r=r, layer_weight=layer_weight, layer_power=layer_power,
                                 layer_bias=layer_bias, gmm_seed=gmm_seed)
        super().__init__(server=server, num_rounds=num_rounds, **kwargs)
        self.warmup_rounds = warmup_rounds
        self.aggregator_id = aggregator_id
