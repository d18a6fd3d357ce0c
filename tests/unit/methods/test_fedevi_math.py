"""Numerical tests of the FedEvi server weight math (feduq.methods.fedevi)."""

import numpy as np
import pytest

from feduq.methods.fedevi import (
    FedEviConfig,
    client_scores,
    fedevi_update,
    initial_weights,
    update_weights,
)

POLYP_COUNTS = [700, 138, 267, 429]


def test_initial_weights_samples_matches_official_run():
    beta0 = initial_weights(POLYP_COUNTS)
    assert beta0.dtype == np.float64 and beta0.shape == (4,)
    np.testing.assert_allclose(beta0, np.array(POLYP_COUNTS) / 1534.0, atol=1e-15)
    # the official run's log (polyp, seed 3): beta^0 = [0.45632, 0.08996, 0.17405, 0.27966]
    np.testing.assert_allclose(beta0, [0.45632, 0.08996, 0.17405, 0.27966], atol=5e-6)


def test_initial_weights_uniform():
    np.testing.assert_array_equal(initial_weights(POLYP_COUNTS, mode="uniform"), [0.25, 0.25, 0.25, 0.25])
    np.testing.assert_allclose(initial_weights([5, 0, 1], mode="uniform"), [1 / 3, 1 / 3, 1 / 3], atol=1e-15)


@pytest.mark.parametrize(
    "counts, mode, pattern",
    [
        ([], "samples", "num_samples must not be empty"),
        ([3, -1, 2], "samples", r"num_samples\[1\].*-1"),
        ([0, 0], "samples", "num_samples must not be all zero"),
        ([0, 0], "uniform", "num_samples must not be all zero"),
        ([1, float("nan")], "samples", r"num_samples\[1\].*finite"),
        ([1, 2], "by_size", r"mode.*'samples'.*'uniform'.*'by_size'"),
    ],
)
def test_initial_weights_errors(counts, mode, pattern):
    with pytest.raises(ValueError, match=pattern):
        initial_weights(counts, mode=mode)


def test_code_variant_update_matches_methods_md_toy():
    beta0 = initial_weights(POLYP_COUNTS)
    x = client_scores([0.02, 0.05, 0.04, 0.01], mean_aleatoric=[0.30, 0.40, 0.35, 0.20], delta=1.0)
    np.testing.assert_allclose(x, [0.02 / 0.30, 0.05 / 0.40, 0.04 / 0.35, 0.01 / 0.20], atol=1e-15)
    beta1 = update_weights(beta0, x)
    np.testing.assert_allclose(beta1, [0.385699, 0.158531, 0.212648, 0.243121], atol=1e-6)
    assert beta1.sum() == pytest.approx(1.0, abs=1e-12)  # nothing clipped
    # same through the config-driven helper with the defaults
    np.testing.assert_allclose(
        fedevi_update(beta0, [0.02, 0.05, 0.04, 0.01], mean_aleatoric=[0.30, 0.40, 0.35, 0.20]), beta1, atol=1e-15
    )


def test_update_moves_weights_as_an_ema_towards_normalised_scores():
    # beta <- (beta + x) / (1 + sum x): a convex combination of beta and x / sum(x)
    beta0 = initial_weights(POLYP_COUNTS)
    x = np.array([0.1, 0.2, 0.05, 0.15])
    lam = x.sum() / (1 + x.sum())
    np.testing.assert_allclose(update_weights(beta0, x), (1 - lam) * beta0 + lam * x / x.sum(), atol=1e-15)
    # zero scores leave normalised weights unchanged
    np.testing.assert_allclose(update_weights(beta0, np.zeros(4)), beta0, atol=1e-15)


def test_paper_variant_two_clients_by_hand():
    # N = [3, 1] -> beta0 = [3/4, 1/4]
    # G = [0.1, 0.2], R = mean(1/U_ale) = [2, 4], delta = 0.5 -> x = 0.5 * G * R = [0.1, 0.4]
    # beta0 + x = [0.85, 0.65], sum 1.5 -> beta1 = [17/30, 13/30]
    beta0 = initial_weights([3, 1])
    np.testing.assert_allclose(beta0, [0.75, 0.25], atol=1e-15)
    x = client_scores([0.1, 0.2], mean_inv_aleatoric=[2.0, 4.0], delta=0.5, reliability="paper")
    np.testing.assert_allclose(x, [0.1, 0.4], atol=1e-15)
    np.testing.assert_allclose(update_weights(beta0, x), [17 / 30, 13 / 30], atol=1e-12)
    cfg = FedEviConfig(delta=0.5, reliability="paper")
    np.testing.assert_allclose(
        fedevi_update(beta0, [0.1, 0.2], mean_inv_aleatoric=[2.0, 4.0], config=cfg), [17 / 30, 13 / 30], atol=1e-12
    )


