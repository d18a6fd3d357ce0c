"""Multi-head CT inference (FIVA / FUNAvg / FedAvg on the FIVA setting), FLARE-free: what scores and what predicts.

A CT job's released model is ``<run dir>/multi_head_model.pt`` (:mod:`feduq.parts.ct_server`): the shared nnU-Net backbone
(by parameter name; FIVA's ``variance::<name>`` beside it) and every training site's last segmentation head
(``head::<site>::weight|bias``), with the organs of each head. One slice goes through it as the site's ``test`` task
runs it (:class:`feduq.flare.ct.CTExecutor` calls :func:`multi_head_slice`, and so does :mod:`feduq.predict`):

1. the K test-time backbones of the method's site part (FedAvg: one pass; FIVA: K draws of the backbone posterior,
   paper Eq. 9; FUNAvg: K passes with MC dropout), each through MONAI's Gaussian sliding window over the slice;
2. per head the mean probability and its uncertainty u_h = aleatoric + epistemic (FIVA Eq. 10-11);
3. the heads placed in the global label space (background, liver, kidney, spleen, pancreas) and averaged where they
   know an organ (the naive merge), then the "+UN" background reweighting m_0 <- m_0 (1 - sum_h u_h).

:func:`predict_volume` runs a whole volume (or a 2D slice) through nnU-Net's own preprocessing of the job's plan
(crop to the non-zero region, resampling to the plan's in-plane spacing, CT intensity normalisation) slice by slice and
maps the probabilities and uncertainty back with nnU-Net's resampling and crop reversal, so the label map is on the
input's own grid.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch
from torch import nn

from ..data import ct as fct
from ..nnunet import pipeline as nc
from ..parts.ct_server import HEAD_WIRE_PREFIX
from .settings import CT_EXECUTOR, ct_site_settings
from ..methods.fiva import head_uncertainty, map_to_global, merge_heads, reweight_background

MODEL_FILE = "multi_head_model.pt"
#: the abdominal window (level 40 HU, width 400 HU) that maps a volume in HU onto 0..255 like the sites' 8-bit slices
CT_WINDOW_HU = (-160.0, 240.0)
#: uncertainty maps of a CT prediction, each the mean over the heads of FIVA's per-head maps (0 <= u < 1)
CT_MAPS = ("total", "aleatoric", "epistemic")
HEAD_FIELDS = {"total": "uncertainty", "aleatoric": "aleatoric", "epistemic": "epistemic"}


class SliceResult(NamedTuple):
    """:func:`multi_head_slice`: ``naive`` and ``un`` ``[B, G, H, W]`` merged scores in the global space; ``heads``: site
    -> :class:`feduq.methods.fiva.HeadUncertainty`; ``fraction_over_one``: pixels where sum_h u_h > 1."""

    naive: torch.Tensor
    un: torch.Tensor
    heads: dict
    fraction_over_one: float


def load_backbone(net: nn.Module, backbone: Sequence[str], params: Mapping) -> None:
    """Copy the backbone tensors ``params[name]`` (arrays or tensors) into ``net``.

    Raises:
        ValueError: a backbone tensor is missing (names the first three) or has another shape (names it, both shapes).
    """
    named = dict(net.named_parameters())
    missing = [n for n in backbone if n not in params]
    if missing:
        raise ValueError(f"the model lacks backbone tensors {missing[:3]}")
    with torch.no_grad():
        for n in backbone:
            value = torch.as_tensor(np.asarray(params[n]))
            if tuple(value.shape) != tuple(named[n].shape):
                raise ValueError(f"backbone tensor {n!r} has shape {tuple(value.shape)}, the job's network "
                                 f"{tuple(named[n].shape)}")
            named[n].copy_(value)


def build_heads(params: Mapping, organs_by_head: Mapping[str, Sequence[str]]) -> dict[str, nn.Conv2d]:
    """site -> its last segmentation layer (1x1 conv, ``len(organs) + 1`` outputs) from ``head::<site>::weight|bias``.

    Raises:
        ValueError: a head's tensors are missing or do not have ``len(organs) + 1`` outputs.
    """
    heads = {}
    for site, organs in organs_by_head.items():
        try:
            weight = torch.as_tensor(np.asarray(params[f"{HEAD_WIRE_PREFIX}{site}::weight"]))
            bias = torch.as_tensor(np.asarray(params[f"{HEAD_WIRE_PREFIX}{site}::bias"]))
        except KeyError:
            raise ValueError(f"the model has no head tensors for site {site!r}") from None
        if weight.ndim != 4 or weight.shape[0] != len(organs) + 1 or tuple(bias.shape) != (len(organs) + 1,):
            raise ValueError(f"head of site {site!r} has weight {tuple(weight.shape)} and bias {tuple(bias.shape)}; "
                             f"expected {len(organs) + 1} outputs for its organs {list(organs)}")
        conv = nn.Conv2d(int(weight.shape[1]), len(organs) + 1, 1)
        with torch.no_grad():
            conv.weight.copy_(weight)
            conv.bias.copy_(bias)
        heads[site] = conv
    return heads


@torch.no_grad()
def multi_head_slice(model: nc.MultiHeadNet, backbone: Sequence[str], samples: Sequence[Mapping], x: torch.Tensor,
                     patch_size: Sequence[int], organs_by_head: Mapping[str, Sequence[str]]) -> SliceResult:
    """One preprocessed slice ``x [B, 1, H, W]`` through every backbone sample and every head (module doc, steps 1-3).

    Returns:
        :class:`SliceResult` on ``x``'s grid; G = 5 global channels (:data:`feduq.data.ct.ORGANS`).
    """
    glabels = list(fct.ORGANS[1:])
    per_head = {s: [] for s in organs_by_head}
    for params in samples:
        load_backbone(model.net, backbone, params)
        for s, p in nc.sliding_window_probs(model, x, patch_size).items():  # model's device; samples stay on CPU
            per_head[s].append(p.cpu())
    hu = {s: head_uncertainty(torch.stack(v)) for s, v in per_head.items()}
    mapped = [map_to_global(hu[s].mean, organs_by_head[s], glabels) for s in organs_by_head]
    naive = merge_heads(mapped, [set(fct.local_to_global(o)) for o in organs_by_head.values()])
    un = reweight_background(naive, [h.uncertainty for h in hu.values()])
    return SliceResult(naive, un.probs, hu, float(un.fraction_over_one))


def backbone_samples(method, backbone: Sequence[str], params: Mapping, generator: torch.Generator, count: int) -> list:
    """The backbones of the K test-time passes of a CT site part (:class:`feduq.parts.site.CTSitePart`): one
    (``sampling`` none), K times ``params`` (MC dropout: the masks differ per pass) or K drawn by the site part."""
    n = 1 if method.sampling == "none" else int(count)
    if method.sampling == "mc_dropout":
        return [params] * n
    return list(method.samples(backbone, params, generator, n))[:n]


@dataclass
class CTModel:
    """A CT job's multi-head model ready to predict (:func:`load_ct_model`)."""

    method: str
    config_file: Path
    model_file: Path
    executor: object
    pipeline: nc.SitePipeline
    model: nc.MultiHeadNet
    backbone: list
    samples: list
    organs_by_head: dict
    device: torch.device
    notes: list = field(default_factory=list)

    @property
    def organs(self) -> list[str]:
        """The organs some head predicts, in global order."""
        known = {o for organs in self.organs_by_head.values() for o in organs}
        return [o for o in fct.ORGANS[1:] if o in known]

    @property
    def primary_uncertainty(self) -> str:
        return "total"

    @property
    def use_un(self) -> bool:
        """The label map of a sampling method (FIVA, FUNAvg) is the "+UN" one; FedAvg's the naive merge."""
        return self.executor.method.sampling != "none"


