"""FedUQ's FLARE executor for 2D sites, every 2D method's: :class:`feduq.site.site2d.Site2D` on FLARE.

What the site does (data, network, training, validation, test, the method's site part) is
:class:`feduq.site.site2d.Site2D`, which needs no FLARE engine. :class:`FedUQExecutor` adds the FLARE side from
:class:`feduq.flare.site_executor.SiteExecutor`: at ``START_RUN`` it reads the site's config from its workspace
(``local/feduq_site.json``) and starts the site in the job's run folder; it writes the site's log lines to FLARE's
log, streams each round's numbers to the server's TensorBoard through the job's TBWriter, holds the site's share of
the host's cores, and answers each task (or a failed set-up) with a reply naming the site.

No method has a class here: a job names this executor and its method's site part with the part's arguments beside
the site's (FedProx: ``{"site_part": "feduq.methods.fedprox.FedProxSite", "mu": 0.01}``; FedAvg: no ``site_part``),
and :class:`feduq.flare.controller.FedUQController` with its server part (``server_part``). A method with a training
loop of its own (FedUAA's image classification) names its FLARE-free site class too (``site_class``, a subclass of
:class:`feduq.site.site2d.Site2D` in :mod:`feduq.methods`); the executor then runs that site on FLARE.
"""

from __future__ import annotations

from typing import Callable

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel

from ..common.checks import method_part_class
from ..tasks import declared as task_files
from ..parts.site import build_site_part, job_site_part
from ..site.site2d import Site2D
from ..site.site3d import Site3D
from .site_config import read_site_config, site_run_folder
from .site_executor import SiteExecutor


