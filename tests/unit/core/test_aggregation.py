"""Aggregation math and guards on hand-made updates (no FLARE runtime)."""

import json

import numpy as np
import pytest

from feduq.core.aggregation import InvalidUpdate, check_update, normalise_weights, weighted_average
from feduq.common.wire import FedUQMetaKey
from feduq.parts.server import Answer, LocalEntriesServer, ServerPart, Stop, run_rounds


def _params(value, bias=0.0):
    return {"conv.weight": np.full((2, 2), value, dtype=np.float32), "conv.bias": np.array([bias], dtype=np.float32)}


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


class _Fed:
    """A federation whose ``train`` answers are given: site -> (params, N_k); every answer counts for the quorum."""

    def __init__(self, answers, num_rounds=1):
        self.answers, self.num_rounds, self.round, self.failures, self.lines = answers, num_rounds, 0, {}, []

    def send(self, task, payload, sites, **kw):
        return {s: Answer(s, params=p, meta={FedUQMetaKey.NUM_SAMPLES: n}) for s, (p, n) in self.answers.items()}

    def require(self, task, expected, valid, rejected):
        if not valid:
            raise Stop(f"{task}: no valid answer", dict(rejected))

    def log(self, line):
        self.lines.append(line)

    warn = log


def _round(server, answers, global_params):
    """One round of FedUQ's loop: the new global model and its FEDUQ_AGGREGATION record."""
    fed = _Fed(answers)
    out = run_rounds(server, fed, dict(global_params), list(answers), 0)
    record = next(json.loads(line.split(" ", 1)[1]) for line in fed.lines if line.startswith("FEDUQ_AGGREGATION "))
    return out, record


def test_fedavg_weights_are_sample_counts():
    out, record = _round(ServerPart(), {"a": (_params(1.0), 3), "b": (_params(5.0), 1)}, _params(0.0))
    np.testing.assert_allclose(out["conv.weight"], 2.0)  # (3*1 + 1*5) / 4
    assert record["weights"] == {"a": 0.75, "b": 0.25} and record["rejected"] == []


def test_round_rejects_nan_shape_and_bad_weight_then_renormalises():
    nan, wrong = _params(1.0), _params(1.0)
    nan["conv.bias"][0] = np.inf
    wrong["conv.weight"] = np.zeros((1, 4), np.float32)
    answers = {"nan-site": (nan, 5), "shape-site": (wrong, 5), "zero-n": (_params(1.0), 0),
               "a": (_params(2.0), 1), "b": (_params(4.0), 3)}
    out, record = _round(ServerPart(), answers, _params(0.0))
    np.testing.assert_allclose(out["conv.weight"], (2.0 * 1 + 4.0 * 3) / 4)
    assert np.isfinite(out["conv.bias"]).all()
    assert record["weights"] == {"a": 0.25, "b": 0.75}
    assert record["rejected"] == ["nan-site", "shape-site", "zero-n"]


def test_no_valid_update_leaves_the_round_unfused():
    bad = _params(1.0)
    bad["conv.weight"][:] = np.nan
    with pytest.raises(Stop, match="no valid answer") as err:
        _round(ServerPart(), {"a": (bad, 1)}, _params(7.0))
    assert "non-finite" in err.value.sites["a"]


def test_sites_keeping_entries_local_average_what_they_send_and_keep_the_rest():
    """FedBN/FedUAA: the sites send only conv.weight; conv.bias keeps the global value; an unknown entry or an update
    with other entries than the round's first is rejected."""
    glob = _params(0.0, bias=7.0)
    only_w = lambda v: {"conv.weight": np.full((2, 2), v, np.float32)}  # noqa: E731
    answers = {"a": (only_w(1.0), 1), "b": (only_w(3.0), 1), "c": ({**only_w(9.0), "head.w": np.ones(1)}, 1),
               "d": (_params(9.0), 1)}
    out, record = _round(LocalEntriesServer(), answers, glob)
    np.testing.assert_allclose(out["conv.weight"], 2.0)
    np.testing.assert_allclose(out["conv.bias"], [7.0])  # nobody sent it: the global value, unchanged
    assert list(out) == list(glob) and record["rejected"] == ["c", "d"]  # c: unknown entry; d: other entries


