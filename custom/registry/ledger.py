"""What each registered method declares may leave a site, looked up for the privacy ledger (no FLARE here).

Every method's declaration is part of its registration (:class:`feduq.registry.MethodSpec` ``ledger``: task ->
:func:`feduq.privacy.ledger.declare`); this module gives the ledger filter its method's declaration of a task
(:func:`declaration`), the union a site's own privacy policy enforces whatever FedUQ job runs (:data:`SITE_POLICY`),
the check of a result (:func:`check_result`) and the ``docs/reference/privacy.md`` table (:func:`ledger_markdown`).
"""

from __future__ import annotations

from typing import Any, Mapping

from ..privacy.ledger import FLARE_META, NAME, SCALAR, LedgerViolation, check_declared, declare
from . import SPECS

#: method -> task -> declaration (what each site may send, per task), from the registrations
LEDGER: dict[str, dict[str, dict]] = {name: dict(spec.ledger) for name, spec in SPECS.items()}

#: the federated nnU-Net plan's fingerprint job (not a method; ``feduq plan``): per site, its training
#: cases' count, then per case its spacing, shape after cropping and relative crop size, and per channel the count,
#: mean, sum of squared deviations, minimum, maximum and 2001 quantiles of its foreground samples
FINGERPRINT_JOB = "nnunet_fingerprint"
LEDGER[FINGERPRINT_JOB] = {
    "feduq_count_cases": declare(metrics={"n_cases": SCALAR}, meta={"feduq_site": NAME}),
    "feduq_plan_fingerprint": declare(metrics={
        "n_cases": SCALAR, "spacings": "per_case:3", "shapes_after_crop": "per_case:3",
        "relative_sizes_after_cropping": "per_case:1", "channel_*_count": SCALAR, "channel_*_mean": SCALAR,
        "channel_*_m2": SCALAR, "channel_*_min": SCALAR, "channel_*_max": SCALAR,
        "channel_*_quantiles": "vector:2001"}, meta={"feduq_site": NAME}),
}
#: the method name of a site's own privacy policy filter (``local/privacy.json``): any FedUQ method's declaration
ANY_METHOD = "*"


def _site_policy() -> dict[str, dict]:
    """task -> the union of every method's declaration of that task: what a site's own privacy policy lets out,
    whatever FedUQ job runs (the job's own ledger filter then holds it to its method's declaration).

    Raises:
        ValueError: two methods declare one key of a task with different forms.
    """
    union: dict[str, dict] = {}
    for tasks in LEDGER.values():
        for task, d in tasks.items():
            u = union.setdefault(task, declare())
            u["model"] = u["model"] or d["model"]
            for section in ("extra_model", "metrics", "meta"):
                for key, form in d[section].items():
                    if u[section].setdefault(key, form) != form:
                        raise ValueError(f"ledger: {task}/{section}/{key} declared as {u[section][key]} and {form}")
    return union


SITE_POLICY = _site_policy()

#: what the declared names mean, for the docs/reference/privacy.md table
DESCRIPTIONS = {
    "feduq_num_samples": "N_k (training images)", "feduq_num_val_samples": "validation images",
    "NUM_STEPS_CURRENT_ROUND": "FLARE's step count (= N_k)", "val_dice": "validation Dice of the received model",
    "val_loss": "its validation Dice loss (model selection)",
    "train_loss": "mean training loss", "fedevi_mean_u_ale": "A_k", "fedevi_mean_inv_u_ale": "mean 1/U_ale",
    "fedevi_mean_u_epi": "G_k", "u_epi": "G_k", "feduaa_youden_threshold": "θ_k", "graphfedseg_mean_vacuity": "U_k",
    "feda3i_q": "q_k = (q_in, q_out)", "feda3i_q_in": "q_in", "feda3i_q_out": "q_out",
    "feduq_site": "the site's name", "feduq_head_organs": "the head's organ names",
    "n_cases": "training cases", "spacings": "voxel spacing per case (mm)",
    "shapes_after_crop": "shape per case after cropping to the non-zero region",
    "relative_sizes_after_cropping": "crop size / image size per case",
    "channel_*_quantiles": "2001 quantiles of the foreground samples",
}


def declaration(method: str, task: str, site: str = "?") -> dict:
    """The declaration of ``task`` for ``method`` (:data:`ANY_METHOD`: :data:`SITE_POLICY`).

    Raises:
        LedgerViolation: an undeclared method or task (names the site).
    """
    if method == ANY_METHOD:
        if task not in SITE_POLICY:
            raise LedgerViolation(f"site {site!r}: task {task!r} is not a task of any FedUQ method; nothing may be sent")
        return SITE_POLICY[task]
    if method not in LEDGER:
        raise LedgerViolation(f"site {site!r}: method {method!r} has no privacy ledger (known: {sorted(LEDGER)})")
    if task not in LEDGER[method]:
        raise LedgerViolation(f"site {site!r}: task {task!r} is not declared for {method!r}; nothing may be sent "
                              f"(declared tasks: {sorted(LEDGER[method])})")
    return LEDGER[method][task]


def check_result(method: str, task: str, site: str, model: Mapping[str, Any], metrics: Mapping[str, Any],
                 meta: Mapping[str, Any], received: Mapping[str, Any] | None = None) -> list[dict]:
    """Check one task result of ``method`` against its declaration (:func:`feduq.privacy.ledger.check_declared`).

    Returns:
        One row per key: ``{"section", "key", "form", "shape", "bytes"}``.

    Raises:
        LedgerViolation: an undeclared method, task or key, or a declared key of the wrong form.
    """
    return check_declared(declaration(method, task, site), method, task, site, model, metrics, meta, received)


def ledger_markdown() -> str:
    """The docs/reference/privacy.md table: per method and task, what may leave a site beyond the model tensors."""
    lines = ["| Method | Task | Model tensors | Metrics | Meta |", "|---|---|---|---|---|"]

    def names(d: Mapping[str, str]) -> str:
        return ", ".join(f"`{k}`" + (f" ({DESCRIPTIONS[k]})" if k in DESCRIPTIONS else "")
                         + ("" if f == SCALAR else f" [{f}]") for k, f in d.items()) or "–"

    for method, tasks in LEDGER.items():
        for task, d in tasks.items():
            model = ("received model's" if d["model"] else "") + (
                (" + " if d["model"] else "") + ", ".join(f"`{k}`" for k in d["extra_model"]) if d["extra_model"] else "")
            lines.append(f"| {method} | {task} | {model or '–'} | {names(d['metrics'])} | {names(d['meta'])} |")
    lines += ["", "Every task's meta may also hold FLARE's own " + names(FLARE_META)
              + ": the class names of the FLARE filters the result went through (e.g. `PercentilePrivacy`)."]
    return "\n".join(lines)
