"""Input checks shared by the method modules (errors name the argument)."""

from __future__ import annotations

import math

import numpy as np


def scalar(value: float, name: str, minimum: float | None = None, maximum: float | None = None) -> float:
    """``float(value)`` when finite and within [minimum, maximum] (None = unbounded).

    Raises:
        ValueError: not a number, not finite, or out of range; the message names ``name``.
    """
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a number, got {value!r}") from exc
    if not math.isfinite(v) or (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise ValueError(f"{name} must be finite and in [{minimum}, {maximum}], got {value!r}")
    return v


def array(values, name: str, ndim: int, shape: tuple[int, ...] | None = None, allow_nan: bool = False) -> np.ndarray:
    """float64 copy with ``ndim`` dims (and ``shape`` if given), non-empty, finite (NaN allowed if asked).

    Raises:
        ValueError: not numbers, wrong dims/shape, empty, or a non-finite entry (its index named).
    """
    try:
        arr = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a {ndim}-D array of numbers: {exc}") from exc
    if arr.ndim != ndim or arr.size == 0:
        raise ValueError(f"{name} must be a non-empty {ndim}-D array, got shape {arr.shape}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    bad = np.argwhere(np.isinf(arr) if allow_nan else ~np.isfinite(arr))
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        raise ValueError(f"{name}{list(idx)} must be finite, got {arr[idx]!r}")
    return arr
