"""What ``feduq predict`` says about its review rule: the line a calibration ends with, and the notes a
prediction run ends with when the rule's figures may not describe its cases.

Pure functions over :class:`feduq.review.rule.ReviewThreshold` records and ``predictions.csv`` rows (dicts).
"""

from __future__ import annotations

__all__ = ["drawn", "certified_for", "SCORE_WORDS", "UNFAMILIAR_NOTE_FRACTION", "COVERAGE_NOTE_P", "calibration_line", "rule_note",
           "unfamiliar_note", "coverage_note"]

#: how the calibration line names each case score (feduq.review.rule.CASE_SCORES)
SCORE_WORDS = {"u_mean": "image-mean", "u_foreground": "foreground-mean", "u_boundary": "boundary-band mean"}
#: more unfamiliar cases than this fraction: the calibration's coverage and accepted Dice do not describe the input
UNFAMILIAR_NOTE_FRACTION = 0.1
#: significance of the two-sample test that calls a run's accepted fraction unlike the calibration's
COVERAGE_NOTE_P = 0.01


def certified_for(c: dict | None, calibrated_on=()) -> str:
    """Whom a certificate's promise holds for: its site (``"Hospital-X"``) or, for a certificate the user asked to
    pool over several sites (``feduq calibrate --pooled-sites``), the mixture of their patients in the labelled
    proportions (``"the mixture of A (40 patients, 50 %) and B (40, 50 %), not each site alone"``); a certificate
    over several sites stored before FedUQ refused pooling (no ``mixture``) is worded as a mixture too, its shares
    unrecorded. FedUQ's own wording."""
    c = c or {}
    mixture = c.get("mixture")
    if mixture:
        total = sum(mixture.values()) or 1
        parts = [f"{site} ({n} {c.get('unit', 'unit')}s, {100 * n / total:.0f} %)" for site, n in mixture.items()]
        return f"the mixture of {' and '.join(parts)}, not each site alone"
    names = list(c.get("sites") or calibrated_on)
    if c and len(names) > 1:  # pooled before pooling was refused: a mixture whose shares were not recorded
        return f"the mixture of {' and '.join(names)} (pooled, shares not recorded), not each site alone"
    return ", ".join(c.get("sites") or calibrated_on) or "?"


def _sites(t) -> str:
    return certified_for(t.certificate, t.calibrated_on)


def drawn(c: dict) -> str:
    """How many labelled images and independent units a certificate counted: ``"74 images from 4 volumes"`` (a record
    of before units: ``"60 cases"``)."""
    if "n_units" not in c:
        return f"{c['k']} cases"
    unit = c.get("unit", "image")
    if unit == "image":
        return f"{c['k']} images, each its own patient"
    plural = {"patient": "patients", "volume": "volumes", "video": "videos"}.get(unit, f"{unit}s")
    if c.get("max_unit_images") == 1 and c["k"] == c["n_units"]:  # a volume task's volumes: one case per unit
        return f"{c['k']} {plural}"
    return f"{c['k']} images from {c['n_units']} {plural}"


def calibration_line(t, path) -> str:
    """The one line ``predict --calibrate`` prints: the rule, the empirical figures on its k cases and, for a
    certified rule, the certified bound beside them."""
    line = (f"review rule: flag a case when its {SCORE_WORDS[t.score]} {t.uncertainty} uncertainty > {t.threshold:.6g}"
            + (f", its predicted area < {100 * t.size_floor:.3g} % of the image" if t.size_floor is not None else "")
            + (f", or its input is unfamiliar (distance > {t.familiarity['threshold']:.3g})"
               if t.familiarity is not None else " (too few cases for the familiarity rule)")
            + f"; on {t.n_cases} labelled cases it accepts {100 * t.coverage:.1f} % with mean Dice "
            f"{100 * t.accepted_dice:.2f} % (target {100 * t.target_dice:.1f} %, all cases {100 * t.all_dice:.2f} %)")
    c = t.certificate
    if c is not None:
        line += (f"; certified: at {_sites(t)} the accepted cases' mean Dice is >= {100 * c['bound']:.1f} % with "
                 f"probability >= {100 * (1 - c['delta']):g} % over the {drawn(c)} drawn")
    else:
        line += "; not certified (these figures describe the calibration cases only)"
    return line + f"; stored in {path}"


