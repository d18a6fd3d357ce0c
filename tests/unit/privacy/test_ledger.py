"""The privacy ledger (feduq.privacy.ledger, feduq.flare.ledger): hand-made results checked against the declarations, the
FLARE filter on real Shareables, and every committed job wired with it on every task."""

import csv
import json

import numpy as np
import pytest

from conftest import REPO, FakeEngine, load_tool


def test_declared_results_are_listed_with_their_bytes():
    from feduq.registry.ledger import check_result

    received = {"w": (2, 3), "b": (3,)}
    model = {"w": np.zeros((2, 3), np.float32), "b": np.zeros(3, np.float32)}
    rows = check_result("fedevi", "train", "site-a", model, {"val_dice": 0.5, "train_loss": np.float32(0.1)},
                        {"feduq_num_samples": 12, "fedevi_mean_u_ale": 0.3}, received)
    assert [(r["section"], r["key"], r["shape"], r["bytes"]) for r in rows] == [
        ("model", "w", "2x3", 24), ("model", "b", "3", 12), ("metrics", "val_dice", "scalar", 8),
        ("metrics", "train_loss", "scalar", 4), ("meta", "feduq_num_samples", "scalar", 8),
        ("meta", "fedevi_mean_u_ale", "scalar", 8)]
    rows = check_result("feda3i", "estimate_noise", "s", {}, {}, {"feda3i_q": [0.2, 0.4], "feduq_site": "s"})
    assert [r["shape"] for r in rows] == ["2", "str"]
    rows = check_result("fiva_p", "submit_head", "s", {"weight": np.zeros((4, 32, 1, 1))}, {},
                        {"feduq_head_organs": ["liver", "spleen"]})  # the head is declared by name: not received
    assert rows[0]["bytes"] == 4 * 32 * 8


@pytest.mark.parametrize("case, message", [
    ("per_image", "undeclared meta key 'per_image_dice'"),
    ("other_method", "undeclared meta key 'fedevi_mean_u_ale'"),  # FedAvg does not send FedEvi's A_k
    ("not_received", "model key 'head.w' is not a tensor of the model the server sent"),
    ("shape", "model key 'w' is shape (4, 3) != the received model's (2, 3)"),
    ("vector", "meta key 'feda3i_q' is 3 numbers, not 2"),
    ("list_as_scalar", "metrics key 'dice' is a list, not a plain number"),
    # smuggling routes that once passed as "scalar" (np.ndim == 0) or through a pattern
    ("dict_as_scalar", "meta key 'feduq_num_val_samples' is a dict, not a plain number"),
    ("set_as_scalar", "meta key 'feduq_num_val_samples' is a set, not a plain number"),
    ("object_0d", "metrics key 'val_dice' is a ndarray, not a plain number"),
    ("string_0d", "metrics key 'val_dice' is a str_, not a plain number"),
    ("nested_dxo", "metrics key 'val_dice' is a DXO, not a plain number"),
    ("infinite", "metrics key 'val_dice' is infinite"),
    ("key_per_pixel", "more than 64 metrics keys match 'dice_*'"),
    ("long_key", "is not a name of <= 100 characters"),
    ("object_tensor", "model key 'w' is a ndarray of dtype object, not a numeric tensor"),
    ("task", "task 'export_images' is not declared for 'fedavg'"),
    ("another_sites_name", "meta key 'feduq_site' is 'site-a', not the sending site's own name 'site-b'"),
])
def test_undeclared_or_misshapen_keys_are_blocked_by_name(case, message):
    from nvflare.apis.dxo import DXO, DataKind

    from feduq.privacy.ledger import LedgerViolation
    from feduq.registry.ledger import check_result

    received = {"w": (2, 3)}
    args = {
        "per_image": ("fedavg", "train", {}, {}, {"per_image_dice": [0.9, 0.4]}),
        "other_method": ("fedavg", "train", {}, {}, {"fedevi_mean_u_ale": 0.3}),
        "not_received": ("fedavg", "train", {"head.w": np.zeros(2)}, {}, {}),
        "shape": ("fedavg", "train", {"w": np.zeros((4, 3))}, {}, {}),
        "vector": ("feda3i", "estimate_noise", {}, {}, {"feda3i_q": [1, 2, 3]}),
        "list_as_scalar": ("fedavg", "test", {}, {"dice": [0.1] * 5}, {}),
        "dict_as_scalar": ("fedavg", "train", {}, {}, {"feduq_num_val_samples": {"pixels": list(range(3000))}}),
        "set_as_scalar": ("fedavg", "train", {}, {}, {"feduq_num_val_samples": {1, 2, 3}}),
        "object_0d": ("fedavg", "train", {}, {"val_dice": np.array({"image": 1}, dtype=object)}, {}),
        "string_0d": ("fedavg", "train", {}, {"val_dice": np.str_("a" * 500)}, {}),
        "nested_dxo": ("fedavg", "train", {}, {"val_dice": DXO(DataKind.WEIGHTS, {"x": np.zeros((64, 64))})}, {}),
        "infinite": ("fedavg", "train", {}, {"val_dice": float("inf")}, {}),
        "key_per_pixel": ("fedavg", "test", {}, {f"dice_{i}": 0.5 for i in range(65)}, {}),
        "long_key": ("fedavg", "test", {}, {"dice_" + "7" * 200: 0.5}, {}),
        "object_tensor": ("fedavg", "train", {"w": np.empty((2, 3), dtype=object)}, {}, {}),
        "task": ("fedavg", "export_images", {}, {}, {}),
        "another_sites_name": ("feda3i", "estimate_noise", {}, {}, {"feda3i_q": [0.2, 0.4], "feduq_site": "site-a"}),
    }[case]
    with pytest.raises(LedgerViolation) as e:
        check_result(args[0], args[1], "site-b", *args[2:], received)
    assert message in str(e.value) and "site-b" in str(e.value)


