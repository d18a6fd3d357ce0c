"""Partial labels: a site that annotates only some of the task's structures trains without counting the others as
background (the marginal loss).

Where a site's label maps say "background", a structure it never annotates may lie. Scoring the network's
unannotated classes against that background would teach every other site's structures to vanish. The marginal loss
(Shi et al., *Marginal loss and exclusion loss for partially supervised multi-organ segmentation*, Medical Image
Analysis 2021, eq. 2; Fang & Yan, TMI 2020, "target adaptive loss") merges the probability of every unannotated class
into the background before the loss: ``p'_0 = p_0 + sum_{u not annotated} p_u``, and scores the site's annotated
classes as they are. On logits this merge is a log-sum-exp (``softmax(z')_0 = p_0 + sum p_u`` exactly), so any loss
that takes logits gets it unchanged: softmax losses (Dice + CE) see the marginal probabilities, and FedEvi's
exp-evidence (``e = exp(z)``) sees the merged background evidence ``e_0 + sum e_u``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["marginal_logits", "compact_label", "partial_label_loss", "scored_columns"]


def marginal_logits(logits: torch.Tensor, annotated: Sequence[int]) -> torch.Tensor:
    """Logits ``[B, C, *spatial]`` -> ``[B, len(annotated), *spatial]``: channel 0 the log-sum-exp of the background's
    and every unannotated class's logits, then the annotated foreground classes in ``annotated``'s order.

    Args:
        annotated: the site's annotated class indices, background 0 first, sorted.
    """
    keep = [int(c) for c in annotated]
    unannotated = [c for c in range(logits.shape[1]) if c not in keep]
    background = torch.logsumexp(logits[:, [0, *unannotated]], dim=1, keepdim=True)
    return torch.cat([background, logits[:, keep[1:]]], dim=1)


def compact_label(label: torch.Tensor, annotated: Sequence[int], num_classes: int) -> torch.Tensor:
    """Class indices of the task -> indices into ``annotated`` (an unannotated class, which a site's labels never
    hold, becomes background 0). Same shape and dtype."""
    lut = torch.zeros(num_classes, dtype=torch.long, device=label.device)
    for i, c in enumerate(annotated):
        lut[int(c)] = i
    return lut[label.long()].to(label.dtype)


def partial_label_loss(loss: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], annotated: Sequence[int],
                       num_classes: int) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """A method's ``(logits [B, C, H, W], label [B, 1, H, W], round) -> loss`` on a site annotating ``annotated``
    (class indices, 0 first) of the task's ``num_classes``: the same loss on :func:`marginal_logits` and
    :func:`compact_label`. All classes annotated: ``loss`` itself.

    Raises:
        ValueError: ``annotated`` does not start with background 0 or names a class outside ``0..num_classes-1``.
    """
    keep = [int(c) for c in annotated]
    if not keep or keep[0] != 0 or sorted(set(keep)) != keep or keep[-1] >= num_classes:
        raise ValueError(f"annotated classes {keep} must be sorted, start with background 0 and lie in "
                         f"0..{num_classes - 1}")
    if len(keep) == num_classes:
        return loss
    return lambda logits, label, round_index: loss(marginal_logits(logits, keep),
                                                   compact_label(label, keep, num_classes), round_index)


def scored_columns(class_names: Sequence[str], regions, annotated) -> tuple[dict[str, tuple[int, ...]], list[int]]:
    """The test's scored structures (``regions``, else one per foreground class) as ``name -> classes``, and the
    indices of those a site with partial labels (``annotated``: its class indices; None: all) has a reference for:
    the only ones it is scored on."""
    columns = {k: tuple(v) for k, v in regions.items()} if regions else {
        name: (c,) for c, name in enumerate(class_names[1:], start=1)}
    keep = [i for i, v in enumerate(columns.values()) if annotated is None or set(v) <= set(annotated)]
    return columns, keep
