"""Network builders shared by every FedUQ method.

FedUQ uses MONAI's :class:`monai.networks.nets.UNet` rather than a hand-written copy of each
paper's U-Net. The defaults follow FedEvi's official polyp network where it matters for
federated aggregation: base width 16 (16-32-64-128-256), five resolution levels, and
InstanceNorm **without affine parameters and without running statistics**, so that normalisation
layers carry no state and every state-dict entry is a convolution weight or bias (FedEvi code,
methods.md §1.1). ``norm="batch"`` gives the batch-norm variant that FedBN needs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from monai.networks.layers import Norm
from monai.networks.nets import UNet

_NORMS = {
    # InstanceNorm2d(affine=False, track_running_stats=False): no state-dict entries.
    "instance": (Norm.INSTANCE, {"affine": False}),
    "batch": (Norm.BATCH, {}),
}


class SegUNet(UNet):
    """2D U-Net returning per-pixel class logits.

    Args:
        in_channels: image channels (3 for RGB endoscopy/fundus, 1 for MRI/CT/US).
        out_channels: number of classes C including background.
        channels: feature widths per level; FedEvi uses (16, 32, 64, 128, 256).
        strides: down-sampling factor between levels (len(channels) - 1 entries).
        norm: ``"instance"`` (FedEvi, stateless) or ``"batch"`` (FedBN variant).
        num_res_units: residual units per block (0 = plain conv blocks, as FedEvi).
        dropout: dropout probability inside conv blocks (FUNAvg/FIVA use > 0).
        init_seed: seed for the weight initialisation (None = the global torch RNG), so that every
            method of a comparison starts from the same global model.

    Shapes:
        input ``[B, in_channels, H, W]`` float32 with H, W divisible by ``prod(strides)``;
        output logits ``[B, out_channels, H, W]`` float32.

    Raises:
        ValueError: unknown ``norm`` or ``len(strides) != len(channels) - 1``.
    """

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 2,
        channels: Sequence[int] = (16, 32, 64, 128, 256),
        strides: Sequence[int] = (2, 2, 2, 2),
        norm: str = "instance",
        num_res_units: int = 0,
        dropout: float = 0.0,
        init_seed: int | None = 0,
    ):
        if norm not in _NORMS:
            raise ValueError(f"SegUNet: norm must be one of {sorted(_NORMS)}, got {norm!r}")
        if len(strides) != len(channels) - 1:
            raise ValueError(
                f"SegUNet: strides needs len(channels) - 1 = {len(channels) - 1} entries, got {len(strides)}"
            )
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            if init_seed is not None:
                torch.manual_seed(init_seed)
            super().__init__(
                spatial_dims=2,
                in_channels=in_channels,
                out_channels=out_channels,
                channels=tuple(channels),
                strides=tuple(strides),
                num_res_units=num_res_units,
                norm=_NORMS[norm],
                dropout=dropout,
            )
        self.norm_kind = norm
        self.size_divisor = int(np.prod(strides))  # H and W must be multiples (see check_input_size)
        self.min_size = self.size_divisor


def check_input_size(model: torch.nn.Module, image_size: int) -> None:
    """Check that ``model`` can take ``image_size`` × ``image_size`` inputs (pixels).

    The network declares what it needs: ``size_divisor`` (the total down-sampling stride; every side
    must be a multiple of it, otherwise a skip connection and its upsampled feature map differ in size)
    and ``min_size``. Networks without these attributes accept any size.

    Raises:
        ValueError: naming the size, the network and the nearest sizes it accepts.
    """
    divisor = int(getattr(model, "size_divisor", 1))
    minimum = int(getattr(model, "min_size", 1))
    name = type(model).__name__
    if image_size < minimum:
        raise ValueError(f"image_size={image_size} is too small for network {name}: it needs >= {minimum} px")
    if image_size % divisor:
        lower, upper = (image_size // divisor) * divisor, (image_size // divisor + 1) * divisor
        raise ValueError(
            f"image_size={image_size} is not a multiple of {divisor}, the total stride of network {name}; "
            f"use {lower if lower >= max(minimum, divisor) else upper} or {upper}"
        )


def normalisation_keys(state_keys: Sequence[str], model) -> list[str]:
    """Names of state-dict entries that belong to normalisation layers of ``model``.

    Used by FedBN to keep these entries local. Detection is by module type, not by name
    substring, so it cannot leak like FedUAA's ``'bn' in name`` filter (methods.md §2.1).
    """
    import torch.nn as nn

    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    prefixes = [name + "." for name, mod in model.named_modules() if isinstance(mod, norm_types)]
    return [k for k in state_keys if any(k.startswith(p) for p in prefixes)]


class ResNetTWEU(torch.nn.Module):
    """FedUAA's classifier: a shared ResNet backbone and a local TWEU head (Wang et al., MICCAI 2023).

    * ``backbone``: MONAI's 2D ResNet (``monai.networks.nets.resnet18/34/50``, no pretrained weights) with its
      ``fc`` replaced by ``Identity``, i.e. stem, four stages and global average pooling. The stem convolution has
      stride 2 (``conv1_t_stride=2``) as torchvision's ResNet that FedUAA uses; MONAI's default is 1.
      (FedUAA: ImageNet-pretrained ResNet-50; here ResNet-18 from scratch by default, see README.)
    * ``classifier`` (the TWEU head, kept local by FedUAA): ``Linear(F, hidden) -> BatchNorm1d -> ReLU ->
      Linear(hidden, K)`` with F = 512 (ResNet-18/34) or 2048 (ResNet-50); FedUAA: 2048 -> 512 -> K.

    Args:
        in_channels: image channels (1 for ultrasound).
        out_channels: number of classes K (named like :class:`SegUNet`'s so job tools can set it per task).
        backbone: ``"resnet18"``, ``"resnet34"`` or ``"resnet50"``.
        hidden: width of the head's hidden layer.
        init_seed: seed for the weight initialisation (None = the global torch RNG).

    Shapes:
        input ``[B, in_channels, H, W]`` float32 (H, W >= 32); output logits ``[B, out_channels]`` float32
        (evidence = softplus(logits) in FedUAA). ``features(x)`` gives the pooled ``[B, F]`` backbone features.
        Training needs B >= 2 (BatchNorm1d in the head).

    Raises:
        ValueError: unknown ``backbone``, ``out_channels < 2`` or ``hidden < 1``.
    """

    FEATURES = {"resnet18": 512, "resnet34": 512, "resnet50": 2048}

    def __init__(
        self,
        in_channels: int = 1,
        out_channels: int = 2,
        backbone: str = "resnet18",
        hidden: int = 128,
        init_seed: int | None = 0,
    ):
        super().__init__()
        from monai.networks.nets import resnet

        if backbone not in self.FEATURES:
            raise ValueError(f"ResNetTWEU: backbone must be one of {sorted(self.FEATURES)}, got {backbone!r}")
        if out_channels < 2 or hidden < 1:
            raise ValueError(f"ResNetTWEU: need out_channels >= 2 and hidden >= 1, got {out_channels}, {hidden}")
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            if init_seed is not None:
                torch.manual_seed(init_seed)
            self.backbone = getattr(resnet, backbone)(
                pretrained=False, spatial_dims=2, n_input_channels=in_channels, conv1_t_stride=2, num_classes=1
            )
            self.backbone.fc = torch.nn.Identity()
            width = self.FEATURES[backbone]
            self.classifier = torch.nn.Sequential(
                torch.nn.Linear(width, hidden),
                torch.nn.BatchNorm1d(hidden),
                torch.nn.ReLU(inplace=True),
                torch.nn.Linear(hidden, out_channels),
            )
        self.backbone_name = backbone
        self.min_size = 32  # five stride-2 stages; global pooling takes any size above

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.backbone(x))

    def head_keys(self) -> list[str]:
        """State-dict names of the TWEU head (``classifier.*``)."""
        return [k for k in self.state_dict() if k.startswith("classifier.")]
