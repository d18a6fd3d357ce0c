"""FUNAvg's FLARE glue (FUNAvg, MICCAI 2024): the job's executor class.

The site part is :class:`feduq.methods.fiva.site.FUNAvgSite` (``Dropout2d(p=0.3)`` in every conv block in training;
at test time only the dropout modules in training mode for K = 10 passes, the heads merged with the same
uncertainty-reweighted background as FIVA+UN, :mod:`feduq.methods.fiva`). The server is FedAvg's
(:class:`feduq.flare.ct.CTController`: the backbone weighted by training cases).
"""

from __future__ import annotations

from ..methods.fiva.site import FUNAvgSite
from .ct import CTExecutor


class FUNAvgExecutor(CTExecutor):
    """FUNAvg site: :class:`feduq.flare.ct.CTExecutor` with ``dropout=0.3`` and :class:`FUNAvgSite`.

    Raises:
        ValueError: ``dropout`` <= 0.
    """

    def __init__(self, dropout: float = 0.3, **kwargs):
        super().__init__(dropout=dropout, method=FUNAvgSite(), **kwargs)
