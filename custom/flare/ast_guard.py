"""A guard against a CPython < 3.13 race in AST construction, installed in every process that imports ``feduq.flare``.

On CPython 3.11.7 the FLARE server intermittently fails while it decodes two sites' updates at once: FLARE's numpy
decomposer reads each array with ``numpy.load``, whose header parser is ``ast.literal_eval``, and the interpreter's
AST constructor keeps its recursion depth in state shared by all threads, so two threads parsing at once can raise
``SystemError: AST constructor recursion depth mismatch`` (python/cpython#106905 and its follow-ups; the depth is
per call from CPython 3.13 on). The guard makes ``ast.parse`` (which ``ast.literal_eval`` calls) take one
process-wide re-entrant lock, so only one thread builds an AST at a time. The parsed strings are array headers of a
few dozen characters, so the lock costs nothing measurable.
"""

from __future__ import annotations

import ast
import functools
import sys
import threading
from typing import Callable

_LOCK = threading.RLock()
GUARDED_ATTR = "_feduq_ast_guard"


def guarded(function: Callable) -> Callable:
    """``function`` wrapped so that one thread at a time runs it (a process-wide re-entrant lock)."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        with _LOCK:
            return function(*args, **kwargs)

    setattr(wrapper, GUARDED_ATTR, True)
    return wrapper


def install(version: tuple = tuple(sys.version_info[:3])) -> bool:
    """Replace ``ast.parse`` by its guarded form on CPython < 3.13 (idempotent).

    Returns:
        True when the guard is in place after the call, False on an interpreter that does not need it.
    """
    if version >= (3, 13):
        return False
    if not getattr(ast.parse, GUARDED_ATTR, False):
        ast.parse = guarded(ast.parse)
    return True
