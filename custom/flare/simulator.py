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
"""

from __future__ import annotations

import sys
import threading

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
