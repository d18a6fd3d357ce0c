"""``feduq <verb> [options]``: the one command FedUQ installs (``[options.entry_points]`` in setup.cfg).

Each verb is a module with ``main(argv) -> int`` (:data:`VERBS`); ``feduq <verb> --help`` is the verb's own help and
``feduq --help`` lists the verbs by who uses them. An unknown verb is one line naming it and the nearest verb, exit 2.
Every verb ends through :func:`feduq.cli.run_main` (an interrupt or a failed write is one line, not a traceback).
"""

from __future__ import annotations

import difflib
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Verb:
    """One verb: its name, who uses it, the module whose ``main(argv)`` runs it, and one line of help."""

    name: str
    group: str
    module: str
    help: str


GROUPS = {"site": "a hospital's site", "consortium": "running the federation", "research": "comparing methods",
          "registry": "what is registered"}

VERBS: tuple[Verb, ...] = (
    Verb("predict", "site", "feduq.commands.site.predict", "apply a trained model to images, volumes or DICOM series"),
    Verb("calibrate", "site", "feduq.commands.site.calibrate",
         "choose and certify the review rule on the site's labelled cases"),
    Verb("report", "site", "feduq.commands.site.report", "the site acceptance report (report.html) of a model"),
    Verb("export-bundle", "site", "feduq.commands.site.export_bundle", "write the model as a MONAI Bundle"),
    Verb("evaluate", "site", "feduq.commands.site.evaluate", "score any model on a labelled site folder"),
    Verb("prepare-site", "site", "feduq.commands.site.prepare_site",
         "write a site's local/feduq_site.json and allow-list FedUQ in its startup kit"),
    Verb("container", "site", "feduq.commands.site.container",
         "check a startup kit and start it in FedUQ's container image (data mounted read-only)"),
    Verb("fingerprint", "site", "feduq.commands.site.fingerprint",
         "a declared CT task's intensity window from the sites' federated fingerprints"),
    Verb("run", "consortium", "feduq.run", "run or export a method's FLARE Recipe (sim, poc, prod)"),
    Verb("simulate", "consortium", "feduq.commands.consortium.simulate", "run a job folder in FLARE's simulator"),
    Verb("configure", "consortium", "feduq.commands.consortium.configure", "write a job folder with changed settings"),
    Verb("plan", "consortium", "feduq.commands.consortium.plan",
         "nnU-Net's plan of a volume task from the sites' federated fingerprints"),
    Verb("resume", "consortium", "feduq.commands.consortium.resume",
         "a job that continues an interrupted run from its checkpoint"),
    Verb("project", "consortium", "feduq.commands.consortium.project",
         "the NVFlare provisioning project file of a federation (nvflare provision -p)"),
    Verb("poc", "consortium", "feduq.commands.consortium.poc", "a local FLARE POC federation: start, submit, status, stop"),
    Verb("compare", "research", "feduq.commands.research.compare", "run methods x seeds on identical data and table them"),
    Verb("compare-report", "research", "feduq.commands.research.compare_report",
         "the uncertainty report (report.md) of a comparison"),
    Verb("reference", "research", "feduq.commands.research.reference", "the local and pooled (centralised) references"),
    Verb("virtual", "research", "feduq.commands.research.virtual", "a job's rounds over many virtual sites in one process"),
    Verb("convert", "research", "feduq.commands.research.convert", "a public dataset's download into FedUQ's layout"),
    Verb("split", "research", "feduq.commands.research.split", "the train/val/test split files of a task's sites"),
    Verb("noisy-labels", "research", "feduq.commands.research.noisy_labels", "sites with FedA3I's simulated annotators"),
    Verb("synthetic", "research", "feduq.commands.research.synthetic", "a tiny synthetic data root (smoke runs)"),
    Verb("acceptance-study", "research", "feduq.commands.research.acceptance_study",
         "does the certified review rule keep its promise (held-out sites, simulation, power)"),
    Verb("methods", "registry", "feduq.commands.listing", "the registered methods: paper, task, what leaves a site"),
    Verb("tasks", "registry", "feduq.commands.listing", "the built-in tasks: sites, channels, structures"),
)
BY_NAME = {v.name: v for v in VERBS}


def overview() -> str:
    """``feduq --help``: the verbs by group."""
    from .. import __version__

    lines = [f"usage: feduq <verb> [options]   (FedUQ {__version__}; feduq <verb> --help for a verb's options)", ""]
    for group, title in GROUPS.items():
        lines.append(f"{title}:")
        lines += [f"  {v.name:<17} {v.help}" for v in VERBS if v.group == group]
        lines.append("")
    lines.append("run also runs as python -m feduq.run; every verb as python -m feduq <verb>.")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """The ``feduq`` console script: dispatch ``argv[0]`` to its verb; returns the exit code."""
    from ..cli import run_main

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(overview())
        return 0 if argv else 2
    if argv[0] == "--version":
        from .. import __version__

        print(f"feduq {__version__}")
        return 0
    verb = BY_NAME.get(argv[0])
    if verb is None:
        near = difflib.get_close_matches(argv[0], list(BY_NAME), n=1)
        hint = f"; did you mean {near[0]}?" if near else "; feduq --help lists the verbs"
        print(f"feduq: error: unknown verb {argv[0]!r}{hint}", file=sys.stderr)
        return 2
    module = importlib.import_module(verb.module)
    entry = getattr(module, "verb_main", None)
    run = (lambda a: entry(verb.name, a)) if entry is not None else module.main
    return run_main(f"feduq {verb.name}", run, argv[1:])


def console() -> None:
    """The installed ``feduq`` script's entry point."""
    sys.exit(main())
