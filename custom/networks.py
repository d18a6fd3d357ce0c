"""Networks shared by every FedUQ method, by name (:func:`build_network`).

A job names its network in the executor's ``"network": {"name": ..., **options}``; the server's
persistor builds the same class (:func:`network_class_path`), and the job check compares the two.

| name | class | what | parameters (RGB → 2) |
|---|---|---|---|
| ``fedevi_unet`` | :class:`FedEviUNet` | FedEvi's 2D U-Net (official code; the network of FedEvi's Tables 1–3 and of the baselines in them) | 3,179,890 |
| ``light`` | :class:`SegUNet` | MONAI ``UNet`` with one stride-2 conv per level: CPU smoke tests and demos, **not a paper's network** | 660,570 |
| ``resnet_tweu`` | :class:`ResNetTWEU` | FedUAA's classifier (ResNet backbone + TWEU head) | ResNet-18: 11.2 M |

Both U-Nets use InstanceNorm **without affine parameters and without running statistics** by
default, so that normalisation layers carry no state and every state-dict entry is a convolution
weight or bias (FedEvi code, methods.md §1.1). ``norm="batch"`` gives the batch-norm variant that
FedBN needs.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
from monai.networks.blocks import Convolution
from monai.networks.layers import Norm
from monai.networks.nets import UNet
from torch import nn

_NORMS = {
    # InstanceNorm2d(affine=False, track_running_stats=False): no state-dict entries.
    "instance": (Norm.INSTANCE, {"affine": False}),
    "batch": (Norm.BATCH, {}),
}


class SegUNet(UNet):
    """The ``light`` network: MONAI's 2D ``UNet`` returning per-pixel class logits (not a paper's network).

    ``paper_network = False``: sites warn and result tables say so when a job trains it.

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
        self.paper_network = False
        self.size_divisor = int(np.prod(strides))  # H and W must be multiples (see check_input_size)
        self.min_size = self.size_divisor

    def head_keys(self) -> list[str]:
        """State-dict names of the top-level output block (MONAI ``UNet`` is ``Sequential(down, skip, up)``;
        with ``num_res_units=0`` a 3×3 stride-2 transposed convolution: ``model.2.conv.weight``/``bias``)."""
        prefix = f"model.{len(self.model) - 1}."
        return [k for k in self.state_dict() if k.startswith(prefix)]


class FedEviUNet(nn.Module):
    """FedEvi's 2D U-Net (Chen et al., MICCAI 2024, official code; methods.md §1.1), from MONAI blocks.

    * Encoder, 5 levels of widths ``w = base_width · (1, 2, 4, 8, 16)`` (16-32-64-128-256): a 2×2
      max-pool before levels 2–5, then three 3×3 convolutions, each followed by the norm; the first
      has **no ReLU**, the other two are followed by ReLU.
    * Decoder, 4 levels from the bottom (w = 256, 128, 64, 32): except at the first, a 3×3
      conv-norm-ReLU 2w → w; nearest ×2 upsampling; a 1×1 conv-norm-ReLU w → w/2; concatenation
      with the encoder's skip (w/2 channels); a 3×3 conv-norm-ReLU w → w.
    * Head: a 1×1 convolution 2·base_width → C (no norm, no activation): the logits.
    * Every convolution has a bias. Init: Kaiming-normal (fan_out, ReLU) weights and zero biases,
      seeded by ``init_seed`` without touching the global RNG.

    With the defaults the network has **3,179,890** parameters for RGB → 2 classes (3,179,602 for
    1 → 2, 3,179,923 for RGB → 3) in **54** state-dict entries. The official forward also returns the
    softmax and the last decoder features; here ``forward`` returns the logits and
    :meth:`features` the last decoder features.

    Args:
        in_channels: image channels (3 RGB, 1 gray).
        out_channels: number of classes C including background.
        base_width: width of the first level (16 in FedEvi).
        norm: ``"instance"`` (FedEvi: InstanceNorm2d, no affine, no running statistics: no state) or
            ``"batch"`` (BatchNorm2d with running statistics: FedBN keeps them on the site).
        dropout: probability of a ``Dropout2d`` after every encoder and decoder level (MC dropout
            for FUNAvg/FIVA); 0 (default, FedEvi) adds no layer.
        init_seed: seed of the weight initialisation (None = the global torch RNG).

    Shapes:
        input ``[B, in_channels, H, W]`` float32 with H, W multiples of 16; output logits
        ``[B, out_channels, H, W]`` float32.

    Raises:
        ValueError: unknown ``norm``, ``base_width`` < 2 or odd, ``dropout`` outside [0, 1).
    """

    LEVELS = 5

    def __init__(
        self,
        in_channels: int = 3,
        out_channels: int = 2,
        base_width: int = 16,
        norm: str = "instance",
        dropout: float = 0.0,
        init_seed: int | None = 0,
    ):
        super().__init__()
        if norm not in _NORMS:
            raise ValueError(f"FedEviUNet: norm must be one of {sorted(_NORMS)}, got {norm!r}")
        if not (isinstance(base_width, int) and base_width >= 2 and base_width % 2 == 0):
            raise ValueError(f"FedEviUNet: base_width must be an even integer >= 2, got {base_width!r}")
        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"FedEviUNet: dropout must be in [0, 1), got {dropout!r}")
        norm_spec = {"instance": ("instance", {"affine": False, "track_running_stats": False}),
                     "batch": ("batch", {})}[norm]

        def conv(cin: int, cout: int, kernel: int, relu: bool = True) -> Convolution:
            return Convolution(spatial_dims=2, in_channels=cin, out_channels=cout, kernel_size=kernel,
                               act="RELU" if relu else None, norm=norm_spec, bias=True, adn_ordering="NA")

        def drop() -> list[nn.Module]:
            return [nn.Dropout2d(float(dropout))] if dropout > 0 else []

        widths = [base_width * 2**i for i in range(self.LEVELS)]
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            if init_seed is not None:
                torch.manual_seed(init_seed)
            self.encoder = nn.ModuleList()
            cin = in_channels
            for i, w in enumerate(widths):
                pool = [nn.MaxPool2d(2)] if i > 0 else []
                self.encoder.append(nn.Sequential(
                    *pool, conv(cin, w, 3, relu=False), conv(w, w, 3), conv(w, w, 3), *drop()))
                cin = w
            self.decoder = nn.ModuleList()
            for j, w in enumerate(reversed(widths[1:])):  # 256, 128, 64, 32
                self.decoder.append(nn.ModuleDict({
                    "reduce": conv(2 * w, w, 3) if j > 0 else nn.Identity(),
                    "up": nn.Upsample(scale_factor=2, mode="nearest"),
                    "project": conv(w, w // 2, 1),
                    "fuse": nn.Sequential(conv(w, w, 3), *drop()),
                }))
            self.head = nn.Conv2d(widths[1], out_channels, kernel_size=1)
            for m in self.modules():
                if isinstance(m, nn.Conv2d):
                    nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                    nn.init.zeros_(m.bias)
        self.norm_kind = norm
        self.size_divisor = 2 ** (self.LEVELS - 1)  # four max-pools: H and W must be multiples of 16
        self.min_size = self.size_divisor

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The last decoder level's features ``[B, 2·base_width, H, W]``."""
        skips = []
        for level in self.encoder:
            x = level(x)
            skips.append(x)
        x = skips.pop()
        for block in self.decoder:
            x = block["project"](block["up"](block["reduce"](x)))
            x = block["fuse"](torch.cat([skips.pop(), x], dim=1))
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))

    def head_keys(self) -> list[str]:
        """State-dict names of the output layer (FedUAA's local segmentation head): ``head.weight``, ``head.bias``."""
        return ["head.weight", "head.bias"]


