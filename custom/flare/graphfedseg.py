"""GraphFedSeg's FLARE glue (Acta Electronica Sinica 2026): the job's executor and controller classes.

The method is :mod:`feduq.methods.graphfedseg`: its site part (:class:`~feduq.methods.graphfedseg.GraphFedSegSite`:
U_k after local training, the alignment term −λ₁·⟨v_i, θ⟩/‖θ‖ when the server sends v_i) and its server part
(:class:`~feduq.methods.graphfedseg.GraphFedSegServer`: each site's own payload, W by Eq. 2, the dual-layer fusion of
Eq. 6–9, the personalised test). The classes here only map the job's arguments onto them.
"""

from __future__ import annotations

from ..methods.graphfedseg import GraphFedSegServer, GraphFedSegSite
from .controller import FedUQController
from .executor import FedAvgExecutor


class GraphFedSegExecutor(FedAvgExecutor):
    """GraphFedSeg site: FedUQ's executor with :class:`feduq.methods.graphfedseg.GraphFedSegSite` (U_k, alignment; its
    ``lam1``, ``align_sign``, ``uncertainty_split``, ``loss``); the other arguments are :class:`feduq.site2d.Site2D`'s."""

    SITE_PART = GraphFedSegSite


class GraphFedSegController(FedUQController):
    """GraphFedSeg's round: FedUQ's round loop with :class:`feduq.methods.graphfedseg.GraphFedSegServer`.

    Its workflow arguments ``gamma``, ``alpha``, ``lam``, ``similarity``, ``send_neighbour`` are
    :class:`feduq.methods.graphfedseg.GraphFedSegServer`'s; the others :class:`feduq.flare.controller.FedUQController`'s
    (a collaboration graph needs ``min_clients`` >= 2; paper: 250 rounds).
    """

    SERVER_PART = GraphFedSegServer
    DEFAULT_ROUNDS = 250
