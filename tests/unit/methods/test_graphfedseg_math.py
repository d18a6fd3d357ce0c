"""Numerical tests of the GraphFedSeg / pFedGraph math (feduq.methods.graphfedseg), hand numbers in comments."""

import numpy as np
import pytest
import torch
from scipy.optimize import minimize

from feduq.methods.graphfedseg import (
    DEFAULT_GAMMA,
    DEFAULT_LAMBDA,
    alignment_term,
    collaboration_graph,
    collaboration_row,
    cosine_matrix,
    default_alpha,
    dual_layer_aggregate,
    effective_weights,
    flatten,
    image_vacuity,
    initial_graph,
    mean_vacuity,
    neighbour_direction,
    pfedgraph_graph,
    project_to_simplex,
    similarity_matrix,
    vacuity,
)

# hand toy: p from the polyp counts (0.7 x counts cancels in the normalisation)
TOY_P = np.array([1000, 196, 380, 612]) / 2188.0
TOY_COS = np.array([[1, .5, .6, .7], [.5, 1, .9, .4], [.6, .9, 1, .5], [.7, .4, .5, 1]])
TOY_U = np.array([0.10, 0.30, 0.20, 0.15])


def _simplex_min(objective, k, seed):
    """Brute-force reference: SLSQP on the simplex from several starts, best value kept."""
    rng = np.random.default_rng(seed)
    best = None
    for x0 in [np.full(k, 1.0 / k)] + [rng.dirichlet(np.ones(k)) for _ in range(3)]:
        res = minimize(objective, x0, method="SLSQP", bounds=[(0, 1)] * k,
                       constraints=[{"type": "eq", "fun": lambda x: x.sum() - 1.0}],
                       options={"ftol": 1e-14, "maxiter": 500})
        if best is None or res.fun < best.fun:
            best = res
    return best.x, best.fun


def _on_simplex(x):
    assert (x >= 0).all() and abs(x.sum() - 1.0) < 1e-12


# ---------------------------------------------------------------------------------------------- projection
@pytest.mark.parametrize("v, expected", [
    ([0.5, 0.5], [0.5, 0.5]),  # already on the simplex: unchanged
    ([2.0, 0.0], [1.0, 0.0]),  # tau = 1: [2-1, max(0-1, 0)]
    ([0.2, 0.2, 0.2], [1 / 3, 1 / 3, 1 / 3]),  # tau = (0.6 - 1)/3 = -0.1333 -> 0.2 + 0.1333
    ([0.6, 0.6], [0.5, 0.5]),  # tau = 0.1
    ([-1.0, 3.0, 0.5], [0.0, 1.0, 0.0]),  # rho = 1 (0.5 - (3.5-1)/2 < 0), tau = 2
    ([0.9, 0.5, -0.2], [0.7, 0.3, 0.0]),  # rho = 2, tau = (1.4 - 1)/2 = 0.2
])
def test_projection_known_vectors(v, expected):
    x = project_to_simplex(v)
    assert x.dtype == np.float64
    np.testing.assert_allclose(x, expected, atol=1e-15)
    _on_simplex(x)


def test_projection_is_optimal_on_random_vectors():
    rng = np.random.default_rng(0)
    for trial in range(8):
        v = rng.normal(scale=1.5, size=int(rng.integers(2, 7)))
        x = project_to_simplex(v)
        _on_simplex(x)
        ref, fun = _simplex_min(lambda y: float(((y - v) ** 2).sum()), v.size, trial)
        assert ((x - v) ** 2).sum() <= fun + 1e-10
        np.testing.assert_allclose(x, ref, atol=1e-5)


def test_projection_errors():
    with pytest.raises(ValueError, match="v must not be empty"):
        project_to_simplex([])
    with pytest.raises(ValueError, match=r"v\[1\] must be finite"):
        project_to_simplex([0.1, np.nan])


# ---------------------------------------------------------------------------------------------- graph (Eq. 2)
def _eq2_objective(p, cos_i, U, alpha, gamma):
    return lambda x: float(((x - p) ** 2).sum() - alpha * (x * cos_i).sum() + gamma * (x * U).sum())


