"""Pure aggregation helpers (numpy; no FLARE).

Every FedUQ aggregator and workflow reduces client models with :func:`weighted_average` and checks
them with :func:`check_update`, so the NaN / shape guards live in exactly one place.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np


class InvalidUpdate(ValueError):
    """A client update that must not enter the global model (message names site and parameter)."""


def check_update(site: str, params: Mapping[str, object], reference: Mapping[str, object] | None = None) -> None:
    """Validate one client's parameters before aggregation.

    Args:
        site: client name, used in the error message.
        params: parameter name -> array-like (numpy array or torch tensor).
        reference: expected parameter names and shapes (e.g. the current global model); when None,
            only finiteness is checked.

    Raises:
        InvalidUpdate: empty update, missing or unexpected parameter names, a shape mismatch
            (``expected=... got=...``), or a non-finite (NaN/Inf) value; the message names the site
            and the first offending parameter.
    """
    if not params:
        raise InvalidUpdate(f"site {site!r} sent an empty update")
    if reference is not None:
        missing = sorted(set(reference) - set(params))
        extra = sorted(set(params) - set(reference))
        if missing or extra:
            raise InvalidUpdate(
                f"site {site!r} parameter names do not match the global model: missing={missing[:5]} extra={extra[:5]}"
            )
    for name, value in params.items():
        arr = np.asarray(value)
        if reference is not None:
            expected = tuple(np.shape(reference[name]))
            if tuple(arr.shape) != expected:
                raise InvalidUpdate(
                    f"site {site!r} parameter {name!r} shape does not match the global model: "
                    f"expected={expected}, got={tuple(arr.shape)}"
                )
        if np.issubdtype(arr.dtype, np.floating) and not np.all(np.isfinite(arr)):
            n_bad = int(arr.size - np.count_nonzero(np.isfinite(arr)))
            raise InvalidUpdate(f"site {site!r} parameter {name!r} has {n_bad} non-finite value(s) (NaN/Inf)")


def normalise_weights(weights: Mapping[str, float]) -> dict[str, float]:
    """Return ``weights`` divided by their sum.

    Raises:
        ValueError: a weight is negative or non-finite, or all weights are zero.
    """
    for site, w in weights.items():
        if not np.isfinite(w) or w < 0:
            raise ValueError(f"aggregation weight of site {site!r} must be finite and >= 0, got {w!r}")
    total = float(sum(weights.values()))
    if total <= 0:
        raise ValueError(f"aggregation weights sum to {total}; at least one must be > 0: {dict(weights)}")
    return {site: float(w) / total for site, w in weights.items()}


def weighted_average(
    params_by_site: Mapping[str, Mapping[str, object]], weights: Mapping[str, float]
) -> dict[str, np.ndarray]:
    """θ = Σ_k w_k θ_k / Σ_k w_k, key by key (FedAvg; FedEvi's surrogate and final model, Eq. 7).

    Args:
        params_by_site: site -> (parameter name -> array). All sites must share names and shapes
            (check them with :func:`check_update` first).
        weights: site -> non-negative weight (renormalised over the sites given here, so a dropped
            client's weight is redistributed over those that answered).

    Returns:
        parameter name -> numpy array with the dtype of the first site's array; floating arrays are
        accumulated in float64, integer arrays (e.g. BatchNorm ``num_batches_tracked``) are rounded.

    Raises:
        ValueError: sites in ``params_by_site`` and ``weights`` differ, or invalid weights.
    """
    if set(params_by_site) != set(weights):
        raise ValueError(
            f"weighted_average: sites with parameters {sorted(params_by_site)} != sites with weights {sorted(weights)}"
        )
    norm = normalise_weights(weights)
    sites = sorted(params_by_site)
    first = params_by_site[sites[0]]
    out: dict[str, np.ndarray] = {}
    for name in first:
        acc = np.zeros(np.shape(first[name]), dtype=np.float64)
        for site in sites:
            acc += norm[site] * np.asarray(params_by_site[site][name], dtype=np.float64)
        dtype = np.asarray(first[name]).dtype
        out[name] = np.rint(acc).astype(dtype) if np.issubdtype(dtype, np.integer) else acc.astype(dtype)
    return out


def sites_summary(expected: Sequence[str], answered: Sequence[str]) -> str:
    """One log line naming who answered and who is missing this round."""
    missing = sorted(set(expected) - set(answered))
    return f"answered={sorted(answered)} missing={missing}"
