"""Networks shared by every FedUQ method, by name (:func:`build_network`).

A job names its network in the executor's ``"network": {"name": ..., **options}``; the server's
persistor builds the same class (:func:`network_class_path`), and the job check compares the two.

| name | class | what | parameters (RGB → 2) |
|---|---|---|---|
| ``fedevi_unet`` | :class:`FedEviUNet` | FedEvi's 2D U-Net (official code; the network of FedEvi's Tables 1–3 and of the baselines in them) | 3,179,890 |
| ``feda3i_unet`` | :class:`FedA3IUNet` | FedA3I's 2D U-Net (official code: milesial Pytorch-UNet, bilinear, width 16, BatchNorm, one sigmoid logit) | 1,082,033 (one-channel head) |
| ``light`` | :class:`SegUNet` | MONAI ``UNet`` with one stride-2 conv per level: CPU smoke tests and demos, **not a paper's network** | 660,570 |
| ``resnet_tweu`` | :class:`feduq.core.classification_networks.ResNetTWEU` | FedUAA's classifier (ResNet backbone + TWEU head) | ResNet-18: 11.2 M |

FedEvi's U-Net and ``light`` use InstanceNorm **without affine parameters and without running statistics** by
default, so that normalisation layers carry no state and every state-dict entry is a convolution
weight or bias (FedEvi official code, ``model/unet2d.py``). ``norm="batch"`` gives the batch-norm variant that
FedBN needs. ``feda3i_unet`` is the other way round: BatchNorm (the paper's) by default, ``norm="instance"``
optional.
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
        # instance normalisation needs >= 2 x 2 positions at the deepest level during training
        self.min_size = self.size_divisor * (2 if norm == "instance" else 1)

    def head_keys(self) -> list[str]:
        """State-dict names of the top-level output block (MONAI ``UNet`` is ``Sequential(down, skip, up)``;
        with ``num_res_units=0`` a 3×3 stride-2 transposed convolution: ``model.2.conv.weight``/``bias``)."""
        prefix = f"model.{len(self.model) - 1}."
        return [k for k in self.state_dict() if k.startswith(prefix)]


class FedEviUNet(nn.Module):
    """FedEvi's 2D U-Net (Chen et al., MICCAI 2024, official code ``model/unet2d.py``), from MONAI blocks.

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
        # instance normalisation needs >= 2 x 2 positions at the deepest level during training
        self.min_size = self.size_divisor * (2 if norm == "instance" else 1)

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