def test_collaboration_row_matches_scipy_minimiser_of_eq2():
    rng = np.random.default_rng(1)
    for trial in range(6):
        k = int(rng.integers(2, 7))
        p = rng.dirichlet(np.ones(k))
        cos_i = rng.uniform(-1, 1, size=k)
        U = rng.uniform(0, 1, size=k)
        alpha, gamma = rng.uniform(0, 3), rng.uniform(0, 3)  # wide so that some rows hit the boundary
        x = collaboration_row(p, cos_i, U, alpha, gamma)
        _on_simplex(x)
        f = _eq2_objective(p, cos_i, U, alpha, gamma)
        ref, fun = _simplex_min(f, k, trial)
        assert f(x) <= fun + 1e-10
        np.testing.assert_allclose(x, ref, atol=1e-5)


def test_collaboration_row_hand_number():
    # K=2, p=[.5,.5], cos=[1,0], U=[0,0], alpha=0.2, gamma=0: v = [.5+.1, .5] -> tau=.05 -> [.55, .45]
    np.testing.assert_allclose(collaboration_row([.5, .5], [1, 0], [0, 0], 0.2, 0.0), [0.55, 0.45], atol=1e-15)
    # uncertainty penalty lowers the uncertain client: U=[0, 1], gamma=0.4 -> v=[.5, .3] -> [.6, .4]
    np.testing.assert_allclose(collaboration_row([.5, .5], [0, 0], [0, 1], 0.0, 0.4), [0.6, 0.4], atol=1e-15)


def test_defaults_alpha_008k_gamma_04():
    assert default_alpha(4) == pytest.approx(0.32) and default_alpha(10) == pytest.approx(0.8)
    assert DEFAULT_GAMMA == 0.4 and DEFAULT_LAMBDA == 0.2
    W = collaboration_graph(TOY_P, TOY_COS, TOY_U)
    np.testing.assert_array_equal(W, collaboration_graph(TOY_P, TOY_COS, TOY_U, alpha=0.32, gamma=0.4))
    assert np.abs(W - collaboration_graph(TOY_P, TOY_COS, TOY_U, alpha=0.4, gamma=0.4)).max() > 1e-3
    assert np.abs(W - collaboration_graph(TOY_P, TOY_COS, TOY_U, alpha=0.32, gamma=0.0)).max() > 1e-3


def test_methods_md_toy_graph_and_effective_weights():
    W = collaboration_graph(TOY_P, TOY_COS, TOY_U)
    np.testing.assert_allclose(W, [[0.522538, 0.035080, 0.155175, 0.287207],
                                   [0.442538, 0.115080, 0.203175, 0.239207],
                                   [0.450538, 0.091080, 0.211175, 0.247207],
                                   [0.482538, 0.027080, 0.147175, 0.343207]], atol=1e-6)
    np.testing.assert_allclose(effective_weights(TOY_P, W, 0.2), [0.471038, 0.071580, 0.178075, 0.279307], atol=1e-6)


def test_methods_md_toy_pfedgraph():
    np.testing.assert_allclose(pfedgraph_graph(TOY_P, TOY_COS), [[0.632732, 0, 0.099368, 0.267901],
                                                                 [0.332038, 0.277080, 0.298675, 0.092207],
                                                                 [0.363288, 0.183330, 0.329925, 0.123457],
                                                                 [0.466065, 0, 0.057701, 0.476234]], atol=1e-6)
    # clip: cos 0.95 -> d=-0.95 < -0.9 -> -1, i.e. treated as cos 1
    cos = np.array([[1, .95], [.95, 1]])
    np.testing.assert_allclose(pfedgraph_graph([.5, .5], cos), [[.5, .5], [.5, .5]], atol=1e-15)
    assert pfedgraph_graph([.5, .5], cos, clip=None)[0, 0] > 0.5


