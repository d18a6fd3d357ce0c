"""FedUQ's FLARE glue (executors, controllers, filters). Importing it guards AST construction on CPython < 3.13
(:mod:`feduq.flare.ast_guard`), which FLARE's concurrent numpy decoding needs, and imports MONAI without the optional
packages no FedUQ site or server uses when it is first imported (:mod:`feduq.common.lean_monai`: a FLARE process
starts faster and smaller, and a tool that only checks a job loads no MONAI)."""

from . import ast_guard as _ast_guard
from ..common.lean_monai import defer_monai_lean as _defer_monai_lean

_ast_guard.install()
_defer_monai_lean()
