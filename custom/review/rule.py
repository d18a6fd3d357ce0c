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

**The rule at a hospital the model never saw** (:func:`choose_rule`). The image mean of the uncertainty
hides a confident miss (an empty prediction is certain almost everywhere), and one threshold from the training sites
does not carry to a shifted site. A case is flagged, with its reasons, when

1. ``implausible size``: every labelled calibration case holds the structure and the predicted area fraction is
   below half the smallest labelled one (:data:`SIZE_FLOOR_FACTOR`), an empty prediction included;
2. ``unfamiliar input``: the network's bottleneck features of the image (:class:`feduq.scores.case_scores.BottleneckTap`)
   lie farther from the calibration images' (:class:`Familiarity`: a probabilistic PCA distance, the Mahalanobis
   distance over the principal components under scikit-learn's Ledoit-Wolf covariance plus the residual outside them)
   than the largest cross-fitted distance of a calibration image;
3. ``uncertain``: its case score is above the threshold chosen as above on the cases rules 1 and 2 keep, the score
   being the one of :data:`CASE_SCORES` (image mean, mean inside the predicted foreground, mean in a band around its
   boundary: :func:`feduq.scores.case_scores.case_scores`) with the lowest area under the risk-coverage curve on them.

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

from ..scores.case_scores import familiarity_distance, rule_reasons

__all__ = ["ReviewError", "ReviewThreshold", "choose_threshold", "choose_rule", "certify_rule", "Familiarity",
           "CASE_SCORES", "review_file", "save_threshold", "load_threshold", "file_sha256", "aurc"]