def test_initial_graph():
    np.testing.assert_allclose(initial_graph(4), (np.ones((4, 4)) - np.eye(4)) / 3)
    assert initial_graph(4)[0, 1] == pytest.approx(0.3333, abs=1e-4)
    np.testing.assert_array_equal(initial_graph(1), [[1.0]])


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(p=[.5, -.1, .6]), r"p\[1\] must be >= 0"),
    (dict(U=[0, np.inf, 0]), r"U\[1\] must be finite"),
    (dict(cos=np.eye(2)), r"cos must have shape \(3, 3\)"),
    (dict(gamma=-1.0), "gamma must be finite"),
])
def test_collaboration_graph_errors(kwargs, pattern):
    args = dict(p=[.3, .3, .4], cos=np.eye(3), U=[0, 0, 0]) | kwargs
    with pytest.raises(ValueError, match=pattern):
        collaboration_graph(**args)


# ---------------------------------------------------------------------------------------------- similarity
def test_cosine_matrix_hand_numbers():
    # [1,0] vs [1,1]: 1/sqrt(2); [1,0] vs [-1,0]: -1; a zero vector has cosine 0
    c = cosine_matrix([[1, 0], [1, 1], [-1, 0], [0, 0]])
    np.testing.assert_allclose(c[0], [1, 2 ** -0.5, -1, 0], atol=1e-15)
    assert c[3, 3] == 0.0 and np.allclose(c, c.T)


def test_model_cosine_is_flat_update_cosine_discriminates():
    rng = np.random.default_rng(2)
    start = {"w": rng.normal(size=(20, 10)), "b": rng.normal(size=10), "n": np.array(7)}  # int buffer skipped
    direction = {k: rng.normal(size=np.shape(v)) for k, v in start.items() if k != "n"}
    # clients 0 and 1 move along +direction, client 2 along -direction (small steps from the same start)
    models = [{k: start[k] + s * 0.01 * direction[k] for k in direction} | {"n": np.array(9)}
              for s in (1.0, 0.5, -1.0)]
    same = similarity_matrix([models[0], models[0]])
    np.testing.assert_allclose(same, np.ones((2, 2)), atol=1e-12)  # identical models: cosine 1
    model_cos = similarity_matrix(models, mode="model")
    assert model_cos.min() > 0.999  # flat: no signal between the two groups
    update_cos = similarity_matrix(models, start=start, mode="update")
    np.testing.assert_allclose(update_cos[0], [1, 1, -1], atol=1e-12)
    # Gram accumulated per key = flatten + cosine_matrix
    np.testing.assert_allclose(model_cos, cosine_matrix([flatten(m) for m in models]), atol=1e-12)


def test_flatten_and_similarity_errors():
    m = {"a": torch.ones(2, 2), "i": torch.tensor(3), "b": np.array([5.0])}
    np.testing.assert_array_equal(flatten(m), [1, 1, 1, 1, 5])  # floating keys, mapping order
    np.testing.assert_array_equal(flatten(m, keys=["b", "i"]), [5, 3])
    with pytest.raises(ValueError, match="missing keys"):
        flatten(m, keys=["zz"])
    with pytest.raises(ValueError, match=r"params\['a'\] has non-finite"):
        flatten({"a": np.array([np.nan])})
    with pytest.raises(ValueError, match="mode must be one of"):
        similarity_matrix([m], mode="grad")
    with pytest.raises(ValueError, match="start is required"):
        similarity_matrix([m], mode="update")
    with pytest.raises(ValueError, match=r"models\[1\] is missing key 'b'"):
        similarity_matrix([m, {"a": torch.ones(2, 2)}])


# ---------------------------------------------------------------------------------------------- vacuity (Eq. 3-4)
@pytest.mark.parametrize("num_classes", [2, 3, 5])
def test_vacuity_of_zero_logits(num_classes):
    # e = 1, a = 2 per class, S = 2C, u = C / 2C = 0.5
    u = vacuity(torch.zeros(2, num_classes, 3, 4))
    assert u.shape == (2, 3, 4)
    torch.testing.assert_close(u, torch.full((2, 3, 4), 0.5))


