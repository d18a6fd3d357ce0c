"""Server-side aggregation components (thin FLARE glue over :mod:`feduq.aggregation`).

:class:`WeightedAggregator` is a ``ModelAggregator``, so it runs under ScatterAndGather (through
``accept``/``aggregate``) and under ModelController workflows (through
``accept_model``/``aggregate_model``). It guarantees that a bad update never reaches the global
model: a NaN/Inf value, a missing/unknown parameter, a shape mismatch, a duplicate, or a
non-positive weight is rejected with a log line naming the site and parameter, and the weights are
renormalised over the sites that were accepted.

Only what every method shares is here (:class:`WeightedAggregator`, :class:`GuardedShareableGenerator`,
:func:`global_weights`, :data:`AGGREGATION_WEIGHTS`); an aggregator of one method lives in that method's
module (FedUAA's softmax(θ) weights: :class:`feduq.flare.feduaa.FedUAAAggregator`).
"""

from __future__ import annotations

import json
import math

from nvflare.apis.dxo import from_shareable
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import ModelLearnable, ModelLearnableKey
from nvflare.app_common.aggregators.model_aggregator import ModelAggregator
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.shareablegenerators.full_model_shareable_generator import FullModelShareableGenerator

from ..aggregation import InvalidUpdate, check_update, normalise_weights, sites_summary, weighted_average
from ..constants import FedUQMetaKey
from .quorum import QuorumLost, job_failed_line, quorum_message, required_answers

AGGREGATION_WEIGHTS = "feduq_aggregation_weights"


def global_weights(fl_ctx: FLContext | None) -> dict | None:
    """Parameters of the current global model from the FLARE context, if any."""
    if fl_ctx is None:
        return None
    ml = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
    if isinstance(ml, ModelLearnable) and not ml.is_empty():
        return ml[ModelLearnableKey.WEIGHTS]
    return None


