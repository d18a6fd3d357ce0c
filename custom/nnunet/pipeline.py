"""nnU-Net v2 as FedUQ's CT pipeline, used as a library (no trainer, no CLI, no path variables).

What every site shares is one nnU-Net **plans** file shipped with the job (``feduq/nnunet/plans/ct_2d.json``,
made by ``tools/make_ct_plans.py`` from one reference site: the 2D architecture, patch size, batch
settings), so every site builds the same backbone. Each site preprocesses its own data with nnU-Net's
``DefaultPreprocessor`` (cropping to the non-zero region, resampling to the plan's spacing, intensity
normalisation), trains with nnU-Net's loader, training transforms, Dice+CE loss with deep supervision
and poly schedule, and keeps its own segmentation head (``decoder.seg_layers``: one 1x1 conv per
deep-supervision stage with ``n_site_organs + 1`` outputs). Used this way (nnunet-fl.md §0-§8):

* :class:`SitePipeline` -- per site: network, loss, preprocessing into a scratch folder, the loader;
* :func:`site_plans` -- the plan a site preprocesses with. ``intensity`` says which CT statistics its
  ``CTNormalization`` clips and z-scores with: ``"site"`` (default; each site's own foreground
  statistics, what FIVA does: windowed 8-bit PNG slices and HU volumes each keep their own range,
  nnunet-fl.md §2 warns that one CT plan across both clips the volumes), ``"reference"`` (the plan's,
  i.e. the reference site's: nnU-Net's strict plan forcing) or ``"zscore"`` (per-image z-score);
* :func:`backbone_names` / :func:`head_names` -- what crosses the wire: ``named_parameters()`` minus
  the head (nnU-Net's state dict holds 292 entries for 108 tensors because ``decoder.encoder.*``
  aliases ``encoder.*``, and its ``all_modules`` indices shift when dropout is inserted);
* :func:`train_iterations` -- T iterations of nnU-Net's recipe (SGD 0.01, momentum 0.99, Nesterov,
  weight decay 3e-5, gradient clipping 12 after unscaling, AMP on CUDA) with hooks for FIVA's Welford
  updates on gradients and parameters;
* :class:`MultiHeadNet` / :func:`sliding_window_probs` -- one backbone pass feeding every site's
  last head (MONAI ``sliding_window_inference``, Gaussian, overlap 0.5; it keeps the module's
  train/eval mode, so MC dropout stays on, unlike nnU-Net's predictor, nnunet-fl.md §6).
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import nn

PLANS_DIR = Path(__file__).resolve().parent / "plans"
#: Shipped plans: ``ct_2d`` (nnU-Net's own 2D plan, the paper's setting) and ``ct_2d_slim`` (tests, CPU demos).
PLANS_NAMES = ("ct_2d", "ct_2d_slim")
HEAD_PREFIX = "decoder.seg_layers."
INTENSITY_MODES = ("site", "reference", "zscore")
#: nnU-Net's 2D plan spacing for PNG slices (NaturalImage2DIO): 999 along the (absent) slice axis.
PNG_SPACING = (999.0, 1.0, 1.0)


def load_plans(plans: str | Path | Mapping, configuration: str = "2d") -> dict:
    """A shipped plans name (:data:`PLANS_NAMES`), a path to an nnU-Net plans JSON, or a plans dict -> the plans dict.

    Raises:
        ValueError: unknown name, unreadable file, or a plan without ``configuration`` (``"2d"``, ``"3d_fullres"``).
    """
    if isinstance(plans, Mapping):
        if configuration not in plans.get("configurations", {}):
            raise ValueError(f"nnU-Net plans {plans.get('plans_name', '?')!r}: no {configuration!r} configuration "
                             f"(it has {sorted(plans.get('configurations', {}))})")
        _check_geometry(plans, configuration, repr(plans.get("plans_name", "?")))
        return copy.deepcopy(dict(plans))
    path = PLANS_DIR / f"{plans}.json" if str(plans) in PLANS_NAMES else Path(plans)
    try:
        out = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"nnU-Net plans {str(plans)!r}: cannot read {path} ({e}); shipped plans: {PLANS_NAMES}") from e
    if not isinstance(out, dict) or not isinstance(out.get("configurations", {}), dict):
        raise ValueError(f"nnU-Net plans {path}: a JSON {type(out).__name__}, not nnU-Net's plans (an object with "
                         "\"configurations\")")
    if configuration not in out.get("configurations", {}):
        raise ValueError(f"nnU-Net plans {path}: no {configuration!r} configuration (it has "
                         f"{sorted(out.get('configurations', {}))})")
    _check_geometry(out, configuration, str(path))
    return out


def _check_geometry(plans: Mapping, configuration: str, where: str) -> None:
    """The configuration's patch size (whole numbers >= 1) and spacing (finite mm > 0) as nnU-Net needs them; a
    configuration inheriting from another is checked where it sets them. Raises ValueError naming the key."""
    import math

    cfg = plans["configurations"][configuration]
    for key, ok, what in (("patch_size", lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                           "whole numbers >= 1"),
                          ("spacing", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)
                           and math.isfinite(v) and v > 0, "finite sizes > 0 in mm")):
        value = cfg.get(key)
        if value is None and "inherits_from" in cfg:
            continue
        if not isinstance(value, list) or not value or not all(ok(v) for v in value):
            raise ValueError(f"nnU-Net plans {where}: configurations.{configuration}.{key} = {value!r}: expected a "
                             f"list of {what}")


def check_plan_channels(plans: Mapping, configuration: str, task) -> None:
    """A plan fits a task's channels: its ``configuration``'s normalisation schemes, one per channel, number the
    task's ``channel_names`` (a :class:`feduq.data.TaskSpec`).

    Raises:
        ValueError: naming the plan, its channel count and the task's.
    """
    schemes = plans["configurations"][configuration].get("normalization_schemes", [])
    channels = list(task.channel_names)
    if len(schemes) != len(channels):
        raise ValueError(f"nnU-Net plans {plans.get('plans_name', '?')!r} were made for {len(schemes)} channel(s) "
                         f"({schemes}); task {task.name!r} has {len(channels)}: {channels}")


def is_slim(plans: Mapping) -> bool:
    """True for the slim test/demo architecture (``ct_2d_slim``), which is not the paper's network."""
    return str(plans.get("plans_name", "")).endswith("_slim")