def test_vacuity_hand_number_clamp_and_means():
    z = torch.tensor([np.log(2.0), 0.0], dtype=torch.float64).reshape(1, 2, 1, 1)
    # e = [2, 1], a = [3, 2], S = 5, u = 2/5
    assert float(vacuity(z)) == pytest.approx(0.4, abs=1e-15)
    huge = vacuity(torch.tensor([1000.0, 0.0]).reshape(1, 2, 1, 1))
    assert torch.isfinite(huge).all() and 0 < float(huge) < 1e-33  # clamp at 80: 2/(e^80 + 3)
    assert vacuity(torch.zeros(1, 2, 1, 1, dtype=torch.float16)).dtype == torch.float32
    # image 0: half pixels 0.5, half 0.4 -> 0.45; image 1: all 0.5
    img = torch.zeros(2, 2, 1, 2, dtype=torch.float64)
    img[0, 0, 0, 1] = np.log(2.0)
    torch.testing.assert_close(image_vacuity(img), torch.tensor([0.45, 0.5], dtype=torch.float64))
    # mean over images, not batches: (0.45 + 0.5 + 0.4) / 3 = 0.45 (batch means would give 0.4375)
    assert mean_vacuity([img, z]) == pytest.approx(0.45, abs=1e-12)
    assert mean_vacuity(img) == pytest.approx(0.475, abs=1e-12)
    with pytest.raises(ValueError, match="at least one image"):
        mean_vacuity([])
    with pytest.raises(ValueError, match="logits must be a floating tensor"):
        vacuity(torch.zeros(4, dtype=torch.long))


# ---------------------------------------------------------------------------------------------- aggregation (Eq. 6-9)
TOY3_P = [0.5, 0.25, 0.25]
TOY3_W = [[0.5, 0.5, 0.0], [0.0, 1.0, 0.0], [0.25, 0.25, 0.5]]


@pytest.mark.parametrize("as_tensor", [False, True])
def test_dual_layer_aggregate_three_client_toy(as_tensor):
    # theta = [1, 2, 4]; base = .5 + .5 + 1 = 2; neigh = [1.5, 2, .25 + .5 + 2 = 2.75]
    # graph = 6.25/3 = 2.083333; global = .2*2 + .8*2.083333 = 2.066667
    # w = .2 p + .8 colmean(W) = [.1+.2, .05+.8*1.75/3, .05+.8*.5/3] = [.3, .516667, .183333]; w.theta = 2.066667
    vals = [1.0, 2.0, 4.0]
    make = (lambda x: torch.tensor([x], dtype=torch.float32)) if as_tensor else (lambda x: np.array([x], np.float32))
    res = dual_layer_aggregate([{"w": make(v)} for v in vals], TOY3_P, TOY3_W, lam=0.2)
    glob, neigh, w = res
    assert type(glob["w"]) is type(make(1.0)) and glob["w"].dtype == make(1.0).dtype and glob["w"].shape == (1,)
    assert float(glob["w"][0]) == pytest.approx(2.0 + 0.2 / 3, abs=1e-6)
    assert [float(n["w"][0]) for n in neigh] == pytest.approx([1.5, 2.0, 2.75], abs=1e-6)
    np.testing.assert_allclose(w, [0.3, 0.8 * 1.75 / 3 + 0.05, 0.8 * 0.5 / 3 + 0.05], atol=1e-15)
    assert float(np.dot(w, vals)) == pytest.approx(float(glob["w"][0]), abs=1e-6)
    # lam = 1: FedAvg by p -> 2.0; lam = 0: graph only -> 2.083333
    def global_at(lam):
        return float(dual_layer_aggregate([{"w": make(v)} for v in vals], TOY3_P, TOY3_W, lam=lam)[0]["w"][0])

    assert global_at(1.0) == pytest.approx(2.0, abs=1e-6) and global_at(0.0) == pytest.approx(6.25 / 3, abs=1e-6)


