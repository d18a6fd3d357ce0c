"""The review flag: which predicted cases a person must check, chosen on a labelled set (selective prediction).

A segmentation model with uncertainty can abstain: cases whose **case-level uncertainty** (the mean of the method's
own uncertainty map over the image, :attr:`feduq.parts.site.SitePart.primary_uncertainty`) is above a threshold
are flagged for review, the others are accepted. On a labelled set (a site's validation split, or any site folder
with masks) :func:`choose_threshold` walks the risk–coverage curve (Geifman & El-Yaniv, *Selective classification
for deep neural networks*, NeurIPS 2017; for segmentation, Jungo & Reyes, MICCAI 2019): cases sorted from the most
to the least certain, the threshold is set at the widest set of most-certain cases whose mean Dice still reaches the
target (the **accepted** cases), so the coverage (the fraction accepted) is as high as the target allows.

The chosen threshold is stored beside the model file (:func:`review_file`, ``<model>.review.json``) with the
model's SHA-256, the target, the coverage and the accepted cases' Dice on that set; :mod:`feduq.predict` reads it
and flags a new case when its uncertainty is above the threshold. A stored threshold of another model is refused.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

__all__ = ["ReviewError", "ReviewThreshold", "choose_threshold", "review_file", "save_threshold", "load_threshold",
           "file_sha256"]


class ReviewError(ValueError):
    """A threshold that cannot be chosen or used; one line naming the file or the number."""


@dataclass
class ReviewThreshold:
    """A case-level uncertainty threshold and what it gave on the labelled set it was chosen on.

    Attributes:
        uncertainty: the uncertainty map whose image mean is the case-level uncertainty (``"total"``, ``"vacuity"``).
        threshold: flag a case for review when its case-level uncertainty is **above** this value (the map's unit:
            nats, or C/S for vacuity).
        target_dice: the mean Dice (fraction) the accepted cases had to reach.
        coverage: fraction of the labelled cases accepted at the threshold.
        accepted_dice: mean Dice of the accepted cases (fraction).
        all_dice: mean Dice of every labelled case (fraction), for comparison.
        n_cases: number of labelled cases.
        calibrated_on: where the labelled cases came from (site folders or ``site:split``).
        model_sha256: SHA-256 of the model file the threshold belongs to.
    """

    uncertainty: str
    threshold: float
    target_dice: float
    coverage: float
    accepted_dice: float
    all_dice: float
    n_cases: int
    calibrated_on: list[str] = field(default_factory=list)
    model_sha256: str = ""

    def flag(self, case_uncertainty: float) -> bool:
        """True when a case must be reviewed (its uncertainty is above the threshold, or NaN)."""
        return not (case_uncertainty <= self.threshold)


def choose_threshold(case_uncertainty: Sequence[float], case_dice: Sequence[float], target_dice: float,
                     uncertainty: str = "total") -> ReviewThreshold:
    """The highest-coverage threshold at which the accepted cases' mean Dice reaches ``target_dice``.

    Cases are accepted when their uncertainty is ``<= threshold``; the candidate sets are the k most certain cases
    (tied cases are accepted or flagged together). Among the sets whose mean Dice is ``>= target_dice`` the largest
    wins, and the threshold lies midway between its most uncertain case and the next case (the largest uncertainty
    when every case is accepted).

    Args:
        case_uncertainty: ``[N]`` case-level uncertainty (float, finite).
        case_dice: ``[N]`` Dice of each case in [0, 1].
        target_dice: the accepted cases' mean Dice to reach, in (0, 1].
        uncertainty: the map's name, stored with the result.

    Returns:
        :class:`ReviewThreshold` (without ``calibrated_on`` and ``model_sha256``).

    Raises:
        ReviewError: no case, lengths differ, a non-finite value, a target outside (0, 1], or no threshold reaches
            the target (the message gives the best accepted Dice).
    """
    u = np.asarray(case_uncertainty, dtype=np.float64).reshape(-1)
    d = np.asarray(case_dice, dtype=np.float64).reshape(-1)
    if u.size == 0 or u.size != d.size:
        raise ReviewError(f"need one uncertainty per case and at least one case, got {u.size} uncertainties and "
                          f"{d.size} Dice values")
    if not (np.all(np.isfinite(u)) and np.all(np.isfinite(d))):
        raise ReviewError("a case has a non-finite uncertainty or Dice")
    if not 0.0 < target_dice <= 1.0:
        raise ReviewError(f"target Dice {target_dice} must be in (0, 1] (a fraction: 0.8 for 80 %)")
    order = np.argsort(u, kind="stable")
    u_sorted, d_sorted = u[order], d[order]
    mean_accepted = np.cumsum(d_sorted) / np.arange(1, u.size + 1)
    last_of_tie = np.r_[u_sorted[1:] != u_sorted[:-1], True]  # a threshold accepts every case tied with it
    ok = np.flatnonzero(last_of_tie & (mean_accepted >= target_dice - 1e-12))
    if ok.size == 0:
        best = float(mean_accepted[last_of_tie].max())
        raise ReviewError(f"no uncertainty threshold reaches a mean Dice of {target_dice:.3f} on these {u.size} cases "
                          f"(the best accepted set has {best:.3f}); lower the target Dice")
    k = int(ok[-1])
    # midway to the first case left out, so a re-computed uncertainty (another batch size, another device) of a case
    # near the boundary falls on the same side
    threshold = float(u_sorted[k]) if k + 1 == u.size else float((u_sorted[k] + u_sorted[k + 1]) / 2)
    return ReviewThreshold(uncertainty=uncertainty, threshold=threshold, target_dice=float(target_dice),
                           coverage=(k + 1) / u.size, accepted_dice=float(mean_accepted[k]), all_dice=float(d.mean()),
                           n_cases=int(u.size))


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def review_file(model_file: str | os.PathLike) -> Path:
    """Where the review threshold of ``model_file`` is stored: ``<model file>.review.json`` beside it."""
    model_file = Path(model_file)
    return model_file.with_name(model_file.name + ".review.json")


def save_threshold(threshold: ReviewThreshold, model_file: str | os.PathLike, path: str | os.PathLike | None = None
                   ) -> Path:
    """Store ``threshold`` for ``model_file`` (its SHA-256 recorded) at ``path`` (default :func:`review_file`),
    written to a temporary file and moved into place. Returns the path."""
    path = Path(path) if path is not None else review_file(model_file)
    record = {**asdict(threshold), "model_sha256": file_sha256(model_file), "model_file": Path(model_file).name}
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def load_threshold(model_file: str | os.PathLike, path: str | os.PathLike | None = None) -> ReviewThreshold | None:
    """The stored threshold of ``model_file`` (``path`` or :func:`review_file`), or None when there is none.

    Raises:
        ReviewError: the file is not a review threshold, or it belongs to another model file (SHA-256 differs).
    """
    path = Path(path) if path is not None else review_file(model_file)
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        names = ReviewThreshold.__dataclass_fields__
        threshold = ReviewThreshold(**{k: v for k, v in record.items() if k in names})
        if not math.isfinite(float(threshold.threshold)):
            raise ValueError("the threshold is not finite")
    except (OSError, ValueError, TypeError) as e:
        raise ReviewError(f"review threshold {path} cannot be read ({type(e).__name__}: {e})") from None
    if threshold.model_sha256 != file_sha256(model_file):
        raise ReviewError(f"review threshold {path} belongs to another model file (SHA-256 differs from {model_file}); "
                          f"choose it again for this model (python -m feduq.predict --calibrate ...)")
    return threshold
