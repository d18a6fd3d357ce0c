"""FedUAA (Wang et al., MICCAI 2023): TWEU head, its loss, Youden threshold, aggregation weights; no FLARE.

:mod:`.losses` (the site's head outputs and losses), :mod:`.thresholds` (Youden threshold, softmax weights, ROC
samples), :mod:`.parts` (the server part :class:`FedUAAServer`), :mod:`.site` (the site parts :class:`FedUAASegSite`, :class:`FedUAAClsSite`). Paper: M. Wang, L. Wang, X. Xu et al., "Federated
uncertainty-aware aggregation for fundus diabetic retinopathy staging" (FedUAA, MICCAI 2023,
arXiv:2303.13033) (official code
``LooKing9218/FedUAA`` @2e45d2c, read, not run).

Per client and round (paper §2.1-2.2, Alg. 1):

1. the local TWEU head maps features to logits z; evidence ``e = softplus(z)``, ``alpha = e + 1``,
   ``S = sum_k alpha_k``, belief ``b_k = e_k / S``, uncertainty ``u = K / S``
   (:func:`evidential_output`; ``sum_k b_k + u = 1``);
2. loss ``L = mean[L_Ice + a(r) * L_KL] + L_Tce`` (Eq. 4-8; :class:`FedUAALoss`);
3. the Youden-optimal uncertainty threshold theta of ``u`` against the error indicator
   ``1 - [argmax b = y]`` (Eq. 2-3; :func:`youden_threshold`), sent to the server;
4. the server aggregates the shared part with ``w = softmax(theta_1..theta_N)``
   (Alg. 1 line 14; :func:`aggregation_weights`); heads stay local.

Segmentation (FedEvi's FedUAA baseline, **inferred** from the bytecode FedEvi released): FedEvi trains FedUAA
with its evidential Dice + KL on softplus evidence (:class:`FedUAASegLoss`) and, per pixel,
``u = C / S``. How the ROC is formed for segmentation is not released; the choice is a switch of
:class:`YoudenCollector` (``level="pixel"``: a seeded random subsample of pixels per image against
the pixel error; ``level="image"``: the image-mean ``u`` against "image Dice < cut-off").

The Dirichlet pieces are :mod:`feduq.core.evidential`'s (``dirichlet_from_logits(evidence="softplus")``,
``dirichlet_kl_to_uniform``, ``kl_annealing_factor``, ``target_to_one_hot``), not copies.
"""

from .losses import (
    EvidentialOutput,
    FedUAALossComponents,
    evidential_output,
    edl_cross_entropy,
    temperature_cross_entropy,
    FedUAALoss,
    FedUAASegLoss,
)
from .parts import FedUAAServer  # noqa: F401
from .site import LOCAL_BN_MODES, FedUAAClsSite, FedUAASegSite, segmentation_head_keys  # noqa: F401
from .thresholds import (
    ROC_LEVELS,
    THRESHOLD_SOURCES,
    DEFAULT_THRESHOLD,
    YoudenPoint,
    youden_point,
    youden_threshold,
    aggregation_weights,
    resolve_threshold,
    pixel_samples,
    image_samples,
    YoudenCollector,
)

__all__ = [
    "ROC_LEVELS",
    "THRESHOLD_SOURCES",
    "DEFAULT_THRESHOLD",
    "EvidentialOutput",
    "FedUAALossComponents",
    "YoudenPoint",
    "evidential_output",
    "edl_cross_entropy",
    "temperature_cross_entropy",
    "FedUAALoss",
    "FedUAASegLoss",
    "youden_point",
    "youden_threshold",
    "aggregation_weights",
    "resolve_threshold",
    "pixel_samples",
    "image_samples",
    "YoudenCollector",
    "FedUAAServer",
]