class _DoubleConv(nn.Module):
    """milesial ``DoubleConv``: (3×3 conv with bias, norm, ReLU) × 2; children ``double_conv.0..5``."""

    def __init__(self, cin: int, cout: int, mid: int, norm: str):
        super().__init__()

        def norm_layer(c: int) -> nn.Module:
            return nn.BatchNorm2d(c) if norm == "batch" else nn.InstanceNorm2d(c, affine=False)

        self.double_conv = nn.Sequential(
            nn.Conv2d(cin, mid, kernel_size=3, padding=1), norm_layer(mid), nn.ReLU(inplace=True),
            nn.Conv2d(mid, cout, kernel_size=3, padding=1), norm_layer(cout), nn.ReLU(inplace=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.double_conv(x)


class _Down(nn.Module):
    """milesial ``Down``: ``maxpool_conv`` = 2×2 max-pool, then :class:`_DoubleConv`."""

    def __init__(self, cin: int, cout: int, norm: str):
        super().__init__()
        self.maxpool_conv = nn.Sequential(nn.MaxPool2d(2), _DoubleConv(cin, cout, cout, norm))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.maxpool_conv(x)


class _Up(nn.Module):
    """milesial ``Up`` (bilinear): ×2 bilinear upsampling (align_corners=True), zero-pad to the skip's size,
    ``cat([skip, up])``, then ``DoubleConv(cin, cout, mid=cin // 2)``."""

    def __init__(self, cin: int, cout: int, norm: str):
        super().__init__()
        self.up = nn.Upsample(scale_factor=2, mode="bilinear", align_corners=True)
        self.conv = _DoubleConv(cin, cout, cin // 2, norm)

    def forward(self, x: torch.Tensor, skip: torch.Tensor) -> torch.Tensor:
        x = self.up(x)
        dy, dx = skip.shape[-2] - x.shape[-2], skip.shape[-1] - x.shape[-1]
        if dy or dx:
            x = nn.functional.pad(x, [dx // 2, dx - dx // 2, dy // 2, dy - dy // 2])
        return self.conv(torch.cat([skip, x], dim=1))


class FedA3IUNet(nn.Module):
    """FedA3I's 2D U-Net (Wu et al., AAAI 2024, official code ``wnn2000/FedAAAI``: the milesial
    Pytorch-UNet with ``bilinear=True, bias=True``; FedA3I official code).

    * ``inc`` = DoubleConv(in, 16); ``down1..down4`` = 2×2 max-pool + DoubleConv to 32, 64, 128 and
      **128** (bilinear mode halves the bottleneck: 256 // 2). DoubleConv = (3×3 conv with bias,
      norm, ReLU) × 2.
    * ``up1..up4``: bilinear ×2 upsampling (align_corners=True), zero padding to the skip's size when
      they differ, ``cat([skip, up])``, DoubleConv(c_in, c_out, mid = c_in // 2) with
      (c_in, c_out) = (256, 64), (128, 32), (64, 16), (32, 16).
    * ``outc``: a 1×1 convolution 16 → **1** (the paper's single sigmoid logit z).
    * Init: PyTorch's defaults (as the official code), seeded by ``init_seed`` without touching the
      global RNG. Dropout 0 (the official default ``p=0``), so none is built.

    The ten top-level children ``inc, down1..down4, up1..up4, outc`` are the ten "layers" of FedA3I's
    layer-wise aggregation (:func:`feduq.methods.feda3i.layer_index`). Sizes: **1,082,033** parameters for
    RGB → 1 (1,081,745 for gray → 1); with BatchNorm 128 state-dict entries (19 convolutions × 2 +
    18 BatchNorms × 5: weight, bias, running_mean, running_var, num_batches_tracked), with
    ``norm="instance"`` 38.

    **Output convention.** FedUQ's core expects C-class logits with softmax/argmax, so :meth:`forward`
    returns ``cat([0, z])`` ``[B, 2, H, W]``: softmax over it is exactly (1 − σ(z), σ(z)), argmax is
    σ(z) > 0.5 (z > 0; ties z = 0 go to background as σ = 0.5 is not > 0.5) and cross entropy equals
    BCE-with-logits on z. :meth:`logit` returns z itself ``[B, 1, H, W]``; the state dict keeps the
    single-channel ``outc``.

    Args:
        in_channels: image channels (3 RGB, 1 gray).
        out_channels: must be 2 (binary tasks: background + foreground).
        norm: ``"batch"`` (default, the paper's: BatchNorm2d, affine, running statistics) or
            ``"instance"`` (InstanceNorm2d without affine parameters or running statistics).
        init_seed: seed of the weight initialisation (None = the global torch RNG).

    Shapes:
        input ``[B, in_channels, H, W]`` float32 with H, W >= 16 (other sizes than multiples of 16 are
        padded in the decoder, as the official code); output logits ``[B, 2, H, W]`` float32.

    Raises:
        ValueError: ``out_channels != 2`` or an unknown ``norm``.
    """

    LAYERS = ("inc", "down1", "down2", "down3", "down4", "up1", "up2", "up3", "up4", "outc")

    def __init__(self, in_channels: int = 3, out_channels: int = 2, norm: str = "batch", init_seed: int | None = 0):
        super().__init__()
        if out_channels != 2:
            raise ValueError(f"network 'feda3i_unet' (FedA3IUNet) is binary (one sigmoid logit returned as the "
                             f"two-class logits [0, z]): out_channels must be 2, got {out_channels!r}")
        if norm not in ("batch", "instance"):
            raise ValueError(f"FedA3IUNet: norm must be one of ['batch', 'instance'], got {norm!r}")
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the global RNG
            if init_seed is not None:
                torch.manual_seed(init_seed)
            self.inc = _DoubleConv(in_channels, 16, 16, norm)
            self.down1, self.down2 = _Down(16, 32, norm), _Down(32, 64, norm)
            self.down3, self.down4 = _Down(64, 128, norm), _Down(128, 128, norm)
            self.up1, self.up2 = _Up(256, 64, norm), _Up(128, 32, norm)
            self.up3, self.up4 = _Up(64, 16, norm), _Up(32, 16, norm)
            self.outc = nn.Module()
            self.outc.conv = nn.Conv2d(16, 1, kernel_size=1)  # milesial OutConv: state-dict outc.conv.*
        self.norm_kind = norm
        self.size_divisor = 1  # the decoder pads, as the official code
        self.min_size = 16

    def logit(self, x: torch.Tensor) -> torch.Tensor:
        """The paper's single foreground logit z ``[B, 1, H, W]``."""
        x1 = self.inc(x)
        x2 = self.down1(x1)
        x3 = self.down2(x2)
        x4 = self.down3(x3)
        x = self.up1(self.down4(x4), x4)
        x = self.up4(self.up3(self.up2(x, x3), x2), x1)
        return self.outc.conv(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.logit(x)
        return torch.cat([torch.zeros_like(z), z], dim=1)

    def head_keys(self) -> list[str]:
        """State-dict names of the output layer: ``outc.conv.weight``, ``outc.conv.bias``."""
        return ["outc.conv.weight", "outc.conv.bias"]


NETWORKS: dict[str, type] = {}  # filled below: name -> class
DEFAULT_NETWORK = "fedevi_unet"


def build_network(name: str, in_channels: int, out_channels: int, **options) -> torch.nn.Module:
    """Build a registered network by name (see the module docstring for the table).

    Args:
        name: ``"fedevi_unet"``, ``"feda3i_unet"``, ``"light"`` or ``"resnet_tweu"``.
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
    """The class path of a registered network (what a job's persistor builds), e.g. ``feduq.core.networks.FedEviUNet``.

    Raises:
        ValueError: an unknown name.
    """
    if name not in NETWORKS:
        raise ValueError(f"unknown network {name!r}; known networks: {sorted(NETWORKS)}")
    cls = NETWORKS[name]
    return f"{cls.__module__}.{cls.__name__}"


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
    substring, so it cannot leak like the FedUAA official code's ``'bn' in name`` filter.
    """
    import torch.nn as nn

    norm_types = (nn.modules.batchnorm._NormBase, nn.GroupNorm, nn.LayerNorm)
    prefixes = [name + "." for name, mod in model.named_modules() if isinstance(mod, norm_types)]
    return [k for k in state_keys if any(k.startswith(p) for p in prefixes)]


from .classification_networks import ResNetTWEU  # noqa: E402  (registered by name below)

NETWORKS.update({"fedevi_unet": FedEviUNet, "feda3i_unet": FedA3IUNet, "light": SegUNet, "resnet_tweu": ResNetTWEU})
