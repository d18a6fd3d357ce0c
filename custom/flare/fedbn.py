"""FedBN's FLARE glue (Li et al., ICLR 2021): the client executor.

:class:`FedBNExecutor` keeps the normalisation layers on the site. The server is FedAvg's
(:class:`feduq.flare.aggregators.WeightedAggregator` with ``partial_updates=True`` under
:class:`feduq.flare.workflows.ResumableScatterAndGather`).
"""

from __future__ import annotations

from nvflare.apis.fl_context import FLContext

from ..networks import normalisation_keys
from .executor import FedUQExecutor


class FedBNExecutor(FedUQExecutor):
    """FedBN client (Li et al., ICLR 2021): FedAvg with the normalisation layers kept local.

    The entries of normalisation layers (found by module type with
    :func:`feduq.networks.normalisation_keys`, never by name: BatchNorm weight, bias, running_mean,
    running_var, num_batches_tracked) never leave the site: ``train`` and ``submit_model`` send
    every other entry, and a received global model overwrites only those other entries, so the
    site's normalisation layers stay exactly as its own training left them, also when the model is
    validated or tested (the final test scores the global model with the site's own statistics).
    The server averages what the sites send (``WeightedAggregator(partial_updates=True)``).

    Needs a network with normalisation state: ``network={"norm": "batch"}`` (the default here); a
    network without any (e.g. the stateless InstanceNorm) stops the site at start-up.

    Args:
        **kwargs: see :class:`FedUQExecutor`.
    """

    global_model_note = ("FedBN keeps normalisation layers on the sites: the global model holds their initial values, "
                         "so its scores here are not FedBN's personalised results")

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.network_args.setdefault("norm", "batch")
        self._local_keys: frozenset[str] | None = None

    def local_keys(self) -> frozenset[str]:
        if self._local_keys is None:  # computed once from the local model's module types
            model = self.trainer.model
            self._local_keys = frozenset(normalisation_keys(list(model.state_dict()), model))
        return self._local_keys

    def _setup(self, fl_ctx: FLContext) -> None:
        super()._setup(fl_ctx)
        self._local_keys = None
        if not self.local_keys():
            self.trainer = None  # no task may run with a model that would leak nothing local
            raise ValueError(
                f"FedBN needs normalisation layers with state, but network {self.network_args} has none "
                "(set network norm to \"batch\")"
            )
