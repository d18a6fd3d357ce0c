"""FedProx's FLARE glue (Li et al., MLSys 2020): the job's executor class.

The method is :mod:`feduq.methods.fedprox` (:class:`~feduq.methods.fedprox.FedProxSite`: μ/2·‖θ − θ_g‖² added to
every local step); the server is FedAvg's (:class:`feduq.flare.controller.FedAvgController`).
"""

from __future__ import annotations

from ..methods.fedprox import FedProxSite
from .executor import FedUQExecutor


class FedProxExecutor(FedUQExecutor):
    """FedProx client: FedUQ's executor with :class:`feduq.methods.fedprox.FedProxSite`.

    Args:
        mu: proximal weight μ >= 0 (:class:`feduq.methods.fedprox.FedProxSite`).
        **kwargs: see :class:`FedUQExecutor`.
    """

    def __init__(self, mu: float = 0.01, loss: str = "dice_ce", **kwargs):
        super().__init__(method=FedProxSite(mu=mu, loss=loss), loss=loss, **kwargs)
