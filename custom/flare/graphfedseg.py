"""GraphFedSeg's FLARE glue (Acta Electronica Sinica 2026): the uncertainty collaboration graph on the server.

* :class:`GraphFedSegExecutor` -- FedAvg's site with two additions: after local training it sends U_k,
  the mean vacuity u = C/S (exp evidence) over its training images (or validation images, a switch);
  and, when the server sends its neighbour vector v_i, it adds the alignment term
  −λ₁·⟨v_i, θ⟩/‖θ‖ (Eq. 5 in pFedGraph's form) to every step's loss.
* :class:`GraphFedSegController` -- per round: every site trains from θ_global (each receives **its own**
  payload: the global model plus, from round 1 on and when λ₁ > 0, its v_i = Σ_j W_ij θ_j/‖θ_j‖ over
  the previous round's local models); the server part (:class:`feduq.methods.graphfedseg.GraphFedSegServer`)
  validates θ_k, n_k and U_k, solves each row of W as a projection onto the simplex (Eq. 2), and fuses
  θ_global = λ Σ p_j θ_j + (1 − λ) mean_i Σ_j W_ij θ_j (Eq. 6–9). W and the effective weights are
  logged every round (``FEDUQ_GRAPHFEDSEG``) and checkpointed with the model.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from nvflare.app_common.abstract.fl_model import FLModel

from ..constants import FedUQMetaKey
from ..engine import per_image_statistics
from ..maps import softmax_entropy_and_vacuity
from ..methods.graphfedseg import (
    DEFAULT_GAMMA,
    DEFAULT_LAMBDA,
    NEIGHBOUR_KEY,
    GraphFedSegServer,
    alignment_keys,
    alignment_term,
    image_vacuity,
)
from .controller import FedUQController
from .executor import FedAvgExecutor


class GraphFedSegExecutor(FedAvgExecutor):
    """GraphFedSeg site: FedAvg's training plus U_k and the alignment term.

    Args:
        lam1: weight λ₁ of the alignment term (the paper gives no value; pFedGraph's code uses 0.01);
            0 switches it off (the server then sends no v_i).
        align_sign: +1 maximises the similarity with the neighbours, as the paper states; −1 is
            pFedGraph's code (its sign is reversed).
        uncertainty_split: ``"train"`` (default: the training images after local training) or ``"val"``.
        **kwargs: :class:`feduq.flare.executor.FedUQExecutor`.
    """

    def __init__(self, lam1: float = 0.01, align_sign: int = 1, uncertainty_split: str = "train", **kwargs):
        super().__init__(**kwargs)
        if not (isinstance(lam1, (int, float)) and math.isfinite(lam1) and lam1 >= 0):
            raise ValueError(f"executor argument lam1={lam1!r}: expected a finite number >= 0")
        if align_sign not in (1, -1) or uncertainty_split not in ("train", "val"):
            raise ValueError(f"executor arguments align_sign={align_sign!r} (1 or -1), "
                             f"uncertainty_split={uncertainty_split!r} ('train' or 'val') out of range")
        self.lam1, self.align_sign, self.uncertainty_split = float(lam1), int(align_sign), uncertainty_split
        self._direction = None

    def train(self, received: FLModel, fl_ctx):
        params = dict(received.params)
        self._direction = params.pop(NEIGHBOUR_KEY, None)
        received.params = params
        return super().train(received, fl_ctx)

    def regularizer(self, received: FLModel):
        if self._direction is None or self.lam1 == 0:
            return None
        keys = alignment_keys(self._shared_params())  # floating entries, sorted: the server's v_i keys
        direction = torch.as_tensor(np.asarray(self._direction))

        def term(model: torch.nn.Module) -> torch.Tensor:
            named = dict(model.named_parameters())
            state = model.state_dict(keep_vars=True)
            return alignment_term({k: named.get(k, state[k]) for k in keys}, direction, self.lam1, self.align_sign, keys)
        return term

    def uncertainty_fn(self):
        return softmax_entropy_and_vacuity()

    primary_uncertainty = "vacuity"  # GraphFedSeg Eq. 3

    def extra_train_record(self, round_index: int) -> dict:
        return {"lam1": self.lam1, "neighbour_vector": self._direction is not None}

    def extra_train_meta(self, round_index: int) -> dict:
        from monai.data import DataLoader

        ds = self.train_ds if self.uncertainty_split == "train" else self.val_ds
        stats = per_image_statistics(self.trainer.model, DataLoader(ds, batch_size=self.batch_size), self.device,
                                     lambda logits: {"u": image_vacuity(logits.float())})
        return {FedUQMetaKey.MEAN_VACUITY: float(np.mean(stats["u"]))}


class GraphFedSegController(FedUQController):
    """GraphFedSeg's round: FedUQ's round loop with :class:`feduq.methods.graphfedseg.GraphFedSegServer`.

    Args:
        num_rounds, persistor_id, min_clients, train_timeout: :class:`feduq.flare.controller.FedUQController`
            (a collaboration graph needs ``min_clients`` >= 2).
        gamma, alpha, lam, similarity, send_neighbour: :class:`feduq.methods.graphfedseg.GraphFedSegServer`.
        aggregator_id: accepted for jobs written before FedUQ's one controller; unused.
    """

    def __init__(self, *, num_rounds: int = 250, gamma: float = DEFAULT_GAMMA, alpha: float | None = None,
                 lam: float = DEFAULT_LAMBDA, similarity: str = "model", send_neighbour: bool = True,
                 aggregator_id: str = "aggregator", **kwargs):
        server = GraphFedSegServer(gamma=gamma, alpha=alpha, lam=lam, similarity=similarity, send_neighbour=send_neighbour)
        super().__init__(server=server, num_rounds=num_rounds, **kwargs)
        self.aggregator_id = aggregator_id
