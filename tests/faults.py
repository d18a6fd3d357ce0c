"""Test-only executors that inject the faults a real federation has (never used by jobs/).

``faults`` is a list of ``{"site": ..., "round": r, "kind": "error" | "nan" | "shape" | "sleep" | "leak",
"seconds": s}``; the named site misbehaves in that round's ``train`` task ("leak": it also tries to send a per-image
Dice list, which the privacy ledger must block). ``{"site": ..., "kind": "setup"}``
makes the site fail at start-up (as a site whose data is missing does).
"""

import time

import numpy as np

from feduq.flare.executor import FedAvgExecutor
from feduq.flare.fedevi import FedEviExecutor


class FaultMixin:
    def __init__(self, faults=(), **kwargs):
        super().__init__(**kwargs)
        self.faults = list(faults)

    def _setup(self, fl_ctx):
        if any(f["site"] == self.site and f["kind"] == "setup" for f in self.faults):
            raise RuntimeError(f"site {self.site!r}: injected setup failure")
        super()._setup(fl_ctx)

    def train(self, received):
        r = int(received.current_round or 0)
        mine = [f for f in self.faults if f["site"] == self.site and f.get("round") == r]
        for f in mine:
            if f["kind"] == "error":
                raise RuntimeError(f"injected failure at round {r}")
            if f["kind"] == "sleep":
                time.sleep(f["seconds"])
        out = super().train(received)
        for f in mine:
            name = sorted(out.params)[0]
            if f["kind"] == "nan":
                out.params[name] = np.full_like(out.params[name], np.nan)
            elif f["kind"] == "shape":
                out.params[name] = np.zeros((3, 3), dtype=np.float32)
            elif f["kind"] == "leak":
                out.meta["per_image_dice"] = [0.91, 0.42, 0.77]
        return out


class FaultyFedAvgExecutor(FaultMixin, FedAvgExecutor):
    pass


class FaultyFedEviExecutor(FaultMixin, FedEviExecutor):
    pass
