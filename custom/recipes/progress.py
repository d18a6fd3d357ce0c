"""One line per round while a federated run trains, read from the ``FEDUQ_*`` records of its log (no FLARE).

Sites log ``FEDUQ_TRAIN {json}`` after local training (with ``site``, ``round`` and the validation metric of the
global model they received, ``val_dice_global`` or ``val_auc_global``); the server logs
``FEDUQ_AGGREGATION {json}`` (``round``, ``weights``: site -> aggregation weight) when it fuses a round. Fed the
run's output line by line, :class:`RoundProgress` returns, at each aggregation, a line such as::

    round 3/20 | val Dice 0.512 (4 sites) | weights Kvasir-SEG 0.41 CVC-ClinicDB 0.20 ... | 2m10s, ETA 12m03s

The ETA is the mean time per finished round times the rounds left (s).
"""

from __future__ import annotations

import json
import re
import time
from typing import Callable

__all__ = ["RoundProgress", "format_seconds"]

TRAIN = re.compile(r"FEDUQ_TRAIN (\{.*\})")
AGGREGATION = re.compile(r"FEDUQ_AGGREGATION (\{.*\})")
VALIDATION = (("val_dice_global", "val Dice"), ("val_auc_global", "val AUC"))


def format_seconds(seconds: float) -> str:
    """``3725.0 -> "1h02m05s"``, ``125.0 -> "2m05s"``, ``9.4 -> "9s"`` (rounded to whole seconds)."""
    s = int(round(max(seconds, 0.0)))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s" if m else f"{s}s"


class RoundProgress:
    """Turns a run's log lines into one progress line per finished round.

    Args:
        num_rounds: the job's rounds R (the line says ``round r+1/R``).
        label: a prefix (e.g. ``"fedevi s0"`` in a sweep).
        clock: seconds, monotonic (``time.monotonic``; tests pass their own).
        max_weights: how many sites' weights to print (the largest first).
    """

    def __init__(self, num_rounds: int, label: str = "", clock: Callable[[], float] = time.monotonic,
                 max_weights: int = 6):
        self.num_rounds = int(num_rounds)
        self.label = label
        self.clock = clock
        self.max_weights = max_weights
        self.start = clock()
        self.validation: dict[int, dict[str, tuple[str, float]]] = {}
        self.rounds_done = 0

    def feed(self, line: str) -> str | None:
        """Read one log line; return the progress line when it closes a round, else None."""
        m = TRAIN.search(line)
        if m:
            rec = self._json(m.group(1))
            key = next(((k, name) for k, name in VALIDATION if k in rec), None)
            if rec and key and isinstance(rec.get("round"), int) and rec.get(key[0]) is not None:
                self.validation.setdefault(rec["round"], {})[str(rec.get("site", "?"))] = (key[1], float(rec[key[0]]))
            return None
        m = AGGREGATION.search(line)
        if not m:
            return None
        rec = self._json(m.group(1))
        if not rec or not isinstance(rec.get("round"), int) or rec["round"] < self.rounds_done:
            return None  # not a record, or a round already reported (the same record read from two sources)
        return self._line(rec["round"], rec.get("weights") or {})

    @staticmethod
    def _json(text: str) -> dict | None:
        try:
            rec = json.loads(text)
        except ValueError:
            return None
        return rec if isinstance(rec, dict) else None

    def _line(self, r: int, weights: dict) -> str:
        self.rounds_done = max(self.rounds_done, r + 1)
        elapsed = self.clock() - self.start
        parts = [f"{self.label + ' | ' if self.label else ''}round {r + 1}/{self.num_rounds}"]
        val = self.validation.pop(r, {})
        if val:
            name = next(iter(val.values()))[0]
            parts.append(f"{name} {sum(v for _, v in val.values()) / len(val):.3f} ({len(val)} sites)")
        if weights:
            top = sorted(weights.items(), key=lambda kv: -float(kv[1]))[: self.max_weights]
            more = " ..." if len(weights) > self.max_weights else ""
            parts.append("weights " + " ".join(f"{s} {float(w):.2f}" for s, w in top) + more)
        left = max(self.num_rounds - self.rounds_done, 0)
        eta = elapsed / self.rounds_done * left if self.rounds_done else 0.0
        parts.append(f"{format_seconds(elapsed)}, ETA {format_seconds(eta)}")
        return " | ".join(parts)