def test_paper_and_code_reliability_differ_by_jensen():
    # client 0 has per-image U_ale [0.25, 1.0]: A = 0.625 (1/A = 1.6), R = (4 + 1) / 2 = 2.5
    per_image = np.array([0.25, 1.0])
    a, r = per_image.mean(), (1 / per_image).mean()
    code = client_scores([0.1], mean_aleatoric=[a], reliability="code")
    paper = client_scores([0.1], mean_inv_aleatoric=[r], reliability="paper")
    assert code[0] == pytest.approx(0.16, abs=1e-15)
    assert paper[0] == pytest.approx(0.25, abs=1e-15)


def test_clip_without_and_with_renormalisation():
    beta_prev = [0.9996, 0.0004]
    x = [0.0, 0.0]
    clipped = update_weights(beta_prev, x, clip_min=1e-3)
    np.testing.assert_allclose(clipped, [0.9996, 0.001], atol=1e-15)
    assert clipped.sum() == pytest.approx(1.0006, abs=1e-12)  # official code: sum > 1
    renorm = update_weights(beta_prev, x, clip_min=1e-3, renormalize_after_clip=True)
    assert renorm.sum() == pytest.approx(1.0, abs=1e-15)
    np.testing.assert_allclose(renorm, [0.9996 / 1.0006, 0.001 / 1.0006], atol=1e-15)
    # clip_min = 0 disables clipping
    np.testing.assert_allclose(update_weights(beta_prev, x, clip_min=0.0), beta_prev, atol=1e-15)
    # beta_prev summing to more than 1 (after an earlier clip) is accepted: normalised, then clipped again
    np.testing.assert_allclose(update_weights(clipped, [0.0, 0.0]), [0.9996 / 1.0006, 0.001], atol=1e-15)


