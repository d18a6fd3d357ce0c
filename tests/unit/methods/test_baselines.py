"""FedProx and FedBN clients and server, and the local/pooled reference tool (no FLARE runtime).

The executors are driven directly: a tiny U-Net and hand-made batches replace what ``_setup``
builds from a site's data, and ``train`` / ``_load_eval_model`` run exactly as in a job.
"""

import copy
import csv
import json

import numpy as np
import pytest
import torch
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from feduq.common.wire import FedUQMetaKey
from feduq.core.training import LocalTrainer
from feduq.flare.executor import FedUQExecutor
from feduq.site.local_entries import LOCAL_ENTRIES_FILE, LocalEntries
from feduq.methods.fedprox import ProximalTerm
from feduq.core.networks import SegUNet, normalisation_keys

TINY = {"channels": [4, 8], "strides": [2]}  # a tiny `light` network
TINY_NETWORK = {"name": "light", **TINY}


def fedprox(**kwargs):
    """FedProx's site as its job builds it: FedUQ's executor naming the method's site part."""
    return FedUQExecutor(site_part="feduq.methods.fedprox.FedProxSite", **kwargs)


def fedbn(**kwargs):
    """FedBN's site as its job builds it."""
    return FedUQExecutor(site_part="feduq.methods.fedbn.FedBNSite", **kwargs)


