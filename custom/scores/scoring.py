"""How a site scores a model on its images (no FLARE here): validation Dice and loss, per-image statistics, and
the final test on each image's own grid (letterbox undone, post-processing, Dice, HD95 in pixels, calibration).

A method plugs in how logits become probabilities (softmax, or the Dirichlet mean alpha/S for evidential methods)
and any extra per-image statistic it needs (:func:`per_image_statistics`).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from monai.transforms import KeepLargestConnectedComponent

from ..core.training import ProbFn, softmax_probs, to_device
from ..data import ORIGINAL_SIZE_KEY, aspect_shape, letterbox_box
from .metrics import calibration_error, dice_per_image, region_scores, segmentation_scores


# -- evaluation ----------------------------------------------------------------------------------
@torch.no_grad()
def per_image_statistics(
    model: torch.nn.Module, loader, device: torch.device, fn: Callable[[torch.Tensor], Mapping[str, torch.Tensor]]
) -> dict[str, np.ndarray]:
    """Apply ``fn(logits) -> {name: [B] tensor}`` to every image of ``loader`` (eval mode).

    The statistics stay on ``device`` until the last batch (one host transfer per name, none per batch).

    Returns:
        name -> ``[N]`` float64 array over the N images of the loader.
    """
    model.eval()
    out: dict[str, list[torch.Tensor]] = {}
    for batch in loader:
        stats = fn(model(to_device(batch["image"], device)))
        for name, value in stats.items():
            out.setdefault(name, []).append(value.detach().double().reshape(-1))
    return {k: torch.cat(v).cpu().numpy() for k, v in out.items()}


def validation_dice_loss():
    """The official FedEvi validation loss (``Dice_Loss_val``), from MONAI's ``DiceLoss``: ``1 - mean_c Dice_c`` over
    all C classes **including background**, each class's Dice pooled over the batch and the pixels, smooth 1e-5 in
    numerator and denominator, no square in the denominator; on probabilities ``[B, C, H, W]`` (softmax, or α/S for
    evidential methods) against class indices ``[B, 1, H, W]``. The official code validates with batches of one image,
    so :func:`validation_scores` applies it to each image of a batch."""
    from monai.losses import DiceLoss

    return DiceLoss(include_background=True, to_onehot_y=True, batch=True, smooth_nr=1e-5, smooth_dr=1e-5)


def per_image_validation_loss():
    """:func:`validation_dice_loss` of each image of a batch: ``(probabilities [B, C, H, W], class indices
    [B, 1, H, W]) -> [B]`` float32 on the inputs' device, each image through MONAI's batch-pooled ``DiceLoss`` alone
    (the official code's validation batch of one image), so each value is bit for bit the one-image loss (MONAI's
    ``batch=False`` form sums each image's pixels in another order: 1 float32 ulp apart). No host transfer."""
    loss = validation_dice_loss()
    return lambda probs, label: torch.stack([loss(probs[i:i + 1], label[i:i + 1]) for i in range(probs.shape[0])])


@torch.no_grad()
def validation_scores(
    model: torch.nn.Module, loader, device: torch.device, num_classes: int, regions: Mapping | None = None,
    prob_fn: ProbFn = softmax_probs, per_image: bool = False,
) -> dict[str, float]:
    """Validation of a model at the training resolution, both selection criteria from one forward pass; the scores
    are computed on ``device`` and reach the host once, after the last batch.

    Returns:
        ``{"val_dice": mean over images of the mean foreground Dice (with ``regions``, e.g. fundus disc = classes
        1-2 and cup = class 2, of the regions, as the test reports them), "val_loss": mean over images of
        :func:`validation_dice_loss` on ``prob_fn(logits)`` of the image (official FedEvi code variant: its model
        selection, with its validation batch of one image)}``; NaN for an empty loader. The loader's batch size
        changes neither (the forward pass is batched, the scores are per image). With ``per_image``, each
        image's values instead: ``[N]`` float64 arrays in the loader's order.
    """
    model.eval()
    loss_fn = per_image_validation_loss()
    scores, losses = [], []
    for batch in loader:  # everything stays on ``device``: one host transfer after the last batch
        logits = model(to_device(batch["image"], device)).float()
        label = to_device(batch["label"], device)
        pred = logits.argmax(dim=1, keepdim=True)
        losses.append(loss_fn(prob_fn(logits), label))
        if regions:
            dice = region_scores(pred, label, regions, hd95=False)["dice"]
        else:
            dice = dice_per_image(pred, label, num_classes)
        scores.append(torch.as_tensor(dice, device=device).mean(dim=1))
    if not scores:
        return {"val_dice": float("nan"), "val_loss": float("nan")}
    values = {"val_dice": torch.cat(scores).cpu().numpy(), "val_loss": torch.cat(losses).double().cpu().numpy()}
    return values if per_image else {k: float(v.mean()) for k, v in values.items()}


def validation_dice(
    model: torch.nn.Module, loader, device: torch.device, num_classes: int, regions: Mapping | None = None
) -> float:
    """Mean over images of the mean foreground Dice at the training resolution (``val_dice`` of
    :func:`validation_scores`)."""
    return validation_scores(model, loader, device, num_classes, regions)["val_dice"]


@torch.no_grad()
def unletterbox(logits: torch.Tensor, stored_shape: Sequence[int], orig_size=None) -> torch.Tensor:
    """Map letterboxed logits ``[B, C, S, S]`` back onto the stored image grid ``[B, C, *stored_shape]``.

    Per sample: crop the content box of :func:`feduq.data.letterbox_box` (aspect ratio of its
    ``orig_size`` row ``[B, 2]`` when known, else of ``stored_shape``), then bilinear-resize it.
    """
    out = []
    for i in range(logits.shape[0]):
        row = None if orig_size is None else orig_size[i]
        box = letterbox_box(aspect_shape(row, stored_shape), logits.shape[-1])
        crop = logits[i : i + 1, :, box[0][0] : box[0][0] + box[0][1], box[1][0] : box[1][0] + box[1][1]]
        out.append(F.interpolate(crop, size=tuple(stored_shape), mode="bilinear", align_corners=False))
    return torch.cat(out)


def to_stored_grid(
    tensor: torch.Tensor, stored_shape: Sequence[int], letterbox: bool = False, orig_size=None
) -> torch.Tensor:
    """Network-grid maps ``[B, C, S, S]`` (logits, images) -> the stored mask grid ``[B, C, *stored_shape]``:
    :func:`unletterbox` for letterboxed inputs, else bilinear resampling (none when the shapes agree)."""
    if letterbox:
        return unletterbox(tensor, stored_shape, orig_size)
    if tuple(tensor.shape[-2:]) != tuple(stored_shape):
        return F.interpolate(tensor, size=tuple(stored_shape), mode="bilinear", align_corners=False)
    return tensor


def check_segment_options(connectivity: int, empty_prediction: str) -> None:
    """Raise ValueError unless ``connectivity`` is 4 or 8 and ``empty_prediction`` is ``"empty"`` or ``"whole_image"``."""
    if connectivity not in (4, 8) or empty_prediction not in ("empty", "whole_image"):
        raise ValueError(f"connectivity must be 4 or 8 and empty_prediction 'empty' or 'whole_image', got "
                         f"{connectivity!r} and {empty_prediction!r}")


@torch.no_grad()
def segment(
    logits: torch.Tensor,
    prob_fn: ProbFn,
    num_classes: int,
    keep_largest_component: bool = True,
    connectivity: int = 8,
    empty_prediction: str = "empty",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits on the output grid -> ``(probabilities [B, C, H, W], class map [B, 1, H, W] int64)``: the one
    post-processing by which FedUQ both scores (:func:`evaluate_test`) and predicts (:mod:`feduq.predict`).

    Probabilities are ``prob_fn(logits)`` (softmax; FedEvi's Dirichlet mean α/S), the class map their argmax;
    ``empty_prediction="whole_image"`` replays the official FedEvi code's quirk (a binary prediction without
    foreground becomes all foreground); ``keep_largest_component`` keeps each foreground class's largest connected
    component (MONAI ``KeepLargestConnectedComponent``, ``connectivity`` 8 = full or 4, FedEvi official
    ``utils/seg/test.py``).

    Raises:
        ValueError: ``connectivity`` or ``empty_prediction`` not one of the values above.
    """
    check_segment_options(connectivity, empty_prediction)
    probs = prob_fn(logits)
    # the first maximal class, as argmax; torch's max over dim 1 is ~30x faster than argmax over it on CPU
    pred = probs.max(dim=1, keepdim=True).indices
    if empty_prediction == "whole_image" and num_classes == 2:  # official quirk (binary tasks): no foreground
        empty = ~pred.flatten(1).any(dim=1)                     # -> the whole image is foreground
        pred[empty] = 1
    if keep_largest_component and num_classes > 1:
        post = KeepLargestConnectedComponent(applied_labels=list(range(1, num_classes)), is_onehot=False,
                                             connectivity=1 if connectivity == 4 else 2)
        pred = torch.stack([torch.as_tensor(post(p)).as_subclass(torch.Tensor) for p in pred])  # MONAI's metadata off
    return probs, pred


def evaluate_test(
    model: torch.nn.Module,
    loader,
    device: torch.device,
    num_classes: int,
    prob_fn: ProbFn = softmax_probs,
    keep_largest_component: bool = True,
    regions: Mapping[str, Sequence[int]] | None = None,
    letterbox: bool = False,
    observe: Callable[[Mapping, torch.Tensor, torch.Tensor, dict], None] | None = None,
    connectivity: int = 8,
    empty_prediction: str = "empty",
) -> dict[str, np.ndarray]:
    """Per-image test scores at the label's resolution (the stored mask size, or the training size when the test
    split was loaded with the validation transforms: ``test_protocol.resolution = "training"``).

    Logits are upsampled (bilinear) to the label's size (with ``letterbox``, the images were
    letterboxed by ``get_dataset(resize="letterbox")``: :func:`unletterbox` crops the padding away
    first), turned into probabilities with
    ``prob_fn``, argmax-ed, and (optionally) reduced to the largest connected component per
    foreground class with MONAI's ``KeepLargestConnectedComponent``, as FedEvi's evaluation does
    (official ``utils/seg/test.py``; its empty-prediction quirk is the ``empty_prediction`` switch).

    With ``regions`` (region name -> class indices, e.g. fundus ``{"disc": (1, 2), "cup": (2,)}``)
    Dice and HD95 are scored per region instead of per class (:func:`feduq.scores.metrics.region_scores`),
    and the largest-component reduction applies to each binarised region (a disc whose rim is cut
    in two by the cup keeps both arcs). ECE stays per foreground class.

    ``connectivity``: neighbours of the largest-component reduction, 8 (MONAI's default, full connectivity) or 4
    (the official FedEvi code: SciPy ``ndimage.label``'s default structure). ``empty_prediction``: ``"empty"``
    (default) scores an empty prediction as it is (Dice 0, HD95 the image diagonal when the mask is not empty);
    ``"whole_image"`` replays the official code's quirk, in which the largest-component step turns an empty
    prediction into an all-foreground mask (a small Dice and a finite HD95 instead of 0 and the diagonal).

    ``observe(batch, logits, probs, scores, pred)``, when given, sees every batch after scoring: the batch as loaded,
    logits and probabilities ``[B, C, H, W]`` float32 on the stored grid (CPU), this batch's rows of the result and
    the class map ``[B, 1, H, W]`` of :func:`segment` (largest-component reduced, except for tasks with ``regions``)
    (:mod:`feduq.site.evaluation` computes uncertainty quality from them without a second forward pass).

    Returns:
        ``{"dice": [N, K], "hd95": [N, K], "ece": [N]}`` float64 with K = C-1 foreground classes, or
        K = len(regions) columns in the order of ``regions``; HD95 in stored pixels.
    """
    check_segment_options(connectivity, empty_prediction)
    model.eval()
    rows: dict[str, list[np.ndarray]] = {"dice": [], "hd95": [], "ece": []}
    for batch in loader:
        # the network, the mapping onto the stored grid and the probabilities run on ``device``; the connected
        # components, HD95 and what ``observe`` sees on the host
        label = to_device(batch["label"], device)
        logits = model(to_device(batch["image"], device)).float()
        logits = to_stored_grid(logits, tuple(label.shape[-2:]), letterbox, batch.get(ORIGINAL_SIZE_KEY))
        probs, pred = segment(logits, prob_fn, num_classes, keep_largest_component and not regions,
                              connectivity, empty_prediction)
        ece = calibration_error(probs, label)
        logits, probs, pred, label = logits.cpu(), probs.cpu(), pred.cpu(), label.cpu()
        if regions:
            scores = region_scores(pred, label, regions, keep_largest_component=keep_largest_component,
                                   connectivity=connectivity)
        else:
            scores = segmentation_scores(pred, label, num_classes)
        scores = {"dice": scores["dice"], "hd95": scores["hd95"], "ece": ece}
        for key, value in scores.items():
            rows[key].append(value)
        if observe is not None:
            observe(batch, logits, probs, scores, pred)
    return {k: np.concatenate(v) for k, v in rows.items()}


def summarize_test_scores(scores: Mapping[str, np.ndarray], class_names: Sequence[str], regions: Mapping | None = None) -> dict:
    """A site's test metrics from :func:`evaluate_test`'s per-image scores, with the keys of the federated ``test``
    task (every runner reports these: the FLARE executor, ``feduq reference``).

    Args:
        scores: ``{"dice": [N, C'], "hd95": [N, C'], "ece": [N]}`` (C' foreground classes, or regions).
        class_names: the task's class names, background first.
        regions: the task's evaluation regions (fundus disc and cup), or None.

    Returns:
        ``dice``, ``hd95`` (pixels; mean over images of the mean over classes or regions), ``ece``, ``num_images``,
        and per region ``dice_<region>``/``hd95_<region>`` (tasks with regions) or per class ``dice_<class>``/
        ``hd95_<class>`` (other tasks with more than one foreground class).
    """
    metrics = {"dice": float(scores["dice"].mean()), "hd95": float(scores["hd95"].mean()),
               "ece": float(scores["ece"].mean()), "num_images": int(scores["dice"].shape[0])}
    columns = list(regions) if regions else (list(class_names[1:]) if len(class_names) > 2 else [])
    for c, name in enumerate(columns):
        metrics[f"dice_{name}"] = float(scores["dice"][:, c].mean())
        metrics[f"hd95_{name}"] = float(scores["hd95"][:, c].mean())
    return metrics