class WeightedAggregator(ModelAggregator):
    """θ = Σ_k w_k θ_k / Σ_k w_k over the accepted sites (FedAvg when w_k = N_k).

    Args:
        weight_key: ``FLModel.meta`` key holding the site's weight (default N_k, the number of
            training images). Subclasses may override :meth:`client_weight` instead.
        partial_updates: sites may keep some entries of the global model local and send the rest
            (FedBN: the sites decide, by module type, which entries are normalisation layers; the
            server needs no list of names). An update is then checked against the global model
            restricted to the entries of the round's first accepted update: an unknown entry, a
            shape mismatch or a NaN/Inf is still rejected, and so is an update whose entries differ
            from the other sites' of the round. Only what the sites send is averaged; the entries
            nobody sent are carried over unchanged from the current global model, so the global
            model keeps its full schema. False (default): every update must carry every entry.
    """

    def __init__(self, weight_key: str = FedUQMetaKey.NUM_SAMPLES, partial_updates: bool = False):
        super().__init__()
        self.weight_key = weight_key
        self.partial_updates = bool(partial_updates)
        self.min_clients: int | None = None  # the workflow's quorum (feduq.flare.quorum), see set_quorum
        self.quorum_set = False
        self.reset_stats()

    def set_quorum(self, min_clients: int | None) -> None:
        """Require ``min_clients`` accepted updates per round (None: every site of the job).

        Set by FedUQ's workflows at start-up. Once set, :meth:`aggregate_model` raises
        :class:`feduq.flare.quorum.QuorumLost` instead of aggregating fewer updates.
        """
        required_answers(min_clients, 1)  # validates
        self.min_clients, self.quorum_set = min_clients, True

    def note_failure(self, site: str, reason: str) -> None:
        """Record that ``site`` answered this round with an error (reported if the quorum is lost)."""
        self._failed[site] = reason

    def reset_stats(self):
        self._params: dict[str, dict] = {}
        self._weights: dict[str, float] = {}
        self._rejected: dict[str, str] = {}
        self._failed: dict[str, str] = {}
        self._round = None

    def check_quorum(self, expected: list[str]) -> None:
        """Raise :class:`QuorumLost` (after logging ``FEDUQ_JOB_FAILED``) when fewer updates were
        accepted this round than the quorum over ``expected`` sites requires; no-op before :meth:`set_quorum`."""
        if not self.quorum_set:
            return
        known = set(expected) | set(self._params) | set(self._failed) | set(self._rejected)
        required = required_answers(self.min_clients, len(known))
        if len(self._params) >= max(required, 1):
            return
        failed = {**self._failed, **self._rejected}
        missing = [s for s in expected if s not in self._params and s not in failed]
        reason = quorum_message("train", self._round, max(required, 1), list(self._params), failed, missing)
        sites = {**failed, **{s: "no answer" for s in missing}}
        self.error(job_failed_line(reason, sites))
        self.reset_stats()
        raise QuorumLost(reason, sites)

    def client_weight(self, model: FLModel) -> float:
        """The site's raw aggregation weight; must be finite and > 0."""
        value = (model.meta or {}).get(self.weight_key)
        try:
            weight = float(value)
        except (TypeError, ValueError):
            raise InvalidUpdate(f"meta {self.weight_key!r} must be a number, got {value!r}")
        if not math.isfinite(weight) or weight <= 0:
            raise InvalidUpdate(f"meta {self.weight_key!r} must be finite and > 0, got {value!r}")
        return weight

    def accept_model(self, model: FLModel) -> bool:
        site = (model.meta or {}).get("client_name", "?")
        try:
            if site in self._params:
                raise InvalidUpdate(f"duplicate update from site {site!r} in round {model.current_round}")
            if model.params_type not in (None, ParamsType.FULL):
                raise InvalidUpdate(f"site {site!r} sent params_type {model.params_type}, expected FULL")
            reference = global_weights(self.fl_ctx) or (next(iter(self._params.values())) if self._params else None)
            if self.partial_updates and reference is not None:
                names = next(iter(self._params.values())) if self._params else (model.params or {})
                reference = {k: v for k, v in reference.items() if k in names}
            check_update(site, model.params, reference)
            weight = self.client_weight(model)
        except InvalidUpdate as e:
            msg = str(e) if site in str(e) else f"site {site!r}: {e}"
            self._rejected[site] = msg
            self.warning(f"rejected update: {msg}")
            return False
        self._params[site] = model.params
        self._weights[site] = weight
        self._round = model.current_round
        return True

    def accept(self, shareable: Shareable, fl_ctx: FLContext) -> bool:
        """ScatterAndGather entry point; returns whether the update was accepted."""
        from nvflare.app_common.utils.fl_model_utils import FLModelUtils

        self.fl_ctx = fl_ctx
        model = FLModelUtils.from_shareable(shareable, fl_ctx)
        model.meta = dict(model.meta or {})
        model.meta.setdefault("client_name", fl_ctx.get_peer_context().get_identity_name(default="?"))
        if model.current_round is None:
            model.current_round = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        return self.accept_model(model)

    def accepted_sites(self) -> list[str]:
        """Sites whose update was accepted since the last reset, sorted."""
        return sorted(self._params)

    def rejected_sites(self) -> dict[str, str]:
        """site -> why its update was rejected since the last reset (copy)."""
        return dict(self._rejected)

    def accepted_params(self) -> dict[str, dict]:
        """site -> accepted parameters (read-only view for workflows that need θ_k, e.g. FedEvi)."""
        return dict(self._params)

    def average(self, weights: dict[str, float] | None = None) -> dict:
        """Weighted average of the accepted updates without resetting (e.g. FedEvi's surrogate θ̂).

        Args:
            weights: site -> weight for exactly the accepted sites; None uses each site's
                :meth:`client_weight` (N_k for FedAvg). Renormalised over the accepted sites.
        """
        return weighted_average(self._params, self._weights if weights is None else weights)

    def aggregate_model(self, weights: dict[str, float] | None = None) -> FLModel:
        """Weighted average over accepted sites, then reset; an empty FLModel when none was accepted.

        Args:
            weights: optional site -> weight overriding :meth:`client_weight` (FedEvi passes β).
        """
        try:
            expected = [c.name for c in self.fl_ctx.get_engine().get_clients()] if self.fl_ctx else []
        except Exception:
            expected = []
        self.check_quorum(expected)
        if not self._params:
            self.error(
                f"round {self._round}: no valid client update ({sites_summary(expected, [])}, "
                f"rejected={sorted(self._rejected)}); the global model stays unchanged"
            )
            self.reset_stats()
            return FLModel(params={}, params_type=ParamsType.FULL, meta={"nr_aggregated": 0})
        raw = self._weights if weights is None else weights
        norm = normalise_weights(raw)
        params = self.average(raw)
        if self.partial_updates:  # entries the sites keep local: the global model's values, unchanged
            base = global_weights(self.fl_ctx) or {}
            kept = [k for k in base if k not in params]
            params = {**{k: params.get(k, base[k]) for k in base}, **params}
            if kept:
                self.info(f"round {self._round}: {len(kept)} global entries kept unchanged (not sent by the sites)")
        self.info(
            f"round {self._round}: aggregated {len(norm)} site(s) ({sites_summary(expected, list(norm))}, "
            f"rejected={sorted(self._rejected)}) with weights "
            + ", ".join(f"{s}={w:.4f}" for s, w in sorted(norm.items()))
        )
        record = {"round": self._round, "weights": {s: round(w, 6) for s, w in sorted(norm.items())},
                  "missing": sorted(set(expected) - set(norm)), "rejected": sorted(self._rejected)}
        self.info("FEDUQ_AGGREGATION " + json.dumps(record))  # machine-readable, for tools/compare.py
        result = FLModel(
            params=params,
            params_type=ParamsType.FULL,
            current_round=self._round,
            meta={"nr_aggregated": len(norm), AGGREGATION_WEIGHTS: norm},
        )
        self.reset_stats()
        return result


class GuardedShareableGenerator(FullModelShareableGenerator):
    """Full-model shareable generator that never replaces the global model with nothing.

    When a round produced no acceptable update (every site failed, timed out or was rejected), the
    aggregation result is empty; this generator then keeps the current global model and logs it,
    where the stock generator would fail or install an empty model. It also records the round in
    the model's meta (``feduq_last_completed_round``), so a checkpoint knows where to resume.
    """

    def shareable_to_learnable(self, shareable: Shareable, fl_ctx: FLContext) -> ModelLearnable:
        dxo = from_shareable(shareable)
        if not dxo.data:
            learnable = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            self.log_warning(fl_ctx, "no aggregated update this round; keeping the current global model")
        else:
            learnable = super().shareable_to_learnable(shareable, fl_ctx)
        current_round = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
        if learnable is not None and current_round is not None:
            meta = learnable.get(ModelLearnableKey.META) or {}
            learnable[ModelLearnableKey.META] = {**meta, FedUQMetaKey.LAST_COMPLETED_ROUND: int(current_round)}
        return learnable
