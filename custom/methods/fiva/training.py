"""FIVA on the site (MLHC 2025, Eq. 2-4): Welford running variances of the parameters (FIVA-P) or the gradients
(FIVA-G). Pure torch, no FLARE."""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch
from torch import Tensor

from ...common.checks import scalar as _scalar

VARIANCE_DIVISORS = ("n", "n+1")
FIVA_G_MODES = ("strong", "weak")
F64 = torch.float64


def check_keys(reference: Mapping[str, Tensor], other: Mapping[str, Tensor], what: str) -> None:
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
            check_keys(self._dtypes, named, "Welford.update")
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
    check_keys(start_variance, gradient_variance, "fiva_g_variance: gradient_variance vs start_variance")
    out = {}
    for name, start in start_variance.items():
        g = gradient_variance[name]
        if tuple(g.shape) != tuple(start.shape):
            raise ValueError(f"fiva_g_variance: {name!r} gradient variance has shape {tuple(g.shape)}, "
                             f"start variance {tuple(start.shape)}")
        out[name] = (start.to(F64) + factor * g.to(device=start.device, dtype=F64)).to(start.dtype)
    return out
