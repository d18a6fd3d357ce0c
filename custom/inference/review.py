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

**The rule at a hospital the model never saw** (:func:`choose_rule`, issue 52). The image mean of the uncertainty
hides a confident miss (an empty prediction is certain almost everywhere), and one threshold from the training sites
does not carry to a shifted site. A case is flagged, with its reasons, when

1. ``implausible size``: every labelled calibration case holds the structure and the predicted area fraction is
   below half the smallest labelled one (:data:`SIZE_FLOOR_FACTOR`), an empty prediction included;
2. ``unfamiliar input``: the network's bottleneck features of the image (:class:`feduq.core.case_scores.BottleneckTap`)
   lie farther from the calibration images' (:class:`Familiarity`: a probabilistic PCA distance, the Mahalanobis
   distance over the principal components under scikit-learn's Ledoit-Wolf covariance plus the residual outside them)
   than the largest cross-fitted distance of a calibration image;
3. ``uncertain``: its case score is above the threshold chosen as above on the cases rules 1 and 2 keep, the score
   being the one of :data:`CASE_SCORES` (image mean, mean inside the predicted foreground, mean in a band around its
   boundary: :func:`feduq.core.case_scores.case_scores`) with the lowest area under the risk-coverage curve on them.

Everything the rule keeps is computed where the calibration runs, from the images given to it.
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

from ..core.case_scores import familiarity_distance, rule_reasons

__all__ = ["ReviewError", "ReviewThreshold", "choose_threshold", "choose_rule", "certify_rule", "Familiarity",
           "CASE_SCORES", "review_file", "save_threshold", "load_threshold", "file_sha256", "aurc"]

#: the case scores the uncertainty rule chooses among (keys of :func:`feduq.core.case_scores.case_scores`)
CASE_SCORES = ("u_mean", "u_foreground", "u_boundary")
#: a prediction smaller than this fraction of the smallest labelled calibration structure is implausible
SIZE_FLOOR_FACTOR = 0.5
#: fewest calibration images the familiarity rule is fitted on (fewer: no such rule, said at calibration)
MIN_FAMILIARITY_CASES = 10


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
        score: the case score the threshold applies to (:data:`CASE_SCORES`; ``u_mean`` before issue 52).
        size_floor: flag a predicted area fraction below this (None: no size rule).
        familiarity: :class:`Familiarity`'s fields (None: no familiarity rule).
        flagged_on_calibration: reason -> fraction of the calibration cases it flagged.
        certificate: None for a rule chosen empirically (:func:`choose_rule`: its figures describe the calibration
            cases only); for a certified rule (:func:`certify_rule`) ``k``, ``delta``, ``bound`` (the certified mean
            Dice of the accepted cases), ``scores_tested``, ``method`` and, from
            ``predict --calibrate``, ``sites`` and ``cases`` (each labelled case's SHA-256 of its image and mask
            files).
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

    score: str = "u_mean"
    size_floor: float | None = None
    familiarity: dict | None = None
    flagged_on_calibration: dict = field(default_factory=dict)
    certificate: dict | None = None

    def flag(self, case_uncertainty: float) -> bool:
        """True when a case must be reviewed (its uncertainty is above the threshold, or NaN)."""
        return not (case_uncertainty <= self.threshold)

    def reasons(self, scores: dict, features=None) -> list[str]:
        """Why a case must be reviewed (empty: accepted): ``implausible size``, ``unfamiliar input``, ``uncertain``.

        Args:
            scores: the case's :func:`feduq.core.case_scores.case_scores` as floats (``u_mean`` stands for a record
                of before issue 52, whose ``score`` is ``u_mean``).
            features: its pooled bottleneck features ``[C]`` (needed when the rule has a familiarity part).
        """
        return rule_reasons(asdict(self), scores, features)


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


