"""FUNAvg's FLARE glue (FUNAvg, MICCAI 2024): FedAvg with dropout 0.3 in training, MC-dropout inference.

The server is :class:`feduq.flare.ct.CTController` (FedAvg of the backbone weighted by training cases);
the site trains nnU-Net with ``Dropout2d(p=0.3)`` in every conv block and at test time keeps only the
dropout modules in training mode for K = 10 passes, merging the heads with the same uncertainty-
reweighted background as FIVA+UN (:mod:`feduq.methods.fiva`).
"""

from __future__ import annotations

from .ct import CTExecutor


class FUNAvgExecutor(CTExecutor):
    """FUNAvg site: :class:`feduq.flare.ct.CTExecutor` with ``dropout=0.3`` and MC-dropout sampling."""

    def __init__(self, dropout: float = 0.3, **kwargs):
        super().__init__(dropout=dropout, **kwargs)
        if self.dropout <= 0:
            raise ValueError("executor argument dropout must be > 0 for FUNAvg (MC-dropout inference)")

    def sampling(self) -> str:
        return "mc_dropout"
