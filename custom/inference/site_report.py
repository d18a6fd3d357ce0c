"""The site acceptance report: one self-contained HTML page a clinical team reads before using a federation's model.

``python -m feduq.predict --job J --report --site-dir SITE --out R`` (with ``--calibrate``: the rule is chosen, or
certified, on the same cases first) scores every labelled case of the site as ``--calibrate`` does
(:func:`feduq.inference.calibration.labelled_cases`) and writes into ``R`` (all at once, :func:`feduq.outputs.
staged_folder`): ``report.html`` and the PNG pictures it shows, ``cases.csv`` (one row per labelled case).

The page holds: what the model is (method, network, rounds, the training sites and their test images where the run
folder records them, the model file's SHA-256, the FedUQ commit that wrote the report); the site's labelled cases
(Dice and HD95 per case and their distribution, the reliability diagram of the primary uncertainty, the risk-coverage
curve with the rule's operating point and, for a certified rule, its certified bound); a gallery of the worst cases
(the image with the reference outline in green and the prediction's in red, beside the uncertainty map); the rule
and what it does not promise.
"""

from __future__ import annotations

import csv
import html
import subprocess
from pathlib import Path

import numpy as np

__all__ = ["REPORT", "REPORT_FILES", "GALLERY", "site_report"]

REPORT = "report.html"
#: what the report writes into its folder (a user's file under one of these names is refused, --force or not)
REPORT_FILES = (REPORT, "*.png", "cases.csv")
#: worst cases shown in the gallery
GALLERY = 6
TOOL = "predict"
STYLE = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
         "table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #bbb;padding:.2em .6em;text-align:left}"
         "th{background:#eee}img{max-width:100%}.gallery figure{display:inline-block;width:48%;margin:.5%}"
         ".note{background:#fff6e0;border-left:4px solid #e0a000;padding:.5em 1em}")


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).parent, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "not a git checkout"
    except (OSError, subprocess.SubprocessError):
        return "not a git checkout"


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


def _outline(region: np.ndarray) -> np.ndarray:
    from scipy import ndimage

    return region & ~ndimage.binary_erosion(region, iterations=max(2, min(region.shape) // 120))


def _gallery_picture(loaded, image_file: Path, mask_file: Path | None, path: Path) -> None:
    """The image with the reference (green) and predicted (red) outlines, beside the primary uncertainty map."""
    from PIL import Image

    from .files import map_scale, overlay, read_plane
    from .planes import Predictor

    predictor = Predictor(loaded, batch_size=1)
    plane, picture = read_plane(image_file, predictor.spec.in_channels)
    res = predictor.planes([plane])[0]
    label = res["label"].T  # [W, H] -> [H, W]
    primary = predictor.primary
    unc = res["maps"][primary].T
    pic = overlay(np.asarray(picture.convert("RGB")), np.zeros_like(label), unc,
                  map_scale(primary, predictor.num_classes))
    arr = np.asarray(pic).copy()
    h, w = label.shape
    if mask_file is not None:
        mask = np.asarray(Image.open(mask_file).convert("L").resize((w, h), Image.NEAREST)) > 0
        arr[:h, :w][_outline(mask)] = (0, 200, 0)
    arr[:h, :w][_outline(label > 0)] = (230, 30, 30)
    Image.fromarray(arr).save(path)


def _image_and_mask(files: list[Path]) -> tuple[Path | None, Path | None]:
    """A case's image (first channel) and mask among its files (:func:`feduq.inference.calibration.case_files`):
    FedUQ's ``images/``/``masks/`` or nnU-Net's ``imagesTr``/``imagesTs``/``labelsTr``; None where not found."""
    image = next((f for f in files if f.parent.name.startswith("images")), None)
    mask = next((f for f in files if f.parent.name in ("masks", "labelsTr")), None)
    return image, mask


def _plots(out: Path, rows: list[dict], cases: dict, rule, quality: dict, primary: str, decisions: list) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..core.uncertainty_quality import plot_reliability, risk_coverage

    names = []
    dice = np.array([r["dice"] for r in rows])
    hd = np.array([r["hd95_px"] for r in rows], dtype=np.float64)
    fig, (a, b) = plt.subplots(1, 2, figsize=(8, 3))
    a.hist(100 * dice, bins=20, range=(0, 100), color="tab:blue")
    a.set(xlabel="Dice (%)", ylabel="cases", title=f"Dice of {dice.size} labelled cases")
    b.hist(hd[np.isfinite(hd)], bins=20, color="tab:gray")
    b.set(xlabel="HD95 (stored pixels)", ylabel="cases", title="HD95")
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


def _table(head: list[str], body: list[list]) -> str:
    cells = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    rows = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in r) + "</tr>" for r in body)
    return f"<table><tr>{cells}</tr>{rows}</table>"