@pytest.mark.parametrize("models, pattern", [
    ([{"a": np.ones(2)}, {"a": np.ones(2), "b": np.ones(1)}, {"a": np.ones(2)}],
     r"models\[1\] has unexpected keys \['b'\]"),
    ([{"a": np.ones(2)}, {}, {"a": np.ones(2)}], r"models\[1\] is missing key 'a'"),
    ([{"a": np.ones(2)}, {"a": np.ones(3)}, {"a": np.ones(2)}], r"models\[1\]\['a'\] has shape \(3,\)"),
    ([{"a": np.ones(2)}, {"a": np.ones(2)}, {"a": np.array([1.0, np.inf])}], r"models\[2\]\['a'\] has non-finite"),
    ([{"a": torch.ones(2)}, {"a": torch.tensor([np.nan, 1.0])}, {"a": torch.ones(2)}],
     r"models\[1\]\['a'\] has non-finite"),
    ([{"n": np.array(3)}] * 3, r"models\[0\]\['n'\] must be floating"),
    ([{"a": np.ones(2)}] * 2, "models must have 3 entries"),
])
def test_dual_layer_aggregate_errors(models, pattern):
    with pytest.raises(ValueError, match=pattern):
        dual_layer_aggregate(models, TOY3_P, TOY3_W)


