"""FIVA and FUNAvg at inference (FIVA Eq. 9-11; FUNAvg's merge): backbone samples, head uncertainty, the merge of
the heads in the global label space and the background reweighting. Pure torch, no FLARE."""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

import torch
from torch import Tensor

from .aggregation import check_variance
from .training import F64, check_keys

SAMPLE_SCALES = ("std", "variance")


def sample_backbone(
    mean: Mapping[str, Tensor],
    variance: Mapping[str, Tensor],
    generator: torch.Generator | None = None,
    scale: str = "std",
) -> dict[str, Tensor]:
    """One backbone sample ``theta_k = theta_g + eps`` (paper Eq. 9); ``mean`` is never modified.

    Args:
        mean: theta_g per key (floating tensors). Returned tensors are new: loading them into a
            network cannot move theta_g (the official code's random walk).
        variance: sigma^2_g per key; same keys and shapes (finite, >= 0).
        generator: torch.Generator on the tensors' device (None: the global RNG).
        scale: ``"std"``: eps ~ N(0, sigma^2), i.e. std sqrt(sigma^2) (paper Eq. 9, default);
            ``"variance"``: sigma^2 used as the std (official code, pitfall 3).

    Returns:
        New dict ``key -> theta_k`` in ``mean``'s dtype and device.

    Raises:
        ValueError: unknown ``scale``; key sets differ; a shape mismatch, a non-floating mean or a
            variance with NaN/Inf/negative entries (names the key).
    """
    if scale not in SAMPLE_SCALES:
        raise ValueError(f"scale must be one of {SAMPLE_SCALES}, got {scale!r}")
    check_keys(mean, variance, "sample_backbone: variance vs mean")
    out = {}
    for name, mu in mean.items():
        if not mu.is_floating_point():
            raise ValueError(f"sample_backbone: mean {name!r} must be floating, got {mu.dtype}")
        check_variance("global", name, variance[name], mu.shape)
        var = variance[name].to(device=mu.device, dtype=F64)
        std = var.sqrt() if scale == "std" else var
        noise = torch.randn(mu.shape, generator=generator, dtype=F64, device=mu.device)
        out[name] = (mu.detach().to(F64) + noise * std).to(mu.dtype)
    return out


class HeadUncertainty(NamedTuple):
    """Output of :func:`head_uncertainty`: ``mean`` [B, C_h, *S]; the others [B, *S]."""

    mean: Tensor
    uncertainty: Tensor
    aleatoric: Tensor
    epistemic: Tensor


def head_uncertainty(sample_probs: Tensor) -> HeadUncertainty:
    """Mean prediction and per-pixel uncertainty of one head (paper Eq. 10-11, official code's trace form).

    ``p_bar = mean_k p_k``; aleatoric ``= sum_c mean_k p(1 - p)``; epistemic ``= sum_c (mean_k p^2 - p_bar^2)``
    (computed as ``sum_c mean_k (p - p_bar)^2``); ``u = aleatoric + epistemic = 1 - sum_c p_bar^2``
    when the channels sum to 1 (FIVA inference, step 6).

    Args:
        sample_probs: softmax samples ``[K, B, C_h, *S]`` (e.g. ``S = H, W``), floating, K >= 1.

    Returns:
        :class:`HeadUncertainty` in the input dtype.

    Raises:
        ValueError: fewer than 3 dims, K == 0, or not floating.
    """
    if not isinstance(sample_probs, Tensor) or not sample_probs.is_floating_point() or sample_probs.ndim < 3 \
            or sample_probs.shape[0] == 0:
        got = f"{sample_probs.dtype} {tuple(sample_probs.shape)}" if isinstance(sample_probs, Tensor) else sample_probs
        raise ValueError(f"sample_probs must be a floating tensor [K >= 1, B, C_h, *spatial], got {got!r}")
    p = sample_probs.to(F64)
    p_bar = p.mean(0)
    aleatoric = (p * (1.0 - p)).mean(0).sum(1)
    epistemic = ((p - p_bar) ** 2).mean(0).sum(1)
    dt = sample_probs.dtype
    return HeadUncertainty(p_bar.to(dt), (aleatoric + epistemic).to(dt), aleatoric.to(dt), epistemic.to(dt))


def global_channels(head_labels: Sequence[str], global_labels: Sequence[str]) -> list[int]:
    """Global channel of each head channel: ``[0, index of head_labels[0] + 1, ...]``.

    Args:
        head_labels: the head's foreground labels in channel order (channel 0 is background).
        global_labels: the global foreground labels (global channel j + 1 = ``global_labels[j]``).

    Raises:
        ValueError: a head label not in the global space (names it); duplicate labels.
    """
    for what, labels in (("global_labels", global_labels), ("head_labels", head_labels)):
        if len(set(labels)) != len(labels):
            raise ValueError(f"{what} has duplicates: {list(labels)}")
    index = {label: j + 1 for j, label in enumerate(global_labels)}
    out = [0]
    for label in head_labels:
        if label not in index:
            raise ValueError(f"head label {label!r} is not in the global label space {list(global_labels)}")
        out.append(index[label])
    return out


