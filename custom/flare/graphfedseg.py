"""GraphFedSeg's FLARE glue (Acta Electronica Sinica 2026): the job's executor and controller classes.

The method is :mod:`feduq.methods.graphfedseg`: its site part (:class:`~feduq.methods.graphfedseg.GraphFedSegSite`:
U_k after local training, the alignment term −λ₁·⟨v_i, θ⟩/‖θ‖ when the server sends v_i) and its server part
(:class:`~feduq.methods.graphfedseg.GraphFedSegServer`: each site's own payload, W by Eq. 2, the dual-layer fusion of
Eq. 6–9, the personalised test). The classes here only map the job's arguments onto them.
"""

from __future__ import annotations

from ..methods.graphfedseg import DEFAULT_GAMMA, DEFAULT_LAMBDA, GraphFedSegServer, GraphFedSegSite
from .controller import FedUQController
from .executor import FedAvgExecutor


class GraphFedSegExecutor(FedAvgExecutor):
    """GraphFedSeg site: FedUQ's executor with :class:`feduq.methods.graphfedseg.GraphFedSegSite` (U_k, alignment; its
    ``lam1``, ``align_sign``, ``uncertainty_split``, ``loss``); the other arguments are :class:`feduq.site2d.Site2D`'s."""

    SITE_PART = GraphFedSegSite


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