def _batches(n=2, size=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        label = (torch.rand(2, 1, size, size, generator=g) > 0.6).float()
        out.append({"image": label.repeat(1, 3, 1, 1) + 0.3 * torch.rand(2, 3, size, size, generator=g), "label": label})
    return out


def _executor(cls, tmp_path, local_epochs=1, **kwargs):
    """An executor set up as ``_setup`` would, on a tiny network and two synthetic batches."""
    ex = cls(task="polyp", image_size=16, batch_size=2, local_epochs=local_epochs, network=dict(TINY_NETWORK), device="cpu",
             **kwargs)
    ex.site = "site-a"
    ex.device = torch.device("cpu")
    ex.num_classes, ex.class_names = 2, ("background", "polyp")
    ex.trainer = LocalTrainer(ex._build_named_network(3, 2), ex.device, **ex.optim_args)
    ex.eval_model = copy.deepcopy(ex.trainer.model)
    ex.loss = ex.build_loss()
    ex.train_loader = _batches(2)
    ex.val_loader = _batches(1, seed=1)
    ex.train_ds, ex.val_ds = [None] * 4, [None] * 2
    ex.state_path = tmp_path / f"{cls.__name__}_state.pt"
    ex._local_keys = None
    ex.local_entries = LocalEntries(ex.local_keys(), tmp_path / f"{cls.__name__}_{LOCAL_ENTRIES_FILE}")  # as _setup
    ex.logs = []
    ex.log_info = lambda fl_ctx, msg: ex.logs.append(msg)
    return ex


def _train_records(ex):
    return [json.loads(m.split(" ", 1)[1]) for m in ex.logs if m.startswith("FEDUQ_TRAIN ")]


def _global(ex, round_index=0):
    return FLModel(params=ex.trainer.get_params(), params_type=ParamsType.FULL, current_round=round_index)


# -- FedProx ---------------------------------------------------------------------------------------
def test_proximal_term_is_mu_half_squared_distance_to_the_frozen_global_model():
    torch.manual_seed(0)
    model = SegUNet(in_channels=3, out_channels=2, **TINY)
    start = [p.detach().clone() for p in model.parameters()]
    mu = 0.3
    prox = ProximalTerm(model, mu)
    assert float(prox(model).detach()) == 0.0  # θ = θ_g at the start of the round
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    batch = _batches(1)[0]
    torch.nn.functional.cross_entropy(model(batch["image"]), batch["label"][:, 0].long()).backward()
    opt.step()
    opt.zero_grad()
    term = prox(model)
    by_hand = mu / 2 * sum(float(((p.detach() - s) ** 2).sum()) for p, s in zip(model.parameters(), start))
    assert by_hand > 1e-4
    assert float(term.detach()) == pytest.approx(by_hand, rel=1e-5)
    term.backward()  # ∂/∂θ = μ (θ − θ_g), and the frozen copy collects no gradient
    for p, s in zip(model.parameters(), start):
        torch.testing.assert_close(p.grad, mu * (p.detach() - s), rtol=1e-5, atol=1e-7)
    assert all(p.grad is None and not p.requires_grad for p in prox.global_model.parameters())
    assert prox.values == [0.0, pytest.approx(by_hand, rel=1e-5)]
    with pytest.raises(ValueError, match="mu"):
        fedprox(mu=-0.1)


def test_fedprox_update_differs_from_fedavg_for_mu_positive_and_equals_it_for_mu_zero(tmp_path):
    def update(cls, **kw):
        ex = _executor(cls, tmp_path, **kw)
        result = ex.train(_global(ex))
        return ex, result.params

    _, fedavg = update(FedUQExecutor)
    prox0_ex, prox0 = update(fedprox, mu=0.0)
    prox_ex, prox = update(fedprox, mu=0.5)
    assert set(fedavg) == set(prox) == set(prox0)
    assert all(np.array_equal(fedavg[k], prox0[k]) for k in fedavg), "mu = 0 must be FedAvg exactly"
    differing = [k for k in fedavg if not np.array_equal(fedavg[k], prox[k])]
    assert differing, "the proximal term had no effect on the update"
    # the logged round mean: 0 at step 1 (θ = θ_g), > 0 at step 2; only with mu > 0
    (record,) = _train_records(prox_ex)
    assert record["mu"] == 0.5 and record["prox_term"] > 0 and record["steps"] == 2
    assert record["prox_term"] == pytest.approx(np.mean(prox_ex.method.term.values))
    assert _train_records(prox0_ex)[0]["prox_term"] == 0.0
    assert "prox_term" not in prox_ex.train(_global(prox_ex, 1)).meta  # logged on the site, never sent


# -- FedBN -----------------------------------------------------------------------------------------
def _shifted(params):
    """Every entry changed: +1 for floating entries, +7 for integer ones (num_batches_tracked)."""
    return {k: (v + 7 if np.issubdtype(v.dtype, np.integer) else v + 1.0) for k, v in params.items()}


def test_fedbn_keeps_every_normalisation_entry_local(tmp_path):
    ex = _executor(fedbn, tmp_path)
    model = ex.trainer.model
    norm = set(normalisation_keys(list(model.state_dict()), model))
    assert norm == ex.local_keys()
    assert {k.rsplit(".", 1)[1] for k in norm} == {"weight", "bias", "running_mean", "running_var", "num_batches_tracked"}
    sent = ex.train(_global(ex)).params  # round 0: the local BN statistics move away from the init
    assert not (set(sent) & norm) and set(sent) == set(model.state_dict()) - norm
    assert not (set(ex.submit_model(FLModel()).params) & norm)

    local = {k: v.clone() for k, v in model.state_dict().items() if k in norm}
    received = _shifted(ex.trainer.get_params())  # a global model whose BN entries (and all others) differ
    ex.local_epochs = 0  # receive only: no training step may touch the entries compared below
    sent = ex.train(FLModel(params=received, params_type=ParamsType.FULL, current_round=1)).params
    state = model.state_dict()
    for k in norm:
        assert state[k].dtype == local[k].dtype and torch.equal(state[k], local[k]), f"{k} was overwritten"
    for k, v in state.items():
        if k not in norm:
            assert np.array_equal(v.numpy(), received[k]), k
            assert np.array_equal(sent[k], received[k]), k

    # validate/test: the received model with the site's own normalisation statistics
    eval_model = ex._load_eval_model(FLModel(params=_shifted(received)))
    for k, v in eval_model.state_dict().items():
        expected = local[k].numpy() if k in norm else _shifted(received)[k]
        assert np.array_equal(v.numpy(), expected), k
    assert all(torch.equal(model.state_dict()[k], local[k]) for k in norm)  # the local model is untouched


def test_fedbn_tests_a_global_model_with_the_local_entries_it_was_validated_with(tmp_path):
    """The best global model of round r was selected by the sites' validation with their local normalisation entries
    of that moment; testing it with a later round's entries would score a model nobody validated."""
    ex = _executor(fedbn, tmp_path)
    norm = ex.local_keys()
    ex.train(_global(ex))  # round 0
    before = {k: v.clone() for k, v in ex.trainer.model.state_dict().items() if k in norm}
    g1 = FLModel(params=_shifted(ex.trainer.get_params()), params_type=ParamsType.FULL, current_round=1)
    ex.train(FLModel(params=dict(g1.params), params_type=ParamsType.FULL, current_round=1))  # validated with `before`
    after = {k: v for k, v in ex.trainer.model.state_dict().items() if k in norm}
    assert any(not torch.equal(before[k], after[k]) for k in norm if after[k].is_floating_point())  # round 1 moved them
    tested = ex._load_eval_model(FLModel(params=dict(g1.params))).state_dict()
    assert all(torch.equal(tested[k], before[k]) for k in norm)
    unknown = ex._load_eval_model(FLModel(params=_shifted(dict(g1.params)))).state_dict()  # never validated here
    assert all(torch.equal(unknown[k], after[k]) for k in norm)
    # kept in host memory whatever the site's device (one copy per validated round)
    assert all(v.device.type == "cpu" for kept in ex.local_entries.by_model.values() for v in kept.values())


def test_fedbn_site_restarted_within_a_job_gets_its_normalisation_entries_back(tmp_path):
    """The normalisation entries never reach the server: a restarted site process reads them from its run folder
    (the current ones, and those it validated each global model with), not from a fresh network."""
    ex = _executor(fedbn, tmp_path)
    norm = ex.local_keys()
    g0 = _global(ex)
    ex.train(g0)
    trained = {k: v.clone() for k, v in ex.trainer.model.state_dict().items() if k in norm}
    again = _executor(fedbn, tmp_path)  # same run folder, a new process: a fresh network
    fresh = again.trainer.model.state_dict()
    assert any(not torch.equal(fresh[k], trained[k]) for k in norm if trained[k].is_floating_point())
    assert again.local_entries.restore(again.trainer.model) == 1
    assert all(torch.equal(again.trainer.model.state_dict()[k], trained[k]) for k in norm)
    validated = again._load_eval_model(FLModel(params=dict(g0.params))).state_dict()  # round 0's entries, not trained
    assert again.eval_local == "matched"
    assert all(torch.equal(validated[k], ex.local_entries.by_model[next(iter(ex.local_entries.by_model))][k]) for k in norm)


@pytest.mark.parametrize("kind", ["bfloat16", "cuda"])
def test_load_params_copies_a_tensor_that_numpy_cannot_read(kind):
    """The entries a site kept are tensors; numpy cannot read a GPU tensor (the polyp 384 px FedBN run on an H100
    failed its test task with "can't convert cuda:0 device type tensor to numpy") nor a bfloat16 one (the same
    failure on a CPU)."""
    from feduq.core.training import load_params

    if kind == "cuda" and not torch.cuda.is_available():
        pytest.skip("no GPU")
    weight = torch.tensor([[3.0, -4.0]], dtype=torch.bfloat16) if kind == "bfloat16" else torch.tensor(
        [[3.0, -4.0]], device="cuda")
    with pytest.raises((TypeError, RuntimeError)):
        np.asarray(weight)
    model = torch.nn.Linear(2, 1)
    assert load_params(model, {"weight": weight}, strict=False) == ["bias"]
    assert model.weight.tolist() == [[3.0, -4.0]] and model.weight.dtype == torch.float32
    with pytest.raises(ValueError, match=r"expected=\(1, 2\), got=\(2,\)"):
        load_params(model, {"weight": torch.zeros(2)}, strict=False)


def _fedbn_round(global_params, answers, server=None):
    """One round of FedUQ's loop with FedBN's server (the sites' updates ``answers``: site -> (params, N_k)):
    ``(new global model, rejected site -> why)``."""
    from feduq.parts.server import Answer, LocalEntriesServer, run_rounds

    class Fed:
        round, num_rounds, failures = 0, 1, {}
        rejected = {}

        def send(self, task, payload, sites, **kw):
            return {s: Answer(s, params=p, meta={FedUQMetaKey.NUM_SAMPLES: n}) for s, (p, n) in answers.items()}

        def require(self, task, expected, valid, rejected):
            self.rejected = dict(rejected)
            assert valid, rejected

        def log(self, line):
            pass

        warn = log

    fed = Fed()
    out = run_rounds(server or LocalEntriesServer(), fed, dict(global_params), list(answers), 0)
    return out, fed.rejected


def test_fedbn_server_averages_what_the_sites_send_and_keeps_its_guards(tmp_path):
    from feduq.parts.server import Answer, ServerPart

    ex = _executor(fedbn, tmp_path)
    norm = ex.local_keys()
    global_params = ex.trainer.get_params()
    shared = {k: v for k, v in global_params.items() if k not in norm}
    plus = lambda d, x: {k: (v + x).astype(v.dtype) for k, v in d.items()}  # noqa: E731
    nan = plus(shared, 0.0)
    conv = next(k for k in nan if k.endswith("conv.weight"))
    nan[conv].flat[0] = np.nan
    leaky = {**plus(shared, 0.0), **{k: global_params[k] for k in norm}}  # a site that sends its BN entries
    wrong = {**plus(shared, 0.0), conv: np.zeros((1, 1), np.float32)}
    answers = {"a": (plus(shared, 1.0), 3), "b": (plus(shared, 5.0), 1), "c": (nan, 1), "d": (leaky, 1),
               "e": (wrong, 1)}
    out, rejected = _fedbn_round(global_params, answers)
    assert "'c'" in rejected["c"] and conv in rejected["c"] and "non-finite" in rejected["c"]
    assert "extra" in rejected["d"] and "shape" in rejected["e"]
    assert list(out) == list(global_params)  # full schema: the global model keeps its BN entries
    for k, v in global_params.items():
        expected = v if k in norm else plus({k: v}, 2.0)[k]  # (3·1 + 1·5) / 4 = 2
        np.testing.assert_allclose(out[k], expected, rtol=1e-6, err_msg=k)

    unknown = {**plus(shared, 0.0), "head.weight": np.zeros(2, np.float32)}
    ok = {"a": (plus(shared, 1.0), 1)}
    assert "extra" in _fedbn_round(global_params, {**ok, "f": (unknown, 1)})[1]["f"]
    assert "non-finite" in _fedbn_round(global_params, {"g": (nan, 1), **ok})[1]["g"]  # NaN also as the first update
    with pytest.raises(ValueError, match="missing"):  # FedAvg's server: every update carries every entry
        ServerPart().check("h", Answer("h", params=shared, meta={FedUQMetaKey.NUM_SAMPLES: 1}), global_params)


# -- local / pooled references ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["local", "pooled"])
def test_train_reference_writes_the_table(tmp_path, data_root, mode):
    from feduq.commands.research.reference import main

    out = tmp_path / mode
    argv = ["--task", "polyp", "--mode", mode, "--image-size", "32", "--rounds", "1", "--local-epochs", "1",
            "--data-root", str(data_root), "--out", str(out), "--max-items", "8", "--seed", "0", "--num-threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert main(argv) == 0
    finally:
        torch.set_num_threads(threads)
    with open(out / "per_client_table.csv") as f:
        table = {row["client"]: row for row in csv.DictReader(f)}
    sites = ["Kvasir-SEG", "CVC-ClinicDB", "CVC-ColonDB", "ETIS-LaribPolypDB"]
    assert list(table) == sites + ["Avg", "Std"]
    for s in sites:
        assert 0.0 <= float(table[s]["dice"]) <= 1.0 and np.isfinite(float(table[s]["hd95"]))
        assert int(table[s]["num_images"]) == min(8, {"ETIS-LaribPolypDB": 6}.get(s, 8))  # ETIS tests 6 of its 30
    assert float(table["Avg"]["dice"]) == pytest.approx(np.mean([float(table[s]["dice"]) for s in sites]), abs=1e-5)
    for s in sites:  # the per-image scores feduq compare pairs, as a federated site writes them: they average to the table
        with open(out / s / "per_image_test.csv") as f:
            rows = list(csv.DictReader(f))
        assert {r["site"] for r in rows} == {s} and len({r["image"] for r in rows}) == int(table[s]["num_images"])
        assert np.mean([float(r["dice"]) for r in rows]) == pytest.approx(float(table[s]["dice"]), abs=1e-5)
        assert np.mean([float(r["hd95_px"]) for r in rows]) == pytest.approx(float(table[s]["hd95"]), abs=1e-3)
    from feduq.commands.research.compare import sites_per_image

    assert sorted(sites_per_image(out)) == sorted(sites)
    with open(out / "test_results_tidy.csv") as f:
        assert {row["method"] for row in csv.DictReader(f)} == {mode}
    log = [json.loads(line) for line in (out / "reference_log.jsonl").read_text().splitlines()]
    assert [r["run"] for r in log] == (sites if mode == "local" else ["pooled"])
    assert all(r["round"] == 0 and r["steps"] >= 1 for r in log)
    models = sorted(p.name for p in out.glob("best_model_*.pt"))
    assert models == (sorted(f"best_model_{s}.pt" for s in sites) if mode == "local" else ["best_model_pooled.pt"])


def test_train_reference_scores_fundus_by_region_as_the_federated_sites(tmp_path, data_root):
    """Local/pooled rows on fundus have the federated table's columns: disc and cup regions, dice = their mean."""
    from feduq.commands.research.reference import main

    if not (data_root / "fundus").is_dir():
        pytest.skip("no fundus data")
    out = tmp_path / "pooled"
    threads = torch.get_num_threads()
    try:
        assert main(["--task", "fundus", "--mode", "pooled", "--image-size", "32", "--rounds", "1", "--local-epochs",
                     "1", "--data-root", str(data_root), "--out", str(out), "--max-items", "3", "--seed", "0",
                     "--num-threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    with open(out / "per_client_table.csv") as f:
        rows = list(csv.DictReader(f))
    assert {"dice_disc", "dice_cup", "hd95_disc", "hd95_cup"} <= set(rows[0])
    assert not {"dice_optic disc (rim, excluding cup)"} & set(rows[0])
    for row in rows[:-2]:
        assert float(row["dice"]) == pytest.approx((float(row["dice_disc"]) + float(row["dice_cup"])) / 2, abs=1e-5)
