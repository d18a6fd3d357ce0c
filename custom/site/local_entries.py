"""The model entries a site keeps to itself, and what it validated each global model with (FLARE-free).

FedBN keeps its normalisation layers on the site, FedUAA its head: those entries never reach the server, so

* a global model is always *used* with the site's own values, and the best global model (selected by the sites'
  validation of round r) must be *tested* with the values the site validated it with in round r, not with a later
  round's: :class:`LocalEntries` keeps, per received global model (identified by :func:`model_digest`), a copy of
  the local entries at the moment the site validated it;
* a site process restarted within a job cannot get them back from the server: :class:`LocalEntries` writes the
  current values and the per-model copies to one file in the site's run folder after every change and reads it at
  start-up.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Mapping

import numpy as np
import torch

from ..core.checkpoints import load_checkpoint
from ..core.training import load_params

#: the site's local entries (current values and one copy per validated global model), in the site's run folder
LOCAL_ENTRIES_FILE = "feduq_local_entries.pt"


def model_digest(params: Mapping, exclude: frozenset[str] | set[str] = frozenset()) -> str:
    """SHA-1 of a model's entries (names and float32 values), sorted by name, ``exclude`` left out.

    Identifies a received global model again later: the test task gets the best global model and looks up the local
    entries it was validated with. Tensors (on any device) and numpy arrays of the same float32 values give the same
    digest.
    """
    h = hashlib.sha1()
    for name in sorted(params):
        if name in exclude:
            continue
        h.update(name.encode())
        value = params[name]
        if isinstance(value, torch.Tensor):
            value = value.detach().float().cpu().numpy()
        h.update(np.ascontiguousarray(np.asarray(value, dtype=np.float32)).tobytes())
    return h.hexdigest()


class LocalEntries:
    """The local entries ``keys`` of a site's model: per validated global model, and across process restarts.

    Args:
        keys: the state-dict names that stay on the site (empty: nothing is kept and no file is written).
        path: the file (:data:`LOCAL_ENTRIES_FILE` in the site's run folder); None keeps everything in memory.

    Copies are kept in host memory as CPU tensors, whatever the model's device.
    """

    def __init__(self, keys: frozenset[str], path: str | Path | None = None):
        self.keys = frozenset(keys)
        self.path = Path(path) if path is not None else None
        self.by_model: dict[str, dict[str, torch.Tensor]] = {}  # global model digest -> local entries

    def _current(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        state = model.state_dict()
        return {k: state[k].detach().cpu().clone() for k in sorted(self.keys) if k in state}

    def remember(self, received: Mapping, model: torch.nn.Module) -> None:
        """Keep ``model``'s local entries as the ones the global model ``received`` is validated with (and save)."""
        if self.keys and received:
            self.by_model[model_digest(received, self.keys)] = self._current(model)
            self.save(model)

    def matched(self, received: Mapping) -> dict[str, torch.Tensor] | None:
        """The local entries the global model ``received`` was validated with here; None if it never was."""
        if not self.keys or not received:
            return None
        return self.by_model.get(model_digest(received, self.keys))

    def save(self, model: torch.nn.Module) -> None:
        """Write ``model``'s current local entries and the per-model copies to :attr:`path` (no-op without one)."""
        if self.keys and self.path is not None:
            from ..common.saving import save_torch

            save_torch({"current": self._current(model), "by_model": self.by_model}, self.path)

    def restore(self, model: torch.nn.Module) -> int | None:
        """Load a file :meth:`save` wrote (a restarted site process): the current entries into ``model`` and the
        per-model copies. Returns the number of copies, or None when there is no file.

        Raises:
            ValueError: the file is unreadable or not tensors and dicts only
                (:func:`feduq.core.checkpoints.load_checkpoint`), or its entries do not fit ``model``
                (:func:`feduq.core.training.load_params`).
        """
        if not self.keys or self.path is None or not self.path.is_file():
            return None
        saved = load_checkpoint(self.path, what="local entries file")
        load_params(model, saved["current"], strict=False)
        self.by_model = {str(k): dict(v) for k, v in saved.get("by_model", {}).items()}
        return len(self.by_model)
