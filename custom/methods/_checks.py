"""Input checks shared by the method modules (errors name the argument)."""

from __future__ import annotations

import math


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
