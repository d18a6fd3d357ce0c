"""Server-side aggregation components (thin FLARE glue over :mod:`feduq.aggregation`).

:class:`WeightedAggregator` is a ``ModelAggregator``, so it runs under ScatterAndGather (through
``accept``/``aggregate``) and under ModelController workflows (through
``accept_model``/``aggregate_model``). It guarantees that a bad update never reaches the global
model: a NaN/Inf value, a missing/unknown parameter, a shape mismatch, a duplicate, or a
non-positive weight is rejected with a log line naming the site and parameter, and the weights are
renormalised over the sites that were accepted.
"""

from __future__ import annotations

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
    """

    def __init__(self, weight_key: str = FedUQMetaKey.NUM_SAMPLES):
        super().__init__()
        self.weight_key = weight_key
        self.reset_stats()

    def reset_stats(self):
        self._params: dict[str, dict] = {}
        self._weights: dict[str, float] = {}
        self._rejected: dict[str, str] = {}
        self._round = None

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
        return self.accept_model(model)

    def accepted_sites(self) -> list[str]:
        """Sites whose update was accepted since the last reset, sorted."""
        return sorted(self._params)

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
        self.info(
            f"round {self._round}: aggregated {len(norm)} site(s) ({sites_summary(expected, list(norm))}, "
            f"rejected={sorted(self._rejected)}) with weights "
            + ", ".join(f"{s}={w:.4f}" for s, w in sorted(norm.items()))
        )
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
    where the stock generator would fail or install an empty model.
    """

    def shareable_to_learnable(self, shareable: Shareable, fl_ctx: FLContext) -> ModelLearnable:
        dxo = from_shareable(shareable)
        if not dxo.data:
            current = fl_ctx.get_prop(AppConstants.GLOBAL_MODEL)
            self.log_warning(fl_ctx, "no aggregated update this round; keeping the current global model")
            return current
        return super().shareable_to_learnable(shareable, fl_ctx)
