"""Aggregation math and guards on hand-made updates (no FLARE runtime)."""

import numpy as np
import pytest
from nvflare.apis.dxo import DXO, DataKind
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.abstract.model import make_model_learnable
from nvflare.app_common.app_constant import AppConstants

from feduq.aggregation import InvalidUpdate, check_update, normalise_weights, weighted_average
from feduq.constants import FedUQMetaKey
from feduq.flare.aggregators import AGGREGATION_WEIGHTS, GuardedShareableGenerator, WeightedAggregator


def _params(value, bias=0.0):
    return {"conv.weight": np.full((2, 2), value, dtype=np.float32), "conv.bias": np.array([bias], dtype=np.float32)}


def _result(site, value, n=1, bias=0.0):
    return FLModel(
        params=_params(value, bias),
        params_type=ParamsType.FULL,
        current_round=3,
        meta={"client_name": site, FedUQMetaKey.NUM_SAMPLES: n},
    )


def test_weighted_average_hand_computed():
    out = weighted_average({"a": _params(1.0, 2.0), "b": _params(4.0, -1.0)}, {"a": 2.0, "b": 1.0})
    # (2*1 + 1*4) / 3 = 2 ; (2*2 + 1*(-1)) / 3 = 1
    np.testing.assert_allclose(out["conv.weight"], np.full((2, 2), 2.0))
    np.testing.assert_allclose(out["conv.bias"], [1.0])
    assert out["conv.weight"].dtype == np.float32


def test_weighted_average_rounds_integer_buffers():
    out = weighted_average(
        {"a": {"n": np.array(3, dtype=np.int64)}, "b": {"n": np.array(6, dtype=np.int64)}}, {"a": 1, "b": 1}
    )
    assert out["n"].dtype == np.int64 and int(out["n"]) == 4  # rint(4.5) = 4 (banker's rounding)


@pytest.mark.parametrize(
    "weights, message", [({"a": -1.0, "b": 1.0}, "site 'a'"), ({"a": 0.0, "b": 0.0}, "sum to 0"), ({"a": np.nan}, "'a'")]
)
def test_normalise_weights_rejects(weights, message):
    with pytest.raises(ValueError, match=message):
        normalise_weights(weights)


def test_check_update_names_site_and_parameter():
    bad = _params(1.0)
    bad["conv.weight"][0, 1] = np.nan
    with pytest.raises(InvalidUpdate, match=r"site 'Kvasir-SEG' parameter 'conv.weight' has 1 non-finite"):
        check_update("Kvasir-SEG", bad)
    wrong_shape = {"conv.weight": np.zeros((3, 2), np.float32), "conv.bias": np.zeros(1, np.float32)}
    with pytest.raises(InvalidUpdate, match=r"'conv.weight' shape .* expected=\(2, 2\), got=\(3, 2\)"):
        check_update("ETIS", wrong_shape, reference=_params(0.0))
    with pytest.raises(InvalidUpdate, match="missing=\\['conv.bias'\\]"):
        check_update("ETIS", {"conv.weight": np.zeros((2, 2))}, reference=_params(0.0))


def _aggregator(global_value=0.0):
    agg = WeightedAggregator()
    agg.fl_ctx = FLContext()
    agg.fl_ctx.set_prop(AppConstants.GLOBAL_MODEL, make_model_learnable(_params(global_value), {}), private=True)
    return agg


def test_aggregator_fedavg_weights_are_sample_counts():
    agg = _aggregator()
    assert agg.accept_model(_result("a", 1.0, n=3))
    assert agg.accept_model(_result("b", 5.0, n=1))
    out = agg.aggregate_model()
    # (3*1 + 1*5) / 4 = 2
    np.testing.assert_allclose(out.params["conv.weight"], 2.0)
    assert out.meta[AGGREGATION_WEIGHTS] == {"a": 0.75, "b": 0.25}
    assert out.meta["nr_aggregated"] == 2
    assert agg.accepted_sites() == []  # reset after aggregation