def foreground_intensity_properties(cases: Iterable[tuple[np.ndarray, np.ndarray]], seed: int = 1234) -> dict:
    """nnU-Net's CT statistics of one site: foreground intensities sampled per case, then pooled.

    Args:
        cases: ``(image, mask)`` pairs, image float ``[Z, H, W]`` or ``[H, W]``, mask int (> 0 = foreground).

    Returns:
        ``{"mean", "median", "std", "min", "max", "percentile_99_5", "percentile_00_5"}`` as nnU-Net's
        fingerprint extractor computes them (``DatasetFingerprintExtractor``).

    Raises:
        ValueError: no foreground pixel in any case.
    """
    from nnunetv2.experiment_planning.dataset_fingerprint.fingerprint_extractor import DatasetFingerprintExtractor

    pooled = []
    for image, mask in cases:
        image = np.asarray(image, dtype=np.float32)
        seg = np.asarray(mask)
        image = image[None, None] if image.ndim == 2 else image[None]
        seg = seg[None, None] if seg.ndim == 2 else seg[None]
        intensities, _ = DatasetFingerprintExtractor.collect_foreground_intensities(seg, image, seed=seed)
        pooled.append(intensities[0])
    values = np.concatenate(pooled) if pooled else np.zeros(0)
    if values.size == 0:
        raise ValueError("foreground_intensity_properties: no foreground pixel in any case")
    p005, median, p995 = np.percentile(values, (0.5, 50.0, 99.5))
    return {"mean": float(values.mean()), "median": float(median), "std": float(values.std()),
            "min": float(values.min()), "max": float(values.max()),
            "percentile_99_5": float(p995), "percentile_00_5": float(p005)}


def site_plans(plans: Mapping, intensity: str = "site", site_properties: Mapping | None = None) -> dict:
    """The plan a site preprocesses with: the shared plan with the intensity handling ``intensity``.

    Raises:
        ValueError: unknown ``intensity``, or ``"site"`` without ``site_properties``.
    """
    if intensity not in INTENSITY_MODES:
        raise ValueError(f"intensity={intensity!r}: expected one of {INTENSITY_MODES}")
    out = copy.deepcopy(dict(plans))
    cfg = out["configurations"]["2d"]
    if intensity == "site":
        if site_properties is None:
            raise ValueError("intensity='site' needs the site's foreground intensity properties")
        out["foreground_intensity_properties_per_channel"] = {"0": dict(site_properties)}
    elif intensity == "zscore":
        cfg["normalization_schemes"] = ["ZScoreNormalization"]
        cfg["use_mask_for_norm"] = [False]
    return out


