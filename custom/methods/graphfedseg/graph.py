"""GraphFedSeg's uncertainty collaboration graph (Acta Electronica Sinica 2026, §2, Eq. 2) solved exactly on the
simplex, pFedGraph's graph (ICML 2023) and the cosine similarity of the sites' models or updates. NumPy, no FLARE;
the toys are in ``tests/unit/methods/test_graphfedseg_math.py``.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from ...common.checks import array as _array
from ...common.checks import non_negative as _non_negative
from ...common.checks import scalar as _scalar


ALPHA_PER_CLIENT = 0.08  # paper: alpha = K x 0.08


DEFAULT_GAMMA = 0.4  # paper: uncertainty penalty, searched over [0, 1.4]


DEFAULT_LAMBDA = 0.2  # paper: fusion coefficient of Eq. 6


PFEDGRAPH_ALPHA = 0.8  # pFedGraph code --alpha (weight of the quadratic term)


PFEDGRAPH_CLIP = -0.9  # pFedGraph code: d = -cos < -0.9 is set to -1


SIMILARITY_MODES = ("model", "update")


# --------------------------------------------------------------------------------------------------
# Server: collaboration graph (Eq. 2, Algorithm 1) and pFedGraph's QP
# --------------------------------------------------------------------------------------------------
def project_to_simplex(v) -> np.ndarray:
    """Euclidean projection ``argmin_{x >= 0, sum x = 1} ||x - v||^2`` (exact, sort-based, O(K log K)).

    Duchi et al. (ICML 2008) / Wang & Carreira-Perpinan (arXiv:1309.1541): sort ``u`` descending,
    ``rho = max{k : u_k - (sum_{r<=k} u_r - 1)/k > 0}``, ``tau = (sum_{r<=rho} u_r - 1)/rho``,
    ``x = max(v - tau, 0)``. Input: 1-D sequence/array of K finite numbers.

    Returns:
        ``np.ndarray`` float64 ``[K]``, entries >= 0 summing to 1 (up to rounding).
    Raises:
        ValueError: ``v`` empty, not 1-D or non-finite (names the index).
    """
    v = _array(v, "v", 1)
    u = np.sort(v)[::-1]
    css = np.cumsum(u) - 1.0
    k = np.arange(1, v.size + 1)
    rho = int(np.flatnonzero(u - css / k > 0)[-1])  # k=1 always satisfies the test
    tau = css[rho] / (rho + 1)
    return np.maximum(v - tau, 0.0)


def _num_clients(num_clients: int) -> int:
    if isinstance(num_clients, bool) or not isinstance(num_clients, (int, np.integer)) or num_clients < 1:
        raise ValueError(f"num_clients must be an integer >= 1, got {num_clients!r}")
    return int(num_clients)


def default_alpha(num_clients: int) -> float:
    """Paper default ``alpha = 0.08 K`` (GraphFedSeg §2.2.1; 0.32 for K = 4). ValueError unless K is an int >= 1."""
    return ALPHA_PER_CLIENT * _num_clients(num_clients)


def collaboration_row(p, cos_i, U, alpha: float, gamma: float = DEFAULT_GAMMA) -> np.ndarray:
    """Row i of the uncertainty collaboration graph (GraphFedSeg Eq. 2; Algorithm 1's QP).

    ``min_x sum_j (x_j - p_j)^2 - alpha sum_j x_j cos_ij + gamma sum_j x_j U_j`` on the simplex
    (diagonal j = i included). Expanding, the objective is
    ``||x||^2 - 2 x.p - x.(alpha cos_i - gamma U) + ||p||^2 = ||x - v_i||^2 + const`` with
    ``v_i = p + (alpha cos_i - gamma U) / 2`` [derived here], so the exact minimiser is
    :func:`project_to_simplex` ``(v_i)``. Algorithm 1's ``x'x + (-2p_i - a_i + gamma U_i)'x`` is the
    same objective with ``a_i = alpha cos_i``.

    Args:
        p: ``[K]`` data shares ``n_j / sum n`` (>= 0). cos_i: ``[K]`` cosines ``cos(theta_i, theta_j)``.
        U: ``[K]`` client uncertainties (>= 0). alpha: similarity weight (>= 0; paper 0.08 K).
        gamma: uncertainty penalty (>= 0; paper 0.4).
    Returns:
        ``np.ndarray`` float64 ``[K]`` on the simplex.
    Raises:
        ValueError: a bad shape, non-finite entry, negative ``p``/``U``/``alpha``/``gamma`` (names it).
    """
    p = _array(p, "p", 1)
    _non_negative(p, "p")
    cos_i = _array(cos_i, "cos_i", 1, p.shape)
    U = _array(U, "U", 1, p.shape)
    _non_negative(U, "U")
    alpha = _scalar(alpha, "alpha", minimum=0.0)
    gamma = _scalar(gamma, "gamma", minimum=0.0)
    return project_to_simplex(p + (alpha * cos_i - gamma * U) / 2.0)


def collaboration_graph(p, cos, U, alpha: float | None = None, gamma: float = DEFAULT_GAMMA) -> np.ndarray:
    """Uncertainty collaboration graph W, one :func:`collaboration_row` per client (GraphFedSeg Eq. 2).

    Args:
        p: ``[K]`` data shares; cos: ``[K, K]`` cosine matrix (row i = client i); U: ``[K]`` uncertainties.
        alpha: similarity weight; ``None`` (default) = ``0.08 K`` (paper). gamma: penalty (paper 0.4).
    Returns:
        ``np.ndarray`` float64 ``[K, K]``, each row on the simplex (``W_ij``: weight of client j for i).
    Raises:
        ValueError: as :func:`collaboration_row`; ``cos`` not ``[K, K]``.
    """
    p = _array(p, "p", 1)
    cos = _array(cos, "cos", 2, (p.size, p.size))
    alpha = default_alpha(p.size) if alpha is None else alpha
    return np.stack([collaboration_row(p, cos[i], U, alpha, gamma) for i in range(p.size)])


def pfedgraph_graph(p, cos, alpha: float = PFEDGRAPH_ALPHA, clip: float | None = PFEDGRAPH_CLIP) -> np.ndarray:
    """pFedGraph's graph (pFedGraph code variant, ``optimizing_graph_matrix_neighbor``).

    Per row: ``min_x alpha x'x + (d_i - 2 alpha p)'x`` on the simplex with ``d_ij = -cos_ij``, and
    ``d_ij = -1`` where ``d_ij < clip`` (code: -0.9). Equals ``alpha ||x - (p - d_i / (2 alpha))||^2 + const``
    [derived], solved exactly here (the code uses cvxpy, agreeing to ~1e-6). The code's ``cos`` is the
    *update* cosine (:func:`similarity_matrix` with ``mode="update"``).

    Args:
        p: ``[K]`` data shares (>= 0). cos: ``[K, K]`` cosines. alpha: > 0 (code default 0.8).
        clip: threshold on ``d`` (``None`` disables it).
    Returns:
        ``np.ndarray`` float64 ``[K, K]``, rows on the simplex.
    Raises:
        ValueError: bad shapes, non-finite entries, negative ``p``, ``alpha <= 0`` (names it).
    """
    p = _array(p, "p", 1)
    _non_negative(p, "p")
    d = -_array(cos, "cos", 2, (p.size, p.size))
    alpha = _scalar(alpha, "alpha", minimum=0.0)
    if alpha == 0.0:
        raise ValueError("alpha must be > 0, got 0.0")
    if clip is not None:
        d[d < _scalar(clip, "clip")] = -1.0
    return np.stack([project_to_simplex(p - d[i] / (2.0 * alpha)) for i in range(p.size)])


def initial_graph(num_clients: int) -> np.ndarray:
    """Round-0 graph ``[K, K]`` float64: ``1/(K-1)`` off the diagonal, 0 on it (pFedGraph code variant; the
    paper's uniform 0.3333 heatmap for K = 4 matches it [inferred]); ``[[1.0]]`` for K = 1. ValueError as
    :func:`default_alpha`."""
    k = _num_clients(num_clients)
    return np.ones((1, 1)) if k == 1 else (np.ones((k, k)) - np.eye(k)) / (k - 1)


# --------------------------------------------------------------------------------------------------
# Server: similarities
# --------------------------------------------------------------------------------------------------
def _to_numpy(value, name: str) -> np.ndarray:
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        return value.double().numpy() if value.dtype != torch.float64 else value.numpy()
    arr = np.asarray(value)
    if arr.dtype.kind not in "fiu":
        raise ValueError(f"{name} must be numeric, got dtype {arr.dtype}")
    return arr.astype(np.float64, copy=False)


def is_floating(value) -> bool:
    return value.is_floating_point() if isinstance(value, Tensor) else np.asarray(value).dtype.kind == "f"


def select_keys(params: Mapping[str, object], keys: Sequence[str] | None, name: str) -> list[str]:
    keys = [k for k, v in params.items() if is_floating(v)] if keys is None else list(keys)
    if not keys:
        raise ValueError(f"{name}: no keys to flatten")
    missing = [k for k in keys if k not in params]
    if missing:
        raise ValueError(f"{name}: missing keys {missing[:5]}")
    return keys


def flatten(params: Mapping[str, object], keys: Sequence[str] | None = None) -> np.ndarray:
    """Concatenate ``params[k].ravel()`` over ``keys`` into one float64 vector (GraphFedSeg §2.2.1 theta).

    Args:
        params: dict ``name -> np.ndarray | Tensor``.
        keys: names in order; ``None`` = every floating entry in the mapping's order (integer buffers
            such as BN ``num_batches_tracked`` are skipped). Use the same keys for every model.
    Returns:
        ``np.ndarray`` float64 ``[D]`` (a copy for tensors; CPU).
    Raises:
        ValueError: no keys, a missing key, or a non-numeric / non-finite entry (names the key).
    """
    keys = select_keys(params, keys, "flatten")
    parts = [_to_numpy(params[k], f"params[{k!r}]").ravel() for k in keys]
    bad = [k for k, a in zip(keys, parts) if not np.isfinite(a).all()]
    if bad:
        raise ValueError(f"params[{bad[0]!r}] has non-finite entries")
    return np.concatenate(parts)


def _cosine_from_gram(gram: np.ndarray) -> np.ndarray:
    norms = np.sqrt(np.maximum(np.diag(gram), 0.0))
    denom = np.outer(norms, norms)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(denom > 0, gram / np.where(denom > 0, denom, 1.0), 0.0)
    return np.clip(cos, -1.0, 1.0)


def cosine_matrix(vectors) -> np.ndarray:
    """Pairwise cosines ``<a_i, a_j> / (||a_i|| ||a_j||)`` (GraphFedSeg §2.2.1 / Algorithm 1).

    ``vectors``: ``[K, D]`` array or K equal-length finite 1-D vectors. A zero vector has cosine 0 with
    everything, itself included (as torch's ``cosine_similarity`` eps).

    Returns:
        ``np.ndarray`` float64 ``[K, K]``, symmetric, clipped to [-1, 1].
    Raises:
        ValueError: not 2-D after stacking, empty, or non-finite (names the index).
    """
    x = _array(vectors, "vectors", 2)
    return _cosine_from_gram(x @ x.T)


def similarity_matrix(models: Sequence[Mapping[str, object]], start: Mapping[str, object] | None = None,
                      mode: str = "model", keys: Sequence[str] | None = None) -> np.ndarray:
    """Client cosine matrix, ``"model"`` (paper: cos of the flattened models) or ``"update"``
    (pFedGraph code variant: cos of ``theta_j - start``, start = the model all clients began from).

    Models trained from the same start have model cosines ~1 for every pair (the paper does not say which vectors it compares);
    update cosines keep the signal. The Gram matrix is accumulated key by key (no full K x D copy).

    Args:
        models: K dicts ``name -> array/tensor``. start: required for ``"update"`` (ignored otherwise).
        mode: ``"model"`` or ``"update"``. keys: as :func:`flatten` (default: models[0]'s floating keys).
    Returns:
        ``np.ndarray`` float64 ``[K, K]``.
    Raises:
        ValueError: unknown mode, no models, missing ``start``, missing keys, shape mismatch or
            non-finite entries (names the client/key).
    """
    if mode not in SIMILARITY_MODES:
        raise ValueError(f"mode must be one of {SIMILARITY_MODES}, got {mode!r}")
    if len(models) == 0:
        raise ValueError("models must not be empty")
    if mode == "update" and start is None:
        raise ValueError("start is required for mode='update'")
    keys = select_keys(models[0], keys, "similarity_matrix")
    gram = np.zeros((len(models), len(models)))
    for k in keys:
        rows = [_to_numpy(model_entry(m, k, j), f"models[{j}][{k!r}]").ravel() for j, m in enumerate(models)]
        if len({r.size for r in rows}) != 1:
            raise ValueError(f"models: {k!r} has different sizes {[r.size for r in rows]}")
        x = np.stack(rows)
        if mode == "update":
            x = x - _to_numpy(model_entry(start, k, "start"), f"start[{k!r}]").reshape(1, -1)
        if not np.isfinite(x).all():
            raise ValueError(f"models: {k!r} has non-finite entries")
        gram += x @ x.T
    return _cosine_from_gram(gram)


def model_entry(model: Mapping[str, object], key: str, who) -> object:
    if key not in model:
        raise ValueError(f"{'start' if who == 'start' else f'models[{who}]'} is missing key {key!r}")
    return model[key]
