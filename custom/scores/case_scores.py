"""Case-level scores of a prediction for the review flag, on any device, no FLARE, no method: where the
method's own uncertainty lies relative to the predicted structure, how large the structure is, and the network's
bottleneck features of the input (how familiar it is to the training sites, :mod:`feduq.review.rule`).

The image mean of an uncertainty map hides a confident miss: a model that predicts (almost) no structure, with
certainty, has a low image mean. The scores here see it: the mean uncertainty **inside the predicted foreground** and
in a **band around its boundary** (where a segmentation's errors lie; Jungo & Reyes, MICCAI 2019, compare such
aggregates of voxel uncertainty), and the predicted **area fraction** against the sizes labelled cases have.

The review rule's decision from these scores (:func:`rule_reasons`, :func:`review_record`) lives here too, so the
MONAI Bundle FedUQ exports (:mod:`feduq.bundle.export`) carries this file as its ``scripts/case_scores.py`` and
flags an image exactly as ``predict`` does: the module imports torch, NumPy and (for the band) MONAI only.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import torch

__all__ = ["BAND_FRACTION", "band_width", "case_sums", "scores_from_sums", "case_scores", "BottleneckTap",
           "mahalanobis", "familiarity_distance", "rule_reasons", "review_record", "plane_stats", "array_stats"]

#: the boundary band's half-width as a fraction of the image's shorter side (at least one pixel): 2 % is 8 pixels of a
#: 384 px image, about the width of the uncertain rim around a polyp's outline in FedEvi's maps
BAND_FRACTION = 0.02


def band_width(shape) -> int:
    """Half-width in pixels of the boundary band of an image of spatial ``shape`` (:data:`BAND_FRACTION`)."""
    return max(1, int(round(BAND_FRACTION * min(shape))))


def case_sums(label: torch.Tensor, uncertainty: torch.Tensor, radius: int | None = None) -> torch.Tensor:
    """The sums :func:`case_scores` divides, ``[6]`` float64 on the inputs' device: pixels, uncertainty over the image,
    foreground pixels, uncertainty over them, band pixels, uncertainty over them. ``label`` and ``uncertainty`` are
    ``[H, W]`` or ``[X, Y, Z]`` (a volume: a 3D band)."""
    fg = label > 0
    u = uncertainty.double()
    radius = band_width(fg.shape) if radius is None else int(radius)
    from monai.transforms.utils_morphological_ops import dilate, erode

    size, mask = 2 * radius + 1, fg[None, None].float()
    # the dilated foreground minus the eroded one (padding the erosion with foreground: the image's border is no edge)
    band = (dilate(mask, size)[0, 0] > 0) & ~(erode(mask, size, pad_value=1.0)[0, 0] > 0)
    n = torch.full((), float(fg.numel()), dtype=torch.float64, device=u.device)
    return torch.stack([n, u.sum(), fg.sum().double(), (u * fg).sum(), band.sum().double(), (u * band).sum()])


def scores_from_sums(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`case_scores` from :func:`case_sums`."""
    n, su, nf, sf, nb, sb = sums[:6]
    mean = su / n
    return {"u_mean": mean,
            "u_foreground": torch.where(nf > 0, sf / nf.clamp_min(1), mean),
            "u_boundary": torch.where(nb > 0, sb / nb.clamp_min(1), mean),
            "area_fraction": nf / n}


def case_scores(label: torch.Tensor, uncertainty: torch.Tensor, radius: int | None = None) -> dict[str, torch.Tensor]:
    """The case-level scores of one predicted case, as 0-d float64 tensors on the inputs' device.

    Args:
        label: predicted class map ``[H, W]`` (int; foreground = class > 0).
        uncertainty: the method's own uncertainty map ``[H, W]`` (float, its unit: nats or C/S).
        radius: the boundary band's half-width in pixels (default :func:`band_width`).

    Returns:
        ``u_mean`` (the image mean), ``u_foreground`` (mean inside the predicted foreground; the image mean when the
        prediction is empty, so an empty prediction is never "certain inside"), ``u_boundary`` (mean over the band of
        pixels within ``radius`` of the predicted boundary: the dilated foreground minus the eroded one, the image's
        own border not counted as a boundary; the image mean when the prediction is empty or fills the image),
        ``area_fraction`` (predicted foreground pixels / all pixels, in [0, 1]).
    """
    return scores_from_sums(case_sums(label, uncertainty, radius))


