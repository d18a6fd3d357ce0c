"""The HTML of the site acceptance report (:mod:`feduq.report.site_report`): the verdict at the top, the model, the
site's labelled cases per structure, the worst cases per structure, the rule, what it does not promise, every case.

Everything here is text from numbers already computed: the labelled cases' rows (``site``, ``image``, ``dice``,
``hd95_px``, ``hd95_mm`` and per scored structure ``dice_<s>``, ``hd95_px_<s>``; fractions and stored pixels), the
rule's decision per case, the stored rule (:class:`feduq.review.rule.ReviewThreshold`) and, when
``--calibrate`` could not certify, its verdict (``ReviewError.verdict``).
"""

from __future__ import annotations

import html

import numpy as np

__all__ = ["structures", "certificate_units", "verdict_html", "limits_html", "per_case_html", "gallery_html",
           "rule_html", "table"]


def table(head: list[str], body: list[list]) -> str:
    """An HTML table of ``head`` and the rows ``body`` (every cell escaped)."""
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><tr>{cells}</tr>{rows}</table>"


def structures(rows: list[dict]) -> list[str]:
    """The scored structures of the rows (``dice_<s>`` keys, in the task's order: fundus ``["disc", "cup"]``, polyp
    ``["polyp"]``); empty when the rows carry none."""
    return [k[len("dice_"):] for k in (rows[0] if rows else {}) if k.startswith("dice_")]


def certificate_units(record: dict) -> tuple[int, str]:
    """``(n_units, unit)`` of a certificate or a verdict: the independent units it counted (``"patient"``,
    ``"volume"``, ``"video"``, ``"group"``, ``"image"``); a record of before units were counted: its ``k`` images."""
    n, unit = record.get("n_units"), record.get("unit")
    if n is None or not unit:
        return int(record["k"]), "image"
    return int(n), str(unit)


def _units(n: int, unit: str) -> str:
    return f"{n:,} {unit}" + ("" if n == 1 else "s")


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def _accepted(rows, decisions) -> tuple[float, float]:
    """(fraction accepted, their mean Dice; NaN when none) of the rule's ``decisions`` (reasons; empty: accepted)."""
    acc = np.array([not d for d in decisions], dtype=bool)
    dice = np.array([r["dice"] for r in rows], dtype=np.float64)
    return float(acc.mean()) if acc.size else float("nan"), float(dice[acc].mean()) if acc.any() else float("nan")


