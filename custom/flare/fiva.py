"""FIVA's FLARE glue (FIVA, MLHC 2025): Welford variances on the site, inverse-variance aggregation on the server.

* :class:`FIVAExecutor` -- a :class:`feduq.flare.ct.CTExecutor` that tracks, over each round's steps,
  the variance of the backbone parameters (FIVA-P) or of their gradients read from
  ``named_parameters()`` after ``backward()`` and unscaling (FIVA-G: σ²_θ = σ²_start + η²·T·σ²_g) and
  sends it beside the parameters (``variance::<name>``, same shapes); at test time it draws K backbones
  θ_g + ε, ε ~ N(0, σ²_g), always from an unchanged copy of θ_g.
* :class:`FIVAController` -- element-wise inverse-variance aggregation (Eq. 5-8, server part
  :class:`feduq.methods.fiva.FIVAServer`) with the official code's ε and floor, forgetting λ_f; the global σ²
  is broadcast with θ_g and checkpointed with it.

The math is :mod:`feduq.methods.fiva`. Code-vs-paper switches (defaults = paper): ``divisor`` (``n`` or
the code's ``n+1``, which also makes FIVA-G's count factor T+1), ``g_mode`` (``strong`` or the code's
``weak``), ``sample_scale`` (``std`` or the code's ``variance`` used as the standard deviation),
aggregation ``mode`` (``full``, or the code's ``layer`` / ``scalar``). The official FIVA-G reads
gradients that are always None (its variance is zero); here it reads the live parameters' gradients.
"""

from __future__ import annotations

import numpy as np
import torch

from nvflare.app_common.abstract.fl_model import FLModel

from ..methods.fiva import (
    FIVA_G_MODES,
    SAMPLE_SCALES,
    VARIANCE_DIVISORS,
    FIVAServer,
    Welford,
    fiva_g_variance,
    sample_backbone,
)
from .ct import VAR_PREFIX, CTController, CTExecutor

VARIANCE_SOURCES = ("parameter", "gradient")


class FIVAExecutor(CTExecutor):
    """FIVA-P (``variance="parameter"``) or FIVA-G (``variance="gradient"``) site.

    Args:
        variance: what Welford tracks per step: the parameters after each optimiser step (P) or the
            unscaled, clipped gradients before it (G).
        divisor: ``"n"`` (paper) or ``"n+1"`` (official code's counter; also FIVA-G's count factor T+1).
        g_mode: FIVA-G ``"strong"`` (σ²_start + η²·T·σ²_g, paper) or ``"weak"`` (no T factor, code).
        sample_scale: test-time ε ~ N(0, σ²_g) with standard deviation σ_g (``"std"``, paper) or σ²_g (``"variance"``, code).
        **kwargs: :class:`feduq.flare.ct.CTExecutor`.
    """

    def __init__(self, variance: str = "parameter", divisor: str = "n", g_mode: str = "strong",
                 sample_scale: str = "std", **kwargs):
        super().__init__(**kwargs)
        for name, value, allowed in (("variance", variance, VARIANCE_SOURCES), ("divisor", divisor, VARIANCE_DIVISORS),
                                     ("g_mode", g_mode, FIVA_G_MODES), ("sample_scale", sample_scale, SAMPLE_SCALES)):
            if value not in allowed:
                raise ValueError(f"executor argument {name}={value!r}: expected one of {allowed}")
        self.variance_source, self.divisor, self.g_mode, self.sample_scale = variance, divisor, g_mode, sample_scale

    def sampling(self) -> str:
        return "posterior"

    def round_hooks(self, received: FLModel):
        missing = [n for n in self.backbone if VAR_PREFIX + n not in received.params]
        if missing:
            raise ValueError(f"received model lacks the global variance of {missing[:3]}")
        self._start = {n: torch.as_tensor(np.asarray(received.params[VAR_PREFIX + n])) for n in self.backbone}
        # float64 accumulators (mean + M2: 4x the backbone's float32 memory): in float32 late-training steps of
        # ~1e-7 on |theta| ~ 0.05 lose sigma^2 entirely (relative error ~1); the variance sent stays float32
        self._welford = Welford(torch.float64)
        names = set(self.backbone)
        if self.variance_source == "parameter":
            def on_step(net):
                self._welford.update({n: p.detach() for n, p in net.named_parameters() if n in names})
            return None, on_step

        def on_gradients(net):
            grads = {n: p.grad.detach() for n, p in net.named_parameters() if n in names and p.grad is not None}
            if len(grads) == len(names):  # a step without every gradient is skipped, like a NaN step
                self._welford.update(grads)
        return on_gradients, None

    def extra_result(self, steps: int, lr: float) -> dict:
        if self._welford.count == 0:
            raise FloatingPointError(f"no usable step this round ({self._welford.skipped} skipped for NaN/Inf)")
        var = self._welford.variance(self.divisor)
        if self.variance_source == "gradient":
            count = self._welford.count + (1 if self.divisor == "n+1" else 0)
            var = fiva_g_variance(self._start, {n: v.cpu() for n, v in var.items()}, lr, count, self.g_mode)
        return {VAR_PREFIX + n: v.detach().cpu().numpy().astype(np.float32) for n, v in var.items()}

    def sample_params(self, received: FLModel, generator: torch.Generator):
        mean = {n: torch.as_tensor(np.asarray(received.params[n])) for n in self.backbone}
        var = {n: torch.as_tensor(np.asarray(received.params[VAR_PREFIX + n])) for n in self.backbone}
        for _ in range(self.inference_samples):
            yield sample_backbone(mean, var, generator, self.sample_scale)


class FIVAController(CTController):
    """FIVA's rounds: the CT round loop with :class:`feduq.methods.fiva.FIVAServer` (inverse-variance fusion).

    Args:
        eps, forgetting, floor, mode: :class:`feduq.methods.fiva.FIVAServer`.
        **kwargs: :class:`feduq.flare.ct.CTController`.
    """

    def __init__(self, *, eps: float = 1e-5, forgetting: float = 0.95, floor: float = 1e-8, mode: str = "full",
                 method: str = "fedavg_ct", results_dir: str = "results", **kwargs):
        server = FIVAServer(eps=eps, forgetting=forgetting, floor=floor, mode=mode, method=method, results_dir=results_dir)
        super().__init__(server=server, **kwargs)
