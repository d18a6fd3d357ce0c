"""FIVA (federated inverse-variance averaging) and FUNAvg's inference merge: the method, no FLARE.

:mod:`.training` is the site's variance tracking, :mod:`.aggregation` the server's fusion and its server part
(:class:`FIVAServer`), :mod:`.inference` the sampling and merging at test time, :mod:`.site` the site parts
(:class:`~.site.FIVASite`, :class:`~.site.FUNAvgSite`) FedUQ's nnU-Net back-end runs (:class:`feduq.flare.ct.CTExecutor`).

Sources: FIVA, "FIVA: Federated Inverse Variance Averaging for Universal CT Segmentation with
Uncertainty Estimation" (MLHC 2025; official code
``asimukaye/fiva``); FUNAvg, Tölle et al. (MICCAI 2024), whose inference merge FIVA reuses. Notes and
where the official code differs from the paper, the docstrings say so ("official code variant").

Per round r:

1. each client tracks a running mean / M2 (:class:`Welford`, paper Eq. 2 and 4) over the parameters
   after every optimiser step (FIVA-P: ``sigma^2_i = M2 / T``) or over the gradients (FIVA-G:
   :func:`fiva_g_variance`, Eq. 3);
2. the server checks each site's variances (:func:`check_variance`) and forms the precision-weighted
   global model and its variance (:func:`inverse_variance_aggregate`, Eq. 5-8);
3. at inference, K backbones are drawn around theta_g (:func:`sample_backbone`, Eq. 9); per head the
   softmax samples give p_bar and u (:func:`head_uncertainty`, Eq. 10-11), the heads are mapped to the
   global label space (:func:`map_to_global`), merged (:func:`merge_heads`) and the background is
   reweighted by ``1 - sum_h u_h`` (:func:`reweight_background`, FUNAvg).

Tensors are dicts ``name -> Tensor`` (a state_dict's floating entries). Internal arithmetic is float64;
results come back in the input dtype and on the input device.
"""

from .aggregation import (
    AGGREGATION_MODES,
    AggregationResult,
    FIVAServer,
    check_variance,
    inverse_variance_aggregate,
    variance_summary,
)
from .inference import (
    SAMPLE_SCALES,
    BackgroundReweight,
    HeadUncertainty,
    global_channels,
    head_uncertainty,
    map_to_global,
    merge_heads,
    reweight_background,
    sample_backbone,
)
from .training import FIVA_G_MODES, VARIANCE_DIVISORS, Welford, fiva_g_variance  # noqa: F401

__all__ = [
    "VARIANCE_DIVISORS", "FIVA_G_MODES", "AGGREGATION_MODES", "SAMPLE_SCALES",
    "Welford", "fiva_g_variance",  # client
    "check_variance", "AggregationResult", "inverse_variance_aggregate", "variance_summary",  # server
    "sample_backbone", "HeadUncertainty", "head_uncertainty",  # inference
    "global_channels", "map_to_global", "merge_heads", "BackgroundReweight", "reweight_background",
    "FIVAServer",
]