def verdict_html(rule, rows: list[dict], decisions: list, failure: dict | None = None,
                 optimistic: list[str] = ()) -> str:
    """The verdict paragraph at the top of the page: what is certified (the target, δ, the coverage on these cases,
    for which site's patients), or why nothing is and how many more independent units would be needed.

    Args:
        rule: the stored :class:`feduq.review.rule.ReviewThreshold`, or None.
        rows / decisions: the report's labelled cases and the rule's reasons per case (None per case without a rule).
        failure: ``ReviewError.verdict`` of a ``--calibrate`` that could not certify (``target``, ``delta``, ``k``,
            ``n_units``, ``unit``, ``units_needed`` (None: no practical number), ``best_target``), or None.
        optimistic: ``"<site>/<case>"`` of the cases the model trained on (``--allow-training-cases``).
    """
    here = sorted({r["site"] for r in rows})
    where = html.escape(", ".join(here))
    n = len(rows)
    if failure is not None:
        units, unit = certificate_units(failure)
        k = int(failure["k"])
        drawn = f"{k:,} labelled images" + ("" if unit == "image" else f" ({_units(units, unit)})")
        best = float(failure.get("best_target") or 0)
        can = f"the highest target they certify is about {_pct(best)}" if best > 0 else "they certify no target"
        needed = failure.get("units_needed")
        more = (f"About {_units(max(int(needed) - units, 1), unit).replace(' ', ' more ', 1)} like these would be "
                f"needed (about {int(needed):,} in all)." if needed is not None else
                f"No practical number of {unit}s like these would certify it: their accepted cases do not reach the "
                f"target, or only barely.")
        text = (f"<b>Not certified.</b> These {drawn} of {where} cannot certify that the cases a rule accepts have a "
                f"mean Dice of at least {_pct(failure['target'])} with probability at least "
                f"{100 * (1 - failure['delta']):g} %: {can}. {more} No rule was stored by this calibration: until one "
                f"is certified, every case of {where} must be reviewed.")
        if rule is not None:
            text += " A rule stored earlier for this model is described under <a href='#rule'>The review rule</a>."
    elif rule is None:
        text = (f"<b>Nothing is certified</b>: no review rule is stored for this model, so every case of {where} must "
                f"be reviewed. Certify one on the site's own labelled cases with <code>feduq predict "
                f"--calibrate --site-dir SITE --target-dice T</code>.")
    elif rule.certificate is None:
        text = (f"<b>Not certified</b>: the stored rule was chosen empirically (<code>--uncertified</code>) on "
                f"{rule.n_cases} cases of {html.escape(', '.join(rule.calibrated_on) or 'unrecorded sites')}; it "
                f"promises nothing for new patients of {where}. Run <code>--calibrate</code> without "
                f"<code>--uncertified</code> on this site's labelled cases to certify a target, or to learn how many "
                f"more cases one needs.")
    else:
        c = rule.certificate
        units, unit = certificate_units(c)
        named = sorted(c.get("sites") or [])
        drawn = _units(units, unit) + ("" if unit == "image" else f" ({int(c['k']):,} labelled images)")
        from ..review.notes import certified_for

        whom = certified_for(c) if named else "the calibration site"
        text = (f"<b>Certified</b> for new patients of {html.escape(whom)}: with "
                f"probability at least {100 * (1 - c['delta']):g} % (δ = {c['delta']:g}) over the {drawn} it was "
                f"certified on, the cases the rule accepts there have a mean Dice of at least {_pct(c['bound'])} "
                f"(target {_pct(rule.target_dice)}).")
        if named != here:
            text += (f" <b>These cases are of {where}, not of the site it was certified for: it promises nothing for "
                     f"them.</b>")
    if rule is not None and n:
        cov, dice = _accepted(rows, decisions)
        text += (f" On these {n} cases the rule accepts {_pct(cov)} (its coverage here)"
                 + (f", with mean Dice {_pct(dice)}" if cov > 0 else "") + "; the others are flagged for review.")
    empty = sum(1 for r in rows if float(r.get("mask_fraction", 1.0)) == 0.0)
    if empty:
        text += (f" <b>{'All' if empty == n else f'{empty} of these'} {n} reference masks {'are' if empty > 1 else 'is'}"
                 f" empty</b> (nothing labelled): there Dice is 0 and HD95 the image diagonal by convention, whatever "
                 f"the model predicts"
                 + (", so these figures say nothing of the model; give labelled cases that hold the structure."
                    if empty == n else "."))
    if optimistic:
        text += (f" <b>Optimistic:</b> {len(optimistic)} of these {n} cases are training cases of the model's job "
                 f"(given with <code>--allow-training-cases</code>, marked in <a href='#per-case'>Every case</a>): "
                 f"the model has seen them, so every figure on them flatters it.")
    return f"<p class='verdict' id='verdict'>{text}</p>"


def rule_html(rule, rows: list[dict], decisions: list, words: dict) -> str:
    """The review rule's section: what it flags and what it gave on its calibration cases."""
    if rule is None:
        return ("<p class='note'>No review rule is stored for this model: every case must be reviewed. Choose one "
                "with <code>feduq predict --calibrate</code>.</p>")
    text = (f"<p>Flag a case when its {words[rule.score]} {html.escape(rule.uncertainty)} uncertainty is above "
            f"{rule.threshold:.6g}"
            + (f", its predicted area is below {100 * rule.size_floor:.3g} % of the image" if rule.size_floor
               is not None else "")
            + (", or its input is unfamiliar" if rule.familiarity is not None else "")
            + f". On its {rule.n_cases} calibration cases ({html.escape(', '.join(rule.calibrated_on))}) it accepted "
            f"{_pct(rule.coverage)} with mean Dice {_pct(rule.accepted_dice)} (target {_pct(rule.target_dice)}).</p>")
    c = rule.certificate
    if c is not None:
        units, unit = certificate_units(c)
        text += (f"<p>Its certificate (Learn then Test; Waudby-Smith–Ramdas p-values): k = {int(c['k'])} labelled "
                 f"images, {_units(units, unit)} counted as independent, δ = {c['delta']:g}, certified mean Dice of "
                 f"the accepted cases {_pct(c['bound'])}, sites {html.escape(', '.join(c.get('sites') or []))}.</p>")
    else:
        text += "<p><b>Not certified</b>: the figures describe the calibration cases only and promise nothing here.</p>"
    cov, dice = _accepted(rows, decisions)
    text += (f"<p>On these {len(rows)} cases it accepts {_pct(cov)}" + (f", with mean Dice {_pct(dice)}." if cov > 0
                                                                       else ": none.") + "</p>")
    return text


