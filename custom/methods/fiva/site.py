"""FIVA's and FUNAvg's site parts on the nnU-Net back-end (:class:`feduq.parts.site.CTSitePart`): FLARE-free.

* :class:`FIVASite` (FIVA, MLHC 2025, Eq. 2-4 and 9): over each round's steps, the Welford variance of the backbone
  parameters (FIVA-P) or of their gradients read from ``named_parameters()`` after ``backward()`` and unscaling
  (FIVA-G: σ²_θ = σ²_start + η²·T·σ²_g), sent beside the parameters as ``variance::<name>`` (same shapes); at test
  time K backbones θ_g + ε, ε ~ N(0, σ²_g), always drawn around an unchanged copy of θ_g.
* :class:`FUNAvgSite` (FUNAvg, Tölle et al., MICCAI 2024): Dropout2d in every conv block in training, and at test
  time only the dropout modules kept in training mode for K passes.

Code-vs-paper switches (defaults = paper): ``divisor`` (``n`` or the code's ``n+1``, which also makes FIVA-G's count
factor T+1), ``g_mode`` (``strong`` or the code's ``weak``), ``sample_scale`` (``std`` or the code's ``variance`` used
as the standard deviation). The official FIVA-G reads gradients that are always None (its variance is zero); here it
reads the live parameters' gradients.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch

from ...parts.ct_server import VAR_PREFIX
from ...parts.site import CTSitePart
from .inference import SAMPLE_SCALES, sample_backbone
from .training import FIVA_G_MODES, VARIANCE_DIVISORS, Welford, fiva_g_variance

VARIANCE_SOURCES = ("parameter", "gradient")


class FIVASite(CTSitePart):
    """FIVA-P (``variance="parameter"``) or FIVA-G (``variance="gradient"``) on the site.

    Args:
        variance: what Welford tracks per step: the parameters after each optimiser step (P) or the unscaled, clipped
            gradients before it (G).
        divisor: ``"n"`` (paper) or ``"n+1"`` (official code's counter; also FIVA-G's count factor T+1).
        g_mode: FIVA-G ``"strong"`` (σ²_start + η²·T·σ²_g, paper Eq. 3) or ``"weak"`` (no T factor, official code).
        sample_scale: test-time ε ~ N(0, σ²_g) with standard deviation σ_g (``"std"``, paper Eq. 9) or σ²_g
            (``"variance"``, official code variant).

    Raises:
        ValueError: an argument out of its set, named as the executor argument.
    """

    sampling = "posterior"

    def __init__(self, variance: str = "parameter", divisor: str = "n", g_mode: str = "strong",
                 sample_scale: str = "std"):
        for name, value, allowed in (("variance", variance, VARIANCE_SOURCES), ("divisor", divisor, VARIANCE_DIVISORS),
                                     ("g_mode", g_mode, FIVA_G_MODES), ("sample_scale", sample_scale, SAMPLE_SCALES)):
            if value not in allowed:
                raise ValueError(f"executor argument {name}={value!r}: expected one of {allowed}")
        self.variance_source, self.divisor, self.g_mode, self.sample_scale = variance, divisor, g_mode, sample_scale
        self._start: dict[str, torch.Tensor] = {}
        self._welford = Welford(torch.float64)

    def start_round(self, backbone: Sequence[str], params: Mapping):
        """Start this round's Welford over the backbone (float64: in float32 late-training steps of ~1e-7 on
        |θ| ~ 0.05 lose σ² entirely; the variance sent stays float32).

        Raises:
            ValueError: the received model lacks the global variance of a backbone tensor.
        """
        missing = [n for n in backbone if VAR_PREFIX + n not in params]
        if missing:
            raise ValueError(f"received model lacks the global variance of {missing[:3]}")
        self._start = {n: torch.as_tensor(np.asarray(params[VAR_PREFIX + n])) for n in backbone}
        self._welford = Welford(torch.float64)
        names = set(backbone)
        if self.variance_source == "parameter":
            def on_step(net):
                self._welford.update({n: p.detach() for n, p in net.named_parameters() if n in names})
            return None, on_step

        def on_gradients(net):
            grads = {n: p.grad.detach() for n, p in net.named_parameters() if n in names and p.grad is not None}
            if len(grads) == len(names):  # a step without every gradient is skipped, like a NaN step
                self._welford.update(grads)
        return on_gradients, None

    def statistics(self, steps: int, lr: float) -> dict:
        """``{"variance::<name>": float32 array}``: FIVA-P σ²_θ, or FIVA-G σ²_start + η²·T·σ²_g (Eq. 3).

        Raises:
            FloatingPointError: no step of the round was usable (all skipped for NaN/Inf).
        """
        if self._welford.count == 0:
            raise FloatingPointError(f"no usable step this round ({self._welford.skipped} skipped for NaN/Inf)")
        var = self._welford.variance(self.divisor)
        if self.variance_source == "gradient":
            count = self._welford.count + (1 if self.divisor == "n+1" else 0)
            var = fiva_g_variance(self._start, {n: v.cpu() for n, v in var.items()}, lr, count, self.g_mode)
        return {VAR_PREFIX + n: v.detach().cpu().numpy().astype(np.float32) for n, v in var.items()}

    def samples(self, backbone, params, generator, count):
        """``count`` backbones θ_g + ε (Eq. 9, :func:`feduq.methods.fiva.sample_backbone`)."""
        mean = {n: torch.as_tensor(np.asarray(params[n])) for n in backbone}
        var = {n: torch.as_tensor(np.asarray(params[VAR_PREFIX + n])) for n in backbone}
        for _ in range(count):
            yield sample_backbone(mean, var, generator, self.sample_scale)


class FUNAvgSite(CTSitePart):
    """FUNAvg on the site: FedAvg's training with dropout, MC-dropout passes at test time."""

    sampling = "mc_dropout"

    def check(self, dropout: float) -> None:
        """Raises ValueError unless ``dropout > 0`` (MC-dropout needs dropout layers)."""
        if dropout <= 0:
            raise ValueError("executor argument dropout must be > 0 for FUNAvg (MC-dropout inference)")