class FedUQExecutor(Site2D, SiteExecutor):
    """FLARE executor for 2D segmentation sites (FedAvg behaviour by default): :class:`feduq.site.site2d.Site2D` on FLARE.

    Tasks handled: ``train``, ``validate``, ``test``, ``submit_model`` and the method's extra tasks
    (:meth:`feduq.site.site2d.Site2D.tasks`). The method's site part is ``site_part`` (a job argument) or the class's
    :attr:`SITE_PART`, built from the job's arguments it names (:func:`feduq.parts.site.build_site_part`): a method's
    executor class only names its site part (FedProx: ``SITE_PART = FedProxSite``).

    Args:
        tracking_writer_id: id of an NVFlare ``TBWriter`` component; each round's numbers (validation
            Dice of the received model, loss, time, method statistics) are streamed to the server's
            TensorBoard (``<server run dir>/tb_events/<site>/``). Absent component: no streaming.
        per_site: site -> its own settings over the job's (``device``, ``batch_size``, ``num_threads``,
            ``num_workers``; FLARE's ``set_per_site_config``, :mod:`feduq.recipes.addons`).
        site_part: dotted path of the method's :class:`feduq.parts.site.SitePart` class (e.g.
            ``"feduq.methods.fedprox.FedProxSite"``); None: :attr:`SITE_PART`.
        configuration: ``"2d"`` (default) or ``"3d_fullres"``: a volume task's sites train nnU-Net's 3D network of
            the job's ``plans`` (:class:`feduq.site.site3d.Site3D`, its arguments ``plans``, ``iterations``...).
        site_class: dotted path of a method's own 2D site, a :class:`feduq.site.site2d.Site2D` subclass in
            :mod:`feduq.methods` with its own training loop (e.g.
            ``"feduq.methods.feduaa.classification.FedUAAClassificationSite"``); the executor is then that site on
            FLARE (:meth:`job_class`), its arguments beside the others. None: :class:`feduq.site.site2d.Site2D`.
        **kwargs: the site part's arguments (e.g. FedProx's ``mu``) and the site's settings, :class:`feduq.site.site2d.Site2D`
            (task, image_size, batch_size, local_epochs, lr, network, test_protocol, dp, ...).

    Raises:
        ValueError: ``site_part`` or ``site_class`` does not name a site part or a 2D site in :mod:`feduq.methods`, or
            an argument is out of range (named).
    """

    #: the method's site part class (None: FedAvg's, :class:`feduq.parts.site.SitePart` with ``loss``)
    SITE_PART: type | None = None

    def __new__(cls, *args, site_class: str | None = None, **kwargs):
        volume = kwargs.get("configuration", "2d") != "2d"
        return super().__new__(cls.job_class({"site_class": site_class, **kwargs}) if site_class or volume else cls)

    @classmethod
    def job_class(cls, args: dict) -> type:
        """The class an executor spec's arguments ``args`` make: this executor, with ``site_class`` that site on FLARE
        (a subclass of both, the site's methods first; one class per site class), or with ``configuration``
        ``"3d_fullres"`` the volume site :class:`feduq.site.site3d.Site3D` on FLARE.

        Raises:
            ValueError: ``site_class`` is not a :class:`feduq.site.site2d.Site2D` subclass in :mod:`feduq.methods`;
                ``configuration`` is neither ``"2d"`` nor ``"3d_fullres"``, or comes with a ``site_class``.
        """
        path = args.get("site_class")
        configuration = args.get("configuration", "2d")
        if configuration not in task_files.CONFIGURATIONS:
            raise ValueError(f"executor argument configuration={configuration!r}: expected one of "
                             f"{task_files.CONFIGURATIONS}")
        if (not path and configuration == "2d") or cls in _ON_FLARE.values():  # already a site on FLARE
            return cls
        if configuration != "2d":
            if path:
                raise ValueError(f"executor argument site_class={path!r} runs its own 2D loop: it cannot train with "
                                 f"configuration={configuration!r}")
            site = Site3D
        else:
            site = method_part_class(path, Site2D, "executor argument site_class",
                                     "feduq.methods.feduaa.classification.FedUAAClassificationSite")
        if (site, cls) not in _ON_FLARE:
            _ON_FLARE[site, cls] = type(f"{cls.__name__}[{site.__name__}]", (site, cls),
                                        {"__module__": __name__, "__doc__": f"{site.__qualname__} on FLARE."})
        return _ON_FLARE[site, cls]

    def __init__(self, tracking_writer_id: str | None = "tb_writer", site_part: str | None = None,
                 per_site: dict | None = None, site_class: str | None = None, configuration: str = "2d", **kwargs):
        SiteExecutor.__init__(self, per_site)
        if "method" not in kwargs:  # a site with its own loop (FedUAA's classification) passes its part itself
            method, kwargs = build_site_part(job_site_part(type(self), site_part), kwargs)
            kwargs["method"] = method
        Site2D.__init__(self, **kwargs)
        self.tracking_writer_id = tracking_writer_id
        self._task_ctx: FLContext | None = None  # the FLContext of the set-up or task running now (for the log)

    # -- the FLARE side of the site's log and cores ----------------------------------------------------------
    def log(self, line: str) -> None:
        self.log_info(self._task_ctx, line)

    def warn(self, line: str) -> None:
        self.log_warning(self._task_ctx, line)

    def take_core_share(self) -> None:
        if self._task_ctx is not None:  # started by FLARE; used as a plain Site2D (feduq virtual): none
            self.share_cores(self._task_ctx)

    # -- SiteExecutor's back-end -------------------------------------------------------------------------------
    def _setup(self, fl_ctx: FLContext) -> None:
        self._task_ctx = fl_ctx
        if self.tracking_writer_id:
            self.writer = fl_ctx.get_engine().get_component(self.tracking_writer_id)
        self.start(self.site, read_site_config(fl_ctx), site_run_folder(fl_ctx))

    def task_handlers(self) -> dict[str, Callable[[FLModel, FLContext], FLModel]]:
        def on_flare(handler: Callable[[FLModel], FLModel]):
            def run(received: FLModel, fl_ctx: FLContext) -> FLModel:
                self._task_ctx = fl_ctx
                return handler(received)
            return run
        return {name: on_flare(handler) for name, handler in self.tasks().items()}

    def before_task(self) -> None:
        if self.cores is not None:  # re-read the share every training step: take the cores other sites freed
            self.trainer.step_hook = self.cores.refresh


#: (a method's own 2D site class, executor class) -> that site on FLARE (:meth:`FedUQExecutor.job_class`)
_ON_FLARE: dict[tuple[type, type], type] = {}
