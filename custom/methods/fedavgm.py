"""FedAvgM's server part (Hsu, Qi and Brown 2019, "Measuring the Effects of Non-Identical Data Distribution for
Federated Visual Classification", §3 "server momentum"): FedAvg's average taken as a pseudo-gradient step with
momentum on the server.

Per round r, with the sites' N_k-weighted average θ̄ of the accepted updates:
Δ = θ − θ̄ (the pseudo-gradient), v ← β·v + Δ, θ ← θ − η·v. With β = 0 and η = 1 this is FedAvg exactly. Integer
entries (BatchNorm's ``num_batches_tracked``) take the average, as in FedAvg. The sites are FedAvg's.

The momentum buffer v is written after every round to the run folder (:data:`MOMENTUM_FILE`, read back with
``allow_pickle=False``) and named in the checkpoint, so a resumed job continues it.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import numpy as np

from ..core.aggregation import normalise_weights, weighted_average
from ..common.checks import scalar
from ..parts.server import ServerPart

MOMENTUM_FILE = "fedavgm_momentum.npz"


class FedAvgMServer(ServerPart):
    """FedAvg with server momentum.

    Args:
        server_lr: η > 0, the server's step size on the pseudo-gradient (paper: 1.0 with β = 0.9 is FedAvg's scale).
        momentum: β in [0, 1), the momentum of the pseudo-gradient.

    Raises:
        ValueError: ``server_lr`` not > 0 or ``momentum`` outside [0, 1) (named).
    """

    label = "FedAvgM"
    state_key = "fedavgm_momentum"

    def __init__(self, server_lr: float = 1.0, momentum: float = 0.9):
        self.server_lr = scalar(server_lr, "FedAvgM: server_lr", minimum=0.0)
        if self.server_lr == 0.0:
            raise ValueError("FedAvgM: server_lr must be > 0, got 0")
        self.momentum = scalar(momentum, "FedAvgM: momentum", minimum=0.0, below=1.0)
        self.velocity: dict[str, np.ndarray] = {}
        self.saved: str | None = None

    def fuse(self, fed, answers, global_params):
        raw = self.weights(fed, answers)
        average = weighted_average({s: a.params for s, a in answers.items()}, raw)
        new = {}
        for key, mean in average.items():
            mean = np.asarray(mean)
            if not np.issubdtype(mean.dtype, np.floating):
                new[key] = mean  # counters: FedAvg's
                continue
            step = np.asarray(global_params[key], dtype=np.float64) - mean  # Δ = θ − θ̄
            v = self.momentum * self.velocity.get(key, 0.0) + step
            self.velocity[key] = v
            new[key] = (np.asarray(global_params[key], dtype=np.float64) - self.server_lr * v).astype(mean.dtype)
        return new, normalise_weights(raw)

    def after_round(self, fed, global_params, sites) -> None:
        """Write v to the run folder (a crash mid-write never leaves a half file under the name)."""
        path = Path(fed.run_dir) / MOMENTUM_FILE
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **self.velocity)
        os.replace(tmp, path)
        self.saved = str(path)

    def state(self) -> dict | None:
        return {"file": self.saved} if self.saved else None

    def start(self, fed, global_params, sites, state) -> None:
        """Restore v from the checkpoint's file; a missing or unreadable file restarts it at 0 (warned)."""
        self.velocity, self.saved = {}, None
        if not state:
            return
        path = Path(str(state.get("file", "")))
        try:
            with np.load(path, allow_pickle=False) as data:
                self.velocity = {k: data[k] for k in data.files}
            self.saved = str(path)
        except (OSError, EOFError, ValueError, zipfile.BadZipFile) as e:
            fed.warn(f"FedAvgM: cannot read the momentum ({path}: {e}); it restarts at 0")