def map_to_global(mean_probs: Tensor, head_labels: Sequence[str], global_labels: Sequence[str]) -> Tensor:
    """Place a head's ``[B, C_h, *S]`` mean probabilities in the global ``[B, G, *S]`` space (FIVA inference, step 3).

    ``G = len(global_labels) + 1``; channel 0 = the head's background; a label channel takes the head's
    channel of that organ, 0 where the head lacks it.

    Raises:
        ValueError: as :func:`global_channels`; ``C_h != len(head_labels) + 1``.
    """
    channels = global_channels(head_labels, global_labels)
    if mean_probs.ndim < 2 or mean_probs.shape[1] != len(channels):
        raise ValueError(f"mean_probs must be [B, {len(channels)}, ...] for head labels {list(head_labels)}, "
                         f"got {tuple(mean_probs.shape)}")
    shape = (mean_probs.shape[0], len(global_labels) + 1, *mean_probs.shape[2:])
    out = mean_probs.new_zeros(shape)
    out[:, channels] = mean_probs
    return out


def merge_heads(mapped: Sequence[Tensor], known: Sequence[set[int]]) -> Tensor:
    """Naive multi-head merge ``m_c = (1/n_c) sum_{h knows c} p'_{h,c}`` (FedAvg inference, FIVA's step 4).

    Channel 0 is known by every head (``n_0`` = number of heads); channels no head knows are 0. The
    official code counts a head for c when its mapped channel is nonzero on the slice; the known sets
    make that deterministic.

    Args:
        mapped: per head ``[B, G, *S]`` (from :func:`map_to_global`), same shape.
        known: per head the global channel indices it predicts (0 may be omitted).

    Raises:
        ValueError: no heads; length or shape mismatch; a known index outside ``[0, G)``.
    """
    if not mapped or len(mapped) != len(known):
        raise ValueError(f"need one known set per head and at least one head, got {len(mapped)} heads "
                         f"and {len(known)} sets")
    shape = tuple(mapped[0].shape)
    g = shape[1]
    total = torch.zeros(shape, dtype=F64, device=mapped[0].device)
    n_c = torch.zeros(g, dtype=F64)
    for h, (probs, channels) in enumerate(zip(mapped, known)):
        if tuple(probs.shape) != shape:
            raise ValueError(f"head {h} has shape {tuple(probs.shape)}, head 0 has {shape}")
        channels = set(int(c) for c in channels) | {0}
        bad = [c for c in channels if not 0 <= c < g]
        if bad:
            raise ValueError(f"head {h}: known channels {bad} outside [0, {g})")
        idx = sorted(channels)
        total[:, idx] += probs[:, idx].to(F64)
        n_c[idx] += 1.0
    view = (1, g) + (1,) * (len(shape) - 2)
    return (total / n_c.clamp_min(1.0).to(total.device).view(view)).to(mapped[0].dtype)


class BackgroundReweight(NamedTuple):
    """Output of :func:`reweight_background`: ``probs`` [B, G, *S]; ``fraction_over_one`` (pixels with sum u > 1)."""

    probs: Tensor
    fraction_over_one: float


def reweight_background(merged: Tensor, uncertainties: Sequence[Tensor]) -> BackgroundReweight:
    """FUNAvg / "+UN" reweighting ``m_0 <- m_0 * (1 - sum_h u_h)``, no clamp (official code; FIVA inference, step 5).

    When ``sum_h u_h > 1`` the background score goes negative and background is never the argmax;
    :attr:`BackgroundReweight.fraction_over_one` reports how often (log it).

    Args:
        merged: ``[B, G, *S]`` from :func:`merge_heads` (not modified).
        uncertainties: per head ``u_h`` ``[B, *S]``.

    Raises:
        ValueError: no uncertainties, or one whose shape is not ``[B, *S]``.
    """
    if len(uncertainties) == 0:
        raise ValueError("reweight_background: no uncertainties")
    expected = (merged.shape[0], *merged.shape[2:])
    for h, u in enumerate(uncertainties):
        if tuple(u.shape) != tuple(expected):
            raise ValueError(f"uncertainty of head {h} has shape {tuple(u.shape)}, expected {tuple(expected)}")
    u_sum = torch.stack([u.to(device=merged.device, dtype=F64) for u in uncertainties]).sum(0)
    out = merged.clone()
    out[:, 0] = (merged[:, 0].to(F64) * (1.0 - u_sum)).to(merged.dtype)
    fraction = float((u_sum > 1.0).to(F64).mean()) if u_sum.numel() else 0.0
    return BackgroundReweight(out, fraction)