def test_the_filter_records_passes_and_blocks(tmp_path):
    from nvflare.apis.fl_constant import FLContextKey, ReturnCode
    from nvflare.apis.fl_context import FLContext
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
    from nvflare.app_common.app_constant import AppConstants
    from nvflare.app_common.utils.fl_model_utils import FLModelUtils

    from nvflare.apis.dxo import DXO, DataKind

    from feduq.flare.ledger import PrivacyLedgerFilter
    from feduq.flare.quorum import error_reply, site_error

    class Engine(FakeEngine):
        def fire_event(self, event_type, fl_ctx):  # log_error fires an event
            pass

    class Ctx(FLContext):
        def get_identity_name(self, default=""):
            return "site-c"

        def get_engine(self):
            return Engine(tmp_path)

        def get_job_id(self):
            return "job1"

    ctx = Ctx()
    ctx.set_prop(FLContextKey.TASK_NAME, "train", private=True, sticky=False)
    sent = FLModelUtils.to_shareable(FLModel(params={"w": np.ones((2, 3), np.float32)}, params_type=ParamsType.FULL))
    sent.set_header(AppConstants.CURRENT_ROUND, 4)
    assert PrivacyLedgerFilter("fedavg", "in").process(sent, ctx) is sent
    out = PrivacyLedgerFilter("fedavg", "out")
    ok = FLModelUtils.to_shareable(FLModel(params={"w": np.zeros((2, 3), np.float32)}, params_type=ParamsType.FULL,
                                           metrics={"val_dice": 0.7, "train_loss": 0.2},
                                           meta={"feduq_num_samples": 10}))
    assert out.process(ok, ctx) is ok
    leak = FLModelUtils.to_shareable(FLModel(params={"w": np.zeros((2, 3), np.float32)}, params_type=ParamsType.FULL,
                                             meta={"feduq_num_samples": 10, "per_image_dice": [0.9]}))
    reply = out.process(leak, ctx)
    assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR
    assert "undeclared meta key 'per_image_dice'" in site_error(reply) and "w" not in (reply.get("DXO") or {})
    rows = list(csv.DictReader(open(tmp_path / "run" / "job1" / "privacy_ledger.csv")))
    assert [(r["round"], r["section"], r["key"], r["bytes"]) for r in rows[:4]] == [
        ("4", "model", "w", "24"), ("4", "metrics", "val_dice", "8"), ("4", "metrics", "train_loss", "8"),
        ("4", "meta", "feduq_num_samples", "8")]
    assert rows[-1]["section"] == "BLOCKED" and "per_image_dice" in rows[-1]["key"]
    with pytest.raises(ValueError, match="method='fedsgd' has no ledger"):
        PrivacyLedgerFilter("fedsgd")

    # what surrounds the DXO: each route that once passed is blocked, the reply carries only the reason
    image = np.random.default_rng(0).integers(0, 255, (64, 64, 3), dtype=np.uint8)
    base = dict(params={"w": np.zeros((2, 3), np.float32)}, params_type=ParamsType.FULL, meta={"feduq_num_samples": 10})

    def header_image(s):
        s.set_header("feduq_extra", image)

    def header_name_ok_value_image(s):
        s.set_header("current_round", image)

    def beside_dxo(s):
        s["pixels"] = image

    def dxo_field(s):
        s["DXO"]["pixels"] = image

    def ok_without_dxo(s):
        s.clear()
        s.set_header("feduq_site_error", "fine")
        s["pixels"] = image

    def ok_empty(s):
        s.clear()

    def collection(s):
        s["DXO"]["kind"] = "COLLECTION"

    for name, tamper, says in [
        ("header", header_image, "undeclared header 'feduq_extra' (ndarray)"),
        ("header value", header_name_ok_value_image, "header 'current_round' is a ndarray"),
        ("beside the DXO", beside_dxo, "the result carries ['pixels'] beside its DXO"),
        ("DXO field", dxo_field, "the DXO carries fields ['pixels']"),
        ("no DXO, OK, with an image", ok_without_dxo, "the result carries ['pixels'] beside its DXO"),
        ("no DXO, OK", ok_empty, "a result with return code OK and no DXO"),
        ("DXO kind", collection, "a DXO of kind 'COLLECTION'"),
    ]:
        result = FLModelUtils.to_shareable(FLModel(**base))
        tamper(result)
        reply = out.process(result, ctx)
        assert reply.get_return_code() == ReturnCode.TASK_RESULT_FILTER_ERROR, name
        assert says in site_error(reply), (name, site_error(reply))
        assert set(reply.keys()) == {"__headers__"} and all(
            not isinstance(v, np.ndarray) for v in reply["__headers__"].values()), name
    metrics_dxo = DXO(DataKind.METRICS, {"val_dice": 0.5}, meta={"feduq_num_val_samples": 3, "initial_metrics": {
        "val_dice": image}}).to_shareable()  # initial_metrics is a model DXO's metrics only
    ctx.set_prop(FLContextKey.TASK_NAME, "validate", private=True, sticky=False)
    assert "undeclared meta key 'initial_metrics'" in site_error(out.process(metrics_dxo, ctx))
    error = error_reply(ReturnCode.EXECUTION_EXCEPTION, "site-c: out of memory")  # a real error reply passes
    assert out.process(error, ctx) is error


