"""CPU threads for the site processes of one job that share a host (simulator, POC on one machine): all cores, no more.

A torch process takes every core by default. The NVFlare simulator runs one process per site, so four polyp sites on
a 2-core machine run 4 x 2 threads on 2 cores, and OpenMP threads that spin at barriers waste most of the time (the
committed FedEvi job took about 850 s per 128 px round against 290 s for the authors' single-process code). With
one thread each the sites no longer compete, but the largest site (Kvasir-SEG, 72 % of the steps) then trains on
one core while the other idles once the small sites are done.

:class:`HostCoreShare` gives each FedUQ process that is *computing now* on this host an equal share of the host's
cores and re-reads the share while it computes: a site that still trains when the others are done takes the cores
they freed. Each computing process holds a small file ``<member>.<pid>`` in one folder per user (under the system's
temporary folder), so two simulations started side by side share the cores too; files of processes that no longer
exist are ignored and removed. A site alone on its host (a real deployment) gets every core, as torch's default
would give it. No FLARE here: the executor opens one share per
task (:meth:`HostCoreShare.computing`) and refreshes it every training step.
"""

from __future__ import annotations

import os
import re
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import torch

__all__ = ["HostCoreShare", "default_folder", "host_cores", "threads_for"]


def default_folder() -> Path:
    """``<tmp>/feduq-cores-<uid>``: where this user's computing FedUQ processes hold their places."""
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"feduq-cores-{uid}"


def host_cores() -> int:
    """Cores this process may run on (its CPU affinity; ``os.cpu_count()`` where affinity is unknown), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def threads_for(cores: int, members: list[str], me: str) -> int:
    """Threads of ``me`` when ``members`` (``me`` among them) share ``cores`` equally.

    The shares add up to ``cores`` while there are no more members than cores: ``cores // n`` each, and one more for
    the first ``cores % n`` members in sorted order; with more members than cores, one thread each.

    Raises:
        ValueError: ``cores < 1``, or ``me`` not in ``members``.

    >>> [threads_for(8, ["a", "b", "c"], m) for m in "abc"]
    [3, 3, 2]
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    ordered = sorted(set(members))
    if me not in ordered:
        raise ValueError(f"{me!r} is not among the members {ordered}")
    base, extra = divmod(cores, len(ordered))
    return max(1, base + (1 if ordered.index(me) < extra else 0))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, another user's
        return True
    return True


class HostCoreShare:
    """This process's share of the host's cores among the FedUQ processes on the host that compute now.

    Args:
        member: this process's name (``<job id>-<site>``; only for reading the folder: the pid makes it unique).
        cores: cores to share (default :func:`host_cores`).
        folder: where the members' files live (default ``<tmp>/feduq-cores-<uid>``).
        refresh_s: :meth:`refresh` re-reads the members at most this often (seconds).

    Attributes:
        threads: the torch intra-op threads last set (0 before the first :meth:`refresh`).
    """

    def __init__(self, member: str, cores: int | None = None, folder: Path | None = None, refresh_s: float = 2.0):
        self.folder = Path(folder) if folder is not None else default_folder()
        self.member = re.sub(r"[^A-Za-z0-9_-]", "_", str(member))
        self.cores = int(cores) if cores is not None else host_cores()
        if self.cores < 1:
            raise ValueError(f"cores must be >= 1, got {cores!r}")
        self.refresh_s = float(refresh_s)
        self.threads = 0
        self._file = self.folder / f"{self.member}.{os.getpid()}"
        self._last = -float("inf")

    def members(self) -> list[str]:
        """``<member>.<pid>`` of every live computing process (files of dead processes are removed)."""
        live = []
        for path in self.folder.glob("*.*"):
            pid = path.suffix[1:]
            if not pid.isdigit():
                continue
            if _alive(int(pid)):
                live.append(path.name)
            else:
                path.unlink(missing_ok=True)
        return live

    def refresh(self, force: bool = False) -> int:
        """Set torch's intra-op threads to this process's share now (at most every ``refresh_s``); returns it."""
        now = time.monotonic()
        if not force and now - self._last < self.refresh_s:
            return self.threads
        self._last = now
        members = self.members()
        if self._file.name not in members:  # not computing (outside :meth:`computing`): count as one
            members.append(self._file.name)
        threads = threads_for(self.cores, members, self._file.name)
        if threads != self.threads:
            torch.set_num_threads(threads)
            self.threads = threads
        return threads

    @contextmanager
    def computing(self):
        """Hold a place among the host's computing processes for the ``with`` block, with this process's share set."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._file.touch()
        try:
            self.refresh(force=True)
            yield self
        finally:
            self._file.unlink(missing_ok=True)
