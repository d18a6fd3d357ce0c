"""Loading a model or state file never runs code: every ``torch.load`` in FedUQ goes through :func:`load_checkpoint`.

A ``.pt`` file is a pickle, and unpickling can call any function the file names (a crafted checkpoint can delete
files or open a shell). FedUQ loads with ``weights_only=True``: tensors, numbers, strings and plain containers only,
which is all its own files hold -- the server's ``FL_global_model.pt`` / ``best_FL_global_model.pt`` (FLARE's PT
persistor: ``{"model": state_dict, "meta_props": {...}, "train_conf": {...}}``), a site's optimizer/scheduler state,
FedUAA's local heads (saved as tensors, :func:`tensors_of`), FIVA's released heads. Anything else is refused with one
line naming the file.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

__all__ = ["CheckpointError", "load_checkpoint", "check_finite", "tensors_of", "arrays_of"]


class CheckpointError(ValueError):
    """A model/state file that is missing, unreadable or would need code to load; one line naming the file."""


def load_checkpoint(path: str | os.PathLike, map_location: str | torch.device = "cpu", what: str = "model file") -> Any:
    """``torch.load(path, weights_only=True)``, with one clear error instead of a traceback.

    Args:
        path: the ``.pt`` file.
        map_location: where tensors go (``"cpu"``, a ``torch.device``).
        what: how the error names the file (``"model file"``, ``"checkpoint"``, ``"site state"``).

    Returns:
        What the file holds (tensors, numbers, strings, lists, tuples, dicts, ``OrderedDict``).

    Raises:
        CheckpointError: the file does not exist; unpickling it needs a global that is not a tensor or plain type
            (the message names it: ``refused: it needs code to load (os.system)``) -- nothing of the file has run;
            or it is not a readable torch file (truncated, another format).
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # noqa: BLE001 - every failure becomes one line naming the file
        text = str(e)
        operand = re.search(r"Unsupported operand (\d+)", text)
        if operand:  # a pickle opcode torch.save never writes: a plain pickle, not a torch file
            raise CheckpointError(f"{what} {path} is not a torch file (a pickle torch.save did not write: opcode "
                                  f"{operand.group(1)}); nothing of it was run") from None
        named = re.search(r"(?:Unsupported global|GLOBAL)[:\s]+(?:GLOBAL\s+)?([\w.]+)", text)
        if "Weights only load failed" in text or named:
            target = named.group(1) if named else "an object that is not a tensor or a plain container"
            raise CheckpointError(f"{what} {path}: refused: it needs code to load ({target}); FedUQ loads tensors and "
                                  f"plain containers only, so nothing of it was run") from None
        first = text.strip().splitlines()[0] if text.strip() else ""
        import zipfile

        kind = ("torch.save's zip archive, damaged" if zipfile.is_zipfile(path) else
                "neither torch.save's zip archive nor its older format: truncated, or another kind of file")
        raise CheckpointError(f"{what} {path} cannot be read as a torch file ({kind}; {type(e).__name__}: "
                              f"{first})") from None


def check_finite(params: Any, path: str | os.PathLike, what: str = "model file") -> None:
    """Refuse a state dict holding a NaN or infinite parameter (a diverged run's model): it would give NaN
    probabilities, empty label maps and NaN uncertainty, and a later step would fail far from the cause.

    Args:
        params: parameter name -> tensor or array (a state dict); other values are skipped.
        path, what: how the error names the file.

    Raises:
        CheckpointError: naming the file, the first such parameter, its NaN and Inf counts, and how many parameters
            hold one.
    """
    bad = []
    for name, value in params.items() if isinstance(params, dict) else ():
        t = torch.as_tensor(value) if isinstance(value, (torch.Tensor, np.ndarray)) else None
        if t is not None and (t.is_floating_point() or t.is_complex()) and not bool(torch.isfinite(t).all()):
            bad.append((name, int(torch.isnan(t).sum()), int(torch.isinf(t).sum()), t.numel()))
    if bad:
        name, n_nan, n_inf, n = bad[0]
        raise CheckpointError(f"{what} {path}: parameter {name!r} holds {n_nan} NaN and {n_inf} Inf of {n} values "
                              f"({len(bad)} of {len(params)} parameters are not finite): a diverged model, refused")


def tensors_of(obj: Any) -> Any:
    """``obj`` with every numpy array replaced by a CPU tensor (recursively in dicts, lists, tuples), for saving."""
    if isinstance(obj, np.ndarray):  # (np.ascontiguousarray alone would make a 0-d array, e.g. a BN counter, 1-d)
        return torch.from_numpy(np.ascontiguousarray(obj).reshape(obj.shape))
    if isinstance(obj, dict):
        return {k: tensors_of(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(tensors_of(v) for v in obj)
    return obj


def arrays_of(obj: Any) -> Any:
    """``obj`` with every tensor replaced by a numpy array (recursively), the inverse of :func:`tensors_of`."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy()
    if isinstance(obj, dict):
        return {k: arrays_of(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(arrays_of(v) for v in obj)
    return obj
