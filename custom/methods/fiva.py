"""FIVA math (federated inverse-variance averaging) and FUNAvg's inference merge. Pure torch, no FLARE.

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

from __future__ import annotations

import json
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from ..ct_server import VAR_PREFIX, CTServer
from ._checks import scalar as _scalar
from .server import num_samples

__all__ = [
    "VARIANCE_DIVISORS", "FIVA_G_MODES", "AGGREGATION_MODES", "SAMPLE_SCALES",
    "Welford", "fiva_g_variance",  # client
    "check_variance", "AggregationResult", "inverse_variance_aggregate", "variance_summary",  # server
    "sample_backbone", "HeadUncertainty", "head_uncertainty",  # inference
    "global_channels", "map_to_global", "merge_heads", "BackgroundReweight", "reweight_background",
]

VARIANCE_DIVISORS = ("n", "n+1")
FIVA_G_MODES = ("strong", "weak")
AGGREGATION_MODES = ("full", "layer", "scalar")
SAMPLE_SCALES = ("std", "variance")
_F64 = torch.float64


def _check_keys(reference: Mapping[str, Tensor], other: Mapping[str, Tensor], what: str) -> None:
    missing = [k for k in reference if k not in other]
    extra = [k for k in other if k not in reference]
    if missing or extra:
        raise ValueError(f"{what}: keys differ (missing {missing[:5]}, unexpected {extra[:5]})")


# --------------------------------------------------------------------------------------------------
# Client: Welford running variance (FIVA-P, FIVA-G)
# --------------------------------------------------------------------------------------------------
class Welford:
    """Element-wise running mean and M2 over a sequence of named tensors (paper Eq. 2 and 4).

    ``m_t = m_{t-1} + (x_t - m_{t-1}) / t``; ``M2_t = M2_{t-1} + (x_t - m_{t-1})(x_t - m_t)``.
    FIVA-P feeds the parameters after each optimiser step, FIVA-G the (unscaled) gradients read from
    ``named_parameters()`` after ``backward()`` (not ``.grad`` after the optimiser step, which AMP's scaler has unscaled and clipped). Create or :meth:`reset`
    one per round. Accumulators are copies (float64 by default) on the input's device (never aliases of the live
    tensors, unlike the official code's P-mode, whose first step aliases the live parameters).

    Args:
        dtype: accumulator dtype: float64 (default; the FLARE client's too) or float32 (half the memory, but not
            exact where it matters: with |theta| ~ 0.05 and parameter steps of ~1e-6 over T = 50-300 steps the
            relative error of sigma^2 reaches 2.5e-2, at steps of ~1e-7 about 1, since x - m loses its digits to the
            float32 rounding of m; the official epsilon = 1e-5 hides it, the paper's epsilon = 0 does not).

    Attributes:
        count: number of accepted steps T.
        skipped: number of steps rejected because some tensor had a NaN/Inf (a guard the official code lacks).
    """

    def __init__(self, dtype: torch.dtype = torch.float64) -> None:
        if dtype not in (torch.float64, torch.float32):
            raise ValueError(f"Welford: dtype must be torch.float64 or torch.float32, got {dtype}")
        self.dtype = dtype
        self.reset()

    def reset(self) -> None:
        """Forget all steps (call at round start)."""
        self._mean: dict[str, Tensor] = {}
        self._m2: dict[str, Tensor] = {}
        self._dtypes: dict[str, torch.dtype] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.count = 0
        self.skipped = 0

    def update(self, named: Mapping[str, Tensor]) -> bool:
        """Add one step ``x_t`` (dict name -> floating tensor, any shape, any device).

        Returns:
            True when the step was accepted; False when any tensor has a NaN/Inf: the whole step is
            skipped (no tensor is updated) and :attr:`skipped` grows by one.

        Raises:
            ValueError: empty dict; a non-floating tensor; after the first step, a different key set
                or a tensor whose shape changed (names the key, old and new shape).
        """
        if not named:
            raise ValueError("Welford.update: no tensors given")
        for name, x in named.items():
            if not isinstance(x, Tensor) or not x.is_floating_point():
                raise ValueError(f"Welford.update: {name!r} must be a floating tensor, got {getattr(x, 'dtype', x)!r}")
        if self._dtypes:
            _check_keys(self._dtypes, named, "Welford.update")
            for name, x in named.items():
                if tuple(x.shape) != self._shapes[name]:
                    raise ValueError(f"Welford.update: shape of {name!r} changed from "
                                     f"{self._shapes[name]} to {tuple(x.shape)}")
        else:
            self._dtypes = {name: x.dtype for name, x in named.items()}
            self._shapes = {name: tuple(x.shape) for name, x in named.items()}
        flags = [torch.isfinite(x).all() for x in named.values()]
        device = flags[0].device
        if not bool(torch.stack([f.to(device) for f in flags]).all()):  # one host sync per step
            self.skipped += 1
            return False
        self.count += 1
        t = float(self.count)
        for name, x in named.items():
            x = x.detach().to(self.dtype)
            if name not in self._mean:
                self._mean[name] = x.clone()
                self._m2[name] = torch.zeros_like(x)
                continue
            delta = x - self._mean[name]
            self._mean[name].add_(delta / t)
            self._m2[name].add_(delta * (x - self._mean[name]))
        return True

    def _require_steps(self, what: str) -> None:
        if self.count == 0:
            raise ValueError(f"Welford.{what}: no accepted step yet (skipped {self.skipped})")

    def mean(self) -> dict[str, Tensor]:
        """Running mean per key (new tensors, input dtype). Raises ValueError before the first accepted step."""
        self._require_steps("mean")
        return {k: m.to(self._dtypes[k]) for k, m in self._mean.items()}

    def variance(self, divisor: str = "n") -> dict[str, Tensor]:
        """Element-wise variance per key (new tensors, input dtype, clamped at 0 against rounding).

        Args:
            divisor: ``"n"``: ``M2 / T`` (paper Eq. 2/4, population variance, numpy ``ddof=0``);
                ``"n+1"``: ``M2 / (T + 1)`` (official code variant: its counter starts at 1).

        Raises:
            ValueError: unknown ``divisor``; no accepted step yet.
        """
        if divisor not in VARIANCE_DIVISORS:
            raise ValueError(f"divisor must be one of {VARIANCE_DIVISORS}, got {divisor!r}")
        self._require_steps("variance")
        d = float(self.count + (1 if divisor == "n+1" else 0))
        return {k: (m2 / d).clamp_min_(0.0).to(self._dtypes[k]) for k, m2 in self._m2.items()}


def fiva_g_variance(
    start_variance: Mapping[str, Tensor],
    gradient_variance: Mapping[str, Tensor],
    lr: float,
    steps: int,
    mode: str = "strong",
) -> dict[str, Tensor]:
    """FIVA-G parameter variance ``sigma^2_theta = sigma^2_start + eta^2 * T * sigma^2_g`` (paper Eq. 3).

    Args:
        start_variance: per key, the variance held at round start (backbone: the server's
            broadcast sigma^2_g; head: the client's previous value), official code.
        gradient_variance: per key, ``Welford.variance()`` of the gradients; same keys and shapes.
        lr: the optimiser's lr eta for this round (finite, >= 0).
        steps: T, the number of accepted gradient steps (int >= 0). The official code's count factor
            is T + 1 (its counter starts at 1); pass ``count + 1`` to reproduce it.
        mode: ``"strong"`` (paper Eq. 3) or ``"weak"`` (official code variant: no T factor).

    Returns:
        New dict, same keys, dtype of ``start_variance``.

    Raises:
        ValueError: unknown ``mode``; bad ``lr``/``steps``; key sets or shapes differ (names the key).
    """
    if mode not in FIVA_G_MODES:
        raise ValueError(f"mode must be one of {FIVA_G_MODES}, got {mode!r}")
    eta = _scalar(lr, "lr", minimum=0.0)
    if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or steps < 0:
        raise ValueError(f"steps must be an int >= 0, got {steps!r}")
    factor = eta * eta * (float(steps) if mode == "strong" else 1.0)
    _check_keys(start_variance, gradient_variance, "fiva_g_variance: gradient_variance vs start_variance")
    out = {}
    for name, start in start_variance.items():
        g = gradient_variance[name]
        if tuple(g.shape) != tuple(start.shape):
            raise ValueError(f"fiva_g_variance: {name!r} gradient variance has shape {tuple(g.shape)}, "
                             f"start variance {tuple(start.shape)}")
        out[name] = (start.to(_F64) + factor * g.to(device=start.device, dtype=_F64)).to(start.dtype)
    return out


# --------------------------------------------------------------------------------------------------
# Server: inverse-variance aggregation
# --------------------------------------------------------------------------------------------------
def check_variance(site: str, name: str, variance: Tensor, expected_shape: Sequence[int]) -> None:
    """Reject a site's variance tensor before aggregation (a rejected site must not touch the global model).

    Raises:
        ValueError: naming ``site`` and ``name``: not a floating tensor; shape differs from
            ``expected_shape`` (gives both); the count of NaN, Inf and negative entries if any.
    """
    where = f"site {site!r}: variance {name!r}"
    if not isinstance(variance, Tensor) or not variance.is_floating_point():
        raise ValueError(f"{where} must be a floating tensor, got {type(variance).__name__}")
    if tuple(variance.shape) != tuple(expected_shape):
        raise ValueError(f"{where} has shape {tuple(variance.shape)}, expected {tuple(expected_shape)}")
    n_nan = int(torch.isnan(variance).sum())
    n_inf = int(torch.isinf(variance).sum())
    n_neg = int((variance < 0).sum())
    if n_nan or n_inf or n_neg:
        raise ValueError(f"{where} has {n_nan} NaN, {n_inf} Inf and {n_neg} negative entries "
                         f"(of {variance.numel()})")


class AggregationResult(NamedTuple):
    """Output of :func:`inverse_variance_aggregate`.

    Attributes:
        params: theta_g per key (dtype of site 0's params).
        variance: sigma^2_g per key (dtype of ``prev_global_variance``).
        key_weights: per site, ``{key: mean over elements of c_i / sum_j c_j}`` (for logs).
        site_weights: ``np.ndarray`` float64 ``[N]``: the same mean over all elements of all keys.
    """

    params: dict[str, Tensor]
    variance: dict[str, Tensor]
    key_weights: list[dict[str, float]]
    site_weights: np.ndarray


def inverse_variance_aggregate(
    params: Sequence[Mapping[str, Tensor]],
    variances: Sequence[Mapping[str, Tensor]],
    num_samples: Sequence[float],
    prev_global_variance: Mapping[str, Tensor],
    eps: float = 1e-5,
    forgetting: float = 0.95,
    floor: float = 1e-8,
    mode: str = "full",
    site_names: Sequence[str] | None = None,
) -> AggregationResult:
    """Inverse-variance aggregation (paper Eq. 5-8 with the official code's eps and floor).

    Per key, element-wise: ``n_hat_i = n_i / sum n``; ``c_i = n_hat_i / (sigma^2_i + eps)``;
    ``theta_g = sum c_i theta_i / sum c_i``; ``P = sum c_i`` (includes eps);
    ``sigma^2_g = max(1 / (forgetting / sigma^2_prev + P), floor)``.

    Modes (official code): ``"full"`` element-wise; ``"layer"``: each site's sigma^2_i replaced by its
    per-key mean, then the same formulas; ``"scalar"``: one mean sigma^2 per site over all elements of
    all keys, with NO eps. The keys aggregated are those of ``params[0]`` (the backbone); nnU-Net's
    aliased keys (tied weights that share one tensor) are aggregated as given.

    Args:
        params: N site dicts ``key -> theta_i`` with identical keys and shapes.
        variances: N site dicts ``key -> sigma^2_i`` (same shapes, finite, >= 0).
        num_samples: N sizes n_i (finite, >= 0, not all 0); n_i = 0 gives the site weight 0.
        prev_global_variance: ``key -> sigma^2_g,r-1`` (finite, > 0; all ones in round 1).
        eps, forgetting, floor: code constants 1e-5, 0.95, 1e-8 (finite, >= 0).
        mode: ``"full"``, ``"layer"`` or ``"scalar"``.
        site_names: names used in error messages (default ``"0"``, ``"1"``, ...).

    Returns:
        :class:`AggregationResult`.

    Raises:
        ValueError: length mismatch; unknown mode; bad constants or ``num_samples``; a site's keys
            differ; a non-finite parameter or a bad variance (via :func:`check_variance`, names site and
            key); a zero precision denominator (``sigma^2_i + eps == 0``, e.g. "scalar" with a zero
            variance) or a bad ``prev_global_variance``.
    """
    n_sites = len(params)
    names = [str(i) for i in range(n_sites)] if site_names is None else [str(s) for s in site_names]
    if n_sites == 0 or not len(variances) == len(num_samples) == len(names) == n_sites:
        raise ValueError(f"need >= 1 site and equal lengths: params {n_sites}, variances {len(variances)}, "
                         f"num_samples {len(num_samples)}, site_names {len(names)}")
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"mode must be one of {AGGREGATION_MODES}, got {mode!r}")
    eps_, lam, floor_ = (_scalar(v, k, minimum=0.0)
                         for k, v in (("eps", eps), ("forgetting", forgetting), ("floor", floor)))
    counts = [_scalar(n, f"num_samples[{i}]", minimum=0.0) for i, n in enumerate(num_samples)]
    if sum(counts) <= 0:
        raise ValueError(f"num_samples must not be all zero, got {counts}")
    n_hat = [n / sum(counts) for n in counts]
    ref = params[0]
    _check_keys(ref, prev_global_variance, f"prev_global_variance vs params of site {names[0]!r}")
    for name, site_params, site_var in zip(names, params, variances):
        _check_keys(ref, site_params, f"params of site {name!r}")
        _check_keys(ref, site_var, f"variances of site {name!r}")
        for key, value in ref.items():
            theta = site_params[key]
            if tuple(theta.shape) != tuple(value.shape) or not theta.is_floating_point() \
                    or not bool(torch.isfinite(theta).all()):
                raise ValueError(f"site {name!r}: param {key!r} must be a finite floating tensor of shape "
                                 f"{tuple(value.shape)}, got {theta.dtype} {tuple(theta.shape)}")
            check_variance(name, key, site_var[key], value.shape)
    for key, value in ref.items():
        check_variance("server", key, prev_global_variance[key], value.shape)
        if bool((prev_global_variance[key] <= 0).any()):
            raise ValueError(f"prev_global_variance {key!r} must be > 0 everywhere")

    device = next(iter(ref.values())).device if ref else torch.device("cpu")
    if mode == "scalar":  # per site, the element-weighted mean over the whole model
        scalar_var = [sum(float(v.to(_F64).sum()) for v in site.values())
                      / max(sum(v.numel() for v in site.values()), 1) for site in variances]

    out_params, out_var = {}, {}
    key_weights: list[dict[str, float]] = [{} for _ in range(n_sites)]
    weight_sums = np.zeros(n_sites)
    n_elements = 0
    for key, value in ref.items():
        precisions = []
        for i in range(n_sites):
            v = variances[i][key].to(device=device, dtype=_F64)
            if mode == "full":
                denom = v + eps_
            elif mode == "layer":
                denom = (v.mean() if v.numel() else v.new_zeros(())) + eps_
            else:
                denom = torch.tensor(scalar_var[i], dtype=_F64, device=device)
            if bool((denom <= 0).any()):
                raise ValueError(f"site {names[i]!r}: variance {key!r} + eps is 0 in mode {mode!r}; "
                                 "the precision would be infinite")
            precisions.append(torch.broadcast_to(n_hat[i] / denom, value.shape))
        c = torch.stack(precisions)  # [N, *shape]
        precision = c.sum(0)
        weights = c / precision
        thetas = torch.stack([params[i][key].to(device=device, dtype=_F64) for i in range(n_sites)])
        out_params[key] = (weights * thetas).sum(0).to(value.dtype)
        prev = prev_global_variance[key].to(device=device, dtype=_F64)
        out_var[key] = (1.0 / (lam / prev + precision)).clamp_min(floor_).to(prev_global_variance[key].dtype)
        per_site = weights.reshape(n_sites, -1).sum(1).cpu().numpy()
        for i in range(n_sites):
            key_weights[i][key] = float(per_site[i] / max(value.numel(), 1))
        weight_sums += per_site
        n_elements += value.numel()
    return AggregationResult(out_params, out_var, key_weights, weight_sums / max(n_elements, 1))


def variance_summary(variance: Mapping[str, Tensor]) -> dict[str, dict[str, float]]:
    """Per key ``{"min", "median", "mean", "max"}`` of a variance dict, as floats (for logs).

    The median is torch's lower median for an even count. Empty tensors are left out.
    """
    out = {}
    for name, v in variance.items():
        if v.numel() == 0:
            continue
        flat = v.detach().reshape(-1).to(_F64)
        out[name] = {"min": float(flat.min()), "median": float(flat.median()),
                     "mean": float(flat.mean()), "max": float(flat.max())}
    return out


# --------------------------------------------------------------------------------------------------
# Inference: backbone sampling, head uncertainty, FUNAvg merge
# --------------------------------------------------------------------------------------------------
def sample_backbone(
    mean: Mapping[str, Tensor],
    variance: Mapping[str, Tensor],
    generator: torch.Generator | None = None,
    scale: str = "std",
) -> dict[str, Tensor]:
    """One backbone sample ``theta_k = theta_g + eps`` (paper Eq. 9); ``mean`` is never modified.

    Args:
        mean: theta_g per key (floating tensors). Returned tensors are new: loading them into a
            network cannot move theta_g (the official code's random walk).
        variance: sigma^2_g per key; same keys and shapes (finite, >= 0).
        generator: torch.Generator on the tensors' device (None: the global RNG).
        scale: ``"std"``: eps ~ N(0, sigma^2), i.e. std sqrt(sigma^2) (paper Eq. 9, default);
            ``"variance"``: sigma^2 used as the std (official code, pitfall 3).

    Returns:
        New dict ``key -> theta_k`` in ``mean``'s dtype and device.

    Raises:
        ValueError: unknown ``scale``; key sets differ; a shape mismatch, a non-floating mean or a
            variance with NaN/Inf/negative entries (names the key).
    """
    if scale not in SAMPLE_SCALES:
        raise ValueError(f"scale must be one of {SAMPLE_SCALES}, got {scale!r}")
    _check_keys(mean, variance, "sample_backbone: variance vs mean")
    out = {}
    for name, mu in mean.items():
        if not mu.is_floating_point():
            raise ValueError(f"sample_backbone: mean {name!r} must be floating, got {mu.dtype}")
        check_variance("global", name, variance[name], mu.shape)
        var = variance[name].to(device=mu.device, dtype=_F64)
        std = var.sqrt() if scale == "std" else var
        noise = torch.randn(mu.shape, generator=generator, dtype=_F64, device=mu.device)
        out[name] = (mu.detach().to(_F64) + noise * std).to(mu.dtype)
    return out


class HeadUncertainty(NamedTuple):
    """Output of :func:`head_uncertainty`: ``mean`` [B, C_h, *S]; the others [B, *S]."""

    mean: Tensor
    uncertainty: Tensor
    aleatoric: Tensor
    epistemic: Tensor


def head_uncertainty(sample_probs: Tensor) -> HeadUncertainty:
    """Mean prediction and per-pixel uncertainty of one head (paper Eq. 10-11, official code's trace form).

    ``p_bar = mean_k p_k``; aleatoric ``= sum_c mean_k p(1 - p)``; epistemic ``= sum_c (mean_k p^2 - p_bar^2)``
    (computed as ``sum_c mean_k (p - p_bar)^2``); ``u = aleatoric + epistemic = 1 - sum_c p_bar^2``
    when the channels sum to 1 (FIVA inference, step 6).

    Args:
        sample_probs: softmax samples ``[K, B, C_h, *S]`` (e.g. ``S = H, W``), floating, K >= 1.

    Returns:
        :class:`HeadUncertainty` in the input dtype.

    Raises:
        ValueError: fewer than 3 dims, K == 0, or not floating.
    """
    if not isinstance(sample_probs, Tensor) or not sample_probs.is_floating_point() or sample_probs.ndim < 3 \
            or sample_probs.shape[0] == 0:
        got = f"{sample_probs.dtype} {tuple(sample_probs.shape)}" if isinstance(sample_probs, Tensor) else sample_probs
        raise ValueError(f"sample_probs must be a floating tensor [K >= 1, B, C_h, *spatial], got {got!r}")
    p = sample_probs.to(_F64)
    p_bar = p.mean(0)
    aleatoric = (p * (1.0 - p)).mean(0).sum(1)
    epistemic = ((p - p_bar) ** 2).mean(0).sum(1)
    dt = sample_probs.dtype
    return HeadUncertainty(p_bar.to(dt), (aleatoric + epistemic).to(dt), aleatoric.to(dt), epistemic.to(dt))


def global_channels(head_labels: Sequence[str], global_labels: Sequence[str]) -> list[int]:
    """Global channel of each head channel: ``[0, index of head_labels[0] + 1, ...]``.

    Args:
        head_labels: the head's foreground labels in channel order (channel 0 is background).
        global_labels: the global foreground labels (global channel j + 1 = ``global_labels[j]``).

    Raises:
        ValueError: a head label not in the global space (names it); duplicate labels.
    """
    for what, labels in (("global_labels", global_labels), ("head_labels", head_labels)):
        if len(set(labels)) != len(labels):
            raise ValueError(f"{what} has duplicates: {list(labels)}")
    index = {label: j + 1 for j, label in enumerate(global_labels)}
    out = [0]
    for label in head_labels:
        if label not in index:
            raise ValueError(f"head label {label!r} is not in the global label space {list(global_labels)}")
        out.append(index[label])
    return out


def map_to_global(mean_probs: Tensor, head_labels: Sequence[str], global_labels: Sequence[str]) -> Tensor:
    """Place a head's ``[B, C_h, *S]`` mean probabilities in the global ``[B, G, *S]`` space (FIVA inference, step 3).

    ``G = len(global_labels) + 1``; channel 0 = the head's background; a label channel takes the head's
    channel of that organ, 0 where the head lacks it.

    Raises:
        ValueError: as :func:`global_channels`; ``C_h != len(head_labels) + 1``.
    """
    channels = global_channels(head_labels, global_labels)
    if mean_probs.ndim < 2 or mean_probs.shape[1] != len(channels):
        raise ValueError(f"mean_probs must be [B, {len(channels)}, ...] for head labels {list(head_labels)}, "
                         f"got {tuple(mean_probs.shape)}")
    shape = (mean_probs.shape[0], len(global_labels) + 1, *mean_probs.shape[2:])
    out = mean_probs.new_zeros(shape)
    out[:, channels] = mean_probs
    return out


def merge_heads(mapped: Sequence[Tensor], known: Sequence[set[int]]) -> Tensor:
    """Naive multi-head merge ``m_c = (1/n_c) sum_{h knows c} p'_{h,c}`` (FedAvg inference, FIVA's step 4).

    Channel 0 is known by every head (``n_0`` = number of heads); channels no head knows are 0. The
    official code counts a head for c when its mapped channel is nonzero on the slice; the known sets
    make that deterministic.

    Args:
        mapped: per head ``[B, G, *S]`` (from :func:`map_to_global`), same shape.
        known: per head the global channel indices it predicts (0 may be omitted).

    Raises:
        ValueError: no heads; length or shape mismatch; a known index outside ``[0, G)``.
    """
    if not mapped or len(mapped) != len(known):
        raise ValueError(f"need one known set per head and at least one head, got {len(mapped)} heads "
                         f"and {len(known)} sets")
    shape = tuple(mapped[0].shape)
    g = shape[1]
    total = torch.zeros(shape, dtype=_F64, device=mapped[0].device)
    n_c = torch.zeros(g, dtype=_F64)
    for h, (probs, channels) in enumerate(zip(mapped, known)):
        if tuple(probs.shape) != shape:
            raise ValueError(f"head {h} has shape {tuple(probs.shape)}, head 0 has {shape}")
        channels = set(int(c) for c in channels) | {0}
        bad = [c for c in channels if not 0 <= c < g]
        if bad:
            raise ValueError(f"head {h}: known channels {bad} outside [0, {g})")
        idx = sorted(channels)
        total[:, idx] += probs[:, idx].to(_F64)
        n_c[idx] += 1.0
    view = (1, g) + (1,) * (len(shape) - 2)
    return (total / n_c.clamp_min(1.0).to(total.device).view(view)).to(mapped[0].dtype)


class BackgroundReweight(NamedTuple):
    """Output of :func:`reweight_background`: ``probs`` [B, G, *S]; ``fraction_over_one`` (pixels with sum u > 1)."""

    probs: Tensor
    fraction_over_one: float


def reweight_background(merged: Tensor, uncertainties: Sequence[Tensor]) -> BackgroundReweight:
    """FUNAvg / "+UN" reweighting ``m_0 <- m_0 * (1 - sum_h u_h)``, no clamp (official code; FIVA inference, step 5).

    When ``sum_h u_h > 1`` the background score goes negative and background is never the argmax;
    :attr:`BackgroundReweight.fraction_over_one` reports how often (log it).

    Args:
        merged: ``[B, G, *S]`` from :func:`merge_heads` (not modified).
        uncertainties: per head ``u_h`` ``[B, *S]``.

    Raises:
        ValueError: no uncertainties, or one whose shape is not ``[B, *S]``.
    """
    if len(uncertainties) == 0:
        raise ValueError("reweight_background: no uncertainties")
    expected = (merged.shape[0], *merged.shape[2:])
    for h, u in enumerate(uncertainties):
        if tuple(u.shape) != tuple(expected):
            raise ValueError(f"uncertainty of head {h} has shape {tuple(u.shape)}, expected {tuple(expected)}")
    u_sum = torch.stack([u.to(device=merged.device, dtype=_F64) for u in uncertainties]).sum(0)
    out = merged.clone()
    out[:, 0] = (merged[:, 0].to(_F64) * (1.0 - u_sum)).to(merged.dtype)
    fraction = float((u_sum > 1.0).to(_F64).mean()) if u_sum.numel() else 0.0
    return BackgroundReweight(out, fraction)


class FIVAServer(CTServer):
    """FIVA's server part: element-wise inverse-variance fusion of the backbone (Eq. 5-8) on the CT rounds.

    Each update carries σ² of every backbone tensor (``variance::<name>``, same shapes, >= 0); the global σ²
    travels with θ_g and is checkpointed with it, so a resumed job continues it. Logged per round:
    ``FEDUQ_FIVA {json}`` (effective site weights, a site-variance summary, the global variance of three layers).

    Args:
        eps: ε added to each site's σ² (official code, 1e-5); caps a site's precision at 1/ε.
        forgetting: λ_f, the weight of the previous global precision (code: 0.95).
        floor: lower bound of the global σ² (code: 1e-8).
        mode: ``"full"`` (element-wise, paper), ``"layer"`` or ``"scalar"`` (official code variants).
        method, results_dir: :class:`feduq.ct_server.CTServer`.

    Raises:
        ValueError: ``mode`` not one of :data:`AGGREGATION_MODES`.
    """

    def __init__(self, eps: float = 1e-5, forgetting: float = 0.95, floor: float = 1e-8, mode: str = "full", **kwargs):
        super().__init__(**kwargs)
        if mode not in AGGREGATION_MODES:
            raise ValueError(f"FIVA: mode={mode!r}: expected one of {AGGREGATION_MODES}")
        self.eps, self.forgetting, self.floor, self.mode = float(eps), float(forgetting), float(floor), mode

    def check(self, site, answer, global_params) -> None:
        """The shared checks (names, shapes, finite values, N_k), then every σ² tensor must be >= 0."""
        super().check(site, answer, global_params)
        for name, ref in global_params.items():
            if name.startswith(VAR_PREFIX):
                check_variance(site, name[len(VAR_PREFIX):], torch.as_tensor(np.asarray(answer.params[name])),
                               np.asarray(ref).shape)

    def fuse(self, fed, answers, global_params):
        names = [k for k in global_params if not k.startswith(VAR_PREFIX)]
        sites = list(answers)
        t = lambda v: torch.as_tensor(np.asarray(v), dtype=torch.float64)  # noqa: E731
        res = inverse_variance_aggregate(
            [{n: t(answers[s].params[n]) for n in names} for s in sites],
            [{n: t(answers[s].params[VAR_PREFIX + n]) for n in names} for s in sites],
            [num_samples(s, answers[s].meta) for s in sites],
            {n: t(global_params[VAR_PREFIX + n]) for n in names},
            eps=self.eps, forgetting=self.forgetting, floor=self.floor, mode=self.mode, site_names=sites)
        first_last = names[:1] + names[-1:]
        summary = {s: {k: round(v, 10) for k, v in variance_summary(
            {n: t(answers[s].params[VAR_PREFIX + n]) for n in first_last}).get(names[0], {}).items()} for s in sites}
        per_layer = variance_summary(res.variance)
        fed.log("FEDUQ_FIVA " + json.dumps({
            "round": fed.round, "mode": self.mode,
            "effective_weights": {s: round(float(w), 6) for s, w in zip(sites, res.site_weights)},
            "site_variance_first_layer": summary,
            "global_variance": {n: {k: float(f"{v:.3e}") for k, v in per_layer[n].items()}
                                for n in (names[0], names[len(names) // 2], names[-1])},
        }))
        out = {n: res.params[n].numpy().astype(np.float32) for n in names}
        out.update({VAR_PREFIX + n: res.variance[n].numpy().astype(np.float32) for n in names})
        return out, dict(zip(sites, map(float, res.site_weights)))