#: the case scores the uncertainty rule chooses among (keys of :func:`feduq.scores.case_scores.case_scores`)
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
        score: the case score the threshold applies to (:data:`CASE_SCORES`; ``u_mean`` in an older FedUQ's rule file).
        size_floor: flag a predicted area fraction below this (None: no size rule).
        familiarity: :class:`Familiarity`'s fields (None: no familiarity rule).
        flagged_on_calibration: reason -> fraction of the calibration cases it flagged.
        certificate: None for a rule chosen empirically (:func:`choose_rule`: its figures describe the calibration
            cases only); for a certified rule (:func:`certify_rule`) ``k`` (images), ``n_units``, ``unit``,
            ``max_unit_images``, ``learn_units``, ``delta``, ``bound`` (the certified mean Dice of the accepted
            images), ``scores_tested``, ``method`` and, from ``predict --calibrate``, ``sites``, ``units_from`` and
            ``digest`` (the labelled set's salted SHA-256: no case name; the list stays at the site,
            :func:`feduq.review.calibration.write_site_record`). A record written before the per-patient certificate has ``cases``
            (names and hashes) and no units.
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
            scores: the case's :func:`feduq.scores.case_scores.case_scores` as floats (``u_mean`` stands for a record
                of an older FedUQ, whose ``score`` is ``u_mean``).
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
    probabilistic PCA model of the calibration features (:func:`feduq.scores.case_scores.mahalanobis`: the Mahalanobis
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
    def fit(cls, features, groups=None) -> "Familiarity":
        """Fit on ``features [N, C]`` (N >= :data:`MIN_FAMILIARITY_CASES`); ``groups [N]``: each image's unit
        (patient, video), so that the cross-fitted distances keep a unit's images in one fold (scikit-learn's
        GroupKFold: a held-out frame is not judged by a model fitted on its neighbours); None: 5 shuffled folds.

        Raises:
            ReviewError: fewer cases, or a non-finite feature.
        """
        from sklearn.model_selection import GroupKFold, KFold

        x = np.asarray(features, dtype=np.float64)
        if x.ndim != 2 or x.shape[0] < MIN_FAMILIARITY_CASES or not np.all(np.isfinite(x)):
            raise ReviewError(f"the familiarity rule needs >= {MIN_FAMILIARITY_CASES} finite feature rows, got "
                              f"{x.shape[0] if x.ndim == 2 else x.shape}")
        k = int(max(1, min(16, x.shape[0] // 4, x.shape[1])))
        held_out = np.empty(x.shape[0])
        n_groups = len(set(np.asarray(groups).tolist())) if groups is not None else 0
        folds = list(GroupKFold(min(5, n_groups)).split(x, groups=groups)) if n_groups >= 2 else []
        if not folds or min(len(f) for f, _ in folds) <= k:  # too few units for k components: folds by image
            folds = list(KFold(5, shuffle=True, random_state=0).split(x))
        for fit_rows, test_rows in folds:
            held_out[test_rows] = familiarity_distance(x[test_rows], cls._fit_arrays(x[fit_rows], k))
        arrays = cls._fit_arrays(x, k)
        return cls(**{n: v.tolist() if isinstance(v, np.ndarray) else v for n, v in arrays.items()},
                   threshold=float(held_out.max()), n_cases=int(x.shape[0]))

    def distance(self, features) -> np.ndarray:
        """Distances ``[N]`` of ``features [N, C]`` (:func:`feduq.scores.case_scores.familiarity_distance`)."""
        return familiarity_distance(features, asdict(self))

    def unfamiliar(self, features) -> np.ndarray:
        """``[N]`` bool: the distance is above :attr:`threshold` (or not finite)."""
        return ~(self.distance(features) <= self.threshold)


def _fixed_parts(cases: dict, features, fit_on=None, groups=None) -> tuple:
    """The rule's parts 1 and 2 fitted on the cases ``fit_on`` selects (``[N]`` bool; None: all; ``groups``: each
    case's unit, so that the familiarity threshold is cross-fitted by unit) and applied to all: ``(size floor or
    None, [N] too small, Familiarity or None, [N] unfamiliar)``."""
    mask = np.asarray(cases["mask_fraction"], dtype=np.float64)
    area = np.asarray(cases["area_fraction"], dtype=np.float64)
    n = mask.size
    fit = np.ones(n, bool) if fit_on is None else np.asarray(fit_on, bool)
    floor = float(SIZE_FLOOR_FACTOR * mask[fit].min()) if fit.any() and np.all(mask[fit] > 0) else None
    small = ~(area >= floor) if floor is not None else np.zeros(n, bool)
    familiarity, odd = None, np.zeros(n, bool)
    if features is not None and fit.sum() >= MIN_FAMILIARITY_CASES:
        x = np.asarray(features)
        familiarity = Familiarity.fit(x[fit], groups=None if groups is None else np.asarray(groups)[fit])
        odd = familiarity.unfamiliar(x)  # the fitted cases: below the cross-fitted largest distance, as a rule
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


def certify_rule(cases: dict, target_dice: float, delta: float = 0.1, features=None, uncertainty: str = "total",
                 units: Sequence | None = None, unit: str = "image", max_unit_images: int | None = None,
                 hint_seconds: float = 30.0) -> ReviewThreshold:
    """The review rule with a certified threshold: with probability at least ``1 - delta`` over the labelled units
    drawn, the image-weighted mean Dice of the images the rule accepts at their site is at least ``target_dice``
    (:mod:`feduq.review.certificate`: the patient as the unit, one bounded value per unit, Learn then Test with the
    score and the start learned on a quarter of the units and a fixed sequence over the fixed grid on the rest).

    Parts 1 and 2 (size floor, familiarity) are fitted on the learn fold's images only (the familiarity threshold
    cross-fitted with folds by unit), so they are fixed before the test fold that certifies: the certificate covers
    the whole rule (an image they flag counts as flagged). ``ReviewThreshold.certificate`` records ``k`` (images),
    ``n_units``, ``unit``, ``max_unit_images``, ``learn_units``, ``delta``, ``bound`` (the certified mean Dice: the
    only figure the procedure guarantees), ``scores_tested`` and ``method``.

    Args:
        units: ``[k]`` each image's unit (patient, volume, video); None: each image its own unit.
        unit: the word for a unit in messages and the certificate (``"volume"``, ``"video"``, ``"patient"``,
            ``"image"``, ...).
        max_unit_images: M (:func:`feduq.review.certificate.certify_units`).
        hint_seconds: at most this long for the units-needed hint when nothing certifies.

    Raises:
        ReviewError: ``target_dice`` or ``delta`` outside (0, 1); a NaN Dice; one unit only or a unit above M; fewer
            units than could certify the target even with Dice 1; or no threshold certified. The last two carry
            ``verdict`` (a dict: ``target``, ``delta``, ``k``, ``n_units``, ``unit``, ``units_needed`` (None: no
            practical number), ``best_target``), their line giving the number of units needed.
    """
    from .certificate import (best_certifiable_target, certify_units, min_units, split_units, unit_codes,
                          units_needed)

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
    units_given = units
    units = [str(u) for u in (range(n) if units is None else units)]  # one order of names for the folds everywhere
    codes, names = unit_codes(units)
    plural = _plural(unit)
    if len(names) < 2:
        raise ReviewError(f"the {n} labelled images are one {unit} ({names[0]!r}): a certificate needs independent "
                          f"{plural}, at least two (label more {plural}, or --units images if each image is its own "
                          f"patient)")
    sizes = np.bincount(codes)
    # M from the units' mode, never from the sizes observed: no units given means each case is its own unit
    bound = 1 if units_given is None and max_unit_images is None else max_unit_images
    learn, _ = split_units(len(names))
    in_learn = np.isin(codes, learn)
    floor, small, familiarity, odd = _fixed_parts(cases, features, fit_on=in_learn, groups=codes)
    kept = ~small & ~odd
    scores = {s: np.where(kept, np.asarray(cases[s], dtype=np.float64), np.inf) for s in CASE_SCORES}
    try:
        cert = certify_units(scores, dice, units, target_dice, delta, bound)
    except ValueError as e:
        raise ReviewError(str(e)) from None
    k_words = (f"{n} labelled images" if unit == "image" else f"{n} labelled {plural}" if sizes.max() == 1 else
               f"{n} labelled images from {len(names)} {plural}")
    if cert.threshold is None:
        need_least = min_units(target_dice, delta, cert.max_unit_images, int(sizes.max()))
        more = units_needed(scores, dice, units, target_dice, delta, cert.max_unit_images, time_limit=hint_seconds)
        best = best_certifiable_target(scores, dice, units, delta, cert.max_unit_images)
        verdict = {"target": float(target_dice), "delta": float(delta), "k": int(n), "n_units": len(names),
                   "unit": unit, "units_needed": more, "best_target": best}
        if len(names) < need_least:
            hint = (f"at least {need_least} {plural} are needed even if every image had Dice 1 (a quarter of them "
                    f"choose the score and the start, the rest certify)")
        elif more is not None:
            hint = (f"about {more} {plural} like these would be needed (80 % of bootstrap sets of that many "
                    f"certify)")
        else:
            hint = (f"no practical number of {plural} like these would (not within 5,000, or the 30 s search ran out):"
                    f" their accepted images do not reach the target, or only barely")
        can = f"the highest target they certify is about {best:.3f}" if best > 0 else "they certify no target"
        error = ReviewError(f"these {k_words} cannot certify a mean Dice of {target_dice:.3f} at any coverage "
                            f"(delta {delta:g}): {can}; {hint}")
        error.verdict = verdict
        raise error
    rule = ReviewThreshold(uncertainty=uncertainty, threshold=float(cert.threshold), target_dice=float(target_dice),
                           coverage=0.0, accepted_dice=0.0, all_dice=float(dice.mean()), n_cases=int(n),
                           score=cert.score, size_floor=floor,
                           familiarity=None if familiarity is None else asdict(familiarity))
    rule.certificate = {"k": int(n), "n_units": int(cert.n_units), "unit": unit,
                        "max_unit_images": int(cert.max_unit_images), "learn_units": int(cert.learn_units),
                        "delta": float(delta), "bound": float(target_dice), "scores_tested": list(CASE_SCORES),
                        "method": "Learn then Test (Angelopoulos et al. 2021) with the patient as the unit: one "
                                  "bounded value per unit, Waudby-Smith-Ramdas betting p-values, the score, the start "
                                  "and the size and familiarity parts learned on a quarter of the units, one fixed "
                                  "sequence over a fixed grid on the others"}
    return _finish(rule, cases, small, odd)


def _plural(unit: str) -> str:
    return {"patient": "patients", "volume": "volumes", "video": "videos", "image": "images",
            "case": "cases"}.get(unit, f"{unit}s")


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
    """The stored threshold of ``model_file`` (``path`` or :func:`review_file`), or None when there is none; a
    certificate's case names of an older rule file are dropped as it is read.

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
        if isinstance(threshold.certificate, dict) and "cases" in threshold.certificate:
            # a rule written before the site-local record listed its case names here: they stay at the site, never
            # in what is read to travel (a bundle, a report, predict's scales.json)
            threshold.certificate = {k: v for k, v in threshold.certificate.items() if k != "cases"}
    except (OSError, ValueError, TypeError) as e:
        raise ReviewError(f"review threshold {path} cannot be read ({type(e).__name__}: {e})") from None
    if threshold.model_sha256 != file_sha256(model_file):
        raise ReviewError(f"review threshold {path} belongs to another model file (SHA-256 differs from {model_file}); "
                          f"choose it again for this model (feduq predict --calibrate ...)")
    return threshold
