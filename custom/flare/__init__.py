"""FedUQ's FLARE glue (executors, controllers, filters). Importing it guards AST construction on CPython < 3.13
(:mod:`feduq.flare.ast_guard`), which FLARE's concurrent numpy decoding needs."""

from . import ast_guard as _ast_guard

_ast_guard.install()
