"""FedBN's site part (Li et al., ICLR 2021): FedAvg with the normalisation layers kept on the site.

FedBN changes only the site; its server averages what the sites send
(:class:`feduq.parts.server.LocalEntriesServer`, the job's ``server_part``).
"""

from __future__ import annotations

import torch

from ..core.networks import normalisation_keys
from ..parts.site import SitePart


class FedBNSite(SitePart):
    """FedBN's site part: the entries of normalisation layers never leave the site (Li et al., ICLR 2021, Alg. 1).

    The entries are found by module type with :func:`feduq.core.networks.normalisation_keys`, never by name (BatchNorm
    weight, bias, running_mean, running_var, num_batches_tracked). ``train`` and ``submit_model`` send every other
    entry, and a received global model overwrites only those other entries, so the site's normalisation layers stay
    exactly as its own training left them, also when the model is validated or tested (the final test scores the
    selected global model with the site's own statistics of the round that validated it:
    :meth:`feduq.flare.executor.FedUQExecutor._load_eval_model`).

    Needs a network with normalisation state: ``network={"norm": "batch"}`` (the default here); a network without
    any (e.g. the stateless InstanceNorm) stops the site at start-up (:meth:`setup` raises ValueError).

    Args:
        loss: FedAvg's local loss (:class:`feduq.parts.site.SitePart`).
    """

    global_model_note = ("FedBN keeps normalisation layers on the sites: the global model holds their initial values, "
                         "so its scores here are not FedBN's personalised results")
    network_defaults = {"norm": "batch"}

    def local_keys(self, model: torch.nn.Module) -> frozenset[str]:
        return frozenset(normalisation_keys(list(model.state_dict()), model))

    def setup(self, site) -> None:
        if not self.local_keys(site.model):
            raise ValueError(f"FedBN needs normalisation layers with state, but network {getattr(site, 'network_args', {})} has none "
                             "(set network norm to \"batch\")")
