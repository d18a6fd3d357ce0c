"""The registration of every FedUQ method: one typed :class:`MethodSpec` each, the single source its job folder, its
Recipe (:class:`feduq.recipes.recipe.FedUQRecipe`), its privacy ledger and ``feduq compare``'s view of it are made from.

A method is a site part and a server part (dotted paths of classes in :mod:`feduq.methods`, None for FedAvg's) with
their arguments; every 2D job runs them in FedUQ's one executor and one controller
(:class:`feduq.flare.executor.FedUQExecutor`, :class:`feduq.flare.controller.FedUQController`), every multi-head CT
job in the CT pair (:class:`feduq.flare.ct.CTExecutor`, :class:`feduq.flare.ct.CTController`). The settings every
2D job shares are :data:`COMMON_CLIENT_ARGS`, the official FedEvi polyp setting; what leaves a site is the spec's
``ledger`` (:func:`feduq.privacy.ledger.declare`). Adding a method is one module in :mod:`feduq.methods` and one
:func:`register` call in :mod:`feduq.registry.methods` (see the README's "Adding a method").
"""

from __future__ import annotations

from .methods import COMMON_CLIENT_ARGS, CT_ITERATIONS, CT_ROUNDS, NUM_ROUNDS
from .spec import (
    CONTROLLER_2D,
    CONTROLLER_CT,
    EXECUTOR_2D,
    EXECUTOR_CT,
    SPECS,
    TASKS_2D,
    MethodSpec,
    all_methods,
    is_ct,
    register,
    spec_of,
)


# -- what the jobs and tools read -------------------------------------------------------------------------------------
def method_task(method: str) -> str:
    """The FedUQ task a method's job runs on."""
    return spec_of(method).task


def task_settings(task: str) -> dict:
    """Sites (= centers), input channels and classes of a task, from the FedUQ data registry."""
    from ..data import get_task

    t = get_task(task)
    held_out = t.held_out  # a task's held-out sites never train
    return {"sites": [c for c in t.centers if c not in held_out], "in_channels": t.in_channels,
            "num_classes": len(t.class_names)}


def method_sites(method: str) -> list[str]:
    """The job's sites: the method's own list (virtual sites) or its task's centers."""
    spec = spec_of(method)
    return list(spec.sites or task_settings(spec.task)["sites"])


def network_args(method: str) -> dict:
    """The method's ``network`` (``{"name": ..., **options}``): the common one with the method's overrides; a method
    naming another network gets only its own options."""
    own = spec_of(method).network
    if "name" in own:
        return dict(own)
    return {**COMMON_CLIENT_ARGS["network"], **own}


def registered_method(executor_path: str, site_part: str | None = None, site_class: str | None = None) -> str | None:
    """The first method registered with the executor at ``executor_path``, ``site_part`` and ``site_class``; None
    when none is."""
    return next((name for name, s in SPECS.items()
                 if (s.executor_path, s.site_part, s.site_class) == (executor_path, site_part, site_class)), None)


def method_site_part(method: str) -> type:
    """The site part class of a 2D method (:class:`feduq.parts.site.SitePart`, FedAvg's, when it names none)."""
    from ..parts.site import SitePart, site_part_class

    spec = spec_of(method)
    if spec.site_class is not None:  # FedUAA's classification loop builds its own part
        from ..common.classpath import resolve_class

        return resolve_class(spec.site_class).SITE_PART
    return site_part_class(spec.site_part) if spec.site_part else SitePart


def method_task_error(method: str, task, configuration: str = "2d") -> str | None:
    """Why ``method`` cannot run on ``task`` (a :class:`feduq.data.TaskSpec`) with ``configuration``, in one line
    naming the method, the task and its classes; None when it can. Read from the registration
    (``MethodSpec.foreground_classes``: FedA3I's noise estimate is written for one foreground class;
    ``MethodSpec.trains_volumes``: ``3d_fullres`` only for a method whose math holds voxel by voxel), whatever the
    job's network."""
    spec = spec_of(method)
    if configuration != "2d" and task.kind != "3d":
        return (f"configuration {configuration!r} trains nnU-Net's 3D network on volumes, but task {task.name!r} holds "
                f"2D images ({task.file_ending} files)")
    if configuration != "2d" and not spec.trains_volumes:
        why = ("its noise estimate scores 2D boundary-band contours" if not spec.volumes_3d else
               "it trains with its own 2D loop" if spec.site_class else "it is a multi-head CT method")
        return f"method {method!r} cannot train with configuration {configuration!r}: {why} (use configuration '2d')"
    need = spec.foreground_classes
    found = list(task.class_names[1:])
    if need is None or len(found) == need:
        return None
    what = "a binary task (1 foreground class)" if need == 1 else f"{need} foreground classes"
    return (f"method {method!r} needs {what}; task {task.name!r} has {len(found)}: {', '.join(found)} (refused "
            "whatever the network)")
