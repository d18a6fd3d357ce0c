"""nnU-Net's network of a plan as a FedUQ model: what a volume site trains and what the server's persistor builds."""

from __future__ import annotations

import torch
from torch import nn

from .pipeline import is_slim, load_plans

__all__ = ["PlannedNetwork"]


class PlannedNetwork(nn.Module):
    """nnU-Net's network of a plan's configuration, as a FedUQ model: what a volume site trains and what the server's
    persistor builds from the same arguments (so both hold the same state-dict names, ``net.*``).

    Deep supervision follows the module's mode: in training the forward pass returns nnU-Net's list of outputs (full
    resolution first, each ``[B, C, *patch / scale]``), in evaluation the full-resolution logits ``[B, C, *shape]``.

    Args:
        plans: the nnU-Net plans dict (or a path / shipped name, :func:`load_plans`).
        configuration: the plan's configuration (``"3d_fullres"``).
        in_channels: input channels (the task's).
        out_channels: classes including background.
        init_seed: torch seed of nnU-Net's He initialisation.

    Raises:
        ValueError: the plans lack ``configuration``.
    """

    def __init__(self, plans, configuration: str = "3d_fullres", in_channels: int = 1, out_channels: int = 2,
                 init_seed: int = 0):
        super().__init__()
        from nnunetv2.utilities.get_network_from_plans import get_network_from_plans
        from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

        plans = load_plans(plans, configuration)
        cm = PlansManager(plans).get_configuration(configuration)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(init_seed))
            self.net = get_network_from_plans(cm.network_arch_class_name, cm.network_arch_init_kwargs,
                                              cm.network_arch_init_kwargs_req_import, int(in_channels),
                                              int(out_channels), allow_init=True, deep_supervision=True)
        self.paper_network = not is_slim(plans)  # the slim plan is FedUQ's CPU/test shrink, not nnU-Net's network

    def forward(self, x: torch.Tensor):
        self.net.decoder.deep_supervision = self.training
        return self.net(x)

    def bottleneck(self, x: torch.Tensor) -> torch.Tensor:
        """The spatial mean ``[B, F]`` (float32) of nnU-Net's encoder's last stage (the bottleneck, ``F`` its
        features: 64 in the slim plan, 320 in nnU-Net's) on ``x [B, C_in, *patch]``: the review rule's pooled features
        of one window (:func:`feduq.nnunet.volume_inference.volume_features` pools a volume's windows)."""
        return self.net.encoder(x)[-1].float().mean(dim=tuple(range(2, x.dim())))

    def head_keys(self) -> list[str]:
        """State-dict names of the segmentation heads (nnU-Net's ``decoder.seg_layers``: one 1x1(x1) convolution per
        deep-supervision output), the output head FedUAA keeps on the site."""
        return [k for k in self.state_dict() if k.startswith("net.decoder.seg_layers.")]