NETWORKS: dict[str, type] = {}  # filled below: name -> class
DEFAULT_NETWORK = "fedevi_unet"


def build_network(name: str, in_channels: int, out_channels: int, **options) -> torch.nn.Module:
    """Build a registered network by name (see the module docstring for the table).

    Args:
        name: ``"fedevi_unet"``, ``"light"`` or ``"resnet_tweu"``.
        in_channels: image channels.
        out_channels: classes C (segmentation: per pixel; ``resnet_tweu``: per image).
        **options: the class's own options (e.g. ``norm``, ``dropout``, ``base_width``, ``init_seed``).

    Raises:
        ValueError: an unknown name (the known ones are listed) or an option the class rejects.
    """
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; known networks: {sorted(NETWORKS)}")
    try:
        return NETWORKS[name](in_channels=in_channels, out_channels=out_channels, **options)
    except TypeError as e:
        raise ValueError(f"network {name!r}: {e}") from None


def network_class_path(name: str) -> str:
    """The class path of a registered network (what a job's persistor builds), e.g. ``feduq.networks.FedEviUNet``.

    Raises:
        ValueError: an unknown name.
    """
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; known networks: {sorted(NETWORKS)}")
    return f"feduq.networks.{NETWORKS[name].__name__}"


def head_keys(model: torch.nn.Module) -> list[str]:
    """State-dict names of a segmentation network's output layer (FedUAA keeps it on the site).

    Raises:
        ValueError: the model declares no head (no ``head_keys`` method).
    """
    if not hasattr(model, "head_keys"):
        raise ValueError(f"{type(model).__name__} declares no output head (head_keys)")
    return list(model.head_keys())


def count_parameters(model: torch.nn.Module) -> int:
    """Number of trainable and frozen parameters (not buffers)."""
    return sum(p.numel() for p in model.parameters())


def network_name(model: torch.nn.Module) -> str:
    """The registry name of ``model``'s class (its class name when it is not registered)."""
    return next((name for name, cls in NETWORKS.items() if type(model) is cls), type(model).__name__)


def network_note(model: torch.nn.Module) -> str:
    """``"network fedevi_unet (FedEviUNet, 3,179,890 parameters)"``; the ``light`` network says it is not a paper's."""
    note = f"network {network_name(model)} ({type(model).__name__}, {count_parameters(model):,} parameters)"
    return note if getattr(model, "paper_network", True) else note + " [smoke-test network, not the paper's]"


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


NETWORKS.update({"fedevi_unet": FedEviUNet, "light": SegUNet, "resnet_tweu": ResNetTWEU})
