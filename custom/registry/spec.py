"""A method's registration as a type: :class:`MethodSpec` (site part, server part, their arguments, what leaves a
site per task, tasks, the paper's rounds and settings), the registry :data:`SPECS` and :func:`register`. The
registrations themselves are :mod:`feduq.registry.methods`; a method's settings for one task are that task's file's
(``feduq.hyperparameters.<method>``, :func:`feduq.recipes.settings.task_method_settings`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping


EXECUTOR_2D = "feduq.flare.executor.FedUQExecutor"
CONTROLLER_2D = "feduq.flare.controller.FedUQController"
EXECUTOR_CT = "feduq.flare.ct.CTExecutor"
CONTROLLER_CT = "feduq.flare.ct.CTController"
TASKS_2D = ("train", "validate", "test", "submit_model")


@dataclass(frozen=True)
class MethodSpec:
    """One method's registration.

    Attributes:
        name: the job's name (``jobs/<name>/``, ``feduq run <name>``).
        description: one line: the paper and what the method changes.
        site_part: dotted path of the method's site part (:class:`feduq.parts.site.SitePart`, CT:
            :class:`feduq.parts.site.CTSitePart`); None: FedAvg's.
        site_args: the site part's arguments in the job (beside the site's settings).
        server_part: dotted path of the method's server part (:class:`feduq.parts.server.ServerPart`); None:
            FedAvg's (CT: :class:`feduq.parts.ct_server.CTServer`).
        server_args: the server part's workflow arguments.
        ledger: task -> what a site may send for it (:func:`feduq.privacy.ledger.declare`); a site refuses anything else.
        tasks: the FLARE tasks the site answers, in the order the job lists them.
        num_rounds: the paper's rounds (the job's ``num_rounds``).
        task: the FedUQ task (:mod:`feduq.tasks.spec`) its job runs on.
        sites: the job's sites (None: the task's centers).
        network: the network options over :data:`COMMON_CLIENT_ARGS`'s (a ``name`` replaces them).
        client_args: the shared site settings the method's paper changes (lr, batch size, image size, ...).
        key_metric: the global model selection's metric.
        final_test_args: :class:`feduq.flare.workflows.FinalTestEvaluation` arguments (FedA3I: the last model).
        kind: ``"2d"`` or ``"ct"`` (multi-head CT on nnU-Net).
        site_class: a method's own 2D site with its own training loop (a :class:`feduq.site.site2d.Site2D` subclass
            in :mod:`feduq.methods`: FedUAA's classification), run by FedUQ's one 2D executor; None: the 2D site.
        ct_variance: CT: the server's model carries FIVA's global variance beside the backbone.
        foreground_classes: the number of foreground classes the method is written for (FedA3I: 1, a binary task:
            its noise estimate scores the logit z = l1 - l0 against label > 0); a task training another number is
            refused by the job check, whatever the network (:func:`feduq.registry.method_task_error`). None: any.
        volumes_3d: the method's math holds voxel by voxel on nnU-Net's 3D network (``configuration 3d_fullres``);
            False for a method written for 2D images (FedA3I's boundary-band contours), refused by the job check.
    """

    name: str
    description: str
    ledger: Mapping[str, dict]
    site_part: str | None = None
    site_args: Mapping = field(default_factory=dict)
    server_part: str | None = None
    server_args: Mapping = field(default_factory=dict)
    tasks: tuple[str, ...] = TASKS_2D
    num_rounds: int = 200
    task: str = "polyp"
    sites: tuple[str, ...] | None = None
    network: Mapping = field(default_factory=dict)
    client_args: Mapping = field(default_factory=dict)
    key_metric: str = "val_dice"
    final_test_args: Mapping = field(default_factory=dict)
    kind: str = "2d"
    site_class: str | None = None
    ct_variance: bool = False
    foreground_classes: int | None = None
    volumes_3d: bool = True

    @property
    def trains_volumes(self) -> bool:
        """Whether the method may train with ``configuration 3d_fullres``: a 2D segmentation method on FedUQ's one
        site (not a CT job, not a method with its own 2D loop) whose math is not 2D-only (:attr:`volumes_3d`)."""
        return self.kind == "2d" and self.site_class is None and self.volumes_3d

    @property
    def executor_path(self) -> str:
        """The job's executor class path."""
        return EXECUTOR_CT if self.kind == "ct" else EXECUTOR_2D

    @property
    def workflow_path(self) -> str:
        """The job's round workflow class path."""
        return CONTROLLER_CT if self.kind == "ct" else CONTROLLER_2D

    @property
    def executor_args(self) -> dict:
        """The method's executor arguments: ``site_class``, ``site_part`` and their arguments."""
        return {**({"site_class": self.site_class} if self.site_class else {}),
                **({"site_part": self.site_part} if self.site_part else {}), **self.site_args}

    @property
    def workflow_args(self) -> dict:
        """The method's workflow arguments: ``server_part`` and its arguments."""
        return {**({"server_part": self.server_part} if self.server_part else {}), **self.server_args}

    @property
    def readme(self) -> str:
        """The job's README (the paper's table it reproduces, its settings and commands)."""
        return f"jobs/{self.name}/README.md"


#: every registered method by name, in registration order (2D first)
SPECS: dict[str, MethodSpec] = {}


def register(spec: MethodSpec) -> MethodSpec:
    """Add ``spec`` to :data:`SPECS`.

    Raises:
        ValueError: the name is taken, the kind unknown, or the ledger does not declare one of the job's tasks.
    """
    if spec.name in SPECS:
        raise ValueError(f"method {spec.name!r} is registered twice")
    if spec.kind not in ("2d", "ct"):
        raise ValueError(f"method {spec.name!r}: kind must be '2d' or 'ct', got {spec.kind!r}")
    if spec.foreground_classes is not None and (not isinstance(spec.foreground_classes, int)
                                                or spec.foreground_classes < 1):
        raise ValueError(f"method {spec.name!r}: foreground_classes must be an integer >= 1 or None, got "
                         f"{spec.foreground_classes!r}")
    missing = sorted(set(spec.tasks) - set(spec.ledger))
    if missing:
        raise ValueError(f"method {spec.name!r}: its ledger does not declare task(s) {missing}")
    SPECS[spec.name] = spec
    return spec


def spec_of(method: str) -> MethodSpec:
    """The registration of ``method``.

    Raises:
        ValueError: an unknown method, naming the registered ones.
    """
    if method not in SPECS:
        raise ValueError(f"unknown method {method!r}; registered: {list(SPECS)}")
    return SPECS[method]


def all_methods() -> list[str]:
    """Every registered job, 2D first, in registration order."""
    return list(SPECS)


def is_ct(method: str) -> bool:
    """True for a multi-head CT method."""
    return spec_of(method).kind == "ct"
