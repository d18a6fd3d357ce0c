"""``feduq predict --calibrate``: the review rule chosen, or certified with the patient as the unit, on a
site's labelled cases, and stored beside the model (:mod:`feduq.review.rule`, :mod:`feduq.review.certificate`).
"""

from __future__ import annotations

from pathlib import Path

from .files import PredictError

__all__ = ["calibrate"]


def calibrate(loaded, *, target_dice: float, site_dirs=(), sites=(), data_root=None, split: str = "val",
              review_path=None, max_items: int | None = None, delta: float | None = 0.1, units: str | None = None,
              unit_pattern: str | None = None, max_unit_images: int | None = None, allow_training_cases: bool = False,
              pooled_sites: bool = False):
    """Choose and store the review rule of ``loaded``'s model on labelled sites (:mod:`feduq.review.rule`).

    Each labelled image is scored as :func:`feduq.site.evaluation.evaluate_site` scores it (``case_level``: the
    primary map's case scores, the predicted and labelled area fractions, the bottleneck features), so the rule is
    on the scale :func:`predict` computes. With ``delta`` (default 0.1)
    :func:`feduq.review.rule.certify_rule` certifies the threshold with the patient as the unit
    (:func:`feduq.review.calibration.case_units` tells the images' units apart: ``units="images"``,
    ``unit_pattern`` or the task's grouping): the accepted images' mean Dice at these units' site is at least
    ``target_dice`` with probability at least 1 - delta. The stored certificate carries counts (k images, n units),
    delta, the bound and one salted SHA-256 digest of the labelled set, no case name; the per-case list and the salt
    stay in a site-local file beside each site's folder (:func:`feduq.review.calibration.write_site_record`).
    ``delta=None``: :func:`feduq.review.rule.choose_rule`'s empirical rule. Labelled cases the model's job
    trained on are refused (:func:`feduq.review.training_cases.check_training_cases`) unless
    ``allow_training_cases``; the certificate then records how many (``training_cases``: its bound is optimistic).
    Both that check and, for a certified rule, the units' grouping run on the listed cases before any is scored.

    A certificate holds for the patients of the site its units were drawn from; units of several sites (``--site
    A,B``, repeated ``--site-dir``) drawn together promise only their mixture, in the labelled proportions, which can
    fail each site alone (site A at Dice 0.80 and B at 0.60: the pooled rule's promise fails for B in about 40 % of
    draws, ``tests/unit/review/test_certificate_sites.py``). So several sites are refused for a certified rule (certify at each
    site), unless ``pooled_sites``: then the certificate is stored and worded as the mixture's, with each site's
    number of units (``certificate["mixture"]``).

    Returns:
        ``(feduq.review.rule.ReviewThreshold, path of the stored file)``.

    Raises:
        ReviewError: as ``certify_rule`` / ``choose_rule``, or units that cannot be told apart (nothing is stored).
        feduq.review.training_cases.TrainingCaseError: a training case, not allowed (nothing is stored).
    """
    from ..review.calibration import UnitError, case_units, labelled_cases, one_case_a_unit, write_site_record
    from ..review.rule import ReviewError, certify_rule, choose_rule, save_threshold
    from ..review.training_cases import check_training_cases

    if not (site_dirs or sites):
        raise PredictError("--calibrate needs labelled images: --site-dir (a folder with images/, masks/, labels.json) "
                           "or --site with --split")
    if delta is not None and not (0 < target_dice < 1 and 0 < delta < 1):  # before any case is scored
        raise PredictError(f"--target-dice {target_dice} and --delta {delta}: a certified rule needs both in (0, 1) "
                           f"(0.8 and 0.1: a mean Dice of 80 % promised with probability 90 %)")
    if units is not None and unit_pattern:
        raise PredictError("--units images and --unit-pattern say two things: each image its own patient, or the "
                           "pattern's group; give one")
    if unit_pattern:  # a pattern that cannot compile or names no patient: before minutes of scoring
        import re

        try:
            groups = re.compile(unit_pattern).groups
        except re.error as e:
            raise PredictError(f"--unit-pattern {unit_pattern!r}: not a regular expression ({e})") from None
        if groups < 1:
            raise PredictError(f"--unit-pattern {unit_pattern!r}: needs a group, (...), whose match names the patient")
    if max_unit_images is not None and max_unit_images < 1:
        raise PredictError(f"--max-unit-images {max_unit_images}: expected an integer >= 1")
    named = [*sites, *site_dirs]
    if delta is not None and len(named) > 1 and not pooled_sites:  # before any case is scored
        raise PredictError(f"a certificate holds for one site's patients; {', '.join(map(str, named))} are "
                           f"{len(named)} sites, whose pooled patients would certify only their mixture, not each "
                           "site: certify at each site (one --site or --site-dir), or give --pooled-sites to certify "
                           "the mixture and say so")
    if pooled_sites and (delta is None or len(named) < 2):
        raise PredictError("--pooled-sites certifies the mixture of several sites' patients: give two or more sites "
                           "(--site A,B or --site-dir twice), without --uncertified")
    primary = loaded.site.primary_uncertainty
    folders: dict = {}

    def before_scoring(listed, center_dirs):  # which cases they are is known before minutes of scoring
        check_training_cases(loaded, listed, center_dirs, data_root=data_root, allow=allow_training_cases)
        if delta is not None:  # a certificate counts patients: a site without a grouping is refused now
            try:
                case_units(listed, loaded.task, center_dirs, units=units, unit_pattern=unit_pattern)
            except UnitError as e:
                raise ReviewError(str(e)) from None

    cases, features, where, rows = labelled_cases(loaded, site_dirs=site_dirs, sites=sites, data_root=data_root,
                                                  split=split, max_items=max_items, center_dirs=folders,
                                                  before_scoring=before_scoring)
    trained = check_training_cases(loaded, rows, folders, data_root=data_root, allow=allow_training_cases).cases
    if delta is None:
        threshold = choose_rule(cases, target_dice, features=features, uncertainty=primary)
    else:
        try:
            unit_of, word, how = case_units(rows, loaded.task, folders, units=units, unit_pattern=unit_pattern)
        except UnitError as e:
            raise ReviewError(str(e)) from None
        if max_unit_images is None:  # M from the units' mode, fixed before the data: one image a unit by construction
            max_unit_images = 1 if one_case_a_unit(how) else None  # None: certify's MAX_UNIT_IMAGES
        threshold = certify_rule(cases, target_dice, delta, features=features, uncertainty=primary, units=unit_of,
                                 unit=word, max_unit_images=max_unit_images)
        threshold.certificate["sites"] = sorted({r["site"] for r in rows})
        if pooled_sites:  # the mixture's certificate: each site's share of the units, said wherever it is named
            per_site: dict = {}
            for r, u in zip(rows, unit_of):
                per_site.setdefault(r["site"], set()).add(u)
            threshold.certificate["mixture"] = {s: len(u) for s, u in sorted(per_site.items())}
        threshold.certificate["units_from"] = how
        if trained:
            threshold.certificate["training_cases"] = len(trained)  # allowed: the bound is optimistic
        try:
            threshold.certificate.update(write_site_record(rows, unit_of, folders, threshold.certificate))
        except OSError as e:  # a read-only data folder, or a user's file of that name: nothing stored
            fix = ("move that file away" if isinstance(e, FileExistsError) else "make that folder writable")
            raise ReviewError(f"cannot write the calibration record beside the site's folder ({e.strerror or e}: "
                              f"{e.filename}): it keeps the certificate's case list at the site; {fix}") from None
    # where the cases came from, without the machine's paths (the rule travels: a bundle, a report)
    threshold.calibrated_on = [f"{Path(w.rsplit(':', 1)[0]).name}:{w.rsplit(':', 1)[-1]}" for w in where]
    return threshold, save_threshold(threshold, loaded.model_file, review_path)