def test_every_job_runs_the_ledger_on_every_task_and_the_readme_table_is_generated():
    from feduq.registry.ledger import LEDGER, ledger_markdown

    for job in sorted((REPO / "jobs").iterdir()):
        cfg = json.loads((job / "app" / "config" / "config_fed_client.json").read_text())
        tasks = cfg["executors"][0]["tasks"]
        for key, direction in (("task_data_filters", "in"), ("task_result_filters", "out")):
            (chain,) = cfg[key]
            assert chain["tasks"] == tasks, job.name
            assert chain["filters"] == [{"path": "feduq.flare.ledger.PrivacyLedgerFilter",
                                         "args": {"method": job.name, "direction": direction}}]
        assert set(tasks) <= set(LEDGER[job.name]), f"{job.name}: undeclared task(s) {set(tasks) - set(LEDGER[job.name])}"
    readme = (REPO / "docs" / "reference" / "privacy.md").read_text()
    assert ledger_markdown() in readme
    make_jobs = load_tool("make_jobs")
    assert make_jobs.readme_with_ledger(readme) == readme


def test_the_site_privacy_policy_is_read_by_flare_and_a_job_cannot_run_without_the_ledger(tmp_path):
    """write_privacy_policy, read by FLARE's own privacy configurator: the site's default scope (a new one, or every
    scope of an existing FLARE policy, keeping its filters) ends with FedUQ's ledger for any method on task data and
    results; writing twice changes nothing. The job check refuses a job whose ledger filters were removed."""
    from nvflare.apis.fl_constant import FilterKey
    from nvflare.apis.workspace import Workspace
    from nvflare.private.fed.app.fl_conf import create_privacy_manager

    from feduq.recipes.job_folders import configure
    from feduq.jobs.jobcheck import JobConfigError, validate_job
    from feduq.flare.ledger import PrivacyLedgerFilter, write_privacy_policy
    from feduq.privacy.ledger import LedgerViolation
    from feduq.registry.ledger import check_result

    def manager(kit):
        (kit / "startup").mkdir(exist_ok=True)  # what FLARE's Workspace requires of a kit
        return create_privacy_manager(Workspace(str(kit), site_name="site-a"), names_only=False)

    new = tmp_path / "new"
    path = write_privacy_policy(new)
    assert write_privacy_policy(new).read_text() == path.read_text()  # idempotent
    scope = manager(new).get_scope("")  # a job naming no scope gets the default one
    assert scope.name == "feduq"
    for chain, direction in ((scope.task_data_filters, FilterKey.IN), (scope.task_result_filters, FilterKey.OUT)):
        (f,) = chain[direction]
        assert isinstance(f, PrivacyLedgerFilter) and (f.method, f.direction) == ("*", direction)
    existing = tmp_path / "existing"
    (existing / "local").mkdir(parents=True)
    (existing / "local" / "privacy.json").write_text(json.dumps({"scopes": [
        {"name": "public", "task_result_filters": [{"path": "nvflare.app_common.filters.percentile_privacy."
                                                            "PercentilePrivacy", "args": {"percentile": 10}}]},
        {"name": "private"}], "default_scope": "public"}))
    write_privacy_policy(existing)
    mgr = manager(existing)
    for name in ("public", "private"):
        filters = mgr.get_scope(name).task_result_filters[FilterKey.OUT]
        assert [type(f).__name__ for f in filters] == (["PercentilePrivacy"] if name == "public" else []) + [
            "PrivacyLedgerFilter"]
    # the site's policy admits what any FedUQ method declares and nothing else
    check_result("*", "train", "s", {}, {"val_dice": 0.5}, {"fedevi_mean_u_ale": 0.2, "feduaa_youden_threshold": 0.4})
    with pytest.raises(LedgerViolation, match="undeclared meta key 'per_image_dice'"):
        check_result("*", "train", "s", {}, {}, {"per_image_dice": 0.5})

    job = configure(REPO / "jobs" / "fedavg", tmp_path / "job")
    client_path = job / "app" / "config" / "config_fed_client.json"
    client = json.loads(client_path.read_text())
    client["task_result_filters"] = []
    client_path.write_text(json.dumps(client))
    with pytest.raises(JobConfigError, match=r"task_result_filters: task 'train' has no privacy ledger filter "
                                             r"\(feduq.flare.ledger.PrivacyLedgerFilter, direction 'out'\)"):
        validate_job(job)