def dataset_json(organs: Sequence[str]) -> dict:
    """nnU-Net's ``dataset.json`` of one site: background + its organs numbered 1..n in the given order."""
    return {"channel_names": {"0": "CT"}, "labels": {"background": 0, **{o: i + 1 for i, o in enumerate(organs)}},
            "file_ending": ".png"}


def backbone_names(net: nn.Module) -> list[str]:
    """Names of the shared backbone: ``named_parameters()`` minus the head (each tensor once)."""
    return [n for n, _ in net.named_parameters() if not n.startswith(HEAD_PREFIX)]


def head_names(net: nn.Module) -> list[str]:
    """Names of the site's segmentation head (``decoder.seg_layers.*``), which never leaves the site in training."""
    return [n for n, _ in net.named_parameters() if n.startswith(HEAD_PREFIX)]


class SitePipeline:
    """nnU-Net's plan, network, loss, preprocessing and loader for one site's label set.

    Args:
        plans: the site's plans dict (:func:`site_plans`).
        organs: the site's organs in global order (site-local ids 1..n).
        dropout: Dropout2d/3d probability in every conv block (FUNAvg trains with 0.3); 0 = none.
        configuration: the plan's configuration: ``"2d"`` (slices) or ``"3d_fullres"`` (volumes).
        dataset_json: the ``dataset.json`` the site's files are read with (its ``file_ending``, labels or regions);
            default: :func:`dataset_json` of ``organs`` (PNG slices).
    """

    def __init__(self, plans: Mapping, organs: Sequence[str], dropout: float = 0.0, configuration: str = "2d",
                 dataset_json: Mapping | None = None):
        from nnunetv2.utilities.plans_handling.plans_handler import PlansManager

        self.plans = dict(plans)
        self.organs = tuple(organs)
        self.dropout = float(dropout)
        self.pm = PlansManager(self.plans)
        self.configuration = configuration
        self.cm = self.pm.get_configuration(configuration)
        self.dataset_json = dict(dataset_json) if dataset_json is not None else globals()["dataset_json"](self.organs)
        self.label_manager = self.pm.get_label_manager(self.dataset_json)
        self.patch_size = tuple(int(p) for p in self.cm.patch_size)

    # -- network and loss ---------------------------------------------------------------------------
    def build_network(self, deep_supervision: bool = True) -> nn.Module:
        """nnU-Net's network from the plan (``get_network_from_plans``), ``len(organs) + 1`` outputs."""
        from nnunetv2.utilities.get_network_from_plans import get_network_from_plans

        kwargs = copy.deepcopy(self.cm.network_arch_init_kwargs)
        req = list(self.cm.network_arch_init_kwargs_req_import)
        if self.dropout > 0:
            kwargs["dropout_op"] = f"torch.nn.Dropout{len(self.patch_size)}d"
            kwargs["dropout_op_kwargs"] = {"p": self.dropout}
            req = sorted(set(req) | {"dropout_op"})
        return get_network_from_plans(self.cm.network_arch_class_name, kwargs, req, 1,
                                      self.label_manager.num_segmentation_heads, allow_init=True,
                                      deep_supervision=deep_supervision)

    def deep_supervision_scales(self) -> list[list[float]]:
        """Per deep-supervision output, its scale relative to the patch (nnU-Net's trainer)."""
        return [list(s) for s in 1 / np.cumprod(np.vstack(self.cm.pool_op_kernel_sizes), axis=0)][:-1]

    def build_loss(self) -> nn.Module:
        """nnU-Net's Dice+CE (batch Dice per the plan, no background Dice) wrapped for deep supervision."""
        from nnunetv2.training.loss.compound_losses import DC_and_CE_loss
        from nnunetv2.training.loss.deep_supervision import DeepSupervisionWrapper
        from nnunetv2.training.loss.dice import MemoryEfficientSoftDiceLoss

        loss = DC_and_CE_loss({"batch_dice": self.cm.batch_dice, "smooth": 1e-5, "do_bg": False, "ddp": False}, {},
                              weight_ce=1, weight_dice=1, ignore_label=self.label_manager.ignore_label,
                              dice_class=MemoryEfficientSoftDiceLoss)
        weights = np.array([1 / 2**i for i in range(len(self.deep_supervision_scales()))])
        weights[-1] = 0
        return DeepSupervisionWrapper(loss, weights / weights.sum())

    # -- preprocessing and loading ------------------------------------------------------------------
    def preprocess(self, image: np.ndarray, mask: np.ndarray | None, spacing=None) -> tuple[np.ndarray, np.ndarray | None, dict]:
        """nnU-Net's ``DefaultPreprocessor.run_case_npy`` on one slice or volume.

        Args:
            image: float ``[H, W]`` (PNG slice) or ``[Z, H, W]`` (volume).
            mask: site-local label ids of the same shape, or None.
            spacing: ``(z, y, x)`` in mm for volumes; None for PNG slices.

        Returns:
            ``(data [1, Z', H', W'] float32, seg [1, Z', H', W'] int16 or None, properties)``; the seg holds
            -1 outside the non-zero region (map it to 0 when scoring).
        """
        from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor

        data = np.asarray(image, dtype=np.float32)
        data = data[None, None] if data.ndim == 2 else data[None]
        seg = None
        if mask is not None:
            seg = np.asarray(mask, dtype=np.int16)
            seg = seg[None, None] if seg.ndim == 2 else seg[None]
        props = {"spacing": list(spacing) if spacing is not None else list(PNG_SPACING)}
        return DefaultPreprocessor(verbose=False).run_case_npy(data, seg, props, self.pm, self.cm, self.dataset_json)

    def preprocess_to_folder(self, cases: Iterable[tuple[str, np.ndarray, np.ndarray, object]], folder: Path) -> list[str]:
        """Preprocess ``(identifier, image, mask, spacing)`` cases into ``folder`` (nnU-Net's blosc2 format)."""
        ids = []
        for identifier, image, mask, spacing in cases:
            self.save_case(folder, identifier, *self.preprocess(image, mask, spacing))
            ids.append(identifier)
        return ids

    def preprocess_files_to_folder(self, cases: Iterable[tuple[str, Sequence[str], str]], folder: Path) -> list[str]:
        """Preprocess ``(identifier, image files, label file)`` cases (:meth:`preprocess_files`) into ``folder``."""
        ids = []
        for identifier, images, label in cases:
            self.save_case(folder, identifier, *self.preprocess_files(images, label))
            ids.append(identifier)
        return ids

    def save_case(self, folder: Path, identifier: str, data: np.ndarray, seg: np.ndarray, props: dict) -> None:
        """One preprocessed case in nnU-Net's blosc2 format, chunked for patch-sized reads (as its ``run_case_save``)."""
        from nnunetv2.training.dataloading.nnunet_dataset import comp_blosc2_params, nnUNetDatasetBlosc2

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        data, seg = data.astype(np.float32, copy=False), seg.astype(np.int16, copy=False)
        blocks, chunks = comp_blosc2_params(data.shape, self.patch_size, data.itemsize)
        blocks_seg, chunks_seg = comp_blosc2_params(seg.shape, self.patch_size, seg.itemsize)
        with contextlib.redirect_stdout(io.StringIO()):  # nnU-Net prints each case's chunk layout
            nnUNetDatasetBlosc2.save_case(data, seg, props, str(folder / identifier), chunks=chunks, blocks=blocks,
                                          chunks_seg=chunks_seg, blocks_seg=blocks_seg)

    def augmentation(self) -> tuple:
        """nnU-Net's trainer's choice for this plan's patch: ``(rotation range in radians, dummy 2D augmentation,
        initial patch size, mirror axes)`` (``nnUNetTrainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size``
        itself, run on this pipeline's configuration: 3D patches rotate by +-30 degrees, +-180 in-plane with dummy 2D
        augmentation when the patch is anisotropic)."""
        from types import SimpleNamespace

        from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

        stand_in = SimpleNamespace(configuration_manager=self.cm, print_to_log_file=lambda *a, **k: None)
        return nnUNetTrainer.configure_rotation_dummyDA_mirroring_and_inital_patch_size(stand_in)

    def _regions(self):
        return self.label_manager.foreground_regions if self.label_manager.has_regions else None

    def make_loader(self, folder: Path, identifiers: Sequence[str], batch_size: int | None = None, seed: int = 0):
        """nnU-Net's training loader (2D or 3D, by the plan's patch) with its training transforms (rotation, scaling,
        noise, mirroring...) and foreground oversampling (a third of each batch).

        ``next(loader)`` -> ``{"data": [B, C, *patch] float32, "target": [DS outputs of [B, 1, *patch / scale]]}``.
        Augmentation runs in this process (no worker pool: 2-core machines, nnunet-fl.md §8).
        """
        from nnunetv2.training.dataloading.data_loader import nnUNetDataLoader
        from nnunetv2.training.dataloading.nnunet_dataset import nnUNetDatasetBlosc2
        from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

        rot, dummy_2d, initial, mirror = self.augmentation()
        transforms = nnUNetTrainer.get_training_transforms(
            self.patch_size, rot, self.deep_supervision_scales(), mirror, dummy_2d,
            use_mask_for_norm=self.cm.use_mask_for_norm, foreground_labels=self.label_manager.foreground_labels,
            regions=self._regions(), ignore_label=self.label_manager.ignore_label)
        np.random.seed(seed)  # nnU-Net's loader and transforms draw from numpy's global generator
        return nnUNetDataLoader(nnUNetDatasetBlosc2(str(folder), list(identifiers)),
                                int(batch_size or self.cm.batch_size), initial, self.patch_size, self.label_manager,
                                oversample_foreground_percent=0.33, transforms=transforms)

    def validation_patches(self, folder: Path, identifiers: Sequence[str], per_case: int = 2, seed: int = 0) -> list:
        """Fixed validation patches: ``per_case`` patches of each case drawn once by nnU-Net's loader with its
        validation transforms (no augmentation; a third foreground-oversampled), as nnU-Net's trainer validates on
        patches during training. Returns ``[{"image": [C, *patch] float32, "label": [1, *patch] float32}]`` in case
        order (numpy's global generator is seeded with ``seed`` and then restored)."""
        from nnunetv2.training.dataloading.data_loader import nnUNetDataLoader
        from nnunetv2.training.dataloading.nnunet_dataset import nnUNetDatasetBlosc2
        from nnunetv2.training.nnUNetTrainer.nnUNetTrainer import nnUNetTrainer

        transforms = nnUNetTrainer.get_validation_transforms(
            None, foreground_labels=self.label_manager.foreground_labels, regions=self._regions(),
            ignore_label=self.label_manager.ignore_label)
        state = np.random.get_state()
        np.random.seed(seed)
        out = []
        try:
            for identifier in identifiers:
                loader = nnUNetDataLoader(nnUNetDatasetBlosc2(str(folder), [identifier]), per_case, self.patch_size,
                                          self.patch_size, self.label_manager, oversample_foreground_percent=0.33,
                                          transforms=transforms)
                batch = next(loader)
                target = batch["target"][0] if isinstance(batch["target"], (list, tuple)) else batch["target"]
                out += [{"image": batch["data"][i].float(), "label": target[i].float(), "case": identifier}
                        for i in range(per_case)]
        finally:
            np.random.set_state(state)
        return out

    def preprocess_files(self, image_files: Sequence[str], label_file: str | None) -> tuple:
        """nnU-Net's ``DefaultPreprocessor.run_case`` on one case's files (read with the plan's reader: crop to the
        non-zero region, resample to the configuration's spacing, normalise): ``(data [C, *shape] float32, seg [1,
        *shape] int16 or None, properties)``; the properties hold what nnU-Net needs to map a prediction back onto the
        file's geometry (``spacing``, ``shape_before_cropping``, ``bbox_used_for_cropping``, the reader's own).

        Raises:
            feduq.io.volumes.VolumeError: a volume file whose header gives no spacing, or with a NaN or infinite
                voxel (nnU-Net's reader would read 1 mm, or 0), naming the file
                (:func:`feduq.io.volume_checks.check_case_files`).
        """
        from nnunetv2.preprocessing.preprocessors.default_preprocessor import DefaultPreprocessor

        from ..io.volume_checks import check_case_files

        check_case_files({"channels": list(image_files), "label": label_file})
        with contextlib.redirect_stdout(io.StringIO()):
            data, seg, props = DefaultPreprocessor(verbose=False).run_case(
                [str(f) for f in image_files], None if label_file is None else str(label_file), self.pm, self.cm,
                self.dataset_json)
        return data, seg, props


