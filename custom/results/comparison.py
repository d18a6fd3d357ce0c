"""The ``results.md`` of a segmentation or classification sweep of ``feduq compare`` (a CT sweep's:
:func:`feduq.results.sweeps.ct_results`): the header from the runs' records, the papers' tables and the paired tests;
the paired tests' CSV files are written into the sweep's folder on the way."""

from __future__ import annotations

from ..scores.tables import write_rows
from .run_records import settings_line
from .structures import structure_paired, structure_tables
from .sweeps import dp_sweep_rows, markdown_table, plot_dp_sweep


def results_markdown(a, tidy: list[dict], methods: list[str], labels: list[str], records: list, per_image: list[dict],
                     per_image_cls: list[dict], paired: str | None, sweep: bool, epsilons: list) -> list[str]:
    """The lines of ``results.md`` for the sweep of arguments ``a`` (``feduq compare``'s, with ``method_seeds``):
    ``tidy`` its test rows, ``methods`` the table's rows (``labels`` + personalised rows), ``records`` the runs'
    records (:mod:`feduq.results.run_records`), ``per_image`` / ``per_image_cls`` the rows paired against the
    baseline ``paired`` (None: no paired test), ``sweep`` / ``epsilons`` a DP sweep's budgets. Writes the DP sweep's
    and the paired tests' files into ``a.out``."""
    own = "".join(f"; {m}: seeds {s}" for m, s in a.method_seeds.items() if s != a.seeds)
    settings = settings_line(records, f"seeds {a.seeds}{own}")  # from what the runs recorded, not this command line
    md = [f"# FedUQ comparison: {settings}", ""]
    if any(r["metric"] == "dice" for r in tidy):
        md += [f"Per-client test Dice (%) of the best global model (by validation "
               f"{'loss' if a.official_protocol or a.select_on == 'val_loss' else 'Dice'}); mean ± std over seeds.", "",
               markdown_table(tidy, methods, "dice", 100.0), "",
               f"HD95 (px at {'the training size, ' + str(a.image_size) + ' px' if a.official_protocol else 'the stored mask size'}):",
               "", markdown_table(tidy, methods, "hd95", 1.0), ""]
        if any(r["metric"] == "hd95_mm" for r in tidy):  # sites of 3D volumes: per case, in mm
            md[-4:] = ["HD95 (mm, per case; Dice above is per case too):", "",
                       markdown_table(tidy, methods, "hd95_mm", 1.0), ""]
        md += structure_tables(tidy, methods)  # several structures: each one's Dice and HD95 beside the mean
    for metric, name in (("auc", "AUC"), ("accuracy", "accuracy")):  # image-level classification jobs
        if any(r["metric"] == metric for r in tidy):
            md += [f"Per-client test {name} (%) of the best global model (by validation AUC; each site with its own "
                   "local entries); mean ± std over seeds:", "", markdown_table(tidy, labels, metric, 100.0), ""]
    if sweep:
        sweep_rows = dp_sweep_rows(tidy, a.methods, epsilons)
        write_rows(a.out / "dp_sweep.csv", sweep_rows)
        plot_dp_sweep(sweep_rows, a.out / "dice_vs_epsilon.png")
        md += [f"ε spent per site (δ = {a.dp_delta:g}, C = {a.dp_max_grad_norm:g}; RDP accountant):", "",
               markdown_table(tidy, [lb for lb in labels if "no DP" not in lb], "dp_epsilon", 1.0), ""]
    if paired and per_image:
        from .paired import (clustered_markdown, clustered_tests, paired_markdown, paired_tests,
                                           site_clusters)

        clusters, units = site_clusters(a.data_root, a.task, sorted({r["site"] for r in per_image}))
        tests = clustered_tests(per_image, baseline=paired, clusters=clusters, units=units)
        independent = paired_tests([r for r in per_image if r["site"] not in units], baseline=paired)
        write_rows(a.out / "per_image_test.csv", per_image)
        write_rows(a.out / "paired_tests.csv", tests)
        write_rows(a.out / "paired_tests_per_image.csv", independent)
        grouped = ", ".join(f"{site} by {unit}" for site, unit in units.items()) or "none"
        md += [f"Paired against {paired} on the same test images (the best global model as each site tested it), over "
               f"independent units: each image's Dice difference averaged over the seeds, then over its group "
               f"(grouped sites: {grouped}; every other image is its own unit). Wilcoxon signed-rank test over the "
               "units, two-sided; Δ = mean over units in Dice points (method − baseline) with the 95 % interval of a "
               "cluster bootstrap (units resampled within each site, 10,000 draws, seed 0); r = matched-pairs "
               "rank-biserial correlation over the units; q = p adjusted over every test in this table "
               "(Benjamini–Hochberg):", "", clustered_markdown(tests), ""]
        if independent:
            md += ["Per image and per seed, only on the sites whose images are independent (q adjusted over these "
                   "rows; `paired_tests_per_image.csv`):", "", paired_markdown(independent), ""]
        md += structure_paired(per_image, paired, clusters, units, a.out)  # several structures: per structure
    if paired and per_image_cls:  # image-level classification: accuracy and AUC paired over the test images
        from .classification_paired import classification_markdown, classification_tests

        tests = classification_tests(per_image_cls, baseline=paired)
        write_rows(a.out / "per_image_test.csv", per_image_cls)
        write_rows(a.out / "paired_tests.csv", tests)
        md += [f"Paired against {paired} on the same test images of all sites (the images are the units): exact McNemar "
               "test of the images only one method classifies right (per seed; seeds combined: Wilcoxon over each "
               "image's seed-mean correctness), AUC on the pooled images with a 95 % bootstrap interval of the "
               "difference over images (2,000 draws, seed 0; `paired_tests.csv`):", "",
               classification_markdown(tests), ""]
    return md
