"""A site whose process is gone, noticed in seconds: FedUQ's watch over the sites a server task waits for.

A site's FLARE job process tells the server it lives every 10 s (FLARE's job heartbeat, and each task check); the
server's communicator hears it (``WFCommServer.client_is_active``). A site killed by SIGKILL, the OOM killer or a
crash stops talking, but FLARE's simulator never reports it dead and a deployed server only after its own grace
periods, so a task waited for it up to its timeout (3600 s in FedUQ's jobs). :class:`SiteWatch` records when each
site was last heard; while a task waits, a site silent for :data:`SILENT_S` seconds is named as gone (its reason
recorded for the quorum message), and once every site the task still waits for is gone the task is cancelled: the
answers received stand and the quorum rule (:mod:`feduq.flare.quorum`) decides, so a run whose quorum needs that
site fails within about a minute, naming it.

Not in the simulator with fewer threads than sites: there FLARE tears a site's process down between its turns, so
silence is normal (the watch is on in the simulator only when :mod:`feduq.flare.simulator` says every site runs at
once, through :data:`CONCURRENT_ENV`; always in POC and provisioned projects).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Iterable

__all__ = ["SILENT_S", "CONCURRENT_ENV", "SiteWatch", "watch_enabled"]

#: seconds without a sign of life (4 missed job heartbeats) after which a site a task waits for is gone
SILENT_S = 40.0
#: set to "1" by feduq.flare.simulator when every site of the job runs at once (threads >= sites)
CONCURRENT_ENV = "FEDUQ_SIM_ALL_SITES_AT_ONCE"


def watch_enabled(simulate_mode: bool) -> bool:
    """Whether silence means a dead site here: always outside the simulator; in it only when every site runs at
    once (:data:`CONCURRENT_ENV`)."""
    return not simulate_mode or os.environ.get(CONCURRENT_ENV) == "1"


class SiteWatch:
    """When each site was last heard, and which ones a waiting task has lost.

    Args:
        on_gone: called from the watch's thread as ``on_gone(gone, cancel)``: ``gone`` maps each newly silent site
            to its reason; ``cancel`` is True when every site the task still waits for is gone.
        silent_s: silence (s) that makes a site gone. period_s: how often the thread looks. clock: seconds (monotonic).
    """

    def __init__(self, on_gone: Callable[[dict[str, str], bool], None], silent_s: float = SILENT_S,
                 period_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        self.on_gone, self.silent_s, self.period_s, self.clock = on_gone, float(silent_s), float(period_s), clock
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
            gone = {s for s, quiet in silence.items() if quiet >= self.silent_s}
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