def aurc(score: Sequence[float], dice: Sequence[float]) -> float:
    """Area under the risk-coverage curve of accepting cases from the lowest ``score`` up, risk = 1 - Dice: the mean
    over k = 1..N of the mean risk of the k most certain cases (ties in their given order)."""
    order = np.argsort(np.asarray(score, dtype=np.float64), kind="stable")
    risk = 1.0 - np.asarray(dice, dtype=np.float64)[order]
    return float(np.mean(np.cumsum(risk) / np.arange(1, risk.size + 1)))


@dataclass
class Familiarity:
    """How far an image's pooled bottleneck features lie from the calibration images': the distance under a
    probabilistic PCA model of the calibration features (:func:`feduq.core.case_scores.mahalanobis`: the Mahalanobis
    distance over ``k`` principal components under scikit-learn's Ledoit-Wolf shrunk covariance, plus the squared
    residual outside them over its per-dimension variance), flagged above ``threshold``: the largest 5-fold
    cross-fitted distance of a calibration image, so about none of its kind would be flagged anew.

    The residual term matters with few calibration images and wide features (k = min(16, N / 4) of hundreds of
    channels): the principal part alone under-states a held-out image's distance (the components over-fit the images
    they were fitted on) and misses a shift outside them.

    Attributes (lists, JSON-ready): ``center [C]``, ``components [k, C]``, ``location [k]``, ``precision [k, k]``,
    ``threshold``; ``n_cases`` the calibration images it was fitted on; ``residual_variance`` (None: a record of
    before the residual term, or k = C).
    """

    center: list
    components: list
    location: list
    precision: list
    threshold: float
    n_cases: int
    residual_variance: float | None = None

    @staticmethod
    def _fit_arrays(x: np.ndarray, k: int):
        from sklearn.covariance import LedoitWolf
        from sklearn.decomposition import PCA

        pca = PCA(n_components=k, random_state=0).fit(x)
        z = pca.transform(x)
        lw = LedoitWolf().fit(z)
        residual = (x - pca.mean_) - z @ pca.components_
        free = x.shape[1] - k
        variance = float(np.einsum("nc,nc->", residual, residual) / (x.shape[0] * free)) if free > 0 else 0.0
        return {"center": pca.mean_, "components": pca.components_, "location": lw.location_,
                "precision": lw.precision_, "residual_variance": variance if variance > 0 else None}

    @classmethod
    def fit(cls, features) -> "Familiarity":
        """Fit on ``features [N, C]`` (N >= :data:`MIN_FAMILIARITY_CASES`).

        Raises:
            ReviewError: fewer cases, or a non-finite feature.
        """
        from sklearn.model_selection import KFold

        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] < MIN_FAMILIARITY_CASES or not np.all(np.isfinite(x)):
            raise ReviewError(f"the familiarity rule needs >= {MIN_FAMILIARITY_CASES} finite feature rows, got "
                              f"{x.shape[0] if x.ndim == 2 else x.shape}")
        k = int(max(1, min(16, x.shape[0] // 4, x.shape[1])))
        held_out = np.empty(x.shape[0])
        for fit_rows, test_rows in KFold(5, shuffle=True, random_state=0).split(x):
            held_out[test_rows] = familiarity_distance(x[test_rows], cls._fit_arrays(x[fit_rows], k))
        arrays = cls._fit_arrays(x, k)
        return cls(**{n: v.tolist() if isinstance(v, np.ndarray) else v for n, v in arrays.items()},
                   threshold=float(held_out.max()), n_cases=int(x.shape[0]))

    def distance(self, features) -> np.ndarray:
        """Distances ``[N]`` of ``features [N, C]`` (:func:`feduq.core.case_scores.familiarity_distance`)."""
        return familiarity_distance(features, asdict(self))

    def unfamiliar(self, features) -> np.ndarray:
        """``[N]`` bool: the distance is above :attr:`threshold` (or not finite)."""
        return ~(self.distance(features) <= self.threshold)


def _fixed_parts(cases: dict, features) -> tuple:
    """The rule's parts 1 and 2 on these cases: ``(size floor or None, [N] too small, Familiarity or None, [N]
    unfamiliar)``."""
    mask = np.asarray(cases["mask_fraction"], dtype=np.float64)
    area = np.asarray(cases["area_fraction"], dtype=np.float64)
    n = mask.size
    floor = float(SIZE_FLOOR_FACTOR * mask.min()) if n and np.all(mask > 0) else None
    small = ~(area >= floor) if floor is not None else np.zeros(n, bool)
    familiarity, odd = None, np.zeros(n, bool)
    if features is not None and n >= MIN_FAMILIARITY_CASES:
        familiarity = Familiarity.fit(features)
        odd = familiarity.unfamiliar(features)  # in-sample: below the cross-fitted largest distance, as a rule
    return floor, small, familiarity, odd


def _finish(rule: ReviewThreshold, cases: dict, small, odd) -> ReviewThreshold:
    """Fill ``coverage``, ``accepted_dice`` and ``flagged_on_calibration`` of the whole rule on these cases."""
    dice = np.asarray(cases["dice"], dtype=np.float64)
    uncertain = ~(np.asarray(cases[rule.score], dtype=np.float64) <= rule.threshold)
    accepted = ~small & ~odd & ~uncertain
    rule.coverage = float(accepted.mean())
    rule.accepted_dice = float(dice[accepted].mean()) if accepted.any() else float("nan")
    rule.flagged_on_calibration = {"implausible size": float(small.mean()), "unfamiliar input": float(odd.mean()),
                                   "uncertain": float(uncertain.mean())}
    return rule


def choose_rule(cases: dict, target_dice: float, features=None, uncertainty: str = "total") -> ReviewThreshold:
    """The review rule of the module doc, chosen on labelled cases (empirically: no finite-sample promise; see
    :func:`certify_rule`).

    Args:
        cases: ``[N]`` arrays per key: the :data:`CASE_SCORES`, ``area_fraction`` (predicted), ``mask_fraction``
            (labelled structure's area fraction) and ``dice`` (fractions).
        target_dice: the accepted cases' mean Dice to reach, in (0, 1].
        features: ``[N, C]`` pooled bottleneck features, or None (no familiarity rule; also with fewer than
            :data:`MIN_FAMILIARITY_CASES` cases).
        uncertainty: the uncertainty map's name, stored with the result.

    Returns:
        :class:`ReviewThreshold` with ``score``, ``size_floor``, ``familiarity`` and ``flagged_on_calibration``;
        ``coverage`` and ``accepted_dice`` are those of the whole rule on these cases.

    Raises:
        ReviewError: as :func:`choose_threshold` (on the cases rules 1 and 2 keep), or none of them is kept.
    """
    dice = np.asarray(cases["dice"], dtype=np.float64)
    n = dice.size
    floor, small, familiarity, odd = _fixed_parts(cases, features)
    kept = ~small & ~odd
    if not kept.any():
        raise ReviewError(f"every one of the {n} labelled cases is of implausible size or unfamiliar: no threshold")
    name = min(CASE_SCORES, key=lambda s: aurc(np.asarray(cases[s])[kept], dice[kept]))
    t = choose_threshold(np.asarray(cases[name])[kept], dice[kept], target_dice, uncertainty=uncertainty)
    rule = ReviewThreshold(uncertainty=uncertainty, threshold=t.threshold, target_dice=float(target_dice),
                           coverage=0.0, accepted_dice=0.0, all_dice=float(dice.mean()), n_cases=int(n), score=name,
                           size_floor=floor, familiarity=None if familiarity is None else asdict(familiarity))
    return _finish(rule, cases, small, odd)


def certify_rule(cases: dict, target_dice: float, delta: float = 0.1, features=None,
                 uncertainty: str = "total") -> ReviewThreshold:
    """The review rule with a certified threshold: with probability at least ``1 - delta`` over the labelled cases
    drawn, the mean Dice of the cases the rule accepts at their site is at least ``target_dice``
    (:mod:`feduq.inference.certify`: Learn then Test, Waudby-Smith–Ramdas betting p-values, fixed-sequence testing
    over the fixed grid :data:`feduq.inference.certify.GRID`, Bonferroni over the :data:`CASE_SCORES`).

    Parts 1 and 2 (size floor, familiarity) are fitted on the same cases as :func:`choose_rule` fits them and are
    taken as given: the certificate is about the uncertainty threshold applied to the cases they keep (the cases they
    flag count as flagged). ``ReviewThreshold.certificate`` records k, δ, the target (the certified bound: the only
    figure the procedure guarantees once the threshold is chosen) and the scores tested.

    Raises:
        ReviewError: ``target_dice`` or ``delta`` outside (0, 1); fewer cases than
            :func:`feduq.inference.certify.min_cases` (one line with the number needed); or no threshold certified
            (one line with the highest target these cases certify and roughly how many cases the target needs).
    """
    from .certify import best_certifiable_target, cases_for_target, certify_scores, family_level, min_cases

    if not 0 < target_dice < 1:
        raise ReviewError(f"--target-dice {target_dice}: a certified target must lie in (0, 1) (0.8 for 80 %)")
    if not 0 < delta < 1:
        raise ReviewError(f"--delta {delta}: the error level must lie in (0, 1) (0.1: the promise holds for 90 % "
                          f"of the labelled sets one could draw)")
    dice = np.asarray(cases["dice"], dtype=np.float64)
    if not np.all(np.isfinite(dice)):
        raise ReviewError(f"{int((~np.isfinite(dice)).sum())} of the labelled cases have no Dice (NaN): a mask or a "
                          f"prediction could not be scored")
    n = dice.size
    need = min_cases(target_dice, family_level(delta, len(CASE_SCORES)), "wsr")
    if n < need:
        raise ReviewError(f"{n} labelled cases cannot certify a mean Dice of {target_dice:.3f} at delta {delta:g}: at "
                          f"least {need} are needed (as many cases of Dice 1 would just do it); label more cases, "
                          f"lower --target-dice or raise --delta")
    floor, small, familiarity, odd = _fixed_parts(cases, features)
    kept = ~small & ~odd
    scores = {s: np.where(kept, np.asarray(cases[s], dtype=np.float64), np.inf) for s in CASE_SCORES}
    name, cert, _ = certify_scores(scores, dice, target_dice, delta)
    if name is None:
        best = best_certifiable_target(scores, dice, delta)
        more = cases_for_target(scores, dice, target_dice, delta)
        hint = (f"about {more:,} labelled cases like these would be needed" if more is not None else
                "no practical number of cases like these would (over 10,000): their accepted cases do not reach the "
                "target, or only barely")
        can = f"the highest target they certify is about {best:.3f}" if best > 0 else "they certify no target"
        raise ReviewError(f"these {n} labelled cases cannot certify a mean Dice of {target_dice:.3f} at any coverage "
                          f"(delta {delta:g}): {can}; {hint}")
    rule = ReviewThreshold(uncertainty=uncertainty, threshold=float(cert.threshold), target_dice=float(target_dice),
                           coverage=0.0, accepted_dice=0.0, all_dice=float(dice.mean()), n_cases=int(n), score=name,
                           size_floor=floor, familiarity=None if familiarity is None else asdict(familiarity))
    rule.certificate = {"k": int(n), "delta": float(delta), "bound": float(target_dice),
                        "scores_tested": list(CASE_SCORES),
                        "method": "Learn then Test (Angelopoulos et al. 2021): Waudby-Smith-Ramdas betting p-values, "
                                  "fixed sequences over a fixed grid from three starts, Bonferroni over starts and "
                                  "scores"}
    return _finish(rule, cases, small, odd)


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
        if threshold.score not in CASE_SCORES:
            raise ValueError(f"unknown case score {threshold.score!r}")
        if threshold.familiarity is not None:
            Familiarity(**threshold.familiarity)
    except (OSError, ValueError, TypeError) as e:
        raise ReviewError(f"review threshold {path} cannot be read ({type(e).__name__}: {e})") from None
    if threshold.model_sha256 != file_sha256(model_file):
        raise ReviewError(f"review threshold {path} belongs to another model file (SHA-256 differs from {model_file}); "
                          f"choose it again for this model (python -m feduq.predict --calibrate ...)")
    return threshold