class BottleneckTap:
    """The network's bottleneck features, pooled per image, captured during its ordinary forward passes.

    The bottleneck is found once by a probe pass of one zero image: the module (a direct part of the network's
    module tree, any depth) whose 4-D output has the smallest spatial area and, among those, the most channels and
    the first in the forward order: the deepest encoder level of FedUQ's U-Nets. A forward hook keeps its output's
    spatial mean ``[B, C]`` (float32, detached) of every later pass; :meth:`take` returns and clears them.

    Args:
        model: the network (eval mode is the caller's).
        in_channels, image_size: the probe's input ``[1, in_channels, image_size, image_size]`` on the model's device.

    Raises:
        ValueError: the network has no module with a 4-D output.
    """

    def __init__(self, model: torch.nn.Module, in_channels: int, image_size: int):
        shapes: list[tuple[int, int, int, str]] = []
        handles = []
        for order, (name, module) in enumerate(model.named_modules()):
            if not name:
                continue

            def probe(mod, inputs, output, name=name, order=order):
                if isinstance(output, torch.Tensor) and output.dim() == 4:
                    shapes.append((output.shape[-1] * output.shape[-2], -output.shape[1], order, name))

            handles.append(module.register_forward_hook(probe))
        device = next(model.parameters()).device
        try:
            with torch.no_grad():
                model(torch.zeros(1, in_channels, image_size, image_size, device=device))
        finally:
            for h in handles:
                h.remove()
        if not shapes:
            raise ValueError(f"{type(model).__name__}: no module with a 4-D output to take bottleneck features from")
        self.name = min(shapes)[3]
        self._pooled: list[torch.Tensor] = []
        module = dict(model.named_modules())[self.name]
        self._handle = module.register_forward_hook(
            lambda mod, inputs, output: self._pooled.append(output.detach().float().mean(dim=(2, 3))))

    def take(self) -> torch.Tensor:
        """The pooled features ``[N, C]`` of the passes since the last call (on the model's device), then cleared.

        Raises:
            ValueError: no forward pass ran since the last call.
        """
        if not self._pooled:
            raise ValueError("no forward pass since the last take()")
        out, self._pooled = torch.cat(self._pooled), []
        return out

    def close(self) -> None:
        """Remove the hook."""
        self._handle.remove()


def mahalanobis(features, center, components, location, precision, residual_variance=None) -> np.ndarray:
    """Distances ``[N]`` (float64) of ``features [N, C]`` under a probabilistic PCA model (Tipping & Bishop, JRSS-B
    1999): ``z = (x - center) components^T`` (``center [C]``, orthonormal ``components [k, C]``),
    ``d^2 = (z - location)^T precision (z - location) + |r|^2 / residual_variance`` with ``r = (x - center) - z
    components`` the part of the features outside the k principal directions (``location [k]``, ``precision
    [k, k]``; without ``residual_variance`` the principal part alone, the record of before the residual term).
    :class:`feduq.review.rule.Familiarity` fits the arrays."""
    x = np.asarray(features, dtype=np.float64) - np.asarray(center)
    components = np.asarray(components, dtype=np.float64)
    z = x @ components.T
    zc = z - np.asarray(location)
    d2 = np.einsum("ni,ij,nj->n", zc, np.asarray(precision), zc)
    if residual_variance is not None:
        r = x - z @ components
        d2 = d2 + np.einsum("nc,nc->n", r, r) / float(residual_variance)
    return np.sqrt(np.maximum(d2, 0.0))


def familiarity_distance(features, familiarity: Mapping) -> np.ndarray:
    """:func:`mahalanobis` of ``features [N, C]`` under a stored familiarity record (its ``center``, ``components``,
    ``location``, ``precision`` and, where fitted, ``residual_variance``)."""
    return mahalanobis(features, familiarity["center"], familiarity["components"], familiarity["location"],
                       familiarity["precision"], familiarity.get("residual_variance"))