def make_optimizer(net: nn.Module, lr: float = 0.01, weight_decay: float = 3e-5) -> torch.optim.SGD:
    """nnU-Net's optimiser: SGD, momentum 0.99, Nesterov."""
    return torch.optim.SGD(net.parameters(), lr=lr, momentum=0.99, nesterov=True, weight_decay=weight_decay)


def train_iterations(
    net: nn.Module,
    loader,
    loss_fn: nn.Module,
    optimizer: torch.optim.Optimizer,
    iterations: int,
    device: torch.device,
    scaler: torch.amp.GradScaler | None = None,
    clip: float = 12.0,
    on_gradients: Callable[[nn.Module], None] | None = None,
    on_step: Callable[[nn.Module], None] | None = None,
) -> dict:
    """``iterations`` steps of nnU-Net's recipe; returns ``{"loss": mean, "steps": T}``.

    Per step: forward (float16 autocast on CUDA when ``scaler`` is enabled), deep-supervision loss,
    backward, unscale, clip the gradient norm at ``clip``, ``on_gradients(net)`` (FIVA-G reads the
    unscaled gradients from ``named_parameters()`` here), optimiser step, ``on_step(net)`` (FIVA-P
    reads the parameters here).

    Raises:
        FloatingPointError: the loss became NaN/Inf (the site then reports an error, never an update).
    """
    net.train()
    scaler = scaler or torch.amp.GradScaler("cuda", enabled=False)
    amp = scaler.is_enabled()
    total = 0.0
    for step in range(int(iterations)):
        batch = next(loader)
        data = batch["data"].to(device, non_blocking=True)
        target = [t.to(device, non_blocking=True) for t in batch["target"]]
        with torch.autocast(device_type="cuda", dtype=torch.float16, enabled=amp):
            output = net(data)
            loss = loss_fn(output, target)
        if not torch.isfinite(loss):
            raise FloatingPointError(f"training loss is {loss.item()} at step {step}")
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        if on_gradients is not None:
            on_gradients(net)
        scaler.step(optimizer)
        scaler.update()
        if on_step is not None:
            on_step(net)
        total += float(loss.detach())
    return {"loss": total / max(int(iterations), 1), "steps": int(iterations)}


