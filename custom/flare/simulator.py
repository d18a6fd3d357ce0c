"""FLARE 2.9's simulator with its client-identity race closed: the entry point FedUQ's tools and Recipes run
(``python -m feduq.flare.simulator JOB -w WS -t N``, the same arguments as
``python -m nvflare.private.fed.app.simulator.simulator``, which this module runs unchanged otherwise).

The race (FLARE 2.9, ``SimulatorClientRunner.do_one_task``): each simulator thread starts a site's worker process
and then sends it the site's build context, a dict **shared by all threads** into which the thread first writes its
site's name (``self.build_ctx["client_name"] = ...``) and which it pickles only when sending. When another thread
writes its own site's name in between (likely when the threads start together and the host is loaded), a worker
started for site A in A's workspace takes site B's identity for the whole run: it fetches B's tasks and trains on
B's data, so one site's data counts twice and A's never. FedUQ's round loop rejects such an update by name
(:func:`feduq.parts.server.check_sender`), which keeps the global model right but can stop a job whose quorum then
fails; this module removes the cause by giving each thread its own copy of the build context.

A job run with ``nvflare simulator`` (FLARE's own command) keeps the race; the round loop's check still guards it.

A second race, on a busy host: for each site FLARE picks a free TCP port for the control connection to the site's
worker process (``get_open_ports``: bind port 0, note the number, close it) and the worker binds that port seconds
later, once its imports are done (longer on an oversubscribed CPU). Port 0 draws from the kernel's ephemeral range,
the range every other automatic bind and outgoing connection on the host draws from too (FLARE's own cells, another
simulation beside it), so the port can be taken in between: the worker cannot bind and dies, and the simulator,
connected to whatever listens there, reads "Connection reset by peer" and loses the site ("Communication error with
client ...", then the site's process is gone). :func:`worker_port` picks the worker's port below the ephemeral
range instead, where nothing is handed out automatically, and checks that it is free. Two FedUQ simulations on one
host (two jobs, or a test run two at a time) could still draw the same free port for workers that bind it seconds
later; each drawn port is therefore claimed for :data:`CLAIM_S` seconds by a file in a folder every simulation on the
host shares (``<tmp>/feduq-worker-ports/<port>``, created exclusively), and a port another simulation claimed is not
drawn.
"""

from __future__ import annotations

import os
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from nvflare.private.fed.app.simulator import simulator_runner


class ThreadOwnBuildContext:
    """A data descriptor for ``SimulatorClientRunner.build_ctx``: the runner keeps the dict it was given; each thread
    reads and writes its own shallow copy (made at its first read), so a site name one thread writes is never the one
    another thread sends."""

    def __set_name__(self, owner, name):
        self.shared, self.local = f"_feduq_{name}_shared", f"_feduq_{name}_local"

    def __get__(self, runner, owner=None):
        if runner is None:
            return self
        own = runner.__dict__[self.local]
        if not hasattr(own, "ctx"):
            shared = runner.__dict__[self.shared]
            own.ctx = dict(shared) if isinstance(shared, dict) else shared
        return own.ctx

    def __set__(self, runner, value):
        runner.__dict__[self.shared] = value
        runner.__dict__[self.local] = threading.local()


def close_identity_race(runner_class=simulator_runner.SimulatorClientRunner) -> None:
    """Install :class:`ThreadOwnBuildContext` on FLARE's simulator client runner (idempotent; call before the
    simulator starts: its client runner is made in a forked process, which inherits the class)."""
    if not isinstance(runner_class.__dict__.get("build_ctx"), ThreadOwnBuildContext):
        descriptor = ThreadOwnBuildContext()
        descriptor.__set_name__(runner_class, "build_ctx")
        runner_class.build_ctx = descriptor


#: the kernel's ephemeral port range (automatic binds and outgoing connections), where it cannot be read
EPHEMERAL_DEFAULT = (32768, 60999)
#: how many ports below the ephemeral range :func:`worker_port` draws from
WORKER_PORTS = 8000
#: seconds a drawn port stays claimed for its worker (its imports and bind take seconds; a minute on a loaded host)
CLAIM_S = 600.0