def test_aggregator_rejects_nan_shape_duplicate_and_bad_weight_then_renormalises(caplog):
    agg = _aggregator()
    nan = _result("nan-site", 1.0, n=5)
    nan.params["conv.bias"][0] = np.inf
    wrong = _result("shape-site", 1.0, n=5)
    wrong.params["conv.weight"] = np.zeros((1, 4), np.float32)
    assert not agg.accept_model(nan)
    assert not agg.accept_model(wrong)
    assert not agg.accept_model(_result("zero-n", 1.0, n=0))
    assert agg.accept_model(_result("a", 2.0, n=1))
    assert not agg.accept_model(_result("a", 9.0, n=1))  # duplicate
    assert agg.accept_model(_result("b", 4.0, n=3))
    out = agg.aggregate_model()
    np.testing.assert_allclose(out.params["conv.weight"], (2.0 * 1 + 4.0 * 3) / 4)
    assert np.isfinite(out.params["conv.bias"]).all()
    assert out.meta[AGGREGATION_WEIGHTS] == {"a": 0.25, "b": 0.75}


def test_aggregator_explicit_weights_override_counts():
    agg = _aggregator()
    agg.accept_model(_result("a", 0.0, n=100))
    agg.accept_model(_result("b", 10.0, n=1))
    np.testing.assert_allclose(agg.average({"a": 0.8, "b": 0.2})["conv.weight"], 2.0)  # no reset
    out = agg.aggregate_model({"a": 0.4, "b": 0.6})
    np.testing.assert_allclose(out.params["conv.weight"], 6.0)


def test_aggregator_with_no_valid_update_returns_empty_model():
    agg = _aggregator()
    bad = _result("a", 1.0)
    bad.params["conv.weight"][:] = np.nan
    agg.accept_model(bad)
    out = agg.aggregate_model()
    assert out.params == {} and out.meta["nr_aggregated"] == 0


def test_guarded_shareable_generator_keeps_global_model_on_empty_aggregate():
    gen = GuardedShareableGenerator()
    ctx = FLContext()
    current = make_model_learnable(_params(7.0), {})
    ctx.set_prop(AppConstants.GLOBAL_MODEL, current, private=True)
    kept = gen.shareable_to_learnable(DXO(DataKind.WEIGHTS, data={}).to_shareable(), ctx)
    np.testing.assert_array_equal(kept["weights"]["conv.weight"], 7.0)
    new = gen.shareable_to_learnable(DXO(DataKind.WEIGHTS, data=_params(1.0)).to_shareable(), ctx)
    np.testing.assert_array_equal(new["weights"]["conv.weight"], 1.0)


def test_quorum_refuses_to_aggregate_fewer_updates_and_names_every_failed_site():
    """min_clients=3 of 4: one NaN update and one site error leave 2 valid updates -> QuorumLost, no model."""
    from feduq.flare.quorum import QuorumLost

    agg = WeightedAggregator()
    agg.fl_ctx = FLContext()
    agg.set_quorum(3)
    bad = _result("c", 1.0)
    bad.params["conv.bias"][0] = np.inf
    assert agg.accept_model(_result("a", 1.0)) and agg.accept_model(_result("b", 2.0))
    assert not agg.accept_model(bad)
    agg.note_failure("d", "site 'd': setup failed: data root /x does not exist")
    with pytest.raises(QuorumLost) as err:
        agg.aggregate_model()
    assert str(err.value).startswith("round 3 task 'train': 2 valid answer(s) ['a', 'b'], but the job needs 3")
    assert set(err.value.sites) == {"c", "d"}
    assert "non-finite" in err.value.sites["c"] and "data root /x" in err.value.sites["d"]
    # the same round with the quorum met aggregates: (1*1 + 1*2) / 2 = 1.5
    agg.set_quorum(2)
    assert agg.accept_model(_result("a", 1.0)) and agg.accept_model(_result("b", 2.0))
    np.testing.assert_allclose(agg.aggregate_model().params["conv.weight"], np.full((2, 2), 1.5))


def test_quorum_of_every_site_and_the_required_count():
    from feduq.flare.quorum import required_answers

    assert required_answers(None, 4) == 4 and required_answers(3, 4) == 3 and required_answers(9, 4) == 4
    with pytest.raises(ValueError, match="min_clients must be >= 1"):
        required_answers(0, 4)