def test_client_scores_epistemic_rounding_tolerance():
    x = client_scores([-1e-9, 0.02], mean_aleatoric=[0.3, 0.4])
    assert x[0] == 0.0
    assert x[1] == pytest.approx(0.05, abs=1e-15)
    with pytest.raises(ValueError, match=r"epistemic\[0\].*-0.01"):
        client_scores([-0.01, 0.02], mean_aleatoric=[0.3, 0.4])


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(epistemic=[0.1, 0.2]), "mean_aleatoric"),
        (dict(epistemic=[0.1, 0.2], mean_aleatoric=[0.3, 0.4], reliability="paper"), "mean_inv_aleatoric"),
        (dict(epistemic=[0.1, 0.2], mean_aleatoric=[0.3, 0.4], reliability="ratio"), r"reliability.*'ratio'"),
        (dict(epistemic=[0.1, 0.2], mean_aleatoric=[0.3]), r"mean_aleatoric must have the length.*\(2\), got 1"),
        (dict(epistemic=[0.1, 0.2], mean_aleatoric=[0.3, 0.0]), r"mean_aleatoric\[1\] must be > 0"),
        (dict(epistemic=[0.1, np.inf], mean_aleatoric=[0.3, 0.4]), r"epistemic\[1\] must be finite"),
        (dict(epistemic=[0.1, 0.2], mean_aleatoric=[0.3, 0.4], delta=-1.0), "delta"),
        (dict(epistemic=[0.1, 0.2], mean_inv_aleatoric=[-2, 3], reliability="paper"), r"mean_inv_aleatoric\[0\]"),
        (dict(epistemic=[], mean_aleatoric=[]), "epistemic must not be empty"),
    ],
)
def test_client_scores_errors(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        client_scores(**kwargs)


@pytest.mark.parametrize(
    "beta_prev, scores, kwargs, pattern",
    [
        ([0.5, 0.5], [0.1], {}, r"scores must have the length of beta_prev \(2\), got 1"),
        ([0.5, 0.5], [0.1, -0.2], {}, r"scores\[1\] must be >= 0, got -0.2"),
        ([0.5, np.nan], [0.1, 0.2], {}, r"beta_prev\[1\] must be finite"),
        ([-0.5, 0.5], [0.1, 0.2], {}, r"beta_prev\[0\] must be >= 0"),
        ([0.0, 0.0], [0.0, 0.0], {}, "beta_prev \\+ scores must be > 0"),
        ([0.5, 0.5], [0.1, 0.2], dict(clip_min=1.0), "clip_min"),
        ([0.5, 0.5], [0.1, 0.2], dict(clip_min=-1e-3), "clip_min"),
    ],
)
def test_update_weights_errors(beta_prev, scores, kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        update_weights(beta_prev, scores, **kwargs)


def test_config_defaults_and_validation():
    cfg = FedEviConfig()
    assert (cfg.delta, cfg.reliability, cfg.clip_min, cfg.renormalize_after_clip, cfg.initial) == (
        1.0,
        "code",
        1e-3,
        False,
        "samples",
    )
    assert cfg.validate() is cfg
    for field, value in [
        ("delta", float("nan")),
        ("reliability", "mean"),
        ("clip_min", 2.0),
        ("renormalize_after_clip", "yes"),
        ("initial", "random"),
    ]:
        with pytest.raises(ValueError, match=field):
            FedEviConfig(**{field: value}).validate()
    with pytest.raises(ValueError, match="initial"):
        fedevi_update([0.5, 0.5], [0.1, 0.1], mean_aleatoric=[0.3, 0.3], config=FedEviConfig(initial="x"))


def test_round_weights_full_participation_is_eq8_and_a_missing_site_keeps_its_weight():
    from feduq.methods.fedevi import round_weights

    beta = {"a": 0.5, "b": 0.3, "c": 0.2}
    # every site scored: exactly fedevi_update (x = G/A = 0.1, 0.2, 0.05; raw 0.6, 0.5, 0.25 over 1.35)
    full = round_weights(beta, {"a": 0.02, "b": 0.04, "c": 0.01}, mean_aleatoric={"a": 0.2, "b": 0.2, "c": 0.2})
    assert full == pytest.approx({"a": 0.6 / 1.35, "b": 0.5 / 1.35, "c": 0.25 / 1.35}, abs=1e-12)
    # c not scored this round: a and b share the 0.8 they held, updated among themselves; c keeps 0.2
    part = round_weights(beta, {"a": 0.02, "b": 0.04}, mean_aleatoric={"a": 0.2, "b": 0.2})
    assert part == pytest.approx({"a": 0.8 * 0.6 / 1.1, "b": 0.8 * 0.5 / 1.1, "c": 0.2}, abs=1e-12)
    assert sum(part.values()) == pytest.approx(1.0, abs=1e-12)
    with pytest.raises(ValueError, match=r"scored site\(s\) \['d'\] have no previous weight"):
        round_weights(beta, {"d": 0.02}, mean_aleatoric={"d": 0.2})
    with pytest.raises(ValueError, match=r"mean_aleatoric lacks the scored site\(s\) \['b'\]"):
        round_weights(beta, {"a": 0.02, "b": 0.04}, mean_aleatoric={"a": 0.2})


#: The authors' code on the polyp reference split, seed 0 (its log, 4 decimals): β after each round's update, and the
#: G_k and A_k it was computed from; sites Kvasir-SEG, ETIS-LaribPolypDB, CVC-ColonDB, CVC-ClinicDB subset.
AUTHORS_SEED0 = {
    0: ([0.7071, 0.0212, 0.2576, 0.0141], None, None),
    1: ([0.5360, 0.0919, 0.2733, 0.0989], [0.0343, 0.0340, 0.0383, 0.0370], [0.2092, 0.2654, 0.2050, 0.2525]),
    2: ([0.4251, 0.1445, 0.2589, 0.1715], [0.0323, 0.0379, 0.0353, 0.0346], [0.1768, 0.2489, 0.2150, 0.1813]),
    3: ([0.3534, 0.1808, 0.2486, 0.2173], [0.0276, 0.0385, 0.0306, 0.0364], [0.1600, 0.2383, 0.1890, 0.1854]),
    4: ([0.3212, 0.2022, 0.2390, 0.2377], [0.0235, 0.0317, 0.0260, 0.0304], [0.1478, 0.2235, 0.1957, 0.1875]),
    5: ([0.3000, 0.2194, 0.2213, 0.2592], [0.0214, 0.0286, 0.0215, 0.0259], [0.1405, 0.1989, 0.1952, 0.1510]),
    6: ([0.2774, 0.2300, 0.2162, 0.2764], [0.0203, 0.0263, 0.0203, 0.0261], [0.1481, 0.1839, 0.1703, 0.1482]),
    7: ([0.2563, 0.2273, 0.2109, 0.3055], [0.0192, 0.0231, 0.0182, 0.0285], [0.1392, 0.1670, 0.1453, 0.1304]),
    8: ([0.2413, 0.2381, 0.2210, 0.2996], [0.0200, 0.0233, 0.0173, 0.0200], [0.1645, 0.1600, 0.1283, 0.1227]),
}


def test_round_weights_give_the_authors_beta_from_their_own_g_and_a():
    """FedUQ's server update fed the authors' logged G_k and A_k gives their logged β, round after round, from their
    initial (sample-count) weights: within 3e-4 (largest: 2.7e-4; the log's 4 decimals: a G of 0.02 known to ±5e-5 is ±0.25 %),
    one round at a time from their previous β and chained over the 8 rounds from FedUQ's own (no drift)."""
    from feduq.methods.fedevi import round_weights

    sites = ["Kvasir-SEG", "ETIS-LaribPolypDB", "CVC-ColonDB", "CVC-ClinicDB"]
    beta0 = initial_weights([700, 21, 255, 14])
    np.testing.assert_allclose(beta0, AUTHORS_SEED0[0][0], atol=5e-5)
    ours = dict(zip(sites, beta0))
    for r in range(1, 9):
        want, g, a = AUTHORS_SEED0[r]
        step = round_weights(dict(zip(sites, AUTHORS_SEED0[r - 1][0])), dict(zip(sites, g)),
                             mean_aleatoric=dict(zip(sites, a)))
        np.testing.assert_allclose([step[s] for s in sites], want, atol=3e-4, err_msg=f"round {r}, one step")
        ours = round_weights(ours, dict(zip(sites, g)), mean_aleatoric=dict(zip(sites, a)))
        np.testing.assert_allclose([ours[s] for s in sites], want, atol=3e-4, err_msg=f"round {r}, chained")