def rule_note(threshold) -> str | None:
    """The line ``predict`` begins its notes with: for whom the rule's promise holds (a certified rule: the site it
    was certified for; an empirical one: none)."""
    if threshold is None:
        return None
    c = threshold.certificate
    if c is None:
        return (f"note: the review rule was chosen empirically on {threshold.n_cases} labelled cases of "
                f"{_sites(threshold)}, not certified: its accepted Dice ({100 * threshold.accepted_dice:.1f} %) is no "
                f"promise for these cases; certify it on labelled cases of their site (--calibrate --site-dir)")
    return (f"note: the review rule is certified for {_sites(threshold)} ({drawn(c)} labelled, delta "
            f"{c['delta']:g}): for cases of that site the accepted ones' mean Dice is >= {100 * c['bound']:.1f} % with "
            f"probability >= {100 * (1 - c['delta']):g} %; for cases of another site it promises nothing")


def unfamiliar_note(rows: list[dict], threshold) -> str | None:
    """The line ``predict`` ends with when more than :data:`UNFAMILIAR_NOTE_FRACTION` of the cases are unfamiliar to
    the calibration images (where the rule's familiarity threshold, the largest cross-fitted calibration distance,
    flags about 1 / n of in-distribution cases), else None."""
    if threshold is None or threshold.familiarity is None or not rows:
        return None
    odd = sum("unfamiliar input" in r.get("review_reason", "") for r in rows) / len(rows)
    if odd <= UNFAMILIAR_NOTE_FRACTION:
        return None
    return (f"note: {100 * odd:.0f} % of these cases are unfamiliar to the {threshold.n_cases} calibration images "
            f"(a case like them would be about {100 / threshold.familiarity['n_cases']:.0f} %): the calibration's "
            f"coverage ({100 * threshold.coverage:.1f} %) and accepted Dice ({100 * threshold.accepted_dice:.1f} %) do "
            f"not describe these cases; calibrate on labelled cases of this site, or review every case")


def coverage_note(rows: list[dict], threshold) -> str | None:
    """The line ``predict`` ends with when the fraction of cases it accepted is unlike the fraction the rule accepted
    of its calibration cases: two samples (Fisher's exact test, SciPy, two-sided, p < :data:`COVERAGE_NOTE_P`, at
    least 10 cases), as the calibration's coverage is itself an estimate from its k cases, not an exact rate (20
    calibration cases at 50 % are compatible with 67 % of 180). Cases accepted far more or far less often than the
    calibration's are not like its cases, so its accepted Dice is no promise for them (at a held-out prostate site, a
    FedAvg rule of 3.8 % calibration coverage accepted 89.5 % of the cases, with a mean Dice of 63.2 % against the
    73.5 % promised). None otherwise."""
    from scipy.stats import fisher_exact

    if threshold is None or len(rows) < 10 or not 0.0 <= threshold.coverage <= 1.0 or threshold.n_cases < 1:
        return None
    accepted = sum(r.get("review") == "no" for r in rows)
    k = int(threshold.n_cases)
    k_accepted = int(round(threshold.coverage * k))
    table = [[accepted, len(rows) - accepted], [k_accepted, k - k_accepted]]
    if fisher_exact(table).pvalue >= COVERAGE_NOTE_P:
        return None
    promise = ("its certificate" if threshold.certificate is not None else "its accepted Dice "
               f"({100 * threshold.accepted_dice:.1f} %)")
    return (f"note: {100 * accepted / len(rows):.1f} % of these {len(rows)} cases were accepted where the rule accepted "
            f"{100 * threshold.coverage:.1f} % of its {k} calibration cases (Fisher's exact test p < "
            f"{COVERAGE_NOTE_P:g}): these cases are not like the calibration's, so {promise} is no promise for them; "
            f"calibrate on labelled cases of this site")
