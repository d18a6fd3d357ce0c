"""GraphFedSeg's equations (Acta Electronica Sinica 2026, §2, Eq. 2-9) and pFedGraph's variants (ICML 2023). NumPy
and torch, no FLARE. How they make up a round is in :mod:`feduq.methods.graphfedseg`'s docstring; the toys are in
``tests/test_graphfedseg_math.py``.
"""

from __future__ import annotations

from typing import Iterable, Mapping, NamedTuple, Sequence

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


def _is_floating(value) -> bool:
    return value.is_floating_point() if isinstance(value, Tensor) else np.asarray(value).dtype.kind == "f"


def _select_keys(params: Mapping[str, object], keys: Sequence[str] | None, name: str) -> list[str]:
    keys = [k for k, v in params.items() if _is_floating(v)] if keys is None else list(keys)
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
    keys = _select_keys(params, keys, "flatten")
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
    keys = _select_keys(models[0], keys, "similarity_matrix")
    gram = np.zeros((len(models), len(models)))
    for k in keys:
        rows = [_to_numpy(_get(m, k, j), f"models[{j}][{k!r}]").ravel() for j, m in enumerate(models)]
        if len({r.size for r in rows}) != 1:
            raise ValueError(f"models: {k!r} has different sizes {[r.size for r in rows]}")
        x = np.stack(rows)
        if mode == "update":
            x = x - _to_numpy(_get(start, k, "start"), f"start[{k!r}]").reshape(1, -1)
        if not np.isfinite(x).all():
            raise ValueError(f"models: {k!r} has non-finite entries")
        gram += x @ x.T
    return _cosine_from_gram(gram)


def _get(model: Mapping[str, object], key: str, who) -> object:
    if key not in model:
        raise ValueError(f"{'start' if who == 'start' else f'models[{who}]'} is missing key {key!r}")
    return model[key]


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
        vals = [_get(m, k, j) for j, m in enumerate(models)]
        for j, v in enumerate(vals):
            if not _is_floating(v):
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
    floating = [k for k, v in models[0].items() if _is_floating(v)]
    fused = dual_layer_aggregate([{k: m[k] for k in floating if k in m} | {k: v for k, v in m.items() if
                                  k not in models[0]} for m in models], p, W, lam)
    w = fused.weights
    buffers = {}
    for k, v0 in models[0].items():
        if k in fused.global_model:
            continue
        vals = [np.asarray(_get(m, k, j), dtype=np.float64) for j, m in enumerate(models)]
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
    return sorted(k for k, v in params.items() if _is_floating(v))


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
    keys = _select_keys(models[0], keys, "neighbour_direction")
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
        theta = [theta[k] for k in _select_keys(theta, keys, "alignment_term")]
    if not isinstance(theta, Tensor) and len(theta) == 0:
        raise ValueError("theta must contain at least one tensor")
    flat = theta.reshape(-1) if isinstance(theta, Tensor) else torch.cat([t.reshape(-1) for t in theta])
    v = torch.as_tensor(direction).reshape(-1).to(device=flat.device, dtype=flat.dtype)
    if v.numel() != flat.numel():
        raise ValueError(f"direction has {v.numel()} values, theta has {flat.numel()}")
    return -sign * lam1 * torch.dot(v, flat) / torch.linalg.vector_norm(flat)
