"""FedUQ's image-level classifier (registered in :mod:`feduq.core.networks` as ``resnet_tweu``): FedUAA's ResNet backbone
with its TWEU head.
"""

from __future__ import annotations

import torch


class ResNetTWEU(torch.nn.Module):
    """FedUAA's classifier: a shared ResNet backbone and a local TWEU head (Wang et al., MICCAI 2023).

    * ``backbone``: MONAI's 2D ResNet (``monai.networks.nets.resnet18/34/50``, no pretrained weights) with its
      ``fc`` replaced by ``Identity``, i.e. stem, four stages and global average pooling. The stem convolution has
      stride 2 (``conv1_t_stride=2``) as torchvision's ResNet that FedUAA uses; MONAI's default is 1.
      (FedUAA: ImageNet-pretrained ResNet-50; here ResNet-18 from scratch by default, see jobs/feduaa_cls/README.md.)
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
