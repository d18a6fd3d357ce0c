"""What every FedUQ site executor does the same on FLARE, whatever trains underneath.

:class:`SiteExecutor` is the FLARE side of a site: it sets the site up once at ``START_RUN`` and, when that fails,
keeps the site connected and answers every task with the site-named reason (so the server knows at once who failed
and why, and stops the job when its quorum is lost, :mod:`feduq.flare.quorum`; a silent exit would leave the server
waiting); it dispatches tasks to handlers ``(FLModel, FLContext) -> FLModel``, holds this site's share of the host's
cores while a task computes (:mod:`feduq.core.threads`), gives the freed heap back to the OS after each task, turns an
exception into an ``EXECUTION_EXCEPTION`` reply naming the site, the task and the error, and lets the back-end delete
what it wrote outside the workspace when the run ends (``END_RUN``: FLARE's site processes end without Python's exit
handlers, so a temporary folder would outlive the job).

Two back-ends subclass it: the 2D trainer (:class:`feduq.flare.executor.FedUQExecutor`, every 2D method) and
nnU-Net's (:class:`feduq.flare.ct.CTExecutor`, multi-head CT). A back-end gives :meth:`SiteExecutor._setup`,
:meth:`SiteExecutor._setup_failed` (so that :meth:`SiteExecutor.ready` is False after a half-finished set-up),
:meth:`SiteExecutor.task_handlers` and :meth:`SiteExecutor.ready`, and may give :meth:`SiteExecutor._teardown`.
"""

from __future__ import annotations

import contextlib
import json
from typing import Callable

from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel
from nvflare.app_common.utils.fl_model_utils import FLModelUtils
from nvflare.fuel.utils.memory_utils import cleanup_memory

from ..core.threads import HostCoreShare
from .quorum import error_reply

Handler = Callable[[FLModel, FLContext], FLModel]


class SiteExecutor(Executor):
    """The FLARE side every FedUQ site shares (see the module docstring); subclasses are the training back-ends.

    Attributes:
        site: the site's name (FLARE's client name), set at ``START_RUN``.
        cores: this site's share of the host's cores (``num_threads`` 0), or None when the job fixes the threads.
    """

    #: a setting a site may own (FLARE's ``set_per_site_config``, :mod:`feduq.recipes.addons`) -> the back-end's attribute
    PER_SITE_ATTRIBUTES = {"device": "device_name", "batch_size": "batch_size", "num_threads": "num_threads",
                           "num_workers": "num_workers"}

    def __init__(self, per_site: dict | None = None):
        super().__init__()
        self.per_site = dict(per_site or {})
        self.site = "?"
        self.cores: HostCoreShare | None = None
        self._setup_error: str | None = None
        self._setup_stack: contextlib.ExitStack | None = None  # open while the site sets up (START_RUN)

    # -- what a back-end gives -----------------------------------------------------------------------
    def _setup(self, fl_ctx: FLContext) -> None:
        """Build the site (data, network, optimiser) once per run; raise with a reason naming what is wrong."""
        raise NotImplementedError

    def _setup_failed(self) -> None:
        """Drop what a failed set-up left half-built, so :meth:`ready` is False."""

    def _teardown(self) -> None:
        """Delete what the site wrote outside its workspace (called at ``END_RUN``, and after a failed set-up)."""

    def ready(self) -> bool:
        """Whether the set-up succeeded and tasks can run."""
        raise NotImplementedError

    def task_handlers(self) -> dict[str, Handler]:
        """Task name -> handler."""
        raise NotImplementedError

    def check_task(self, task_name: str) -> str | None:
        """The reason, naming the site, this site refuses ``task_name`` (a held-out CT site never trains); None = it runs it."""
        return None

    def before_task(self) -> None:
        """Called before each task's handler, inside the core share (the 2D trainer re-reads it every step)."""

    # -- FLARE ---------------------------------------------------------------------------------------
    def share_cores(self, fl_ctx: FLContext) -> None:
        """``num_threads`` 0: take this site's share of the host's cores among the FedUQ processes computing now;
        the start-up (decoding and caching the data) computes too, so it holds the share from here on."""
        self.cores = HostCoreShare(member=f"{fl_ctx.get_job_id()}-{self.site}")
        if self._setup_stack is not None:
            self._setup_stack.enter_context(self.cores.computing())

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.END_RUN:
            self._teardown()
        if event_type != EventType.START_RUN:
            return
        self.site = fl_ctx.get_identity_name()
        try:
            with contextlib.ExitStack() as self._setup_stack:
                self._apply_per_site(fl_ctx)
                self._setup(fl_ctx)
        except Exception as e:  # a clear, site-named error instead of a crash deep in a worker
            self._setup_failed()
            self._teardown()
            self._setup_error = str(e) if str(e).startswith(f"site {self.site!r}") else f"site {self.site!r}: {e}"
            self.log_error(fl_ctx, f"FedUQ setup failed: {self._setup_error}")
        finally:
            self._setup_stack = None

    def _apply_per_site(self, fl_ctx: FLContext) -> None:
        """This site's own settings of the job's ``per_site`` argument, over the job's (logged, one line)."""
        mine = self.per_site.get(self.site) or {}
        for key, value in mine.items():
            attr = self.PER_SITE_ATTRIBUTES.get(key)
            if attr is None or not hasattr(self, attr):
                raise ValueError(f"per-site setting {key!r} is not one this site's executor has")
            setattr(self, attr, value)
        if mine:
            self.log_info(fl_ctx, "FEDUQ_PER_SITE " + json.dumps({"site": self.site, **mine}))

    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        handlers = self.task_handlers()
        if task_name not in handlers:
            reason = f"site {self.site!r}: unknown task {task_name!r} (known: {sorted(handlers)})"
            self.log_error(fl_ctx, reason)
            return error_reply(ReturnCode.TASK_UNKNOWN, reason)
        if not self.ready():
            reason = f"setup failed: {self._setup_error or f'site {self.site!r}: executor not set up'}"
            self.log_error(fl_ctx, f"cannot run task {task_name!r}: {reason}")
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, reason)
        refused = self.check_task(task_name)
        if refused:
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, refused)
        try:
            received = FLModelUtils.from_shareable(shareable)
            with self.cores.computing() if self.cores is not None else contextlib.nullcontext():
                self.before_task()
                result = handlers[task_name](received, fl_ctx)
            # the task's activations are freed but glibc keeps the heap: give it back (gc + malloc_trim), so a site
            # waiting for the server holds ~440 MB PSS instead of ~860 MB (128 px fedevi_unet, tests/unit/core/test_memory.py)
            cleanup_memory()
            if abort_signal.triggered:
                return make_reply(ReturnCode.TASK_ABORTED)
            return FLModelUtils.to_shareable(result)
        except Exception as e:
            reason = f"site {self.site!r}: task {task_name!r} failed: {type(e).__name__}: {e}"
            self.log_exception(fl_ctx, reason)
            return error_reply(ReturnCode.EXECUTION_EXCEPTION, reason)
