"""FedPer's site part (Arivazhagan, Aggarwal, Singh and Choudhary 2019, "Federated Learning with Personalization
Layers", arXiv:1912.00818, §3): FedAvg on the base layers, the personalization layers kept on each site.

FedPer changes only the site. Its server averages what the sites send, the base layers
(:class:`feduq.parts.server.LocalEntriesServer`, FedBN's too), so each site trains the shared base with its own
head. For segmentation the personalization layers are the network's output convolution, the last
``personal_layers`` layers with parameters (FedEvi's U-Net: ``head``; the light U-Net: ``model.2.conv``).
"""

from __future__ import annotations

import torch

from ..common.checks import scalar
from ..parts.site import SitePart


def personal_layer_keys(model: torch.nn.Module, personal_layers: int = 1) -> frozenset[str]:
    """The state entries of ``model``'s last ``personal_layers`` layers with parameters (a layer: a module without
    children that holds parameters of its own), in the order the network registers them, which for FedUQ's networks
    is the order of the forward pass: ``1`` is the output convolution (weight and bias).

    Raises:
        ValueError: ``personal_layers`` is not an integer in [1, number of such layers).
    """
    layers = [name for name, module in model.named_modules()
              if next(module.children(), None) is None and next(module.parameters(recurse=False), None) is not None]
    if isinstance(personal_layers, bool) or not isinstance(personal_layers, int) or not 1 <= personal_layers < len(layers):
        raise ValueError(f"FedPer: personal_layers must be an integer in [1, {len(layers) - 1}] for this network "
                         f"({len(layers)} layers with parameters), got {personal_layers!r}")
    personal = layers[-personal_layers:]
    return frozenset(key for key in model.state_dict() if any(key.startswith(f"{layer}.") for layer in personal))


class FedPerSite(SitePart):
    """FedPer's site part: the personalization layers never leave the site (Arivazhagan et al. 2019, §3).

    ``train`` and ``submit_model`` send every other entry; a received global model overwrites only those, so each
    site's output layer stays as its own training left it, also when a model is validated or tested (the final test
    scores the selected global base with the site's own head of the round that validated it).

    Args:
        personal_layers: how many of the network's last layers with parameters stay on the site (default 1, the
            output convolution); :func:`personal_layer_keys`.
        loss: FedAvg's local loss (:class:`feduq.parts.site.SitePart`).

    Raises:
        ValueError: ``personal_layers`` is not an integer >= 1 (here), or leaves nothing to share (at the site's start).
    """

    global_model_note = ("FedPer keeps the output layer on the sites: the global model holds its initial values, "
                         "so its scores here are not FedPer's personalised results")

    def __init__(self, personal_layers: int = 1, loss: str = "dice_ce"):
        super().__init__(loss=loss)
        scalar(personal_layers, "FedPer: personal_layers", minimum=1)
        if isinstance(personal_layers, bool) or int(personal_layers) != personal_layers:
            raise ValueError(f"FedPer: personal_layers must be an integer >= 1, got {personal_layers!r}")
        self.personal_layers = int(personal_layers)

    def local_keys(self, model: torch.nn.Module) -> frozenset[str]:
        return personal_layer_keys(model, self.personal_layers)

    def setup(self, site) -> None:
        self.local_keys(site.model)  # ValueError at the start: more personal layers than the network has
