"""FedUQ's FLARE glue (executors, controllers, filters). Importing it guards AST construction on CPython < 3.13
(:mod:`feduq.flare.ast_guard`), which FLARE's concurrent numpy decoding needs, and imports MONAI without the optional
packages no FedUQ site or server uses (:mod:`feduq.flare.lean_monai`: a FLARE process starts faster and smaller)."""

from . import ast_guard as _ast_guard
from .lean_monai import import_monai_lean as _import_monai_lean

_ast_guard.install()
_import_monai_lean()
