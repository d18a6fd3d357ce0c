"""FedA3I (annotation-quality-aware, layer-wise aggregation): the method, no FLARE.

:mod:`.equations` holds the noise estimate and the weights (Eq. 3-6), :mod:`.layerwise` the layer-wise
aggregation (Eq. 7); :mod:`.parts` the site part (:class:`FedA3ISite`) and the
server part (:class:`FedA3IServer`) FedUQ runs.

Source: FedA3I, Wu et al., "FedA3I: Annotation Quality-Aware Aggregation for Federated Medical Image
Segmentation against Heterogeneous Annotation Noise" (AAAI 2024, §3.3,
Eq. 3-7; official code ``wnn2000/FedAAAI``). Where the official code differs from the paper, the docstrings say so; the hand-computed toy is in
``tests/unit/methods/test_feda3i_math.py``.

Once, at the end of the FedAvg warm-up (round T1 - 1, after aggregation):

1. each site evaluates the global model on its own (noisy) training images: per image the inner and
   outer bands around the label's contour (:func:`band_regions`) and the mean BCE-with-logits over
   each (:func:`band_losses`, Eq. 3-4), then the nanmean over images (:func:`site_noise_statistic`);
   the site sends q_i = (q_i1, q_i2) (per class: [in, out] interleaved, the code's layout);
2. the server splits the sites into G_l ("expand") and G_s ("shrink") with a 2-component GMM
   (:func:`group_sites`), computes the noise strengths (:func:`strengths`, Eq. 5), the quality
   weights IntraGW + InterGW (:func:`quality_weights`, Eq. 6; the code's min-max form
   :func:`quality_weights_minmax` is the same numbers) and the quantity weights (:func:`quantity_weights`);
   :func:`compute_weights` does all of it and returns a :class:`FedA3IWeights`;
3. the weights are **frozen**; every later round aggregates layer-wise: the j-th of L = 10 blocks uses
   w_ij = L(j) w̄_i + (1 - L(j)) w̃_i (:func:`layer_schedule`, :func:`layerwise_weights`, Eq. 7) over
   **every** state-dict entry (:func:`layerwise_average`).

Server arrays are ``float64`` NumPy, K sites in a fixed order; models are dicts ``name -> array``.
"""

from .equations import (
    band_losses,
    band_regions,
    compute_weights,
    DEFAULT_R,
    FedA3IWeights,
    foreground_logit,
    group_sites,
    quality_weights,
    quality_weights_minmax,
    quantity_weights,
    site_noise_statistic,
    STRENGTH_MODES,
    strengths,
)
from .layerwise import (
    FEDEVI_UNET_LAYERS,
    LAYER_NAMES,
    layer_index,
    layer_names_for,
    layer_names_of,
    layer_schedule,
    layerwise_average,
    layerwise_weights,
)
from .parts import ESTIMATE_NOISE, NOISE_Q, FEDA3I_WEIGHTS, FEDA3I_LOSSES, FedA3IServer, FedA3ISite

__all__ = [
    "LAYER_NAMES", "FEDEVI_UNET_LAYERS", "DEFAULT_R", "STRENGTH_MODES",
    "band_regions", "foreground_logit", "band_losses", "site_noise_statistic",  # site: noise estimation
    "group_sites", "strengths", "quality_weights", "quality_weights_minmax", "quantity_weights",  # server
    "FedA3IWeights", "compute_weights",
    "layer_index", "layer_names_of", "layer_names_for", "layer_schedule", "layerwise_weights", "layerwise_average",  # aggregation
    "ESTIMATE_NOISE", "NOISE_Q", "FEDA3I_WEIGHTS", "FEDA3I_LOSSES", "FedA3IServer", "FedA3ISite",  # server, site
]