def rule_reasons(rule: Mapping, scores: Mapping, features=None) -> list[str]:
    """Why a case must be reviewed under a review rule (empty: accepted), in this order: ``implausible size`` (the
    area fraction is below ``size_floor``), ``unfamiliar input`` (the features' :func:`mahalanobis` distance is
    above ``familiarity["threshold"]``), ``uncertain`` (``scores[rule["score"]]`` is above ``threshold``); a NaN
    compares as flagged. Source: :mod:`feduq.review.rule`.

    Args:
        rule: a review record's fields: ``score``, ``threshold``, ``size_floor`` (or None), ``familiarity`` (a dict
            of :func:`familiarity_distance`'s arrays and ``threshold``, or None).
        scores: the case's :func:`case_scores` as floats.
        features: its pooled bottleneck features ``[C]`` (the familiarity part is skipped without them).
    """
    out = []
    floor = rule.get("size_floor")
    if floor is not None and not float(scores["area_fraction"]) >= floor:
        out.append("implausible size")
    familiarity = rule.get("familiarity")
    if familiarity is not None and features is not None:
        d = familiarity_distance(np.asarray(features, dtype=np.float64).reshape(1, -1), familiarity)[0]
        if not d <= familiarity["threshold"]:
            out.append("unfamiliar input")
    if not float(scores[rule.get("score", "u_mean")]) <= rule["threshold"]:
        out.append("uncertain")
    return out


def review_record(label: torch.Tensor, uncertainty: torch.Tensor, rule: Mapping, features=None) -> dict:
    """One case's review decision as a JSON-ready dict: ``review`` (``"yes"``/``"no"``), ``review_reason``
    (:func:`rule_reasons` joined by ``"; "``), the :func:`case_scores` and ``familiarity_distance`` (None without a
    familiarity part or features).

    Args:
        label: predicted class map ``[H, W]``; uncertainty: the method's own map ``[H, W]`` (the rule's map).
        rule: as :func:`rule_reasons`; features: pooled bottleneck features ``[C]`` or None.
    """
    scores = {k: float(v) for k, v in case_scores(label, uncertainty).items()}
    familiarity = rule.get("familiarity")
    distance = None
    if familiarity is not None and features is not None:
        distance = float(familiarity_distance(np.asarray(features, dtype=np.float64).reshape(1, -1), familiarity)[0])
    reasons = rule_reasons(rule, scores, features)
    return {"review": "yes" if reasons else "no", "review_reason": "; ".join(reasons), **scores,
            "familiarity_distance": distance}


def plane_stats(label: torch.Tensor, maps: dict[str, torch.Tensor], primary: str, num_classes: int
                ) -> dict[str, torch.Tensor]:
    """A case's numbers for ``predictions.csv`` on the tensors' device (0-d float64 tensors).

    Args:
        label: class map ``[*spatial]`` (int); maps: name -> uncertainty ``[*spatial]``; primary: the method's own map.

    Returns:
        ``foreground_px``, ``px_<c>`` for each foreground class c >= 1 when ``num_classes > 2``, ``case_uncertainty``
        (the image mean of ``primary``), ``uncertainty_inside`` / ``uncertainty_outside`` (its mean inside / outside
        the predicted foreground; NaN where that region is empty), the primary map's
        :func:`case_scores` ``u_foreground``, ``u_boundary``, ``area_fraction`` (a volume's
        band is 3D), ``mean_<map>`` for every map.
    """
    n, su, nf, sf = case_sums(label, maps[primary])[:4]
    nan = torch.full_like(su, float("nan"))
    out = {"foreground_px": nf, "case_uncertainty": su / n,
           "uncertainty_inside": torch.where(nf > 0, sf / nf.clamp_min(1), nan),
           "uncertainty_outside": torch.where(n > nf, (su - sf) / (n - nf).clamp_min(1), nan),
           **{k: v for k, v in case_scores(label, maps[primary]).items() if k != "u_mean"}}
    if num_classes > 2:
        out.update({f"px_{c}": (label == c).sum().double() for c in range(1, num_classes)})
    out.update({f"mean_{k}": v.double().mean() for k, v in maps.items()})
    return out


def array_stats(label: np.ndarray, maps: dict[str, np.ndarray], primary: str, num_classes: int) -> dict[str, float]:
    """:func:`plane_stats` of host arrays (a volume's stacked planes), as Python floats."""
    stats = plane_stats(torch.from_numpy(np.ascontiguousarray(label)),
                        {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in maps.items()}, primary, num_classes)
    return {k: float(v) for k, v in stats.items()}
