"""FedA3I's equations (Wu et al., AAAI 2024, §3.3, Eq. 3-7; official code ``wnn2000/FedAAAI``). NumPy / SciPy /
scikit-learn / torch, no FLARE. The steps they make up are in :mod:`feduq.methods.feda3i`'s docstring; the
hand-computed toy is in ``tests/unit/methods/test_feda3i_math.py``.
"""

from __future__ import annotations

import json
import math
import warnings
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

import torch
from scipy.ndimage import distance_transform_edt
from torch import Tensor
from ...common.checks import array as _array
from ...common.checks import scalar as _scalar


DEFAULT_R = 0.5  # paper: InterGW balance r
STRENGTH_MODES = ("sum", "first")


def _groups(groups, k: int) -> np.ndarray:
    g = np.asarray(groups)
    if g.shape != (k,):
        raise ValueError(f"groups must have shape ({k},), got {g.shape}")
    bad = [i for i, v in enumerate(g.tolist()) if v not in (0, 1)]
    if bad:
        raise ValueError(f"groups[{bad[0]}] must be 1 (G_l) or 0 (G_s), got {g[bad[0]]!r}")
    return g.astype(np.int64)


def _q(q) -> np.ndarray:
    arr = _array(q, "q", 2)
    if arr.shape[1] % 2:
        raise ValueError(f"q must have 2C columns ([in, out] per class), got shape {arr.shape}")
    return arr


# --------------------------------------------------------------------------------------------------
# Site: noise estimation (Eq. 3-4)


def band_regions(mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, float]:
    """The inner and outer bands around a label's contour (paper §3.3 "Noise Estimation"; code ``region``).

    Signed distance (SciPy's exact Euclidean transform, pixel units): inside, the depth t = distance to
    the nearest background pixel (>= 1); outside, the distance to the nearest foreground pixel (>= 1).
    d = min(max inner depth, max outer distance) (the paper's "grow d until |R_in| or
    |R_out| stops changing"). R_in = foreground pixels with depth <= d, R_out = background pixels with
    distance <= d (both inclusive, the code's ``sdm >= -d`` / ``sdm <= d``). One band is therefore the
    whole object or the whole background.

    Args:
        mask: ``[H, W]`` label, anything castable to bool (non-zero = foreground).

    Returns:
        ``(inner, outer, d)``: two ``bool [H, W]`` masks and d (float, pixels). An empty or full mask has
        no contour: both bands empty and d = NaN (the code skips empty labels and would assert on full ones).

    Raises:
        ValueError: ``mask`` is not 2-D.
    """
    m = np.asarray(mask).astype(bool)
    if m.ndim != 2:
        raise ValueError(f"mask must be 2-D [H, W], got shape {m.shape}")
    empty = np.zeros_like(m)
    if not m.any() or m.all():
        return empty, empty.copy(), float("nan")
    depth = distance_transform_edt(m)  # foreground: distance to the nearest background pixel
    outside = distance_transform_edt(~m)  # background: distance to the nearest foreground pixel
    d = float(min(depth.max(), outside.max()))
    return m & (depth <= d), ~m & (outside <= d), d


def foreground_logit(logits: Tensor) -> Tensor:
    """The foreground log-odds z = l_1 - l_0 ``[B, H, W]`` of two-class logits ``[B, 2, H, W]``.

    For :class:`feduq.core.networks.FedA3IUNet` (logits ``[0, z]``) this is exactly the paper's sigmoid logit;
    for any two-class softmax network, sigmoid(l_1 - l_0) = softmax(l)_1, so the BCE on it equals the CE.

    Raises:
        ValueError: ``logits`` is not ``[B, 2, H, W]``.
    """
    if logits.ndim != 4 or logits.shape[1] != 2:
        raise ValueError(f"logits must be [B, 2, H, W], got {tuple(logits.shape)}")
    return logits[:, 1] - logits[:, 0]


