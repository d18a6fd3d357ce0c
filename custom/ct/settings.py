"""A multi-head CT job's site settings, FLARE-free: what the job's executor arguments mean, checked once.

The CT executor (:class:`feduq.flare.ct.CTExecutor`) trains with them; :mod:`feduq.ct.inference` reads the same
arguments from a job's ``config_fed_client.json`` to apply the released model to a new patient, without FLARE. A CT
method is its site part (:class:`feduq.parts.site.CTSitePart`), named in the job by ``site_part`` with its own
arguments beside the shared ones (FIVA-P: ``{"site_part": "feduq.methods.fiva.site.FIVASite", "variance":
"parameter", ...}``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..nnunet import pipeline as nc
from ..common.checks import keyword_names, method_part_class
from ..parts.site import CTSitePart

#: the executor every multi-head CT job names (a string: this module never imports FLARE)
CT_EXECUTOR = "feduq.flare.ct.CTExecutor"


@dataclass
class CTSiteSettings:
    """A CT site's settings, made and checked by :func:`ct_site_settings` (its defaults); attribute names are the
    executor's."""

    plans_name: str
    intensity: str
    iterations: Any
    batch_size: int | None
    lr: float
    weight_decay: float
    num_rounds: int
    dropout: float
    inference_samples: int
    max_items: int | None
    seed: int
    device_name: str
    amp: Any
    num_threads: int
    method: CTSitePart


def ct_site_part_class(path: str) -> type:
    """The :class:`~feduq.parts.site.CTSitePart` subclass at dotted ``path`` (in ``feduq.methods``).

    Raises:
        ValueError: the path is outside ``feduq.methods``, does not import, or is not a CT site part.
    """
    return method_part_class(path, CTSitePart, "executor argument site_part", "feduq.methods.fiva.site.FIVASite")


def _part_arguments(part_class: type) -> set[str]:
    """The arguments a CT site part's constructor names (none for a part without its own constructor)."""
    return keyword_names(part_class.__init__) if part_class.__init__ is not object.__init__ else set()


def ct_site_arguments(args: dict) -> set[str]:
    """The executor arguments a CT job may give: the site's (:func:`ct_site_settings`) and those of the site part
    its ``site_part`` names (what the job check accepts; a misspelt key gets a "did you mean").

    Raises:
        ValueError: ``site_part`` does not name a CT site part.
    """
    part_class = ct_site_part_class(args["site_part"]) if args.get("site_part") else CTSitePart
    return (keyword_names(ct_site_settings) - {"method"}) | _part_arguments(part_class)


def ct_site_settings(plans: str = "ct_2d", intensity: str = "site", iterations=250, batch_size: int | None = None,
                     lr: float = 0.01, weight_decay: float = 3e-5, num_rounds: int = 1500, dropout: float = 0.0,
                     inference_samples: int = 10, max_items: int | None = None, seed: int = 0, device: str = "auto",
                     amp: str | bool = "auto", num_threads: int = 0, site_part: str | None = None,
                     method: CTSitePart | None = None, **part_args) -> CTSiteSettings:
    """A CT job's executor arguments -> :class:`CTSiteSettings`, every value checked.

    Args:
        plans: the job's shared nnU-Net plans (``ct_2d``: nnU-Net's own plan, the paper's setting; ``ct_2d_slim``:
            tests and CPU demos).
        intensity: ``site`` (own CT statistics, FIVA), ``reference`` or ``zscore`` (:func:`feduq.nnunet.pipeline.site_plans`).
        iterations: training iterations per round, one number or ``{site: T}`` (FIVA: TS 300, LiTS 50, ...).
        batch_size: None = the plan's batch size.
        lr, weight_decay: nnU-Net's SGD; poly decay (exponent 0.9) over ``num_rounds``.
        num_rounds: rounds of the poly schedule (the job's rounds).
        dropout: Dropout2d probability in every conv block (FUNAvg 0.3).
        inference_samples: K samples at test time (FedAvg: 1, nothing is drawn).
        max_items, seed, device, amp, num_threads: as the 2D sites.
        site_part: dotted path of the method's :class:`~feduq.parts.site.CTSitePart` (None: FedAvg's), built from
            ``part_args`` (FIVA's ``variance``, ``divisor``, ``g_mode``, ``sample_scale``).
        method: a site part made by code (instead of ``site_part``).

    Raises:
        ValueError: a value out of range, an unknown plan, or an argument neither the site nor its part takes
            (named).
    """
    nc.load_plans(plans)  # ValueError naming the plans
    if intensity not in nc.INTENSITY_MODES:
        raise ValueError(f"executor argument intensity={intensity!r}: expected one of {nc.INTENSITY_MODES}")
    its = iterations.values() if isinstance(iterations, dict) else [iterations]
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 1 for t in its):
        raise ValueError(f"executor argument iterations={iterations!r}: expected an integer >= 1 or {{site: int}}")
    if not (0 <= float(dropout) < 1) or int(inference_samples) < 1 or float(lr) <= 0 or int(num_rounds) < 1:
        raise ValueError("executor arguments out of range: need 0 <= dropout < 1, inference_samples >= 1, "
                         f"lr > 0, num_rounds >= 1 (got {dropout}, {inference_samples}, {lr}, {num_rounds})")
    if method is None:
        part_class = ct_site_part_class(site_part) if site_part else CTSitePart
        names = _part_arguments(part_class)
        unknown = sorted(set(part_args) - names)
        if unknown:
            raise ValueError(f"unknown executor argument {unknown[0]!r} (the CT site's, or its part "
                             f"{part_class.__name__}'s: {sorted(names) or 'none'})")
        method = part_class(**part_args)
    elif part_args:
        raise ValueError(f"unknown executor argument {sorted(part_args)[0]!r}")
    method.check(float(dropout))
    return CTSiteSettings(plans, intensity, iterations, batch_size, float(lr), float(weight_decay), int(num_rounds),
                          float(dropout), int(inference_samples), max_items, int(seed), device, amp, int(num_threads),
                          method)