def is_ct_config(config_file: Path) -> bool:
    """True when the job's site executor is FedUQ's multi-head CT executor (:data:`feduq.ct.settings.CT_EXECUTOR`)."""
    try:
        return json.loads(Path(config_file).read_text())["executors"][0]["executor"]["path"] == CT_EXECUTOR
    except (OSError, ValueError, KeyError, IndexError, AttributeError, TypeError):
        return False  # feduq.site.evaluation.load_model names what is wrong with the config


def job_method(config: Mapping) -> str | None:
    """The method a job's site config runs: what its privacy ledger filter declares (``args.method`` of the
    ``out`` filter, e.g. ``"fiva_p"``); None when the config has none."""
    for group in config.get("task_result_filters", []) or []:
        for f in group.get("filters", []) or []:
            method = (f.get("args") or {}).get("method")
            if isinstance(method, str) and method != "*":
                return method
    return None


def load_ct_model(config_file: Path, model_file: Path, device: str = "cpu") -> CTModel:
    """The job's CT executor arguments (plans, intensity, dropout, K, seed, the method's site part;
    :func:`feduq.ct.settings.ct_site_settings`) and ``model_file`` (``multi_head_model.pt``) -> :class:`CTModel` in
    eval mode (MC dropout on for FUNAvg).

    The job normalised each site with its own CT statistics (``intensity: site``); a new image has none, so it is
    normalised with the plan's (the reference site's, nnU-Net's own inference); ``zscore`` jobs stay per image.

    Raises:
        ValueError: a job that is not a multi-head CT job, a model file that is not a multi-head model, or whose
            backbone or heads do not fit the plan; a NaN or infinite parameter (naming it).
        feduq.core.checkpoints.CheckpointError: unreadable model file.
    """
    from ..core.checkpoints import check_finite, load_checkpoint

    config = json.loads(Path(config_file).read_text())
    spec = config["executors"][0]["executor"]
    if spec.get("path") != CT_EXECUTOR:
        raise ValueError(f"{config_file}: executor {spec.get('path')} is not FedUQ's CT executor ({CT_EXECUTOR})")
    args = {k: v for k, v in spec.get("args", {}).items() if k not in ("tracking_writer_id", "device", "per_site")}
    executor = ct_site_settings(**args)
    saved = load_checkpoint(model_file, what="model file")
    if not isinstance(saved, dict) or "params" not in saved or not saved.get("head_organs"):
        raise ValueError(f"model file {model_file}: not a multi-head CT model ({MODEL_FILE}: params and head organs)")
    params, organs_by_head = saved["params"], {s: list(o) for s, o in saved["head_organs"].items()}
    check_finite(params, model_file)
    plans = nc.load_plans(executor.plans_name)
    intensity = "zscore" if executor.intensity == "zscore" else "reference"
    notes = []
    if executor.intensity == "site":
        notes.append("the job normalised each site's CT with its own statistics; new images are normalised with the "
                     "plan's (its reference site's)")
    pipeline = nc.SitePipeline(nc.site_plans(plans, intensity), fct.ORGANS[1:2], executor.dropout)
    net = pipeline.build_network()
    backbone = nc.backbone_names(net)
    load_backbone(net, backbone, params)
    dev = torch.device(device)
    model = nc.MultiHeadNet(copy.deepcopy(net), build_heads(params, organs_by_head)).to(dev)
    nc.set_mc_dropout(model, executor.method.sampling == "mc_dropout")
    samples = backbone_samples(executor.method, backbone, params, torch.Generator().manual_seed(executor.seed),
                           executor.inference_samples)
    method = job_method(config) or type(executor.method).__name__
    if nc.is_slim(plans):
        notes.append(f"plans {executor.plans_name} are FedUQ's slim test architecture, not the paper's")
    return CTModel(method, Path(config_file), Path(model_file), executor, pipeline, model, backbone, samples,
                   organs_by_head, dev, notes)