def test_dual_layer_aggregate_weight_errors():
    m = [{"a": np.ones(1)}] * 3
    with pytest.raises(ValueError, match="p must sum to 1"):
        dual_layer_aggregate(m, [0.5, 0.5, 0.5], TOY3_W)
    with pytest.raises(ValueError, match="W row 1 must sum to 1"):
        dual_layer_aggregate(m, TOY3_P, [[1, 0, 0], [0.5, 0, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="lam must be finite and in"):
        dual_layer_aggregate(m, TOY3_P, TOY3_W, lam=1.5)


# ---------------------------------------------------------------------------------------------- alignment (Eq. 5)
def test_alignment_term_hand_number():
    # theta_1 = [2, 0], theta_2 = [0, 3], W_row = [.25, .75] -> v = [.25, .75]
    v = neighbour_direction([{"w": np.array([2.0, 0.0])}, {"w": np.array([0.0, 3.0])}], [0.25, 0.75])
    np.testing.assert_allclose(v, [0.25, 0.75], atol=1e-15)
    theta = torch.tensor([1.0, 0.0], dtype=torch.float64)
    # -lam1 * sum_j W_ij cos(theta, theta_j) = -0.1 * (.25 * 1 + .75 * 0) = -0.025; pFedGraph code sign: +0.025
    assert float(alignment_term(theta, v, 0.1)) == pytest.approx(-0.025, abs=1e-15)
    assert float(alignment_term(theta, v, 0.1, sign=-1)) == pytest.approx(0.025, abs=1e-15)
    # dict input flattened over the same keys
    assert float(alignment_term({"w": theta}, v, 0.1, keys=["w"])) == pytest.approx(-0.025, abs=1e-15)


@pytest.mark.parametrize("sign", [1, -1])
def test_alignment_sgd_step_direction(sign):
    rng = np.random.default_rng(3)
    models = [{"w": rng.normal(size=(4, 3)), "b": rng.normal(size=3)} for _ in range(3)]
    v = neighbour_direction(models, [0.2, 0.3, 0.5])
    params = [torch.tensor(rng.normal(size=shape), requires_grad=True) for shape in [(4, 3), (3,)]]

    def cos_with_v():
        flat = torch.cat([q.detach().reshape(-1) for q in params]).numpy()
        return float(flat @ v / np.linalg.norm(flat) / np.linalg.norm(v))

    before = cos_with_v()
    alignment_term(params, v, lam1=1.0, sign=sign).backward()
    with torch.no_grad():
        for q in params:
            q -= 0.05 * q.grad
    after = cos_with_v()
    assert (after > before + 1e-4) if sign == 1 else (after < before - 1e-4)


def test_alignment_errors():
    v = np.ones(3)
    with pytest.raises(ValueError, match="sign must be"):
        alignment_term(torch.ones(3), v, 0.1, sign=0)
    with pytest.raises(ValueError, match="direction has 3 values, theta has 2"):
        alignment_term(torch.ones(2), v, 0.1)
    with pytest.raises(ValueError, match="lam1 must be"):
        alignment_term(torch.ones(3), v, -1.0)
    with pytest.raises(ValueError, match="W_row must have 2 entries"):
        neighbour_direction([{"w": np.ones(1)}] * 2, [1.0])
    with pytest.raises(ValueError, match=r"models\[1\] has zero norm"):
        neighbour_direction([{"w": np.ones(1)}, {"w": np.zeros(1)}], [0.5, 0.5])


def test_neighbour_vector_and_alignment_use_floating_parameters_only_on_a_batchnorm_network():
    """3 sites with Conv + BatchNorm whose num_batches_tracked are 10, 1000 and 100000: v_i and the alignment term
    run over the floating entries (sorted), equal a hand computation, and do not move when the counts change.
    With the counts in, they would be ~100 % of ||theta||^2 and every model would point the same way."""
    import torch

    from feduq.methods.graphfedseg import alignment_keys, alignment_term, neighbour_direction

    def site_model(seed, batches):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
        net[1].num_batches_tracked.fill_(batches)
        return {k: v.detach().numpy().copy() for k, v in net.state_dict().items()}

    models = [site_model(s, n) for s, n in ((0, 10), (1, 1000), (2, 100000))]
    keys = alignment_keys(models[0])
    assert "1.num_batches_tracked" not in keys and keys == sorted(keys) and len(keys) == 6  # w, b, bn w/b/mean/var
    row = np.array([0.5, 0.3, 0.2])
    flat = [np.concatenate([m[k].ravel().astype(np.float64) for k in keys]) for m in models]
    by_hand = sum(w * x / np.linalg.norm(x) for w, x in zip(row, flat))
    v = neighbour_direction(models, row, keys=keys)
    np.testing.assert_allclose(v, by_hand, rtol=1e-12)
    counts_share = 100000.0 ** 2 / (100000.0 ** 2 + float(flat[2] @ flat[2]))
    assert counts_share > 0.9999  # what the integer buffer did to the old all-keys norm
    for m, n in zip(models, (7, 7, 7)):  # other counts: the same v_i
        m["1.num_batches_tracked"] = np.array(n)
    np.testing.assert_allclose(neighbour_direction(models, row, keys=alignment_keys(models[0])), by_hand, rtol=1e-12)

    theta = {k: torch.tensor(models[0][k], dtype=torch.float32, requires_grad=True) for k in keys}
    term = alignment_term(theta, v, lam1=0.01, sign=1, keys=keys)
    x = flat[0]
    assert float(term.detach()) == pytest.approx(-0.01 * float(v @ x) / np.linalg.norm(x), rel=1e-5)


def test_aggregation_of_batchnorm_state_dicts_rounds_the_integer_counts():
    """Floating entries as dual_layer_aggregate on them alone; num_batches_tracked = rint(sum_j w_j n_j), w the
    effective weights, in the global and every neighbourhood model, int64 kept."""
    from feduq.methods.graphfedseg import aggregate_with_buffers, dual_layer_aggregate

    counts = (10, 1000, 100000)
    models = []
    for seed, n in zip(range(3), counts):
        torch.manual_seed(seed)
        net = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3), torch.nn.BatchNorm2d(2))
        net[1].num_batches_tracked.fill_(n)
        models.append({k: v.detach().numpy().copy() for k, v in net.state_dict().items()})
    p = np.array([0.5, 0.3, 0.2])
    W = np.array([[0.0, 0.5, 0.5], [0.5, 0.0, 0.5], [0.25, 0.75, 0.0]])
    fused = aggregate_with_buffers(models, p, W, lam=0.2)
    floats = dual_layer_aggregate([{k: v for k, v in m.items() if k != "1.num_batches_tracked"} for m in models],
                                  p, W, lam=0.2)
    w = 0.2 * p + 0.8 * W.mean(axis=0)
    expected = np.rint(float(np.dot(w, counts)))
    assert list(fused.global_model) == list(models[0])
    for k, v in floats.global_model.items():
        np.testing.assert_array_equal(fused.global_model[k], v)
    for model in (fused.global_model, *fused.neighbourhood):
        assert model["1.num_batches_tracked"].dtype == np.int64 and model["1.num_batches_tracked"] == expected
    np.testing.assert_allclose(fused.weights, w)
