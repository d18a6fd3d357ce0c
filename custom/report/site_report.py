"""The site acceptance report: one self-contained HTML page a clinical team reads, and signs, before using a
federation's model.

``feduq predict --job J --report --site-dir SITE --out R`` (with ``--calibrate``: the rule is chosen, or
certified, on the same cases first) scores every labelled case of the site as ``--calibrate`` does
(:func:`feduq.review.calibration.labelled_cases`) and writes into ``R`` (all at once, :func:`feduq.outputs.
staged_folder`): ``report.html`` and the PNG pictures it shows, ``cases.csv`` (one row per labelled case, Dice and
HD95 per scored structure).

The page holds (:mod:`feduq.report.page`), top to bottom: the verdict in one paragraph (what is certified:
the target, δ, the coverage on these cases, for which site's patients; or why nothing is and how many more
independent units would be needed); what the model is (method, network, rounds, the training sites, the model
file's SHA-256, the FedUQ commit that wrote the report) and the per-site test Dice of the run only where the run's
test scored that same model file (:func:`run_test_table`); the site's labelled cases (Dice and HD95 per case and
structure and their distribution, the reliability diagram of the primary uncertainty, the risk-coverage curve with
the rule's operating point and, for a certified rule, its certified bound); the worst cases, one gallery per scored
structure (the image with that structure's reference outline in green and the prediction's in red, beside the
uncertainty map); the rule and what it does not promise; every case.

Labelled cases the model's job trained on are refused (:mod:`feduq.review.training_cases`); with
``allow_training_cases`` they are used and the page names them as optimistic.
"""

from __future__ import annotations

import csv
import html
import re
from pathlib import Path

import numpy as np

from ..common.provenance import code_version

__all__ = ["REPORT", "REPORT_FILES", "GALLERY", "site_report", "run_test_table"]

REPORT = "report.html"
#: what the report writes into its folder (a user's file under one of these names is refused, --force or not)
REPORT_FILES = (REPORT, "*.png", "cases.csv")
#: worst cases shown in a gallery (one gallery per scored structure)
GALLERY = 6
TOOL = "predict"
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #bbb;padding:.2em .6em;text-align:left}"
         "th{background:#eee}img{max-width:100%}.gallery figure{display:inline-block;width:48%;margin:.5%}"
         ".note{background:#fff6e0;border-left:4px solid #e0a000;padding:.5em 1em}"
         ".verdict{font-size:1.1em;background:#eef4ff;border-left:4px solid #3060c0;padding:.6em 1em}")


def _training(config_file: Path) -> list[tuple[str, str, str]]:
    """(site, test images, test Dice %) of the run that trained the model: its ``per_client_table.csv`` where FLARE's
    run folder keeps it (``<run>/results/`` beside ``app_server/``), the Avg and Std rows left out; empty for a job
    folder or a model copied elsewhere (nothing above the run folder is searched)."""
    for folder in list(Path(config_file).parents)[1:3]:  # app_*/config/ -> app_*/ -> the run folder
        table = folder / "results" / "per_client_table.csv"
        if table.is_file():
            with open(table, newline="") as f:
                return [(r["client"], r.get("num_images", ""), f"{100 * float(r['dice']):.1f}" if r.get("dice") else "")
                        for r in csv.DictReader(f) if r.get("client") not in ("Avg", "Std")]
    return []


def run_test_table(config_file, model_file, model_sha: str) -> dict:
    """The run's per-site test table (:func:`_training`) and the model file its test scored: the name the job's
    final test wrote under the table's title (``per_client_table.md``: "Model evaluated: `best_FL_global_model.pt`.",
    :class:`feduq.flare.workflows.FinalTestEvaluation`; FedA3I's jobs test ``FL_global_model.pt``, the last round).

    Returns:
        ``{"rows": [(site, test images, test Dice %)], "tested": the scored file's name or None (not recorded),
        "tested_file": its path in the run folder (``app_server*/<name>``) or None, "same": True only when that file
        is ``model_file`` (the same path, or the same SHA-256 ``model_sha``)}``.
    """
    rows = _training(Path(config_file))
    out = {"rows": rows, "tested": None, "tested_file": None, "same": False}
    for folder in list(Path(config_file).parents)[1:3]:
        note = folder / "results" / "per_client_table.md"
        if rows and note.is_file():
            found = re.search(r"Model evaluated: `([^`/\\]+)`", note.read_text(errors="replace"))
            if found:
                out["tested"] = found.group(1)
                files = sorted(folder.glob(f"app_server*/{found.group(1)}"))
                out["tested_file"] = files[0] if files else None
            break
    tested, model = out["tested_file"], Path(model_file)
    if tested is not None:
        from ..review.rule import file_sha256

        out["same"] = tested.resolve() == model.resolve() or file_sha256(tested) == model_sha
    return out