def test_quorum_of_every_site_and_the_required_count():
    from feduq.flare.quorum import required_answers

    assert required_answers(None, 4) == 4 and required_answers(3, 4) == 3 and required_answers(9, 4) == 4
    with pytest.raises(ValueError, match="min_clients must be >= 1"):
        required_answers(0, 4)


def test_the_round_schema_is_what_most_sites_sent_so_one_odd_site_cannot_veto_the_others():
    glob = _params(0.0, bias=7.0)
    only_w = lambda v: {"conv.weight": np.full((2, 2), v, np.float32)}  # noqa: E731
    odd_first = {"a": (_params(9.0), 1), "b": (only_w(1.0), 1), "c": (only_w(3.0), 1)}  # a also sends its bias
    out, record = _round(LocalEntriesServer(), odd_first, glob)
    assert record["rejected"] == ["a"] and record["weights"] == {"b": 0.5, "c": 0.5}
    np.testing.assert_allclose(out["conv.weight"], 2.0)


class _ValFed(_Fed):
    """Every site answers round r with validation Dice ``dice[r]`` of the model it received (N_val = 1 and 3)."""

    def __init__(self, dice, num_rounds):
        super().__init__({}, num_rounds)
        self.dice, self.saved = dice, []

    def send(self, task, payload, sites, **kw):
        r = self.round
        return {s: Answer(s, params=_params(float(r)), meta={FedUQMetaKey.NUM_SAMPLES: 1,
                                                              FedUQMetaKey.NUM_VAL_SAMPLES: n},
                          metrics={"val_dice": self.dice[r][i]}) for i, (s, n) in enumerate((("a", 1), ("b", 3)))}


def _run_with_patience(dice, patience, first=0, state=None, num_rounds=8):
    from feduq.parts.server import EarlyStopping

    fed = _ValFed(dice, num_rounds)
    stopping = EarlyStopping(patience, "val_dice")
    stopping.restore(state)
    run_rounds(ServerPart(), fed, _params(0.0), ["a", "b"], first, stopping=stopping,
               round_started=lambda r: setattr(fed, "round", r),
               save=lambda r, p, meta: fed.saved.append((r, meta[EarlyStopping.STATE_KEY])))
    stop = [json.loads(line.split(" ", 1)[1]) for line in fed.lines if line.startswith("FEDUQ_EARLY_STOP ")]
    return fed.saved, stop


def test_early_stopping_ends_at_the_round_the_patience_rule_gives_and_a_resume_stops_there_too():
    # per round, sites a (1 val image) and b (3): weighted means .1, .3, .25, .28, .2, .9, ... -> best at round 1;
    # rounds 2 and 3 do not improve on it, so with patience 2 the run stops after round 3 (1 + 2)
    dice = [(0.1, 0.1), (0.6, 0.2), (0.25, 0.25), (0.4, 0.24), (0.2, 0.2), (0.9, 0.9), (0.9, 0.9), (0.9, 0.9)]
    saved, stop = _run_with_patience(dice, 2)
    assert [r for r, _ in saved] == [0, 1, 2, 3]
    assert stop == [{"round": 3, "key_metric": "val_dice", "last": pytest.approx(0.28), "best": pytest.approx(0.3),
                     "best_round": 1, "patience": 2}]
    # resumed after round 2 from its checkpointed state: stops after round 3 as well, not later
    resumed, stop = _run_with_patience(dice, 2, first=3, state=saved[2][1])
    assert [r for r, _ in resumed] == [3] and stop[0]["round"] == 3
    # without the state the resumed run would start its record afresh and go on past round 3
    fresh, _ = _run_with_patience(dice, 2, first=3)
    assert [r for r, _ in fresh][:3] == [3, 4, 5]
    with pytest.raises(ValueError, match="patience >= 1"):
        _run_with_patience(dice, 0)
