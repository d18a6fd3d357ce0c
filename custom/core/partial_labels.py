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

Nested structures (nnU-Net's regions) make the same step more general: a site that annotates only the optic disc of
a task trained on background / disc rim / cup marks the disc, i.e. "rim or cup". A site's annotation is then a
partition of the task's classes into **groups**, one per value its label maps hold: the background group (class 0
and every class the site never marks) first, then one group per annotated structure (``((0,), (1, 2))`` for the
disc-only site; ``((0, 1), (2,))`` for a site annotating the cup only). The loss sees one channel per group, the
log-sum-exp of the group's logits, so ``softmax(z')_g = sum_{c in g} p_c`` (the marginal probability of the group),
and the label holds the group's index. A site annotating every class has one singleton group per class and is
trained as before; plain partial labels (a subset of classes) are the groups whose foreground groups are singletons.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

__all__ = ["as_groups", "group_names", "marginal_logits", "compact_label", "partial_label_loss", "scored_columns"]

Groups = tuple[tuple[int, ...], ...]


def as_groups(annotated: Sequence, num_classes: int) -> Groups:
    """A site's annotation as groups of the task's classes (module docstring), background group first.

    Args:
        annotated: groups (a sequence of class-index sequences, background's first), or the older flat form: the
            annotated class indices, background 0 first (every other class then joins the background group).
        num_classes: the task's classes C.

    Raises:
        ValueError: the groups do not partition ``0..C-1``, or the background group lacks class 0.
    """
    items = list(annotated)
    if items and all(isinstance(a, (int,)) or hasattr(a, "__index__") for a in items):  # flat: annotated classes
        keep = [int(c) for c in items]
        if not keep or keep[0] != 0 or sorted(set(keep)) != keep or keep[-1] >= num_classes:
            raise ValueError(f"annotated classes {keep} must be sorted, start with background 0 and lie in "
                             f"0..{num_classes - 1}")
        background = tuple(c for c in range(num_classes) if c == 0 or c not in keep)
        return (background, *((c,) for c in keep[1:]))
    groups = tuple(tuple(sorted(int(c) for c in g)) for g in items)
    flat = sorted(c for g in groups for c in g)
    if flat != list(range(num_classes)) or not groups or 0 not in groups[0] or not all(groups):
        raise ValueError(f"annotation groups {[list(g) for g in groups]} must partition the classes 0..{num_classes - 1}"
                         ", background's group (holding 0) first")
    return groups


def marginal_logits(logits: torch.Tensor, annotated: Sequence) -> torch.Tensor:
    """Logits ``[B, C, *spatial]`` -> ``[B, G, *spatial]``, one channel per group (:func:`as_groups`): the log-sum-exp
    of the group's logits (a single class's logit as it is), so that the softmax of the result is each group's
    marginal probability."""
    groups = as_groups(annotated, logits.shape[1])
    return torch.cat([logits[:, list(g)] if len(g) == 1 else torch.logsumexp(logits[:, list(g)], dim=1, keepdim=True)
                      for g in groups], dim=1)


def compact_label(label: torch.Tensor, annotated: Sequence, num_classes: int) -> torch.Tensor:
    """Class indices of the task -> the index of each class's group (:func:`as_groups`). Same shape and dtype."""
    lut = torch.zeros(num_classes, dtype=torch.long, device=label.device)
    for i, group in enumerate(as_groups(annotated, num_classes)):
        for c in group:
            lut[int(c)] = i
    return lut[label.long()].to(label.dtype)


def partial_label_loss(loss: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor], annotated: Sequence,
                       num_classes: int) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
    """A method's ``(logits [B, C, H, W], label [B, 1, H, W], round) -> loss`` on a site whose annotation is
    ``annotated`` (groups or annotated classes, :func:`as_groups`) of the task's ``num_classes``: the same loss on
    :func:`marginal_logits` and :func:`compact_label`. Every class its own group: ``loss`` itself.

    Raises:
        ValueError: as :func:`as_groups`.
    """
    groups = as_groups(annotated, num_classes)
    if len(groups) == num_classes:
        return loss
    return lambda logits, label, round_index: loss(marginal_logits(logits, groups),
                                                   compact_label(label, groups, num_classes), round_index)


def scored_columns(class_names: Sequence[str], regions, annotated) -> tuple[dict[str, tuple[int, ...]], list[int]]:
    """The test's scored structures (``regions``, else one per foreground class) as ``name -> classes``, and the
    indices of those a site with partial labels (``annotated``: its groups or annotated classes, :func:`as_groups`;
    None: all) has a reference for: a structure whose classes are a union of the site's foreground groups (the disc
    on a disc-only site; not the cup, nor the rim)."""
    columns = {k: tuple(v) for k, v in regions.items()} if regions else {
        name: (c,) for c, name in enumerate(class_names[1:], start=1)}
    if annotated is None:
        return columns, list(range(len(columns)))
    groups = as_groups(annotated, len(class_names))[1:]
    keep = [i for i, v in enumerate(columns.values())
            if set(v) == {c for g in groups if set(g) <= set(v) for c in g}]
    return columns, keep


def group_names(class_names: Sequence[str], regions, annotated) -> list[str]:
    """The name of each foreground group of a site's annotation (:func:`as_groups`): the scored structure (region or
    class) that is exactly the group, else its classes' names joined by ``+``."""
    columns = scored_columns(class_names, regions, None)[0]
    by_classes = {tuple(sorted(v)): k for k, v in columns.items()}
    return [by_classes.get(tuple(g), "+".join(class_names[c] for c in g))
            for g in as_groups(annotated, len(class_names))[1:]]
