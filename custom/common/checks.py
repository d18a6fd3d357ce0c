"""Input checks shared by the method modules (errors name the argument)."""

from __future__ import annotations

import math

import numpy as np


def scalar(value: float, name: str, minimum: float | None = None, maximum: float | None = None,
           below: float | None = None) -> float:
    """``float(value)`` when finite, ``>= minimum``, ``<= maximum`` and ``< below`` (None = unbounded).

    Raises:
        ValueError: not a number, not finite, or out of range; the message names ``name`` and the range.
    """
    try:
        v = float(value)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a number, got {value!r}") from exc
    if minimum is not None and maximum is not None:
        bounds = [f"in [{minimum}, {maximum}]"]
    else:
        bounds = [f">= {minimum}"] * (minimum is not None) + [f"<= {maximum}"] * (maximum is not None)
    bounds += [f"< {below}"] * (below is not None)
    if (not math.isfinite(v) or (minimum is not None and v < minimum) or (maximum is not None and v > maximum)
            or (below is not None and v >= below)):
        raise ValueError(f"{name} must be finite{''.join(' and ' + b for b in bounds)}, got {value!r}")
    return v


def vector(values, name: str, allow_empty: bool = False) -> np.ndarray:
    """:func:`array` with ``ndim=1``: a finite 1-D float64 copy, non-empty unless ``allow_empty``."""
    return array(values, name, 1, allow_empty=allow_empty)


def _first_bad(arr: np.ndarray, bad: np.ndarray, name: str, rule: str) -> None:
    where = np.argwhere(bad)
    if where.size:
        idx = tuple(int(i) for i in where[0])
        raise ValueError(f"{name}{list(idx)} must be {rule}, got {float(arr[idx])!r}")


def non_negative(arr: np.ndarray, name: str, tol: float = 0.0) -> None:
    """ValueError naming the first entry below ``-tol`` (``name[i, ...] must be >= 0, got v``)."""
    _first_bad(arr, arr < -tol, name, ">= 0")


def positive(arr: np.ndarray, name: str) -> None:
    """ValueError naming the first entry <= 0 (``name[i, ...] must be > 0, got v``)."""
    _first_bad(arr, arr <= 0, name, "> 0")


def same_length(a: np.ndarray, a_name: str, b: np.ndarray, b_name: str) -> None:
    """ValueError when ``b`` has not the shape of ``a`` (both 1-D)."""
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the length of {a_name} ({a.shape[0]}), got {b.shape[0]}")


def array(values, name: str, ndim: int, shape: tuple[int, ...] | None = None, allow_nan: bool = False,
          allow_empty: bool = False) -> np.ndarray:
    """float64 copy with ``ndim`` dims (and ``shape`` if given), non-empty unless ``allow_empty``, finite (NaN allowed if
    asked).

    Raises:
        ValueError: not numbers, wrong dims/shape, empty, or a non-finite entry (``name[i, ...]`` and its value named).
    """
    try:
        arr = np.array(values, dtype=np.float64)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a {ndim}-D array of numbers: {exc}") from exc
    if arr.ndim != ndim:
        raise ValueError(f"{name} must be a {ndim}-D array, got shape {arr.shape}")
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"{name} must not be empty (a non-empty {ndim}-D array), got shape {arr.shape}")
    if shape is not None and arr.shape != shape:
        raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
    bad = np.argwhere(np.isinf(arr) if allow_nan else ~np.isfinite(arr))
    if bad.size:
        idx = tuple(int(i) for i in bad[0])
        raise ValueError(f"{name}{list(idx)} must be finite, got {float(arr[idx])!r}")
    return arr


def keyword_names(fn) -> set[str]:
    """The parameters of ``fn`` a caller can pass by keyword (``self``/``cls`` and ``*args``/``**kwargs`` left out)."""
    import inspect

    params = inspect.signature(fn).parameters.values()
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("self", "cls")}


#: where a job's site or server part (or its own site class) may come from: the methods, the shared base parts, and
#: FedUQ's shared classification site
PART_MODULES = ("feduq.methods.", "feduq.parts.", "feduq.site.classification.")


def method_part_class(path: str, base: type, argument: str, example: str) -> type:
    """The subclass of ``base`` at dotted ``path``, which must lie in ``feduq.methods`` or ``feduq.parts`` (a job
    names a method's site or server part, or a shared base part; nothing else is imported from a job file).

    Raises:
        ValueError: the path is outside ``feduq.methods`` and ``feduq.parts``, does not import, or is not a ``base``; the message names
            ``argument`` and the path.
    """
    from .classpath import ClassPathError, resolve_class

    if not str(path).startswith(PART_MODULES):
        raise ValueError(f"{argument}={path!r}: expected a class in feduq.methods or feduq.parts (e.g. \"{example}\")")
    try:
        cls = resolve_class(path, PART_MODULES)
    except ClassPathError as e:
        raise ValueError(f"{argument}: {e}") from None
    if not issubclass(cls, base):
        raise ValueError(f"{argument}={path!r} is not a {base.__module__}.{base.__name__}")
    return cls


def site_names(value: str) -> list[str]:
    """A ``--sites`` value, ``"A,B,C"`` -> ``["A", "B", "C"]`` (an argparse ``type``).

    Raises:
        argparse.ArgumentTypeError: an empty value or an empty name (``--sites ""`` meant every site before; say
            nothing to mean that).
    """
    import argparse

    names = [v.strip() for v in value.split(",")]
    if not value.strip() or any(not n for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated site names, got {value!r} (leave --sites out "
                                         f"for every site of the task)")
    return names