def band_losses(logits_fg: Tensor, masks) -> np.ndarray:
    """Per image, the mean BCE-with-logits over the inner and the outer band (the summands of paper Eq. 3-4).

    Args:
        logits_fg: foreground logits z, ``[B, H, W]`` or ``[B, 1, H, W]``, float (any device).
        masks: labels ``[B, H, W]`` or ``[B, 1, H, W]`` in {0, 1} (tensor or array).

    Returns:
        ``float64 [B, 2]``: (mean over R_in, mean over R_out) per image; a row of NaN for an image whose
        label is empty (or full), as the code (skipped later by :func:`site_noise_statistic`).

    Raises:
        ValueError: shapes that differ or are not 3-D / 4-D with one channel, or labels outside {0, 1}.
    """
    z = logits_fg.detach()
    y = torch.as_tensor(np.asarray(masks.detach().cpu() if isinstance(masks, Tensor) else masks))
    if z.ndim == 4 and z.shape[1] == 1:
        z = z[:, 0]
    if y.ndim == 4 and y.shape[1] == 1:
        y = y[:, 0]
    if z.ndim != 3 or tuple(y.shape) != tuple(z.shape):
        raise ValueError(f"logits_fg {tuple(logits_fg.shape)} and masks {tuple(y.shape)} must both be "
                         f"[B, H, W] or [B, 1, H, W] of the same size")
    y = y.to(torch.float64)
    if not bool(((y == 0) | (y == 1)).all()):
        raise ValueError("masks must hold only 0 and 1")
    loss = torch.nn.functional.binary_cross_entropy_with_logits(
        z.to(torch.float64).cpu(), y, reduction="none").numpy()
    out = np.full((z.shape[0], 2), np.nan)
    for b in range(z.shape[0]):
        inner, outer, _ = band_regions(y[b].numpy() > 0.5)
        if inner.any() and outer.any():
            out[b] = loss[b][inner].mean(), loss[b][outer].mean()
    return out