def _claim(port: int, claims: Path | None) -> bool:
    """Claim ``port`` for this simulation in the folder ``claims`` (None: no claims): False when another simulation
    claimed it less than :data:`CLAIM_S` seconds ago. A folder that cannot be written claims nothing (True)."""
    if claims is None:
        return True
    marker = claims / str(port)
    try:
        claims.mkdir(mode=0o777, exist_ok=True)
        fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    except FileExistsError:
        try:
            if time.time() - marker.stat().st_mtime < CLAIM_S:
                return False
            os.utime(marker)  # a stale claim (its simulation ended long ago): this one takes it
            return True
        except OSError:
            return False
    except OSError:
        return True
    os.close(fd)
    return True


def ephemeral_range(path: str | Path = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int]:
    """``(low, high)`` of the kernel's ephemeral ports (Linux' ``ip_local_port_range``; the IANA range elsewhere)."""
    try:
        low, high = (int(v) for v in Path(path).read_text().split()[:2])
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT


def worker_port(rng: random.Random | None = None, ephemeral: tuple[int, int] | None = None, tries: int = 200,
                claims: Path | None | str = "host") -> int:
    """A free TCP port for a site worker's control connection, below the host's ephemeral range (module docstring):
    drawn at random from the :data:`WORKER_PORTS` ports under it (at least 1024), checked by binding
    ``localhost:port`` as the worker will (Python's ``multiprocessing.connection.Listener``, ``SO_REUSEADDR``), and
    claimed in the folder ``claims`` so that no other simulation on the host draws it (``"host"``: the host's shared
    ``<tmp>/feduq-worker-ports``; None: no claims).

    Raises:
        OSError: no free port after ``tries`` draws (the range is full, or the ephemeral range starts too low).
    """
    rng = rng or random.SystemRandom()
    low = (ephemeral or ephemeral_range())[0]
    first = max(1024, low - WORKER_PORTS)
    if low - first < 64:
        raise OSError(f"the ephemeral port range starts at {low}: no room below it for the simulator's worker ports")
    if claims == "host":
        claims = Path(tempfile.gettempdir()) / "feduq-worker-ports"
    for _ in range(tries):
        port = rng.randrange(first, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("localhost", port))
                s.listen(1)
            except OSError:
                continue
        if not _claim(port, claims):
            continue
        return port
    raise OSError(f"no free port in {first}..{low - 1} for the simulator's site workers after {tries} tries")


def reserve_worker_ports(module=simulator_runner) -> None:
    """Make FLARE's simulator pick its site workers' ports with :func:`worker_port` (its module-level
    ``get_open_ports``, used there only for that port; idempotent)."""
    if getattr(module.get_open_ports, "__name__", "") != "_worker_ports":
        def _worker_ports(number: int) -> list[int]:
            return [worker_port() for _ in range(int(number))]

        module.get_open_ports = _worker_ports


def main(argv: list[str] | None = None) -> int:
    """Parse FLARE's simulator arguments, close the race and run the simulator; returns its exit status."""
    import argparse

    from nvflare.private.fed.app.simulator.simulator import define_simulator_parser, run_simulator
    from nvflare.private.fed.app.utils import version_check

    if sys.platform == "darwin":  # as FLARE's entry point: macOS needs 'spawn' (the child then imports FLARE's class
        import multiprocessing  # afresh, so there the round loop's check is the guard)

        multiprocessing.set_start_method("spawn")
    version_check()
    parser = argparse.ArgumentParser(prog="python -m feduq.flare.simulator")
    define_simulator_parser(parser)
    args = parser.parse_args(argv)
    close_identity_race()
    reserve_worker_ports()
    _say_if_every_site_runs_at_once(args)
    return run_simulator(args)


def _say_if_every_site_runs_at_once(args) -> None:
    """Tell FedUQ's server watch (:mod:`feduq.flare.liveness`) that a silent site is a dead one: every site of the job
    has its own thread (with fewer, FLARE tears a site's process down between its turns)."""
    import json
    import os
    from pathlib import Path

    from .liveness import CONCURRENT_ENV

    try:
        deploy = json.loads((Path(args.job_folder) / "meta.json").read_text()).get("deploy_map", {})
        sites = {s for targets in deploy.values() for s in targets if s not in ("server", "@ALL")}
    except (OSError, ValueError, AttributeError):
        return
    if args.clients:
        sites = set(str(args.clients).split(","))
    if sites and args.threads and int(args.threads) >= len(sites):
        os.environ[CONCURRENT_ENV] = "1"


if __name__ == "__main__":
    sys.exit(main())
