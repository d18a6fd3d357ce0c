"""Per-pixel uncertainty maps of a segmentation model on a site's test images (no FLARE here).

What the FedEvi paper shows next to its tables (Fig. 3): the prediction and, per pixel, how
uncertain the model is, split for evidential models into the epistemic part (what the model has
not learned; high on other sites' data) and the aleatoric part (ambiguity in the data itself;
high on the lesion boundary). Softmax models have only the predictive entropy.

Maps contain the site's images, so they are written on the site (the ``test`` task's
``save_maps`` option writes them to the site's run folder) and never sent to the server.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

from ..core.evidential import dirichlet_from_logits, evidential_uncertainty
from ..data import ORIGINAL_SIZE_KEY
from .scoring import to_stored_grid

UncertaintyFn = Callable[[torch.Tensor], Mapping[str, torch.Tensor]]


def softmax_entropy(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """Predictive entropy of ``softmax(logits)`` per position, in nats: ``{"total": [B, *spatial]}``.

    In [0, ln C]. A softmax model has no decomposition into epistemic and aleatoric parts.
    """
    logp = torch.log_softmax(logits, dim=1)
    return {"total": -(logp.exp() * logp).sum(dim=1)}


def dirichlet_uncertainty(evidence: str = "exp", clamp_max: float = 80.0) -> UncertaintyFn:
    """``logits -> {"total", "aleatoric", "epistemic", "vacuity"}`` maps ``[B, *spatial]`` of the Dirichlet
    ``alpha = evidence(logits) + 1`` (``evidence`` ``"exp"`` for FedEvi, ``"softplus"`` for FedUAA): total =
    aleatoric + epistemic in nats (FedEvi Eq. 3-5), and the vacuity ``u = C / S`` in (0, 1] (FedUAA's and
    GraphFedSeg's uncertainty, Sensoy et al. 2018)."""

    def fn(logits: torch.Tensor) -> dict[str, torch.Tensor]:
        alpha = dirichlet_from_logits(logits.double(), clamp_max, evidence).alpha
        u = evidential_uncertainty(alpha)
        return {"total": u.total, "aleatoric": u.aleatoric, "epistemic": u.epistemic.clamp_min(0.0),
                "vacuity": alpha.shape[1] / alpha.sum(dim=1)}

    return fn


@torch.no_grad()
def save_uncertainty_maps(
    model: torch.nn.Module,
    loader,
    device: torch.device,
    prob_fn: Callable[[torch.Tensor], torch.Tensor],
    uncertainty_fn: UncertaintyFn,
    out_dir: str | Path,
    max_images: int,
    letterbox: bool = False,
    title: str = "",
) -> Path:
    """Write maps of the first ``max_images`` test images of ``loader`` to ``out_dir``.

    Logits are brought to the stored mask grid exactly as :func:`feduq.scores.scoring.evaluate_test` does
    (letterbox crop, bilinear upsampling) before the prediction and the uncertainties are computed.

    Per image ``<i>_<stem>``: ``.npz`` with ``image`` ``[C, H, W]`` (network input resampled to the
    stored grid), ``label``, ``prediction`` ``[H, W]`` int and one float32 ``[H, W]`` array per
    uncertainty (nats), and a ``.png`` panel: image, ground truth, prediction, each map. Also
    ``maps_summary.csv``: per image, each uncertainty's mean over the image and over the wrongly
    predicted pixels, and the pixel error rate.

    Args:
        loader: test loader (batch 1) of ``{"image": [1, C, S, S], "label": [1, 1, H, W]}``.
        prob_fn / uncertainty_fn: the method's ``logits -> probabilities`` and ``logits -> maps``.
        out_dir: created if missing.
        max_images: how many images (in loader order); 0 writes nothing but the empty summary.
        letterbox: the images were letterboxed (``resize="letterbox"``).
        title: panel title prefix (e.g. site and method).

    Returns:
        ``out_dir / "maps_summary.csv"``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.eval()
    rows = []
    for i, batch in enumerate(loader):
        if i >= max_images:
            break
        label = batch["label"].cpu()
        image = batch["image"]
        logits = model(image.to(device)).float().cpu()
        shape, orig_size = tuple(label.shape[-2:]), batch.get(ORIGINAL_SIZE_KEY)
        logits = to_stored_grid(logits, shape, letterbox, orig_size)
        image = to_stored_grid(torch.as_tensor(image).float().cpu(), shape, letterbox, orig_size)
        pred = prob_fn(logits).argmax(dim=1)[0].numpy()
        maps = {k: v[0].float().numpy() for k, v in uncertainty_fn(logits).items()}
        gt = label[0, 0].numpy().astype(np.int64)
        img = torch.as_tensor(image)[0].numpy().astype(np.float32)
        stem = _stem(batch, i)
        np.savez_compressed(out_dir / f"{stem}.npz", image=img, label=gt, prediction=pred, **maps)
        wrong = pred != gt
        row = {"image": stem, "error_rate": float(wrong.mean())}
        for k, m in maps.items():
            row[f"mean_{k}"] = float(m.mean())
            row[f"mean_{k}_on_errors"] = float(m[wrong].mean()) if wrong.any() else float("nan")
        rows.append(row)
        _panel(plt, img, gt, pred, maps, out_dir / f"{stem}.png", f"{title} {stem}".strip())
    summary = out_dir / "maps_summary.csv"
    with open(summary, "w", newline="") as f:
        if rows:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
    return summary


def image_stem(batch: Mapping) -> str | None:
    """File stem of the first image of a loader batch (its ``id``, e.g. a volume slice ``<case>_z<zzz>`` read by
    :mod:`feduq.sites.nnunet_raw`, else MONAI's ``filename_or_obj`` meta), or None when unknown."""
    ids = batch.get("id") if isinstance(batch, Mapping) else None
    if isinstance(ids, (list, tuple)) and ids:
        return str(ids[0])
    meta = getattr(batch["image"], "meta", None) or {}
    name = meta.get("filename_or_obj")
    if isinstance(name, (list, tuple)):
        name = name[0] if name else None
    return Path(str(name)).stem if name else None


def _stem(batch: Mapping, index: int) -> str:
    stem = image_stem(batch)
    return f"{index:03d}_{stem}" if stem else f"{index:03d}"


def _panel(plt, img: np.ndarray, gt: np.ndarray, pred: np.ndarray, maps: dict, path: Path, title: str) -> None:
    """Image | ground truth | prediction | one panel per uncertainty map (PILReader axes: transpose to H x W)."""
    shown = np.moveaxis(img, 0, -1).transpose(1, 0, 2)
    shown = shown[..., 0] if shown.shape[-1] == 1 else np.clip(shown, 0.0, 1.0)
    panels = [("image", shown, "gray"), ("ground truth", gt.T, "viridis"), ("prediction", pred.T, "viridis")]
    panels += [(f"{k} (C/S)" if k == "vacuity" else f"{k} (nats)", m.T, "magma") for k, m in maps.items()]
    fig, axes = plt.subplots(1, len(panels), figsize=(2.6 * len(panels), 2.9), squeeze=False)
    for ax, (name, data, cmap) in zip(axes[0], panels):
        im = ax.imshow(data, cmap=cmap, interpolation="nearest")
        ax.set_title(name, fontsize=8)
        ax.axis("off")
        if name.endswith(("(nats)", "(C/S)")):
            fig.colorbar(im, ax=ax, fraction=0.046, pad=0.02)
    fig.suptitle(title, fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