def hu_to_window(m: CTModel, image: np.ndarray) -> np.ndarray:
    """A CT volume in HU -> 0..255 in the abdominal window (:data:`CT_WINDOW_HU`) when the plan's intensity statistics
    are those of 8-bit windowed slices (their 99.5th percentile <= 255, FedUQ's shipped plans); otherwise unchanged."""
    props = m.pipeline.plans["foreground_intensity_properties_per_channel"]["0"]
    if m.executor.intensity == "zscore" or float(props["percentile_99_5"]) > 255:
        return image
    low, high = CT_WINDOW_HU
    return ((np.clip(image, low, high) - low) / (high - low) * 255.0).astype(np.float32)


@torch.no_grad()
def predict_volume(m: CTModel, image: np.ndarray, spacing: Sequence[float] | None) -> dict:
    """A CT volume ``[Z, H, W]`` (HU, voxel order S, P, L as :func:`feduq.data.ct.read_case`) with ``spacing (z, y, x)`` mm,
    or a windowed 2D slice ``[H, W]`` with ``spacing`` None -> on the input's grid (same shape):
    ``{"label": uint8 global organ ids, "probability": float32 foreground (1 - background score, clipped to [0, 1]),
    "maps": {name: float32} for :data:`CT_MAPS` (the mean over the heads), "fraction_over_one": float}``.
    """
    from acvl_utils.cropping_and_padding.bounding_boxes import insert_crop_into_image

    data, _, props = m.pipeline.preprocess(image, None, spacing)
    channels, over = [], []
    for z in range(data.shape[1]):
        x = torch.as_tensor(data[:, z][None]).to(m.device)
        r = multi_head_slice(m.model, m.backbone, m.samples, x, m.pipeline.patch_size, m.organs_by_head)
        probs = (r.un if m.use_un else r.naive)[0]
        maps = [torch.stack([getattr(h, HEAD_FIELDS[name])[0] for h in r.heads.values()]).mean(0)[None]
                for name in CT_MAPS]
        channels.append(torch.cat([probs, *maps]).float().numpy())
        over.append(r.fraction_over_one)
    stack = np.stack(channels, axis=1)  # [G + maps, Z', H', W']
    pm, cm = m.pipeline.pm, m.pipeline.cm
    spacing_t = [props["spacing"][i] for i in pm.transpose_forward]
    current = cm.spacing if len(cm.spacing) == len(props["shape_after_cropping_and_before_resampling"]) \
        else [spacing_t[0], *cm.spacing]
    stack = np.asarray(cm.resampling_fn_probabilities(stack, props["shape_after_cropping_and_before_resampling"],
                                                      current, spacing_t))
    G = len(fct.ORGANS)
    # outside nnU-Net's crop (the zero region): background with certainty, as nnU-Net's revert_cropping
    full = np.zeros((stack.shape[0], *props["shape_before_cropping"]), np.float32)
    full[0] = 1.0
    full = insert_crop_into_image(full, stack.astype(np.float32), [[0, stack.shape[0]], *props["bbox_used_for_cropping"]])
    scores = full[:G]
    label = scores.argmax(0).astype(np.uint8)
    back = [int(i) for i in pm.transpose_backward]
    out = {"label": label.transpose(back),
           "probability": np.clip(1.0 - scores[0], 0.0, 1.0).transpose(back).astype(np.float32),
           "maps": {n: full[G + i].transpose(back) for i, n in enumerate(CT_MAPS)},
           "fraction_over_one": float(np.mean(over)) if over else 0.0}
    if image.ndim == 2:  # a 2D slice went through as a one-slice volume
        out = {**out, "label": out["label"][0], "probability": out["probability"][0],
               "maps": {k: v[0] for k, v in out["maps"].items()}}
    return out
