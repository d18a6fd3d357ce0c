"""What every FedUQ command does at its edges: an interrupt or a failed write ends it with one line.

Every verb of the ``feduq`` command (:mod:`feduq.commands.main`), ``python -m feduq.run`` and
the developer tools in ``tools/`` end through :func:`run_main`:

* **Ctrl-C (SIGINT) or SIGTERM** (a stopped sweep, a scheduler's kill): the tool's FLARE processes go with it (the
  simulator's process group is killed by :func:`feduq.recipes.simulation.run_process_group`; a POC the command started is
  stopped), a staged output is removed (:func:`feduq.outputs.staged_folder`), and one line says what was kept and how
  to go on (a tool raises :class:`Interrupted` with that line), exit 130 (SIGINT) or 143 (SIGTERM), as a shell would
  report the signal.
* **A write that fails** (disk full, quota, a read-only or foreign folder, a file size limit): one line naming the path
  and the system's reason, exit 1, no traceback. What the tool was writing is staged beside its output and removed, so
  nothing half-written is left in the output's place (the line names the path the file was meant to have).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import errno
import os
import re
import signal
import sys
import threading
from typing import Callable, Iterator, Sequence

# errno values of a write the user can fix by freeing space or choosing another folder (not a bug in FedUQ)
WRITE_ERRORS = {errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EPERM, errno.EFBIG}
EXIT_SIGNAL = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Interrupted(KeyboardInterrupt):
    """An interrupted command's one line: what was stopped, what was kept and how to go on.

    A tool raises it from the ``KeyboardInterrupt`` it caught (a :class:`KeyboardInterrupt`, so code that cleans up on
    an interrupt still does); :func:`run_main` prints it after the tool's name.
    """

    def __init__(self, message: str, signum: int = signal.SIGINT):
        super().__init__(message)
        self.message, self.signum = message, signum


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as an interrupt so that it unwinds (and cleans up) as Ctrl-C does."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(f"signal {signum}")
        self.signum = signum


def signal_number(exc: BaseException) -> int:
    """The signal behind an interrupt: SIGTERM when :func:`run_main`'s handler raised it, else SIGINT (Ctrl-C)."""
    return getattr(exc, "signum", signal.SIGINT)


def run_main(tool: str, main: Callable[[Sequence[str] | None], int | None], argv: Sequence[str] | None = None) -> int:
    """Run a command's ``main(argv)`` and return its exit code, ending an interrupt or a failed write with one line.

    Args:
        tool: the command's name as the user typed it (``"feduq simulate"``, ``"feduq.run"``), the line's prefix.
        main: the command's ``main``; its return value is the exit code (None: 0).
        argv: the arguments (None: ``sys.argv[1:]``, as argparse reads them).

    Returns:
        ``main``'s code; 130 after SIGINT, 143 after SIGTERM; 1 after a failed write (:data:`WRITE_ERRORS`).
    """
    with sigterm_as_interrupt():
        return _run(tool, main, argv)


def _run(tool: str, main, argv) -> int:
    try:
        return int(main(argv) or 0)
    except KeyboardInterrupt as e:
        signum = signal_number(e)
        what = getattr(e, "message", None) or "nothing it started is left running"
        print(f"{tool}: interrupted ({signal.Signals(signum).name}); {what}", file=sys.stderr, flush=True)
        return EXIT_SIGNAL.get(signum, 130)
    except BrokenPipeError:  # the reader went away (``feduq methods | head``): quiet, as a shell tool ends
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would fail again
        return 141
    except OSError as e:
        if e.errno not in WRITE_ERRORS:
            raise
        where = e.filename if e.filename is not None else "a file"
        print(f"{tool}: {where}: {e.strerror or e}; nothing half-written was kept", file=sys.stderr, flush=True)
        return 1


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """Within the block, SIGTERM raises :class:`Terminated` (an interrupt, so it unwinds and cleans up as Ctrl-C
    does); the previous handler is restored after. Only in the main thread (elsewhere Python cannot set handlers)."""
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_term(signum, frame):
            raise Terminated(signum)

        previous = signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class VerbParser(argparse.ArgumentParser):
    """An ``argparse`` parser whose usage errors are one line naming the bad argument and, for an unknown option or
    choice, the nearest known one (``difflib``), exit 2 as argparse exits.

    Every ``feduq <verb>`` builds its parser with it (``prog="feduq <verb>"``); ``--help`` is argparse's own.
    """

    def error(self, message: str):  # noqa: D401 (argparse's hook)
        hint = ""
        unknown = re.match(r"unrecognized arguments: (\S+)", message)
        if unknown:
            name = unknown.group(1).split("=")[0]
            options = [o for a in self._actions for o in a.option_strings]
            near = difflib.get_close_matches(name, options, n=1)
            hint = f" (did you mean {near[0]}?)" if near else f"; see {self.prog} --help"
            message = f"unknown option {name}"
        choice = re.match(r"argument (\S+): invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if choice:
            known = [c.strip().strip("'") for c in choice.group(3).split(",")]
            near = difflib.get_close_matches(choice.group(2), known, n=1)
            hint = f" (did you mean {near[0]}?)" if near else ""
        self.exit(2, f"{self.prog}: error: {message}{hint}\n")


def verb_parser(prog: str, description: str | None = None, **kwargs) -> VerbParser:
    """The parser of one command: :class:`VerbParser` with the module's docstring kept as written."""
    kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
    return VerbParser(prog=prog, description=description, **kwargs)
