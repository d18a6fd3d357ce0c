"""A site whose process is gone, noticed in seconds: FedUQ's watch over the sites a server task waits for.

A site's FLARE job process tells the server it lives every 10 s (FLARE's job heartbeat, and each task check); the
server's communicator hears it (``WFCommServer.client_is_active``). A site killed by SIGKILL, the OOM killer or a
crash stops talking, but FLARE's simulator never reports it dead and a deployed server only after its own grace
periods, so a task waited for it up to its timeout (3600 s in FedUQ's jobs). :class:`SiteWatch` records when each
site was last heard; while a task waits, a site silent for :data:`SILENT_S` seconds is named as gone (its reason
recorded for the quorum message), and once every site the task still waits for is gone the task is cancelled: the
answers received stand and the quorum rule (:mod:`feduq.flare.quorum`) decides, so a run whose quorum needs that
site fails within about a minute, naming it.

A site that is silent but whose process still runs on this host (a simulator's site worker, starved of CPU by a long
test task beside other jobs: its heartbeat thread missed four beats) is busy, not gone: :func:`simulator_site_alive`
looks for it, and the watch names only a site whose process it cannot find (or, off the simulator's host, any silent
one). A run killed that way once lost ten minutes of a CT sweep at its last task.

Not in the simulator with fewer threads than sites: there FLARE tears a site's process down between its turns, so
silence is normal (the watch is on in the simulator only when :mod:`feduq.flare.simulator` says every site runs at
once, through :data:`CONCURRENT_ENV`; always in POC and provisioned projects).
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable, Iterable

__all__ = ["SILENT_S", "CONCURRENT_ENV", "SiteWatch", "simulator_site_alive", "watch_enabled", "watch_sites"]

#: seconds without a sign of life (4 missed job heartbeats) after which a site a task waits for is gone
SILENT_S = 40.0
#: set to "1" by feduq.flare.simulator when every site of the job runs at once (threads >= sites)
CONCURRENT_ENV = "FEDUQ_SIM_ALL_SITES_AT_ONCE"


def watch_enabled(simulate_mode: bool) -> bool:
    """Whether silence means a dead site here: always outside the simulator; in it only when every site runs at
    once (:data:`CONCURRENT_ENV`)."""
    return not simulate_mode or os.environ.get(CONCURRENT_ENV) == "1"


#: the module FLARE's simulator runs each site's process with
SIMULATOR_WORKER = "nvflare.private.fed.app.simulator.simulator_worker"


def simulator_site_alive(simulator_root: str | os.PathLike, proc: str | os.PathLike = "/proc"
                         ) -> Callable[[str], bool | None]:
    """``alive(site)``: whether this host runs the site's process of the simulation in ``simulator_root`` (FLARE's
    ``simulator_worker ... --client <site> ... --simulator_root <root>``, read from ``/proc/<pid>/cmdline``); None
    (unknown) where there is no ``/proc``. Another simulation's site of the same name does not count."""
    roots = {str(Path(simulator_root).resolve())}
    proc = Path(proc)

    def arg(argv: list[str], flag: str) -> str | None:
        return argv[argv.index(flag) + 1] if flag in argv[:-1] else None

    def alive(site: str) -> bool | None:
        if not proc.is_dir():
            return None
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:  # ended while we looked, or not ours to read
                continue
            if SIMULATOR_WORKER in argv and arg(argv, "--client") == site:
                root = arg(argv, "--simulator_root")
                if root is not None and str(Path(root).resolve()) in roots:
                    return True
        return False

    return alive


class SiteWatch:
    """When each site was last heard, and which ones a waiting task has lost.

    Args:
        on_gone: called from the watch's thread as ``on_gone(gone, cancel)``: ``gone`` maps each newly silent site
            to its reason; ``cancel`` is True when every site the task still waits for is gone.
        silent_s: silence (s) that makes a site gone. period_s: how often the thread looks. clock: seconds (monotonic).
        alive: ``alive(site) -> True | False | None``: whether the site's process is known to run on this host
            (:func:`simulator_site_alive`); a silent site it calls alive is busy, not gone. None: every silent site
            is gone.
    """

    def __init__(self, on_gone: Callable[[dict[str, str], bool], None], silent_s: float = SILENT_S,
                 period_s: float = 2.0, clock: Callable[[], float] = time.monotonic,
                 alive: Callable[[str], bool | None] | None = None):
        self.on_gone, self.silent_s, self.period_s, self.clock = on_gone, float(silent_s), float(period_s), clock
        self.alive = alive
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._pending: set[str] = set()
        self._since = 0.0
        self._named: set[str] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def heard(self, site: str) -> None:
        """A sign of life from ``site`` (a job heartbeat, a task check, a result)."""
        with self._lock:
            self._last[site] = self.clock()

    def expect(self, sites: Iterable[str]) -> None:
        """A task now waits for ``sites``."""
        with self._lock:
            self._pending, self._since, self._named = set(sites), self.clock(), set()

    def answered(self, site: str) -> None:
        with self._lock:
            self._pending.discard(site)

    def done(self) -> None:
        """The task ended."""
        with self._lock:
            self._pending = set()

    def check(self) -> tuple[dict[str, str], bool]:
        """``(newly gone sites -> reason, cancel)`` now (also what the thread calls)."""
        now = self.clock()
        with self._lock:
            if not self._pending:
                return {}, False
            silence = {s: now - max(self._last.get(s, self._since), self._since) for s in self._pending}
            silent = {s for s, quiet in silence.items() if quiet >= self.silent_s}
            named = set(self._named)
        busy = {s for s in silent - named if self.alive is not None and self.alive(s) is True}  # outside the lock
        with self._lock:
            gone = silent - busy
            new = {s: (f"no sign of life for {silence[s]:.0f} s while the server waited for it: its process is gone "
                       f"(killed, out of memory or crashed)") for s in sorted(gone - self._named)}
            self._named |= gone
            cancel = bool(gone) and gone >= self._pending
            if cancel:
                self._pending = set()
        return new, cancel

    def start(self) -> None:
        def loop():
            while not self._stop.wait(self.period_s):
                gone, cancel = self.check()
                if gone or cancel:
                    self.on_gone(gone, cancel)

        self._thread = threading.Thread(target=loop, name="feduq-site-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()


def watch_sites(communicator, fl_ctx, on_gone: Callable[[dict[str, str], bool], None],
                silent_s: float = SILENT_S) -> tuple[SiteWatch, Path] | None:
    """Start a :class:`SiteWatch` over the sites a server controller's ``communicator`` (FLARE's ``WFCommServer``)
    hears, where silence means a dead site (:func:`watch_enabled`): FLARE's ``client_is_active`` hook (each job
    heartbeat and task check) is wrapped to record each sign of life. Returns ``(the watch, the simulator root)`` (in
    FLARE's simulator the server's workspace is ``<root>/server`` and each site's process a simulator worker of that
    root; elsewhere no such process exists and every silent site is gone), or None where no watch runs."""
    from nvflare.apis.fl_constant import FLContextKey

    if communicator is None or not watch_enabled(bool(fl_ctx.get_prop(FLContextKey.SIMULATE_MODE, False))):
        return None
    simulator_root = Path(fl_ctx.get_engine().get_workspace().get_root_dir()).resolve().parent
    watch = SiteWatch(on_gone, silent_s=silent_s, alive=simulator_site_alive(simulator_root))
    heard = communicator.client_is_active

    def client_is_active(client_name, reason, ctx):
        watch.heard(client_name)
        return heard(client_name, reason, ctx)

    communicator.client_is_active = client_is_active
    watch.start()
    return watch, simulator_root