def site_report(loaded, out, *, site_dirs=(), sites=(), data_root=None, split: str = "val", rule=None,
                force: bool = False, max_items: int | None = None) -> Path:
    """Write the site acceptance report of ``loaded``'s model on the labelled cases of ``site_dirs`` / ``sites``
    into the folder ``out`` (see the module doc); ``rule``: the stored review rule (None: the page says there is none).

    Returns:
        the path of ``report.html``.

    Raises:
        feduq.outputs.OutputFolderError: ``out`` overlaps an input or holds a user's file (checked before anything is
            scored). feduq.data.DataError / EvaluationError: as ``labelled_cases``.
    """
    from ..outputs import check_output_folder, staged_folder
    from .calibration import case_files, labelled_cases
    from .review import file_sha256
    from .review_notes import SCORE_WORDS

    inputs = {"model file": loaded.model_file, "job config": loaded.config_file, "data root": data_root,
              **{f"site folder {d}": d for d in site_dirs}}
    out = check_output_folder(out, inputs, TOOL, force)
    quality, folders = {}, {}
    cases, features, where, rows = labelled_cases(loaded, site_dirs=site_dirs, sites=sites, data_root=data_root, split=split,
                                           max_items=max_items, quality=quality, center_dirs=folders)
    primary = loaded.site.primary_uncertainty
    if rule is not None:
        decisions = [rule.reasons({k: cases[k][i] for k in ("u_mean", "u_foreground", "u_boundary", "area_fraction")},
                                  features[i]) for i in range(len(rows))]
    else:
        decisions = [None] * len(rows)
    with staged_folder(out, overwrite=True, what=TOOL, marker=TOOL) as stage:
        pictures = _plots(stage, rows, cases, rule, quality, primary, decisions)
        worst = sorted(range(len(rows)), key=lambda i: rows[i]["dice"])[:GALLERY]
        files = {(site, stem): found for site in {rows[i]["site"] for i in worst}  # one walk of each site's folder
                 for stem, found in case_files(folders[site], [rows[i]["image"] for i in worst
                                                               if rows[i]["site"] == site]).items()}
        gallery = []
        for rank, i in enumerate(worst):
            image, mask = _image_and_mask(files[rows[i]["site"], rows[i]["image"]])
            if image is None:
                continue
            name = f"worst_{rank}.png"
            _gallery_picture(loaded, image, mask, stage / name)
            gallery.append((name, rows[i]))
        with open(stage / "cases.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["site", "case", "dice", "hd95_px", "hd95_mm", "score", "review", "review_reason", "sha256"])
            for r, d in zip(rows, decisions):
                w.writerow([r["site"], r["image"], f"{r['dice']:.4f}", f"{r['hd95_px']:.2f}", f"{r['hd95_mm']:.2f}",
                            f"{r[rule.score] if rule is not None else r['u_mean']:.6g}",
                            "" if d is None else ("yes" if d else "no"), "" if d is None else "; ".join(d),
                            r["sha256"] or ""])
        (stage / REPORT).write_text(_page(loaded, rows, decisions, rule, where, pictures, gallery, primary,
                                          file_sha256(loaded.model_file), SCORE_WORDS))
    return out / REPORT


def _page(loaded, rows, decisions, rule, where, pictures, gallery, primary, model_sha, words) -> str:
    from .bundle import job_provenance

    prov = job_provenance(Path(loaded.config_file))
    from ..core.networks import network_note

    network = network_note(loaded.model).removeprefix("network ")
    model = _table(["", ""], [["method", loaded.method], ["task", loaded.task], ["network", network],
                              ["rounds", prov.get("rounds", "not recorded")],
                              ["training sites", ", ".join(prov.get("sites", [])) or "not recorded in the job folder"],
                              ["model file", f"{Path(loaded.model_file).name} (SHA-256 {model_sha[:16]}…)"],
                              ["report written by FedUQ", _commit()]])
    training = _training(Path(loaded.config_file))
    training_html = (_table(["training site", "test images", "test Dice (%)"], training) if training else
                     "<p>The run folder holds no per-site table (a job folder, or a model copied elsewhere).</p>")
    dice = np.array([r["dice"] for r in rows])
    hd = np.array([r["hd95_px"] for r in rows], dtype=np.float64)
    summary = (f"{len(rows)} labelled cases of {html.escape(', '.join(sorted({r['site'] for r in rows})))} "
               f"({html.escape('; '.join(where))}): mean Dice {100 * dice.mean():.1f} % (median "
               f"{100 * np.median(dice):.1f} %, {100 * np.mean(dice < 0.5):.0f} % of the cases below 50 %), "
               f"median HD95 {np.nanmedian(hd):.1f} stored pixels.")
    pics = "".join(f'<p><img src="{p}" alt="{p}"></p>' for p in pictures)
    worst = "".join(f'<figure><img src="{n}" alt="{html.escape(r["image"])}"><figcaption>{html.escape(r["site"])} / '
                    f'{html.escape(r["image"])}: Dice {100 * r["dice"]:.1f} %, HD95 {r["hd95_px"]:.1f} px'
                    f'</figcaption></figure>' for n, r in gallery)
    per_case = _table(["site", "case", "Dice (%)", "HD95 (px)", "HD95 (mm)", "review"],
                      [[r["site"], r["image"], f"{100 * r['dice']:.1f}", f"{r['hd95_px']:.1f}",
                        "–" if not np.isfinite(r["hd95_mm"]) else f"{r['hd95_mm']:.1f}",
                        "no rule" if d is None else ("flag: " + "; ".join(d) if d else "accept")]
                       for r, d in sorted(zip(rows, decisions), key=lambda x: x[0]["dice"])])
    if rule is None:
        rule_html = ("<p class='note'>No review rule is stored for this model: every case must be reviewed. Choose "
                     "one with <code>python -m feduq.predict --calibrate</code>.</p>")
    else:
        c = rule.certificate
        promise = (f"<b>Certified</b> on {c['k']} labelled cases of {html.escape(', '.join(c.get('sites') or []))}: "
                   f"with probability at least {100 * (1 - c['delta']):g} % over the cases drawn, the mean Dice of "
                   f"the cases the rule accepts at that site is at least {100 * c['bound']:.1f} % (Learn then Test; "
                   f"Waudby-Smith–Ramdas p-values)." if c is not None else
                   "<b>Not certified</b>: the figures describe the calibration cases only and promise nothing here.")
        here = sorted({r["site"] for r in rows})
        named = (c or {}).get("sites") or []
        if c is not None and sorted(named) != here:
            promise += (f" <b>These cases are of {html.escape(', '.join(here))}, not of the site it was certified "
                        f"for</b>: it promises nothing for them.")
        acc = [not d for d in decisions]
        promise += (f" On these {len(rows)} cases it accepts {100 * np.mean(acc):.1f} %, with mean Dice "
                    f"{100 * np.mean([r['dice'] for r, a in zip(rows, acc) if a]):.1f} %." if any(acc) else
                    f" On these {len(rows)} cases it accepts none.")
        rule_html = (f"<p>Flag a case when its {words[rule.score]} {html.escape(rule.uncertainty)} uncertainty is above "
                     f"{rule.threshold:.6g}"
                     + (f", its predicted area is below {100 * rule.size_floor:.3g} % of the image" if rule.size_floor
                        is not None else "")
                     + (", or its input is unfamiliar" if rule.familiarity is not None else "")
                     + f". On its {rule.n_cases} calibration cases it accepted {100 * rule.coverage:.1f} % with mean "
                     f"Dice {100 * rule.accepted_dice:.1f} % (target {100 * rule.target_dice:.1f} %).</p><p>{promise}"
                     "</p>")
    limits = ("<ul><li>It says nothing of cases unlike these: another scanner, protocol or population, a new kind "
              "of finding; <code>predict</code> notes unfamiliar inputs and an accepted fraction unlike the "
              "calibration's, but cannot see every shift.</li>"
              "<li>The promise assumes the labelled cases are a random sample of independent cases of the site: "
              "frames of one video or slices of one patient are not independent, and cases chosen for being easy or "
              "hard void it.</li>"
              f"<li>{len(rows)} cases are few: the empirical figures above move by several points from one sample to "
              "another; only the certified bound, where there is one, accounts for it.</li>"
              "<li>An accepted case is not a correct one: the promise is about the mean Dice of the accepted cases, "
              "not about any one of them.</li></ul>")
    return (f"<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'><title>Site acceptance: "
            f"{html.escape(loaded.method)} on {html.escape(', '.join(sorted({r['site'] for r in rows})))}</title>"
            f"<style>{STYLE}</style></head><body>"
            f"<h1>Site acceptance report</h1><h2 id='model'>The model</h2>{model}{training_html}"
            f"<h2 id='cases'>The site's labelled cases</h2><p>{summary}</p>{pics}"
            f"<h2 id='worst'>The worst cases</h2><p>Reference outline green, prediction red; right: the "
            f"{html.escape(primary)} uncertainty.</p><div class='gallery'>{worst}</div>"
            f"<h2 id='rule'>The review rule</h2>{rule_html}<h2 id='limits'>What it does not promise</h2>{limits}"
            f"<h2 id='per-case'>Every case</h2>{per_case}</body></html>\n")