def _outline(region: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    return region & ~ndimage.binary_erosion(region, iterations=max(2, min(region.shape) // 120))


def _image_and_mask(files: list[Path]) -> tuple[Path | None, Path | None]:
    """A case's image (first channel) and mask among its files (:func:`feduq.review.calibration.case_files`):
    FedUQ's ``images/``/``masks/`` or nnU-Net's ``imagesTr``/``imagesTs``/``labelsTr``; None where not found."""
    image = next((f for f in files if f.parent.name.startswith("images")), None)
    mask = next((f for f in files if f.parent.name in ("masks", "labelsTr")), None)
    return image, mask


def _mask_classes(center_dir: Path, spec, site: str):
    """Mask value -> class index of a site folder (its ``labels.json``, as the site reads its masks), or None."""
    from ..data import DataError
    from ..tasks.spec import label_classes, read_label_values

    try:
        values = read_label_values(center_dir)
        return dict(zip(values, label_classes(spec, values, site)))
    except DataError:
        return None


def _structure_classes(spec, names: list[str]) -> dict[str, tuple[int, ...]]:
    """Structure -> the class indices whose union it is (a region task's regions, else one class each)."""
    if spec.eval_regions:
        return {n: tuple(spec.eval_regions[n]) for n in names if n in spec.eval_regions}
    return {n: (spec.class_names.index(n),) for n in names if n in spec.class_names}


def _case_picture(predictor, image_file: Path, mask_file: Path | None, lut: dict | None):
    """One prediction of a case for its pictures: ``(picture [H, 2W + 4, 3] uint8: the image beside the primary
    uncertainty map, predicted class map [H, W], reference class map [H, W] or None)``."""
    from PIL import Image

    from ..predict.files import map_scale, overlay, read_plane

    plane, picture = read_plane(image_file, predictor.spec.in_channels)
    res = predictor.planes([plane])[0]
    label = res["label"].T  # [W, H] -> [H, W]
    unc = res["maps"][predictor.primary].T
    pic = overlay(np.asarray(picture.convert("RGB")), np.zeros_like(label), unc,
                  map_scale(predictor.primary, predictor.num_classes))
    h, w = label.shape
    ref = None
    if mask_file is not None:
        mask = np.asarray(Image.open(mask_file).convert("L").resize((w, h), Image.NEAREST)).astype(np.int64)
        if lut:
            ref = np.zeros_like(mask)
            for value, c in lut.items():
                ref[mask == value] = c
        else:  # no labels.json (an nnU-Net site): its label ids are the classes
            ref = mask if mask.max() < predictor.num_classes else (mask > 0).astype(np.int64)
    return np.asarray(pic).copy(), label, ref


def _volume_picture(predictor, files: list[Path], center_dir: Path, site: str):
    """:func:`_case_picture` of a volume case of a declared task (its channel files and label in nnU-Net's layout):
    the axial slice with the largest reference area (the middle one when the reference is empty), read and
    normalised as the site reads it, through the model as predict runs it; None when the case cannot be read."""
    from ..data import DataError
    from ..sites.nnunet_raw import IMAGES, LABELS, read_case, read_site_labels
    from ..predict.files import map_scale, overlay

    channels = sorted(f for f in files if f.parent.name == IMAGES)
    mask = next((f for f in files if f.parent.name == LABELS), None)
    if not channels:
        return None
    case = channels[0].name.split(".")[0][: -len("_0000")]
    try:
        data = read_case(case, {"channels": channels, "label": mask}, predictor.spec,
                         read_site_labels(center_dir, predictor.spec, site), site)
    except DataError:
        return None
    image, ref3d = data["image"], data["label"]
    area = (ref3d[0] > 0).sum(axis=(0, 1)) if ref3d is not None else np.zeros(image.shape[-1])
    z = int(np.argmax(area)) if area.any() else image.shape[-1] // 2
    res = predictor.planes([np.ascontiguousarray(image[..., z])])[0]
    label, unc = res["label"].T, res["maps"][predictor.primary].T  # [W, H] -> [H, W]
    pic = overlay(image[0, :, :, z].T, np.zeros_like(label), unc, map_scale(predictor.primary, predictor.num_classes))
    ref = None if ref3d is None else ref3d[0, :, :, z].T.astype(np.int64)
    return np.asarray(pic).copy(), label, ref


def _volume_picture_3d(loaded, files: list[Path], center_dir: Path, site: str):
    """:func:`_case_picture` of a volume case of a 3D job: the case predicted whole by the 3D network
    (:func:`feduq.site.evaluation_3d.volume_case_slice`), cut at its largest reference slice; None when the case
    cannot be read."""
    from ..data import DataError, get_task
    from ..sites.nnunet_raw import IMAGES, LABELS, read_site_labels
    from ..site.evaluation_3d import volume_case_slice
    from ..predict.files import map_scale, overlay

    channels = sorted(f for f in files if f.parent.name == IMAGES)
    mask = next((f for f in files if f.parent.name == LABELS), None)
    if not channels:
        return None
    spec = get_task(loaded.task)
    try:
        labels = read_site_labels(center_dir, spec, site)
        cut = volume_case_slice(loaded, {"channels": channels, "label": mask}, labels.value_to_class)
    except DataError:
        return None
    pic = overlay(cut["image"], np.zeros_like(cut["label"]), cut["uncertainty"],
                  map_scale(loaded.site.primary_uncertainty, len(spec.class_names)))
    return np.asarray(pic).copy(), cut["label"], cut["reference"]


def _draw(picture, label, ref, classes: tuple[int, ...], path: Path) -> None:
    """Save ``picture`` with the structure ``classes`` outlined: the reference green, the prediction red."""
    from PIL import Image

    arr = picture.copy()
    h, w = label.shape
    if ref is not None:
        arr[:h, :w][_outline(np.isin(ref, classes))] = (0, 200, 0)
    arr[:h, :w][_outline(np.isin(label, classes))] = (230, 30, 30)
    Image.fromarray(arr).save(path)


def _galleries(loaded, stage: Path, rows: list[dict], folders: dict) -> list:
    """The worst cases' pictures, one gallery per scored structure (the worst by that structure's Dice; one
    structure: by the case's Dice), written into ``stage``; returns ``[(structure or None, [(file, row)])]``."""
    from ..data import get_task
    from ..review.calibration import case_files
    from ..predict.files import IMAGE_FILE_SUFFIXES
    from ..predict.planes import Predictor
    from .page import structures

    spec = get_task(loaded.task)
    names = structures(rows)
    classes = _structure_classes(spec, names)
    if len(names) > 1 and len(classes) == len(names):
        plan = [(n, f"dice_{n}", classes[n]) for n in names]
    else:  # one structure (or structures this task cannot outline one by one): every foreground class
        plan = [(None, "dice", tuple(range(1, len(spec.class_names))))]
    worst = {key: sorted(range(len(rows)), key=lambda i: (not np.isfinite(rows[i][key]), rows[i][key]))[:GALLERY]
             for _, key, _ in plan}
    shown = sorted({i for w in worst.values() for i in w})
    files = {(site, stem): found for site in {rows[i]["site"] for i in shown}  # one walk of each site's folder
             for stem, found in case_files(folders[site], [rows[i]["image"] for i in shown
                                                           if rows[i]["site"] == site]).items()}
    luts = {site: _mask_classes(folders[site], spec, site) for site in {rows[i]["site"] for i in shown}}
    volume_job = getattr(loaded.site, "configuration", "2d") != "2d"  # nnU-Net's 3D network: whole volumes
    predictor = None if volume_job else Predictor(loaded, batch_size=1)
    made, out = {}, []
    for j, (name, key, cls) in enumerate(plan):
        gallery = []
        for rank, i in enumerate(worst[key]):
            site = rows[i]["site"]
            image, mask = _image_and_mask(files[site, rows[i]["image"]])
            if image is None:
                continue
            if i not in made and volume_job:
                made[i] = _volume_picture_3d(loaded, files[site, rows[i]["image"]], folders[site], site)
            if i not in made:
                made[i] = (_case_picture(predictor, image, mask, luts[site])
                           if image.suffix.lower() in IMAGE_FILE_SUFFIXES else  # a volume: its largest slice
                           _volume_picture(predictor, files[site, rows[i]["image"]], folders[site], site)
                           if spec.kind == "3d" else None)
            if made[i] is None:
                continue
            picture = f"worst_{rank}.png" if name is None else f"worst_{j}_{rank}.png"
            _draw(*made[i], cls, stage / picture)
            gallery.append((picture, rows[i]))
        out.append((name, gallery))
    return out


def _plots(out: Path, rows: list[dict], cases: dict, rule, quality: dict, primary: str, decisions: list) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..scores.uncertainty_quality import plot_reliability, risk_coverage
    from .page import structures

    names = []
    dice = np.array([r["dice"] for r in rows])
    several = structures(rows) if len(structures(rows)) > 1 else []
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    keys = [("", "mean" if several else None), *[(f"_{s}", s) for s in several]]
    hds = {key: np.array([r.get("hd95_px" + key, np.nan) for r in rows], dtype=np.float64) for key, _ in keys}
    finite = np.concatenate([h[np.isfinite(h)] for h in hds.values()])
    edges = np.histogram_bin_edges(finite, bins=20) if finite.size else 20  # one set of bins for every structure
    for key, label in keys:
        d = np.array([r["dice" + key] for r in rows], dtype=np.float64)
        kind = dict(histtype="step", lw=1.5, label=label) if several else {}
        a.hist(100 * d[np.isfinite(d)], bins=20, range=(0, 100), color=None if several else "tab:blue", **kind)
        b.hist(hds[key][np.isfinite(hds[key])], bins=edges, color=None if several else "tab:gray", **kind)
    a.set(xlabel="Dice (%)", ylabel="cases", title=f"Dice of {dice.size} labelled cases")
    b.set(xlabel="HD95 (stored pixels)", ylabel="cases", title="HD95")
    if several:
        a.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "distribution.png", dpi=110)
    plt.close(fig)
    names.append("distribution.png")
    for site, q in quality.items():
        if primary in q and "bins" in q[primary]:
            name = f"reliability_{len(names)}.png"
            plot_reliability(q[primary]["bins"], out / name, f"{site} ({primary})")
            names.append(name)
    risk = 1.0 - dice
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for label, key in (("oracle", risk), ("image mean (u_mean)", cases["u_mean"]),
                       *([(f"rule score ({rule.score})", cases[rule.score])] if rule is not None else [])):
        coverage, curve, _ = risk_coverage(np.asarray(key, dtype=np.float64), risk)
        ax.plot(coverage, curve, label=label)
    if rule is not None:  # the whole rule (size, familiarity, uncertainty) on the report's own cases
        accepted = np.array([not d for d in decisions])
        risk_here = float(risk[accepted].mean()) if accepted.any() else float("nan")
        ax.plot([accepted.mean()], [risk_here], "ko", label="the rule on these cases")
        if rule.certificate is not None:
            ax.axhline(1 - rule.certificate["bound"], color="tab:red", ls="--",
                       label=f"certified: risk <= {1 - rule.certificate['bound']:.2f} (prob. >= "
                             f"{1 - rule.certificate['delta']:g})")
    ax.set(xlim=(0, 1), xlabel="coverage (most certain cases accepted)", ylabel="risk (mean 1 - Dice)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "risk_coverage.png", dpi=110)
    plt.close(fig)
    names.append("risk_coverage.png")
    return names




def site_report(loaded, out, *, site_dirs=(), sites=(), data_root=None, split: str = "val", rule=None,
                force: bool = False, max_items: int | None = None, failure: dict | None = None,
                allow_training_cases: bool = False) -> Path:
    """Write the site acceptance report of ``loaded``'s model on the labelled cases of ``site_dirs`` / ``sites``
    into the folder ``out`` (see the module doc).

    Args:
        rule: the stored review rule (:class:`feduq.review.rule.ReviewThreshold`; None: the page says there is
            none and every case must be reviewed).
        failure: the verdict of a ``--calibrate`` that could not certify (``ReviewError.verdict``: ``target``,
            ``delta``, ``k``, ``n_units``, ``unit``, ``units_needed``, ``best_target``): the page's verdict says why
            nothing is certified and how many more units would be needed.
        allow_training_cases: use labelled cases the model's job trained on, named on the page as optimistic
            (default: refused).

    Returns:
        the path of ``report.html``.

    Raises:
        feduq.outputs.OutputFolderError: ``out`` overlaps an input or holds a user's file (checked before anything is
            scored). feduq.review.training_cases.TrainingCaseError: a labelled case is a training case of the job
            and ``allow_training_cases`` is False (one line naming the site; nothing written).
            feduq.data.DataError / EvaluationError: as ``labelled_cases``.
    """
    from ..outputs import check_output_folder, staged_folder
    from ..review.calibration import labelled_cases
    from .page import structures
    from ..review.rule import file_sha256
    from ..review.training_cases import check_training_cases

    inputs = {"model file": loaded.model_file, "job config": loaded.config_file, "data root": data_root,
              **{f"site folder {d}": d for d in site_dirs}}
    out = check_output_folder(out, inputs, TOOL, force)
    quality, folders = {}, {}
    cases, features, where, rows = labelled_cases(loaded, site_dirs=site_dirs, sites=sites, data_root=data_root,
                                                  split=split, max_items=max_items, quality=quality,
                                                  center_dirs=folders, before_scoring=lambda listed, dirs:
                                                  check_training_cases(loaded, listed, dirs, data_root=data_root,
                                                                       allow=allow_training_cases))
    trained = check_training_cases(loaded, rows, folders, data_root=data_root, allow=allow_training_cases)
    primary = loaded.site.primary_uncertainty
    if rule is not None:
        decisions = [rule.reasons({k: cases[k][i] for k in ("u_mean", "u_foreground", "u_boundary", "area_fraction")},
                                  None if features is None else features[i]) for i in range(len(rows))]
    else:
        decisions = [None] * len(rows)
    names = structures(rows)
    with staged_folder(out, overwrite=True, what=TOOL, marker=TOOL) as stage:
        pictures = _plots(stage, rows, cases, rule, quality, primary, decisions)
        galleries = _galleries(loaded, stage, rows, folders)
        optimistic = set(trained.cases)
        with open(stage / "cases.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["site", "case", "dice", "hd95_px", "hd95_mm", *[f"dice_{n}" for n in names],
                        *[f"hd95_px_{n}" for n in names], "score", "review", "review_reason", "training_case",
                        "sha256"])
            for r, d in zip(rows, decisions):
                w.writerow([r["site"], r["image"], f"{r['dice']:.4f}", f"{r['hd95_px']:.2f}", f"{r['hd95_mm']:.2f}",
                            *[f"{r[f'dice_{n}']:.4f}" for n in names],
                            *[f"{r.get(f'hd95_px_{n}', float('nan')):.2f}" for n in names],
                            f"{r[rule.score] if rule is not None else r['u_mean']:.6g}",
                            "" if d is None else ("yes" if d else "no"), "" if d is None else "; ".join(d),
                            "yes" if f"{r['site']}/{r['image']}" in optimistic else "no", r["sha256"] or ""])
        (stage / REPORT).write_text(_page(loaded, rows, decisions, rule, where, pictures, galleries, primary,
                                          file_sha256(loaded.model_file), failure, trained,
                                          _record_note(rule, folders)))
    return out / REPORT


def _model_html(loaded, model_sha: str) -> str:
    """The model: what it is, the model file with its SHA-256, and the run's per-site test Dice only when the run's
    test scored this same file (:func:`run_test_table`)."""
    from ..core.networks import network_note
    from ..common.provenance import job_provenance
    from .page import table

    prov = job_provenance(Path(loaded.config_file))
    network = network_note(loaded.model).removeprefix("network ")
    name = Path(loaded.model_file).name
    model = table(["", ""], [["method", loaded.method], ["task", loaded.task], ["network", network],
                             ["rounds", prov.get("rounds", "not recorded")],
                             ["training sites", ", ".join(prov.get("sites", [])) or "not recorded in the job folder"],
                             ["model file", f"{name} (SHA-256 {model_sha})"],
                             ["report written by", code_version()]])
    run = run_test_table(loaded.config_file, loaded.model_file, model_sha)
    if not run["rows"]:
        return model + "<p>The run folder holds no per-site table (a job folder, or a model copied elsewhere).</p>"
    if run["same"]:
        return model + (f"<p>The job's own test of this model file ({html.escape(name)}, the SHA-256 above) on each "
                        f"training site's test images:</p>"
                        + table(["training site", "test images", f"test Dice (%) of {name}"], run["rows"]))
    sites = table(["training site", "test images"], [r[:2] for r in run["rows"]])
    if run["tested"] is None:
        return model + ("<p class='note'>The run's per-site test table does not record which model file it scored, so "
                        "its test Dice are not shown: they may be of another file than this one.</p>" + sites)
    return model + (f"<p class='note'>The run's per-site test table scored <code>{html.escape(run['tested'])}</code>, "
                    f"not this report's model file <code>{html.escape(name)}</code>: its test Dice are of that file "
                    f"and are not shown here. A report on <code>{html.escape(run['tested'])}</code> (<code>--model "
                    f"{html.escape(str(run['tested_file'] or run['tested']))}</code>) shows them.</p>" + sites)


def _record_note(rule, folders: dict) -> str:
    """Whether the certificate's labelled cases are these sites' (their site-local records,
    :func:`feduq.review.calibration.check_site_record`); empty without a certificate that has a digest."""
    from ..review.calibration import check_site_record

    c = None if rule is None else rule.certificate
    if not c or "digest" not in c:
        return ""
    found = {site: check_site_record(c, folder) for site, folder in folders.items()}
    if all(v is None for v in found.values()):
        return (f"<p>The certificate's labelled cases are these sites' own, unchanged: checked against the calibration "
                f"record beside each site's folder ({html.escape(', '.join(found))}).</p>")
    return "".join(f"<p class='note'>{html.escape(site)}: {html.escape(v)}.</p>" for site, v in found.items() if v)


def _training_note(trained) -> str:
    """What the check for training cases found (:class:`feduq.review.training_cases.TrainingCheck`)."""
    checked = ", ".join(trained.training_sites)
    text = (f"<b>{len(trained.cases)} of these cases are training cases</b> of the model's job (optimistic)"
            if trained.cases else "None of these cases is a training image of the model's job"
            if checked else "Whether any of these cases trained the model could not be checked")
    if checked:
        text += f" (checked against the training splits of {html.escape(checked)})"
    why: dict[str, list[str]] = {}
    for site, reason in trained.unchecked.items():
        why.setdefault(reason, []).append(site)
    text += "".join(f"; not checked for {html.escape(', '.join(s))} ({html.escape(w)})" for w, s in why.items())
    return f"<p>{text}.</p>"


def _page(loaded, rows, decisions, rule, where, pictures, galleries, primary, model_sha, failure, trained,
          record_note: str = "") -> str:
    from .page import gallery_html, limits_html, per_case_html, rule_html, structures, verdict_html
    from ..review.notes import SCORE_WORDS

    here = html.escape(", ".join(sorted({r["site"] for r in rows})))
    dice = np.array([r["dice"] for r in rows])
    hd = np.array([r["hd95_px"] for r in rows], dtype=np.float64)
    mm = np.array([r["hd95_mm"] for r in rows], dtype=np.float64)
    hd_text = (f"median HD95 {np.nanmedian(hd):.1f} stored pixels" if np.isfinite(hd).any() else
               f"median HD95 {np.nanmedian(mm):.1f} mm" if np.isfinite(mm).any() else "no HD95")
    names = structures(rows)
    per = ("; per structure: " + ", ".join(
        f"{html.escape(n)} mean Dice {100 * np.nanmean([r[f'dice_{n}'] for r in rows]):.1f} %" for n in names)
           if len(names) > 1 else "")
    sources = "; ".join(f"{Path(w.rsplit(':', 1)[0]).name}:{w.rsplit(':', 1)[-1]}" for w in where)  # no machine path
    summary = (f"{len(rows)} labelled cases of {here} ({html.escape(sources)}): mean Dice "
               f"{100 * dice.mean():.1f} % (median {100 * np.median(dice):.1f} %, {100 * np.mean(dice < 0.5):.0f} % of "
               f"the cases below 50 %), {hd_text}{per}. Every case's figures: "
               f"<a href='cases.csv'>cases.csv</a>.")
    pics = "".join(f'<p><img src="{p}" alt="{p}"></p>' for p in pictures)
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Site acceptance: "
            f"{html.escape(loaded.method)} on {here}</title><style>{STYLE}</style></head><body>"
            f"<h1>Site acceptance report</h1>{verdict_html(rule, rows, decisions, failure, trained.cases)}"
            f"<h2 id='model'>The model</h2>{_model_html(loaded, model_sha)}"
            f"<h2 id='cases'>The site's labelled cases</h2><p>{summary}</p>{_training_note(trained)}{pics}"
            f"<h2 id='worst'>The worst cases</h2>{gallery_html(galleries, primary)}"
            f"<h2 id='rule'>The review rule</h2>{rule_html(rule, rows, decisions, SCORE_WORDS)}{record_note}"
            f"<h2 id='limits'>What it does not promise</h2>{limits_html(rule, len(rows), failure)}"
            f"<h2 id='per-case'>Every case</h2><p><a href='cases.csv'>cases.csv</a></p>"
            f"{per_case_html(rows, decisions, trained.cases)}</body></html>\n")
