"""GraphFedSeg's vacuity, dual-layer aggregation and alignment term (Acta Electronica Sinica 2026, §2, Eq. 3-9) and
pFedGraph's alignment (ICML 2023). NumPy and torch, no FLARE. The collaboration graph and the model similarities
are :mod:`.graph`; how they make up a round is in :mod:`feduq.methods.graphfedseg`'s docstring; the toys are in
``tests/unit/methods/test_graphfedseg_math.py``.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from ...common.checks import array as _array
from ...common.checks import non_negative as _non_negative
from ...common.checks import scalar as _scalar
from .graph import DEFAULT_LAMBDA, model_entry, is_floating, select_keys, flatten


# --------------------------------------------------------------------------------------------------
# Client: vacuity (Eq. 3-4)
# --------------------------------------------------------------------------------------------------
def vacuity(logits: Tensor, clamp_max: float = 80.0) -> Tensor:
    """Per-pixel vacuity ``u = C / S`` (GraphFedSeg §2.2.1, Algorithm 1): ``e = exp(z)``, ``a = e + 1``,
    ``S = sum_c a_c``. Logits are clamped from above at ``clamp_max`` before ``exp`` (FedEvi's code:
    80, keeps float32 finite); half/bfloat16 inputs are computed in float32. ``logits``: float tensor
    ``[B, C, *spatial]`` (``[B, C, H, W]`` for 2-D), any device.

    Returns:
        tensor ``[B, *spatial]`` in (0, 1], float32/float64, input device. Zero logits give C/2C = 1/2.
    Raises:
        ValueError: not a floating tensor or fewer than 2 dims.
    """
    if not (isinstance(logits, Tensor) and logits.is_floating_point() and logits.dim() >= 2):
        raise ValueError(f"logits must be a floating tensor [B, C, *spatial], got {getattr(logits, 'shape', logits)!r}")
    z = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    strength = (torch.exp(torch.clamp(z, max=clamp_max)) + 1.0).sum(dim=1)
    return z.shape[1] / strength


def image_vacuity(logits: Tensor, clamp_max: float = 80.0) -> Tensor:
    """Per-image mean vacuity ``u_image`` (GraphFedSeg Eq. 3): ``[B, C, *spatial]`` -> ``[B]``.

    Raises ValueError as :func:`vacuity`."""
    u = vacuity(logits, clamp_max)
    return u.reshape(u.shape[0], -1).mean(dim=1)


def mean_vacuity(batches: Tensor | Iterable[Tensor], clamp_max: float = 80.0) -> float:
    """Client uncertainty ``U_j`` = mean over images of ``u_image`` (GraphFedSeg Eq. 4; Algorithm 1's
    ``U_i = sum U_i |D_i|`` is a typo for the division by |D_i|). Accumulated in float64. ``batches``: one
    logits tensor ``[B, C, *spatial]`` or an iterable of them (e.g. over a loader).

    Returns:
        Python float.
    Raises:
        ValueError: as :func:`vacuity`; no images.
    """
    total, count = 0.0, 0
    for logits in [batches] if isinstance(batches, Tensor) else batches:
        per_image = image_vacuity(logits, clamp_max)
        total += float(per_image.double().sum())
        count += per_image.numel()
    if count == 0:
        raise ValueError("batches must contain at least one image")
    return total / count


# --------------------------------------------------------------------------------------------------
# Server: dual-layer aggregation (Eq. 6-9)
# --------------------------------------------------------------------------------------------------
class DualLayerResult(NamedTuple):
    global_model: dict  #: theta_global = lam theta_base + (1 - lam) theta_graph (Eq. 6), input dtypes
    neighbourhood: list  #: theta_neigh[i] = sum_j W_ij theta_j (Eq. 8), one dict per client
    weights: np.ndarray  #: effective w_j with theta_global = sum_j w_j theta_j (:func:`effective_weights`)


def _check_p_w(p, W, lam) -> tuple[np.ndarray, np.ndarray, float]:
    p = _array(p, "p", 1)
    _non_negative(p, "p")
    if abs(p.sum() - 1.0) > 1e-6:
        raise ValueError(f"p must sum to 1, got {p.sum()!r}")
    W = _array(W, "W", 2, (p.size, p.size))
    _non_negative(W, "W", tol=1e-12)
    bad = np.flatnonzero(np.abs(W.sum(axis=1) - 1.0) > 1e-6)
    if bad.size:
        raise ValueError(f"W row {int(bad[0])} must sum to 1, got {W[bad[0]].sum()!r}")
    return p, W, _scalar(lam, "lam", 0.0, 1.0)


def effective_weights(p, W, lam: float = DEFAULT_LAMBDA) -> np.ndarray:
    """``w_j = lam p_j + (1 - lam) (1/K) sum_i W_ij`` (collapse of GraphFedSeg Eq. 6-9 [derived]).

    Args:
        p: ``[K]`` shares summing to 1. W: ``[K, K]`` rows on the simplex. lam: in [0, 1] (paper 0.2).
    Returns:
        ``np.ndarray`` float64 ``[K]`` summing to 1.
    Raises:
        ValueError: bad shapes, non-finite/negative entries, sums off by > 1e-6, ``lam`` outside [0, 1].
    """
    p, W, lam = _check_p_w(p, W, lam)
    return lam * p + (1.0 - lam) * W.mean(axis=0)


def dual_layer_aggregate(models: Sequence[Mapping[str, object]], p, W, lam: float = DEFAULT_LAMBDA) -> DualLayerResult:
    """Dual-layer aggregation (GraphFedSeg Eq. 6-9; Algorithm 1).

    ``theta_base = sum_j p_j theta_j`` (Eq. 7), ``theta_neigh[i] = sum_j W_ij theta_j`` (Eq. 8; also
    pFedGraph's personalised models), ``theta_graph = mean_i theta_neigh[i]`` (Eq. 9),
    ``theta_global = lam theta_base + (1 - lam) theta_graph`` (Eq. 6). Computed in float64 and cast back
    to each entry's dtype (tensors keep their device).

    Args:
        models: K dicts ``name -> floating np.ndarray | Tensor`` with the same keys and shapes.
        p: ``[K]`` shares summing to 1. W: ``[K, K]`` rows on the simplex. lam: in [0, 1] (paper 0.2).
    Returns:
        :class:`DualLayerResult` ``(global_model, neighbourhood, weights)``; dicts keep models[0]'s key order.
    Raises:
        ValueError: as :func:`effective_weights`; ``len(models) != K``; a missing/unexpected key, a
            shape mismatch, a non-floating or non-finite entry (names the key and client).
    """
    p, W, lam = _check_p_w(p, W, lam)
    if len(models) != p.size:
        raise ValueError(f"models must have {p.size} entries (len(p)), got {len(models)}")
    ref = models[0]
    for j, m in enumerate(models):
        extra = [k for k in m if k not in ref]
        if extra:
            raise ValueError(f"models[{j}] has unexpected keys {extra[:5]}")
    glob, neigh = {}, [{} for _ in models]
    for k, v0 in ref.items():
        vals = [model_entry(m, k, j) for j, m in enumerate(models)]
        for j, v in enumerate(vals):
            if not is_floating(v):
                raise ValueError(f"models[{j}][{k!r}] must be floating (filter buffers such as num_batches_tracked)")
            if tuple(np.shape(v)) != tuple(np.shape(v0)):
                raise ValueError(f"models[{j}][{k!r}] has shape {tuple(np.shape(v))}, "
                                 f"models[0] has {tuple(np.shape(v0))}")
        dev = v0.device if isinstance(v0, Tensor) else torch.device("cpu")
        x = torch.stack([torch.as_tensor(v).detach().to(dev, torch.float64) for v in vals])
        finite = torch.isfinite(x.reshape(len(vals), -1)).all(dim=1).cpu().numpy()
        if not finite.all():
            raise ValueError(f"models[{int(np.flatnonzero(~finite)[0])}][{k!r}] has non-finite entries")
        nb = torch.tensordot(torch.as_tensor(W, device=dev), x, dims=1)
        g = lam * torch.tensordot(torch.as_tensor(p, device=dev), x, dims=1) + (1.0 - lam) * nb.mean(dim=0)
        if isinstance(v0, Tensor):
            cast = lambda t: t.to(v0.dtype)  # noqa: E731
        else:
            cast = lambda t: t.numpy().astype(np.asarray(v0).dtype)  # noqa: E731
        glob[k] = cast(g)
        for i in range(p.size):
            neigh[i][k] = cast(nb[i])
    return DualLayerResult(glob, neigh, lam * p + (1.0 - lam) * W.mean(axis=0))


def aggregate_with_buffers(models: Sequence[Mapping[str, object]], p, W, lam: float = DEFAULT_LAMBDA) -> DualLayerResult:
    """:func:`dual_layer_aggregate` over the floating entries of full state dicts; integer buffers (BatchNorm's
    ``num_batches_tracked``) are not parameters and the paper is silent on them: each is averaged with the
    effective weights w and rounded (as FedUQ's FedAvg aggregation does), the same value in the global and every
    neighbourhood model.

    Args / Raises: as :func:`dual_layer_aggregate` (keys and shapes checked on the floating entries).
    Returns:
        :class:`DualLayerResult` whose dicts hold every key of ``models[0]``, buffers keeping their dtype.
    """
    floating = [k for k, v in models[0].items() if is_floating(v)]
    fused = dual_layer_aggregate([{k: m[k] for k in floating if k in m} | {k: v for k, v in m.items() if
                                  k not in models[0]} for m in models], p, W, lam)
    w = fused.weights
    buffers = {}
    for k, v0 in models[0].items():
        if k in fused.global_model:
            continue
        vals = [np.asarray(model_entry(m, k, j), dtype=np.float64) for j, m in enumerate(models)]
        mean = np.rint(sum(wj * x for wj, x in zip(w, vals)))
        buffers[k] = (torch.as_tensor(mean).to(v0.dtype) if isinstance(v0, Tensor)
                      else mean.astype(np.asarray(v0).dtype))
    order = list(models[0])
    glob = {k: (fused.global_model | buffers)[k] for k in order}
    neigh = [{k: (nb | buffers)[k] for k in order} for nb in fused.neighbourhood]
    return DualLayerResult(glob, neigh, w)


# --------------------------------------------------------------------------------------------------
# Client: alignment regulariser (Eq. 5, pFedGraph form)
# --------------------------------------------------------------------------------------------------
def alignment_keys(params: Mapping[str, object]) -> list[str]:
    """The keys v_i and the alignment term run over, on the server and the site alike: the **floating** entries of
    a model, sorted by name. Integer buffers (BatchNorm's ``num_batches_tracked``, a count in the thousands) are
    not parameters: left in, they dominate ``||theta||`` (99.99997 % of the squared norm of a small BatchNorm model)
    and make every cosine ~1, as the server's similarity (:func:`flatten`) already excludes them.

    Returns:
        ``sorted(k for k, v in params.items() if v is floating)``.
    """
    return sorted(k for k, v in params.items() if is_floating(v))


def neighbour_direction(models: Sequence[Mapping[str, object]], W_row, keys: Sequence[str] | None = None) -> np.ndarray:
    """``v_i = sum_j W_ij theta_j / ||theta_j||`` over the flattened models (pFedGraph code variant of
    GraphFedSeg Eq. 5: ``sum_j W_ij cos(theta, theta_j) = <v_i, theta> / ||theta||``).

    Args:
        models: K dicts (previous-round local models). W_row: ``[K]`` row i of W (finite, >= 0).
        keys: as :func:`flatten`; must match the keys/order the client flattens in :func:`alignment_term`
            (pFedGraph's code mixes state_dict and parameters(), which breaks with BN).
    Returns:
        ``np.ndarray`` float64 ``[D]``.
    Raises:
        ValueError: ``len(W_row) != K``, bad ``W_row``, flatten errors, size mismatch or a zero model (names it).
    """
    w = _array(W_row, "W_row", 1)
    _non_negative(w, "W_row")
    if w.size != len(models):
        raise ValueError(f"W_row must have {len(models)} entries (len(models)), got {w.size}")
    keys = select_keys(models[0], keys, "neighbour_direction")
    v = None
    for j, m in enumerate(models):
        x = flatten(m, keys)
        norm = np.linalg.norm(x)
        if norm == 0.0:
            raise ValueError(f"models[{j}] has zero norm")
        if v is not None and x.size != v.size:
            raise ValueError(f"models[{j}] flattens to {x.size} values, models[0] to {v.size}")
        v = w[j] * x / norm if v is None else v + w[j] * x / norm
    return v


def alignment_term(theta: Tensor | Mapping[str, Tensor] | Sequence[Tensor], direction, lam1: float,
                   sign: int = 1, keys: Sequence[str] | None = None) -> Tensor:
    """``-sign * lam1 * <v_i, theta> / ||theta||``, to add to the local loss (GraphFedSeg Eq. 5).

    ``sign=+1`` (default) maximises the similarity, as the paper states; ``sign=-1`` reproduces
    pFedGraph's code (``loss += lam * ...``, lam = 0.01; open issue MediaBrain-SJTU/pFedGraph#1).
    The paper writes ``-(lam1/2) sum_j W_ij cos``, so paper lam1 = 2 x ``lam1`` here; the paper gives
    **no value** for lam1 (not the fusion lambda = 0.2). ``||theta|| > 0`` is assumed (no host sync).

    Args:
        theta: live parameters: a 1-D tensor, a sequence of tensors, or a dict (flattened over ``keys``,
            default its floating entries in order, as :func:`flatten`); may require grad.
        direction: ``[D]`` v_i from :func:`neighbour_direction` (np.ndarray or tensor).
        lam1: weight (finite, >= 0). sign: +1 or -1.
    Returns:
        scalar tensor (theta's dtype/device), differentiable w.r.t. theta.
    Raises:
        ValueError: ``sign`` not +-1, bad ``lam1``, no tensors, or ``direction`` size != theta size.
    """
    if sign not in (1, -1):
        raise ValueError(f"sign must be +1 or -1, got {sign!r}")
    lam1 = _scalar(lam1, "lam1", minimum=0.0)
    if isinstance(theta, Mapping):
        theta = [theta[k] for k in select_keys(theta, keys, "alignment_term")]
    if not isinstance(theta, Tensor) and len(theta) == 0:
        raise ValueError("theta must contain at least one tensor")
    flat = theta.reshape(-1) if isinstance(theta, Tensor) else torch.cat([t.reshape(-1) for t in theta])
    v = torch.as_tensor(direction).reshape(-1).to(device=flat.device, dtype=flat.dtype)
    if v.numel() != flat.numel():
        raise ValueError(f"direction has {v.numel()} values, theta has {flat.numel()}")
    return -sign * lam1 * torch.dot(v, flat) / torch.linalg.vector_norm(flat)
