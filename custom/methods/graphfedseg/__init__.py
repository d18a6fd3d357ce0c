"""GraphFedSeg (uncertainty collaboration graph + dual-layer aggregation): the method, no FLARE.

:mod:`.equations` holds the math (and pFedGraph's variants); :mod:`.parts` the site part
(:class:`GraphFedSegSite`) and the server part (:class:`GraphFedSegServer`) FedUQ runs.

Sources: GraphFedSeg, Du et al., "Personalized Federated Medical Image Segmentation Based on Uncertain
Collaboration Graph and Dual-Layer Aggregation Mechanism" (Acta Electronica Sinica 2026, 54(3):1078,
doi 10.12263/DZXB.20250856, in Chinese; §2, Eq. 2-9,
Algorithm 1); pFedGraph, Ye et al., "Personalized Federated Learning with Inferred Collaboration Graphs"
(ICML 2023; code ``MediaBrain-SJTU/pFedGraph``). Ambiguities are named where they are resolved; the toys are in ``tests/unit/methods/test_graphfedseg_math.py``.

Per round (Algorithm 1): clients report theta_j, n_j and U_j (:func:`mean_vacuity`, Eq. 3-4); the server
forms p_j = n_j / sum n, the cosines (:func:`similarity_matrix`: ``"model"`` = paper, ``"update"`` =
pFedGraph) and W (:func:`collaboration_graph`, Eq. 2, solved exactly by :func:`project_to_simplex`;
pFedGraph: :func:`pfedgraph_graph`), then :func:`dual_layer_aggregate` (Eq. 6-9). Clients may add
:func:`alignment_term` (Eq. 5, pFedGraph form) built from :func:`neighbour_direction`.

Server arrays are ``float64`` NumPy, K clients in a fixed order; models are dicts ``name -> array/tensor``.
"""

from .equations import (
    vacuity,
    image_vacuity,
    mean_vacuity,
    DualLayerResult,
    effective_weights,
    dual_layer_aggregate,
    aggregate_with_buffers,
    neighbour_direction,
    alignment_term,
    alignment_keys,
)
from .graph import (
    ALPHA_PER_CLIENT,
    DEFAULT_GAMMA,
    DEFAULT_LAMBDA,
    PFEDGRAPH_ALPHA,
    PFEDGRAPH_CLIP,
    SIMILARITY_MODES,
    project_to_simplex,
    default_alpha,
    collaboration_row,
    collaboration_graph,
    pfedgraph_graph,
    initial_graph,
    flatten,
    cosine_matrix,
    similarity_matrix,
)
from .parts import NEIGHBOUR_KEY, GraphFedSegServer, GraphFedSegSite  # noqa: F401

__all__ = [
    "ALPHA_PER_CLIENT", "DEFAULT_GAMMA", "DEFAULT_LAMBDA", "PFEDGRAPH_ALPHA", "PFEDGRAPH_CLIP", "SIMILARITY_MODES",
    "project_to_simplex", "default_alpha", "collaboration_row", "collaboration_graph",  # graph
    "pfedgraph_graph", "initial_graph",
    "flatten", "cosine_matrix", "similarity_matrix",  # similarity
    "vacuity", "image_vacuity", "mean_vacuity",  # uncertainty
    "DualLayerResult", "effective_weights", "dual_layer_aggregate", "aggregate_with_buffers",  # aggregation
    "neighbour_direction", "alignment_term", "alignment_keys",  # client regulariser
    "NEIGHBOUR_KEY", "GraphFedSegServer", "GraphFedSegSite",  # the server and site parts
]