def limits_html(rule, n_cases: int, failure: dict | None = None) -> str:
    """What the report does not promise; the unit the certificate (or the failed calibration) counted, where known."""
    certified = rule is not None and rule.certificate is not None
    record = rule.certificate if certified else failure
    counted = certificate_units(record) if record is not None else None
    who = "certificate" if certified else "calibration"
    if counted is not None and counted[1] != "image":
        units, unit = counted
        sample = (f"<li>The {who} counted {_units(units, unit)} as its independent units (its "
                  f"{int(record['k']):,} labelled images grouped by {unit}, so the images of one {unit} count once): "
                  f"it assumes these {unit}s are a random sample of the site's {unit}s; {unit}s chosen for being easy "
                  f"or hard void it.</li>")
    else:
        sample = ("<li>The promise assumes the labelled cases are a random sample of independent cases of the site"
                  + (f" (the {who} counted each of its {counted[0]:,} images as one unit)" if counted else "")
                  + ": frames of one video or slices of one patient are not independent, and cases chosen for being "
                    "easy or hard void it.</li>")
    return ("<ul><li>It says nothing of cases unlike these: another scanner, protocol or population, a new kind "
            "of finding; <code>predict</code> notes unfamiliar inputs and an accepted fraction unlike the "
            "calibration's, but cannot see every shift.</li>" + sample +
            f"<li>{n_cases} cases are few: the empirical figures above move by several points from one sample to "
            "another; only the certified bound, where there is one, accounts for it.</li>"
            "<li>An accepted case is not a correct one: the promise is about the mean Dice of the accepted cases, "
            "not about any one of them.</li></ul>")


def _num(x: float, scale: float = 1.0) -> str:
    return "–" if not np.isfinite(x) else f"{scale * x:.1f}"


def per_case_html(rows: list[dict], decisions: list, optimistic: list[str] = ()) -> str:
    """Every case, worst mean Dice first: its Dice and HD95 (stored pixels) per structure where there are several,
    HD95 in mm where known, the rule's decision, and whether the model trained on it."""
    names = structures(rows)
    several = names if len(names) > 1 else []
    trained = set(optimistic)
    head = (["site", "case", "Dice (%)", *[f"Dice {s} (%)" for s in several], "HD95 (px)",
             *[f"HD95 {s} (px)" for s in several], "HD95 (mm)", "review"] + (["training case"] if trained else []))
    body = [[r["site"], r["image"], _num(r["dice"], 100), *[_num(r[f"dice_{s}"], 100) for s in several],
             _num(r["hd95_px"]), *[_num(r.get(f"hd95_px_{s}", float("nan"))) for s in several], _num(r["hd95_mm"]),
             "no rule" if d is None else ("flag: " + "; ".join(d) if d else "accept")]
            + (["yes (optimistic)" if f"{r['site']}/{r['image']}" in trained else ""] if trained else [])
            for r, d in sorted(zip(rows, decisions), key=lambda x: x[0]["dice"])]
    return table(head, body)


def gallery_html(galleries: list[tuple[str | None, list[tuple[str, dict]]]], primary: str) -> str:
    """The worst cases: one gallery per structure (``(structure, [(picture file, row)])``; structure None: the
    mean over the structures of a one-structure task)."""
    out = (f"<p>Reference outline green, prediction red; right: the {html.escape(primary)} uncertainty. "
           "<a href='cases.csv'>cases.csv</a> holds every case's figures.</p>")
    for j, (name, shown) in enumerate(galleries):
        if name is not None:
            out += f"<h3 id='worst-{j}'>The worst cases by {html.escape(name)} Dice ({html.escape(name)} outlined)</h3>"
        key = "" if name is None else f"_{name}"
        out += "<div class='gallery'>" + "".join(
            f'<figure><img src="{p}" alt="{html.escape(r["image"])}"><figcaption>{html.escape(r["site"])} / '
            f'{html.escape(r["image"])}: {html.escape(name + " " if name else "")}Dice {_num(r["dice" + key], 100)} %, '
            f'HD95 {_num(r.get("hd95_px" + key, float("nan")))} px</figcaption></figure>' for p, r in shown) + "</div>"
    return out