class MultiHeadNet(nn.Module):
    """One backbone pass, every site's last segmentation head: logits concatenated over the heads.

    Built from a network with ``deep_supervision=False`` (only ``decoder.seg_layers[-1]`` runs) whose last
    seg layer is replaced by the heads' last 1x1 convs, so the output is ``[B, Σ_h C_h, H, W]`` split by
    :meth:`split`.

    Args:
        net: an nnU-Net network of the shared plan (its own head is ignored).
        heads: site -> that site's last seg layer (``nn.Conv2d`` with ``C_h`` outputs).
    """

    def __init__(self, net: nn.Module, heads: Mapping[str, nn.Module]):
        super().__init__()
        self.net = net
        self.sites = list(heads)
        self.channels = [int(h.out_channels) for h in heads.values()]
        self.heads = nn.ModuleList(heads.values())
        net.decoder.deep_supervision = False
        net.decoder.seg_layers[-1] = _Concat(self.heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def split(self, logits: torch.Tensor) -> dict[str, torch.Tensor]:
        """``[B, Σ C_h, H, W]`` -> site -> ``[B, C_h, H, W]``."""
        return dict(zip(self.sites, torch.split(logits, self.channels, dim=1)))


class _Concat(nn.Module):
    def __init__(self, heads: nn.ModuleList):
        super().__init__()
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([h(x) for h in self.heads], dim=1)


@torch.no_grad()
def sliding_window_probs(model: MultiHeadNet, image: torch.Tensor, patch_size: Sequence[int],
                         overlap: float = 0.5) -> dict[str, torch.Tensor]:
    """Per-head softmax over a whole 2D image by MONAI's Gaussian sliding window (pads images smaller than the patch).

    Args:
        image: ``[B, 1, H, W]`` preprocessed slice(s).

    Returns:
        site -> ``[B, C_h, H, W]`` float32 probabilities. The model's train/eval mode is kept (MC dropout).
    """
    from monai.inferers import sliding_window_inference

    logits = sliding_window_inference(image, list(patch_size), 4, model, overlap=overlap, mode="gaussian")
    return {site: torch.softmax(x.float(), dim=1) for site, x in model.split(logits).items()}


def set_mc_dropout(net: nn.Module, on: bool) -> int:
    """Dropout modules to train mode (MC dropout) or eval mode; the rest of ``net`` is put in eval mode.

    Returns the number of dropout modules found (0 means MC dropout cannot sample).
    """
    net.eval()
    n = 0
    for m in net.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.train(on)
            n += 1
    return n
