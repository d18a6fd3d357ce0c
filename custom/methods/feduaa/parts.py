"""FedUAA's server part, run by FedUQ's round loop (FLARE-free); its site parts are in :mod:`.site`."""

from __future__ import annotations

import json

from ...common.wire import FedUQMetaKey
from ...parts.server import LocalEntriesServer
from .thresholds import DEFAULT_THRESHOLD, aggregation_weights, resolve_threshold


class FedUAAServer(LocalEntriesServer):
    """FedUAA's server part (Wang et al., MICCAI 2023, Alg. 1 lines 13-15): softmax(θ) over the sites' thresholds.

    Each site sends the shared part of its model (its head stays local) and its Youden uncertainty threshold θ_k
    (``feduaa_youden_threshold``). The server fuses the accepted sites with ``w = softmax(θ)``
    (:func:`aggregation_weights`), the paper's softmax renormalised over the sites that answered. A threshold that
    is None (the site's ROC was undefined this round), NaN/Inf, outside [0, 1] or missing does not reject the update:
    the site's previous threshold is used, or ``default_threshold`` for a site that never sent a usable one
    (:func:`resolve_threshold`), with a warning. Logged per round: ``FEDUAA_WEIGHTS {json}`` (θ used, where each
    came from, weights); the thresholds are checkpointed (``feduaa_thresholds``), so a resumed job continues them.

    Args:
        default_threshold: θ of a site without a usable history (0.5, the official code's fallback).

    Raises:
        ValueError: ``default_threshold`` not finite in [0, 1].
    """

    label = "FedUAA"
    state_key = FedUQMetaKey.FEDUAA_THRESHOLDS

    def __init__(self, default_threshold: float = DEFAULT_THRESHOLD):
        resolve_threshold(None, default=default_threshold)  # validates the default
        self.default_threshold = float(default_threshold)
        self.thresholds: dict[str, float] = {}  # site -> the threshold used for it in the last fused round

    def start(self, fed, global_params, sites, state) -> None:
        """Restore the thresholds the sites reported before the checkpoint (not the fallbacks)."""
        self.thresholds = {}
        for site, value in (state or {}).items():
            theta, source = resolve_threshold(value, None, self.default_threshold)
            if source == "reported":
                self.thresholds[str(site)] = theta
        if self.thresholds:
            fed.log(f"restored FedUAA thresholds from the global model: {self.thresholds}")

    def state(self) -> dict[str, float] | None:
        return dict(self.thresholds) or None

    def weights(self, fed, answers):
        sites = list(answers)
        theta, source = {}, {}
        for s in sites:
            value = answers[s].meta.get(FedUQMetaKey.FEDUAA_THRESHOLD)
            theta[s], source[s] = resolve_threshold(value, self.thresholds.get(s), self.default_threshold)
            if source[s] != "reported":
                fed.warn(f"site {s!r} sent no usable FedUAA threshold ({FedUQMetaKey.FEDUAA_THRESHOLD}={value!r}); "
                         f"using its {source[s]} threshold {theta[s]:.6f}")
        w = dict(zip(sites, map(float, aggregation_weights([theta[s] for s in sites]))))
        self.thresholds.update(theta)
        fed.log("FEDUAA_WEIGHTS " + json.dumps({"round": fed.round, "threshold": {s: round(t, 6) for s, t in theta.items()},
                                                "source": source, "weight": {s: round(v, 6) for s, v in w.items()}}))
        return w
