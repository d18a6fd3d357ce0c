"""FIVA on the server (MLHC 2025, Eq. 5-8): checks of the sites' variances, inverse-variance aggregation, and
:class:`FIVAServer`, the server part FedUQ's round loop runs. Pure torch, no FLARE."""

from __future__ import annotations

import json
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import Tensor

from ...parts.ct_server import VAR_PREFIX, CTServer
from ...common.checks import scalar as _scalar
from ...parts.server import num_samples
from .training import F64, check_keys

AGGREGATION_MODES = ("full", "layer", "scalar")


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
    check_keys(ref, prev_global_variance, f"prev_global_variance vs params of site {names[0]!r}")
    for name, site_params, site_var in zip(names, params, variances):
        check_keys(ref, site_params, f"params of site {name!r}")
        check_keys(ref, site_var, f"variances of site {name!r}")
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
        scalar_var = [sum(float(v.to(F64).sum()) for v in site.values())
                      / max(sum(v.numel() for v in site.values()), 1) for site in variances]

    out_params, out_var = {}, {}
    key_weights: list[dict[str, float]] = [{} for _ in range(n_sites)]
    weight_sums = np.zeros(n_sites)
    n_elements = 0
    for key, value in ref.items():
        precisions = []
        for i in range(n_sites):
            v = variances[i][key].to(device=device, dtype=F64)
            if mode == "full":
                denom = v + eps_
            elif mode == "layer":
                denom = (v.mean() if v.numel() else v.new_zeros(())) + eps_
            else:
                denom = torch.tensor(scalar_var[i], dtype=F64, device=device)
            if bool((denom <= 0).any()):
                raise ValueError(f"site {names[i]!r}: variance {key!r} + eps is 0 in mode {mode!r}; "
                                 "the precision would be infinite")
            precisions.append(torch.broadcast_to(n_hat[i] / denom, value.shape))
        c = torch.stack(precisions)  # [N, *shape]
        precision = c.sum(0)
        weights = c / precision
        thetas = torch.stack([params[i][key].to(device=device, dtype=F64) for i in range(n_sites)])
        out_params[key] = (weights * thetas).sum(0).to(value.dtype)
        prev = prev_global_variance[key].to(device=device, dtype=F64)
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
        flat = v.detach().reshape(-1).to(F64)
        out[name] = {"min": float(flat.min()), "median": float(flat.median()),
                     "mean": float(flat.mean()), "max": float(flat.max())}
    return out


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
        method, results_dir: :class:`feduq.parts.ct_server.CTServer`.

    Raises:
        ValueError: ``mode`` not one of :data:`AGGREGATION_MODES`.
    """

    def __init__(self, eps: float = 1e-5, forgetting: float = 0.95, floor: float = 1e-8, mode: str = "full",
                 method: str = "fedavg_ct", results_dir: str = "results"):
        super().__init__(method=method, results_dir=results_dir)
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
