"""The one resolver of a dotted class path (``"feduq.methods.fedevi.FedEviSite"``) that a job file, a checkpoint or
a registration names: only modules under the prefixes the caller allows are imported, so resolving a path from a
job never runs code outside them."""

from __future__ import annotations

import importlib
import inspect


#: modules that moved when the package was arranged in folders (old -> today's), so a checkpoint or job folder made
#: before still names its classes: a recorded ``feduq.methods.server.LocalEntriesServer`` is today's
#: ``feduq.parts.server.LocalEntriesServer``. Only modules whose old name is no module today are listed.
MOVED = {
    "feduq.methods.server": "feduq.parts.server",
    "feduq.methods.site": "feduq.parts.site",
    "feduq.methods.ct_server": "feduq.parts.ct_server",
    "feduq.ct_server": "feduq.parts.ct_server",
    "feduq.site2d": "feduq.site.site2d",
    "feduq.evaluation": "feduq.site.evaluation",
    "feduq.nnunet_ct": "feduq.nnunet.pipeline",
    "feduq.ct.nnunet": "feduq.nnunet.pipeline",
}


def current_path(path: str) -> str:
    """``path`` with a module that moved (:data:`MOVED`) replaced by today's; any other path unchanged."""
    module, _, name = str(path).rpartition(".")
    return f"{MOVED[module]}.{name}" if module in MOVED else str(path)


class ClassPathError(ValueError):
    """A dotted path that names no usable class; the message says why (outside the allowed packages, does not
    import, not a class)."""


def resolve_class(path: str, prefixes: tuple[str, ...] = ("feduq.",)) -> type:
    """The class at dotted ``path``, imported only when the path starts with one of ``prefixes`` (a module that moved
    is found at its new place, :func:`current_path`).

    Raises:
        ClassPathError: not a string, outside ``prefixes`` (nothing imported), the module or name does not import,
            or the name is not a class.
    """
    if not isinstance(path, str) or not path.startswith(tuple(prefixes)):
        raise ClassPathError(f"{str(path)[:200]!r} is not under {' or '.join(p + '*' for p in prefixes)}")
    module, _, name = current_path(path).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as e:
        raise ClassPathError(f"{path!r} does not import: {e}") from None
    if not inspect.isclass(cls):
        raise ClassPathError(f"{path!r} is a {type(cls).__name__}, not a class")
    return cls
