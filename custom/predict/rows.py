"""The rows of ``predict``'s ``predictions.csv``: a case's areas per structure (classes and nnU-Net's nested
regions, each under its own name), its uncertainty and the review rule's decision."""

from __future__ import annotations

__all__ = ["structures", "label_meanings", "case_row"]


def structures(class_names, regions=None) -> dict[str, tuple[int, ...]]:
    """Each reported structure's class indices: every foreground class under its name, then each region of
    ``regions`` (name -> class indices, e.g. fundus' disc = rim and cup) as the union of its classes under the region's
    name (a region wins over a class of the same name: a declared region task names each class after the region that
    paints it, so its ``optic_disc`` is the rim and the cup, not the rim alone)."""
    out = {name: (c,) for c, name in enumerate(class_names) if c > 0}
    out.update({name: tuple(int(c) for c in classes) for name, classes in (regions or {}).items()})
    return out


def class_meaning(c: int, class_names, parts: dict) -> str:
    """What class index ``c`` of a label map means, in the structures' names: the structures it belongs to, and for a
    class inside a nested region the structures it is outside of (``"optic_disc (not optic_cup)"``, ``"optic_disc +
    optic_cup"``), so that no value reads as a whole region that other values belong to as well.

    Args:
        parts: :func:`structures` (name -> class indices).
    """
    if c == 0:
        return class_names[0]
    inside = [name for name, classes in parts.items() if c in classes]
    if not any(len(classes) > 1 for classes in parts.values()):  # no nested region: a class is its structure
        return " + ".join(inside) or class_names[c]
    outside = [name for name, classes in parts.items() if c not in classes
               and any(set(classes) < set(parts[i]) for i in inside)]  # the nested regions it is not in
    return " + ".join(inside or [class_names[c]]) + (f" (not {', '.join(outside)})" if outside else "")


def label_meanings(class_names, parts: dict) -> dict[str, str]:
    """``scales.json``'s ``label``: what each class index of ``label.png`` means (:func:`class_meaning`; nnU-Net's
    painting under ``regions_class_order``: ``"1": "optic_disc (not optic_cup)", "2": "optic_disc + optic_cup"``)."""
    return {str(c): class_meaning(c, class_names, parts) for c in range(len(class_names))}


def case_row(case, stats: dict, shape, primary: str, parts: dict, unit_area: float | None, volume: bool,
             threshold, features=None) -> dict:
    """One ``predictions.csv`` row from a case's numbers (:func:`feduq.scores.case_scores.plane_stats` and the case
    scores), with the review rule's decision and its reasons (``features``: the case's pooled bottleneck features).

    Args:
        parts: :func:`structures`: with more than one, each one's area (``px_<name>``; ``mm2_<name>`` or
            ``ml_<name>`` with ``unit_area``, mm² per pixel or mm³ per voxel) is the count of its classes' pixels, a
            nested region (nnU-Net's) counting every class inside it.
    """
    from ..review.rule import Familiarity

    row = {"case": case.name, "input": str(case.path), "kind": case.kind, "shape": " x ".join(map(str, shape)),
           "foreground_px": int(stats["foreground_px"])}
    if unit_area is not None:
        key = "foreground_ml" if volume else "foreground_mm2"
        row[key] = float(stats["foreground_px"]) * unit_area / (1000.0 if volume else 1.0)
    if len(parts) > 1:
        for name, classes in parts.items():
            row[f"px_{name}"] = int(sum(stats[f"px_{c}"] for c in classes))
            if unit_area is not None:
                row[f"{'ml' if volume else 'mm2'}_{name}"] = row[f"px_{name}"] * unit_area / (1000.0 if volume else 1.0)
    row.update({"uncertainty": primary, "case_uncertainty": stats["case_uncertainty"],
                "uncertainty_inside": stats["uncertainty_inside"], "uncertainty_outside": stats["uncertainty_outside"]})
    row.update({k: v for k, v in stats.items() if k.startswith("mean_")})
    row.update({k: stats.get(k, float("nan")) for k in ("u_foreground", "u_boundary", "area_fraction")})
    familiar = threshold is not None and threshold.familiarity is not None and features is not None
    row["familiarity_distance"] = (float(Familiarity(**threshold.familiarity).distance(features[None])[0]) if familiar
                                   else float("nan"))
    reasons = [] if threshold is None else threshold.reasons({"u_mean": stats["case_uncertainty"], **stats}, features)
    row["review"] = "" if threshold is None else ("yes" if reasons else "no")
    row["review_reason"] = "; ".join(reasons)
    return row
