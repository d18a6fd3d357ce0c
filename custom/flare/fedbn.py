"""FedBN's FLARE glue (Li et al., ICLR 2021): the job's executor class.

The method is :mod:`feduq.methods.fedbn` (:class:`~feduq.methods.fedbn.FedBNSite`: the normalisation layers stay on
the site); the server is FedAvg's (:class:`feduq.flare.controller.FedAvgController` with ``partial_updates: true``:
:class:`feduq.methods.server.LocalEntriesServer` averages what the sites send).
"""

from __future__ import annotations

from ..methods.fedbn import FedBNSite
from .executor import FedUQExecutor


class FedBNExecutor(FedUQExecutor):
    """FedBN client: FedUQ's executor with :class:`feduq.methods.fedbn.FedBNSite`.

    Args:
        **kwargs: see :class:`FedUQExecutor`.
    """

    def __init__(self, loss: str = "dice_ce", **kwargs):
        super().__init__(method=FedBNSite(loss=loss), loss=loss, **kwargs)