def site_noise_statistic(per_image) -> np.ndarray:
    """A site's q_i: the nanmean over its images of :func:`band_losses` rows (paper Eq. 3-4, code ``nanmean``).

    Args:
        per_image: ``[N, 2C]`` (N images; per class the [in, out] columns), NaN rows allowed.

    Returns:
        ``float64 [2C]``; a column with no finite value is NaN (no warning).

    Raises:
        ValueError: not 2-D, empty, or holding +-inf.
    """
    arr = _array(per_image, "per_image", 2, allow_nan=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # "Mean of empty slice" for an all-NaN column
        return np.nanmean(arr, axis=0)


# --------------------------------------------------------------------------------------------------
# Server: grouping, strengths, weights (Eq. 5-6)


def group_sites(q, seed: int = 0) -> np.ndarray:
    """Split the sites into G_l ("expand", 1) and G_s ("shrink", 0) with a 2-component GMM (paper §3.3).

    scikit-learn ``GaussianMixture(n_components=2, covariance_type="full", random_state=seed)`` fit on q
    (the code seeds it only through the global NumPy RNG). G_l is the component whose mean has the larger
    sum over classes of (in - out), i.e. μ_l1 - μ_l2 > μ_s1 - μ_s2 for one class.

    Degenerate inputs (documented choice, never NaN): with K < 2 sites, or all rows of q equal, there is
    nothing to split: every site goes to G_l if its (equal or single) sum of (in - out) is >= 0, otherwise
    to G_s. The GMM may also leave a component empty; :func:`quality_weights` then gives the other group
    everything.

    Args:
        q: ``[K, 2C]`` float, per class [q_in, q_out] interleaved (the code's ``loss_client``).
        seed: the GMM's ``random_state``.

    Returns:
        ``int64 [K]``: 1 for G_l, 0 for G_s.

    Raises:
        ValueError: q not 2-D with an even number of columns, or not finite (a site whose every label was
            empty has a NaN row: leave it out or give it a value before grouping).
    """
    arr = _q(q)
    gap = arr[:, 0::2].sum(axis=1) - arr[:, 1::2].sum(axis=1)
    if arr.shape[0] < 2 or np.all(arr == arr[0]):
        return np.full(arr.shape[0], 1 if gap[0] >= 0 else 0, dtype=np.int64)
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.mixture import GaussianMixture

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        gmm = GaussianMixture(n_components=2, covariance_type="full", random_state=seed).fit(arr)
        label = gmm.predict(arr)
    means = gmm.means_
    mean_gap = means[:, 0::2].sum(axis=1) - means[:, 1::2].sum(axis=1)
    expand = 0 if mean_gap[0] > mean_gap[1] else 1  # the code's tie rule: component 1 on a tie
    return (label == expand).astype(np.int64)


def strengths(q, groups, mode: str = "sum") -> np.ndarray:
    """Noise strength s_i (paper Eq. 5): q_i1 - q_i2 for G_l, q_i2 - q_i1 for G_s.

    For C > 1 classes (paper footnote 1: "each class separately"; the official code is binary):
    ``mode="sum"`` (default) uses the sum over classes of (in - out), the same quantity that orders the
    GMM components in :func:`group_sites`; ``mode="first"`` uses the first class's columns only (official
    code variant: ``loss_client[:, 0] - loss_client[:, 1]``). Both are Eq. 5 for C = 1.

    Args:
        q: ``[K, 2C]`` float. groups: ``[K]`` in {0, 1} (1 = G_l).
        mode: ``"sum"`` or ``"first"``.

    Returns:
        ``float64 [K]`` (a larger s = noisier within its group; may be negative).

    Raises:
        ValueError: bad shapes, non-finite q, groups outside {0, 1}, unknown mode.
    """
    arr = _q(q)
    g = _groups(groups, arr.shape[0])
    if mode not in STRENGTH_MODES:
        raise ValueError(f"mode must be one of {list(STRENGTH_MODES)}, got {mode!r}")
    gap = arr[:, 0::2].sum(axis=1) - arr[:, 1::2].sum(axis=1) if mode == "sum" else arr[:, 0] - arr[:, 1]
    return np.where(g == 1, gap, -gap)


def _shares(g: np.ndarray, r: float) -> dict[int, float]:
    """InterGW: r to G_l and 1 - r to G_s; an empty group's share goes to the other one."""
    present = {v for v in (0, 1) if np.any(g == v)}
    if present == {0, 1}:
        return {1: r, 0: 1.0 - r}
    return {v: 1.0 for v in present}


def _group_weights(s: np.ndarray, g: np.ndarray, r: float, raw: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    w = np.zeros(s.shape[0])
    for grp, share in _shares(g, r).items():
        idx = np.flatnonzero(g == grp)
        u = raw(s[idx])
        total = u.sum()
        # a singleton group or equal strengths: 0/0 in both forms -> split the share equally
        w[idx] = share * (u / total if idx.size > 1 and total > 0 else np.full(idx.size, 1.0 / idx.size))
    return w


def quality_weights(s, groups, r: float = DEFAULT_R) -> np.ndarray:
    """Quality weights w̄ = IntraGW + InterGW (paper Eq. 6).

    w̄_i = r · (max_G s - s_i) / Σ_{j∈G} (max_G s - s_j) for i in G = G_l, the same with 1 - r for G_s:
    the noisiest site of each group gets 0.

    Degenerate cases (documented choices; never NaN): a singleton group, or a group whose strengths are
    all equal (0/0 in Eq. 6), splits its share (r or 1 - r) equally among its members; an empty group
    gives the other group the whole weight (its share renormalised to 1). Result sums to 1.

    Args:
        s: ``[K]`` strengths (:func:`strengths`). groups: ``[K]`` in {0, 1}. r: InterGW balance in [0, 1].

    Returns:
        ``float64 [K]``, >= 0, sum 1.

    Raises:
        ValueError: non-finite s, mismatched groups, r outside [0, 1].
    """
    sv = _array(s, "s", 1)
    g = _groups(groups, sv.shape[0])
    return _group_weights(sv, g, _scalar(r, "r", 0.0, 1.0), lambda x: x.max() - x)


def quality_weights_minmax(s, groups, r: float = DEFAULT_R) -> np.ndarray:
    """Quality weights in the official code's form: 1 - (s - min)/(max - min) per group, renormalised within
    the group, times r (G_l) or 1 - r (G_s). Algebraically identical to :func:`quality_weights` (Eq. 6):
    1 - (s - min)/(max - min) = (max - s)/(max - min), and the constant cancels in the renormalisation.
    Same degenerate-case rules (the code divides 0 by 0 there).

    Args / Returns / Raises: as :func:`quality_weights`.
    """
    sv = _array(s, "s", 1)
    g = _groups(groups, sv.shape[0])

    def raw(x: np.ndarray) -> np.ndarray:
        span = x.max() - x.min()
        return 1.0 - (x - x.min()) / span if span > 0 else np.zeros_like(x)

    return _group_weights(sv, g, _scalar(r, "r", 0.0, 1.0), raw)


def quantity_weights(n) -> np.ndarray:
    """Quantity (FedAvg) weights w̃_i = n_i / Σ n (paper §3.3, before Eq. 7).

    Args:
        n: ``[K]`` sample counts (non-negative numbers).

    Returns:
        ``float64 [K]``, sum 1.

    Raises:
        ValueError: naming the site index for a negative or NaN/inf count; a zero total.
    """
    try:
        arr = np.array(n, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"n must be a 1-D array of counts: {exc}") from exc
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError(f"n must be a non-empty 1-D array, got shape {arr.shape}")
    for i, v in enumerate(arr):
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"n[{i}] (site {i}) must be a finite count >= 0, got {arr[i]!r}")
    if arr.sum() <= 0:
        raise ValueError(f"n must have a positive total, got {arr.tolist()}")
    return arr / arr.sum()


@dataclass
class FedA3IWeights:
    """What the server computes once at the end of the warm-up and then freezes (paper Algorithm 1).

    Attributes (K sites, C classes): ``q`` ``[K, 2C]`` (per class [in, out]); ``groups`` ``[K]`` int
    (1 = G_l "expand", 0 = G_s "shrink"); ``s`` ``[K]`` strengths (Eq. 5); ``w_quality`` ``[K]`` (w̄, Eq. 6);
    ``w_quantity`` ``[K]`` (w̃); ``r``; ``sites``: optional site names in the same order.
    """

    q: np.ndarray
    groups: np.ndarray
    s: np.ndarray
    w_quality: np.ndarray
    w_quantity: np.ndarray
    r: float = DEFAULT_R
    sites: tuple[str, ...] | None = None

    def to_json(self) -> str:
        """A JSON object of plain lists and numbers (for logs and for restoring the frozen weights)."""
        return json.dumps({
            "q": np.asarray(self.q, dtype=float).tolist(), "groups": np.asarray(self.groups).astype(int).tolist(),
            "s": np.asarray(self.s, dtype=float).tolist(),
            "w_quality": np.asarray(self.w_quality, dtype=float).tolist(),
            "w_quantity": np.asarray(self.w_quantity, dtype=float).tolist(),
            "r": float(self.r), "sites": None if self.sites is None else list(self.sites),
        })

    @classmethod
    def from_json(cls, text: str) -> "FedA3IWeights":
        """The inverse of :meth:`to_json`."""
        d = json.loads(text)
        return cls(q=np.array(d["q"], dtype=np.float64), groups=np.array(d["groups"], dtype=np.int64),
                   s=np.array(d["s"], dtype=np.float64), w_quality=np.array(d["w_quality"], dtype=np.float64),
                   w_quantity=np.array(d["w_quantity"], dtype=np.float64), r=float(d["r"]),
                   sites=None if d.get("sites") is None else tuple(d["sites"]))


def compute_weights(q, n, r: float = DEFAULT_R, seed: int = 0, mode: str = "sum",
                    sites: Sequence[str] | None = None) -> FedA3IWeights:
    """Step 2 of the module docstring in one call: :func:`group_sites`, :func:`strengths`,
    :func:`quality_weights` and :func:`quantity_weights`.

    Args:
        q: ``[K, 2C]``. n: ``[K]`` sample counts. r, seed, mode: as the functions above. sites: names.

    Raises:
        ValueError: from the functions above, or ``len(n)`` / ``len(sites)`` != K.
    """
    arr = _q(q)
    if np.shape(n) != (arr.shape[0],) or (sites is not None and len(sites) != arr.shape[0]):
        raise ValueError(f"n and sites must have one entry per row of q ({arr.shape[0]})")
    groups = group_sites(arr, seed=seed)
    s = strengths(arr, groups, mode=mode)
    return FedA3IWeights(q=arr, groups=groups, s=s, w_quality=quality_weights(s, groups, r),
                         w_quantity=quantity_weights(n), r=float(r), sites=None if sites is None else tuple(sites))
