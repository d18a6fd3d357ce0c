"""FedA3I's layer-wise aggregation (Wu et al., AAAI 2024, §3.3, Eq. 7; official code ``wnn2000/FedAAAI``): the
ten blocks of the U-Net, the per-block mix of the frozen quality and quantity weights, and the weighted average of
every state-dict entry. NumPy, no FLARE; the hand-computed toy is in ``tests/unit/methods/test_feda3i_math.py``.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from ...common.checks import array as _array
from ...common.checks import scalar as _scalar

#: The ten "layers" of the layer-wise mix: the official U-Net's top-level blocks, in depth order.
LAYER_NAMES = ("inc", "down1", "down2", "down3", "down4", "up1", "up2", "up3", "up4", "outc")
#: The same ten blocks of FedEvi's U-Net (:class:`feduq.core.networks.FedEviUNet`), matched as dotted prefixes:
#: ``encoder.0`` = inc (no pool), ``encoder.1..4`` = down1..down4, ``decoder.0..3`` = up1..up4, ``head`` = outc.
FEDEVI_UNET_LAYERS = ("encoder.0", "encoder.1", "encoder.2", "encoder.3", "encoder.4",
                      "decoder.0", "decoder.1", "decoder.2", "decoder.3", "head")



def layer_index(key: str, layer_names: Sequence[str] = LAYER_NAMES) -> int:
    """The layer number j (1-based, as Eq. 7's j ∈ [L]) of a state-dict key.

    A key belongs to layer j when it equals ``layer_names[j-1]`` or starts with it followed by a dot; for
    the default names this is the key's first dotted component (``"down3.maxpool_conv.1..."`` -> 4). The
    code matches by substring (``"inc" in key``); the prefix rule cannot match by accident. Dotted names
    (e.g. :data:`FEDEVI_UNET_LAYERS`) map other networks' blocks.

    Raises:
        ValueError: naming the key when no name (or more than one) matches.
    """
    hits = [j for j, name in enumerate(layer_names, start=1) if key == name or key.startswith(name + ".")]
    if len(hits) != 1:
        why = "matches none" if not hits else f"matches several ({[layer_names[j - 1] for j in hits]})"
        raise ValueError(f"state-dict key {key!r} {why} of the FedA3I layers {list(layer_names)}")
    return hits[0]


def layer_names_of(keys: Sequence[str]) -> tuple[str, ...]:
    """The ten layer names that map every state-dict key exactly once: :data:`LAYER_NAMES` (``feda3i_unet``)
    or :data:`FEDEVI_UNET_LAYERS` (``fedevi_unet``).

    Raises:
        ValueError: neither set maps every key (the message names the first keys).
    """
    for names in (LAYER_NAMES, FEDEVI_UNET_LAYERS):
        try:
            for key in keys:
                layer_index(key, names)
            return names
        except ValueError:
            continue
    raise ValueError(f"the model's entries ({list(keys)[:3]}...) map onto neither {LAYER_NAMES} nor "
                     f"{FEDEVI_UNET_LAYERS}; use network feda3i_unet or fedevi_unet")


def layer_names_for(network: str) -> tuple[str, ...]:
    """The ten layer names of a registered network: ``feda3i_unet`` -> :data:`LAYER_NAMES`,
    ``fedevi_unet`` -> :data:`FEDEVI_UNET_LAYERS` (same ten blocks).

    Raises:
        ValueError: a network without a FedA3I layer map (``light``, ``resnet_tweu``, unknown names).
    """
    table = {"feda3i_unet": LAYER_NAMES, "fedevi_unet": FEDEVI_UNET_LAYERS}
    if network not in table:
        raise ValueError(f"network {network!r} has no FedA3I layer map; known: {sorted(table)}")
    return table[network]


def layer_schedule(j: int, num_layers: int = 10, weight: float = 1.0, power: float = 1.0,
                   bias: float = 0.0) -> float:
    """The trade-off coefficient L(j) = weight · ((j - 1)/(L - 1))^power + bias (paper Eq. 7 with the
    defaults: (j - 1)/(L - 1); weight, power, bias are the official code's hook).

    Values outside [0, 1] (non-default hooks) are returned as they are, as in the code; the mixed weights
    of :func:`layerwise_weights` still sum to 1 but may be negative.

    Args:
        j: layer number in 1..L. num_layers: L >= 2 (L = 1 gives L(1) = bias, a 0/0 made 0).

    Raises:
        ValueError: j outside 1..L, L < 1, non-finite hook values.
    """
    if int(num_layers) != num_layers or num_layers < 1:
        raise ValueError(f"num_layers must be an integer >= 1, got {num_layers!r}")
    if int(j) != j or not 1 <= j <= num_layers:
        raise ValueError(f"layer j must be an integer in 1..{num_layers}, got {j!r}")
    weight, power, bias = (_scalar(v, name) for v, name in ((weight, "weight"), (power, "power"), (bias, "bias")))
    frac = (j - 1) / (num_layers - 1) if num_layers > 1 else 0.0
    return weight * frac**power + bias


def layerwise_weights(keys: Sequence[str], w_quality, w_quantity, layer_names: Sequence[str] = LAYER_NAMES,
                      layer_of: Callable[[str], int] | None = None, num_layers: int | None = None,
                      weight: float = 1.0, power: float = 1.0, bias: float = 0.0) -> dict[str, np.ndarray]:
    """Per state-dict key, the site weights w_ij = L(j) w̄_i + (1 - L(j)) w̃_i (paper Eq. 7).

    Every key is weighted, including BatchNorm running statistics and ``num_batches_tracked`` (the code).
    With the defaults ``inc.*`` (j = 1) gets the pure quantity weights and ``outc.*`` (j = L) the pure
    quality weights.

    Args:
        keys: state-dict names.
        w_quality: ``[K]`` w̄ (sum 1). w_quantity: ``[K]`` w̃ (sum 1).
        layer_names: the L block names for :func:`layer_index` (e.g. :func:`layer_names_for`).
        layer_of: instead of ``layer_names``, a function key -> j in 1..num_layers (another network's map).
        num_layers: L; default ``len(layer_names)``.
        weight, power, bias: :func:`layer_schedule`'s hook.

    Returns:
        ``{key: float64 [K]}``, each summing to 1.

    Raises:
        ValueError: a key no layer matches (naming it), a layer number out of range, weights of different
            lengths, negative, not finite or not summing to 1 (1e-6).
    """
    wq, wn = _array(w_quality, "w_quality", 1), _array(w_quantity, "w_quantity", 1)
    if wq.shape != wn.shape:
        raise ValueError(f"w_quality {wq.shape} and w_quantity {wn.shape} must have one entry per site")
    for arr, name in ((wq, "w_quality"), (wn, "w_quantity")):
        if (arr < 0).any() or abs(arr.sum() - 1.0) > 1e-6:
            raise ValueError(f"{name} must be >= 0 and sum to 1, got {arr.tolist()}")
    L = len(layer_names) if num_layers is None else int(num_layers)
    find = layer_of if layer_of is not None else (lambda key: layer_index(key, layer_names))
    coeff = {j: layer_schedule(j, L, weight, power, bias) for j in range(1, L + 1)}
    out = {}
    for key in keys:
        j = find(key)
        if j not in coeff:
            raise ValueError(f"layer_of({key!r}) = {j!r} is not in 1..{L}")
        out[key] = coeff[j] * wq + (1.0 - coeff[j]) * wn
    return out


def layerwise_average(models: Sequence[Mapping[str, np.ndarray]],
                      weights_per_key: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The layer-wise weighted average θ_j = Σ_i w_ij θ_ij of K site models (paper Eq. 7's use).

    Float entries are summed in float64 and returned in the first model's dtype. Integer entries (e.g.
    ``num_batches_tracked``) are averaged likewise and **rounded to the nearest integer** in their dtype
    (the code's ``load_state_dict`` truncates the float sum instead, which can lose 1 to rounding error).

    Args:
        models: K dicts ``name -> array`` (NumPy arrays or CPU tensors) with the same keys and shapes.
        weights_per_key: ``{name: [K]}`` from :func:`layerwise_weights`, covering every key.

    Returns:
        ``{name: np.ndarray}`` in the models' key order.

    Raises:
        ValueError: no models, differing keys or shapes (naming them), a key without weights, weights of
            the wrong length, a non-numeric entry.
    """
    if not models:
        raise ValueError("layerwise_average needs at least one model")
    keys = list(models[0])
    for i, m in enumerate(models[1:], start=1):
        if set(m) != set(keys):
            diff = sorted(set(m) ^ set(keys))
            raise ValueError(f"model {i} has different keys than model 0: {diff[:5]}")
    out = {}
    for key in keys:
        if key not in weights_per_key:
            raise ValueError(f"no weights for state-dict key {key!r}")
        w = np.asarray(weights_per_key[key], dtype=np.float64)
        if w.shape != (len(models),):
            raise ValueError(f"weights for {key!r} must have shape ({len(models)},), got {w.shape}")
        arrays = [np.asarray(m[key]) for m in models]
        dtype = arrays[0].dtype
        if not (np.issubdtype(dtype, np.floating) or np.issubdtype(dtype, np.integer)):
            raise ValueError(f"state-dict entry {key!r} has non-numeric dtype {dtype}")
        for i, a in enumerate(arrays):
            if a.shape != arrays[0].shape:
                raise ValueError(f"{key!r}: model {i} has shape {a.shape}, model 0 {arrays[0].shape}")
        total = sum(wi * a.astype(np.float64) for wi, a in zip(w, arrays))
        out[key] = np.asarray(np.rint(total) if np.issubdtype(dtype, np.integer) else total).astype(dtype)
    return out
