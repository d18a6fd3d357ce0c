"""FIVA's FLARE glue (FIVA, MLHC 2025): the job's executor and controller classes.

The method is :mod:`feduq.methods.fiva`: the site part :class:`~feduq.methods.fiva.site.FIVASite` (Welford variances
of the backbone over each round's steps, K backbones drawn at test time) runs on the nnU-Net back-end
(:class:`feduq.flare.ct.CTExecutor`); the server part :class:`~feduq.methods.fiva.FIVAServer` (element-wise
inverse-variance fusion, Eq. 5-8, with the official code's ε and floor and forgetting λ_f; the global σ² is
broadcast with θ_g and checkpointed with it) runs in the CT round (:class:`feduq.flare.ct.CTController`).
"""

from __future__ import annotations

from ..methods.fiva import FIVAServer
from ..methods.fiva.site import FIVASite
from .ct import CTController, CTExecutor


class FIVAExecutor(CTExecutor):
    """FIVA-P (``variance="parameter"``) or FIVA-G (``variance="gradient"``) site: :class:`CTExecutor` with
    :class:`feduq.methods.fiva.site.FIVASite`.

    Args:
        variance, divisor, g_mode, sample_scale: :class:`feduq.methods.fiva.site.FIVASite`.
        **kwargs: :class:`feduq.flare.ct.CTExecutor`.
    """

    def __init__(self, variance: str = "parameter", divisor: str = "n", g_mode: str = "strong",
                 sample_scale: str = "std", **kwargs):
        super().__init__(method=FIVASite(variance=variance, divisor=divisor, g_mode=g_mode, sample_scale=sample_scale),
                         **kwargs)


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
