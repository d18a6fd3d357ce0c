"""The 2D site runs without FLARE's engine, and FLARE's executor adds nothing to its numbers."""

import csv
import json

import numpy as np
from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import ReservedKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from conftest import FakeEngine
from feduq.common.wire import SITE_CONFIG_FILE, FedUQMetaKey
from feduq.scores.tables import PER_IMAGE_TEST_FILE
from feduq.flare.executor import FedUQExecutor
from feduq.methods.fedevi import FedEviSite
from feduq.site.site2d import Site2D

ARGS = dict(task="polyp", image_size=32, batch_size=2, local_epochs=1, max_items=4, network={"name": "light"},
            num_threads=1, device="cpu", resize="letterbox", intensity="max")
SITE = "CVC-ClinicDB"
TIMES = ("train_seconds", "validate_seconds", "statistics_seconds", "torch_threads")


def _records(lines, tag):
    return [{k: v for k, v in json.loads(m.split(" ", 1)[1]).items() if k not in TIMES}
            for m in lines if m.startswith(tag + " ")]


def test_a_2d_site_runs_without_flare_and_the_flare_executor_gives_the_same_numbers(tmp_path, data_root):
    # off FLARE: the method's site part, the site's config as a dict, a run folder; nothing of FLARE runs
    plain_lines = []
    site = Site2D(method=FedEviSite(), **ARGS)
    site.log = plain_lines.append
    site.start(SITE, {"data_root": str(data_root)}, tmp_path / "plain")
    assert site.ready() and site.site == SITE and site.center == SITE
    # amp "auto" on a CPU: bfloat16 autocast where the CPU has bfloat16 hardware (this network has no BatchNorm),
    # named in the site's start line
    from feduq.core.training import cpu_has_bf16, has_batchnorm

    assert not has_batchnorm(site.trainer.model)
    expected = "bfloat16 autocast" if cpu_has_bf16() else "float32"
    assert sum(f"training precision {expected}, " in line for line in plain_lines) == 1, plain_lines
    assert (len(site.train_ds), len(site.val_ds), len(site.test_ds)) == (4, 4, 4)  # max_items
    # what a site keeps between tasks: its training and validation images cached, its test split (read once, at the
    # end) checked at the start but not kept
    assert [type(d).__name__ for d in (site.train_ds, site.val_ds, site.test_ds)] == ["CacheDataset"] * 2 + ["Dataset"]
    assert sorted(site.tasks()) == ["submit_model", "test", "train", "validate", "validate_surrogate"]

    # on FLARE: the job's executor class, started at START_RUN from the site's workspace, tasks through execute()
    flare_root = tmp_path / "flare"
    (flare_root / "local").mkdir(parents=True)
    (flare_root / "local" / SITE_CONFIG_FILE).write_text(json.dumps({"data_root": str(data_root)}))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, FakeEngine(flare_root), private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "job", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, SITE, private=True, sticky=False)
    ex = FedUQExecutor(tracking_writer_id=None, site_part="feduq.methods.fedevi.FedEviSite", **ARGS)
    flare_lines = []
    ex.log_info = lambda fl_ctx, msg: flare_lines.append(msg)
    ex.handle_event(EventType.START_RUN, ctx)
    assert ex.ready(), ex._setup_error

    init = site.trainer.get_params()  # both seeded alike: the same initial model
    for k, v in ex.trainer.get_params().items():
        np.testing.assert_array_equal(v, init[k])

    received = FLModel(params={k: v.copy() for k, v in init.items()}, params_type=ParamsType.FULL, current_round=0,
                       total_rounds=2)
    plain = site.train(received)
    reply = ex.execute("train", FLModelUtils.to_shareable(received), ctx, Signal())
    assert reply.get_return_code(ReturnCode.OK) == ReturnCode.OK
    on_flare = FLModelUtils.from_shareable(reply)
    assert set(plain.params) == set(on_flare.params) == set(init)
    for k, v in plain.params.items():
        np.testing.assert_array_equal(np.asarray(on_flare.params[k]), v)
        assert np.isfinite(v).all()
    assert plain.meta[FedUQMetaKey.NUM_SAMPLES] == on_flare.meta[FedUQMetaKey.NUM_SAMPLES] == 4  # N_k
    a_k = plain.meta[FedUQMetaKey.MEAN_INV_ALEATORIC]  # FedEvi's A_k, sent with θ_k
    assert a_k == on_flare.meta[FedUQMetaKey.MEAN_INV_ALEATORIC] and np.isfinite(a_k) and a_k > 0
    assert _records(plain_lines, "FEDUQ_TRAIN") == _records(flare_lines, "FEDUQ_TRAIN")
    assert len(_records(plain_lines, "FEDUQ_TRAIN")) == 1

    # the test task: the same scores, and each writes the site's per-image file into its own run folder
    final = FLModel(params=dict(plain.params), params_type=ParamsType.FULL)
    scores = site.test(final).metrics
    reply = ex.execute("test", FLModelUtils.to_shareable(final), ctx, Signal())
    assert FLModelUtils.from_shareable(reply).metrics == scores
    assert scores["num_images"] == 4 and 0.0 <= scores["dice"] <= 1.0
    for folder in (tmp_path / "plain", flare_root / "run" / "job"):
        with open(folder / PER_IMAGE_TEST_FILE) as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 4
        assert np.mean([float(r["dice"]) for r in rows]) == scores["dice"]


def test_a_site_that_cannot_start_is_not_ready_and_names_what_is_wrong(tmp_path):
    site = Site2D(**ARGS)
    try:
        site.start("Hospital-Z", {"data_root": str(tmp_path)}, tmp_path / "run")
    except Exception as e:
        assert "Hospital-Z" in str(e) and "center" in str(e)
    else:
        raise AssertionError("an unknown center started")
    assert not site.ready()


def test_a_job_names_a_site_part_and_its_arguments_beside_the_sites():
    from feduq.jobs.jobcheck import JobConfigError, check_arguments
    from feduq.methods.fedprox import FedProxSite
    from feduq.methods.feduaa import FedUAASegSite
    from feduq.parts.site import build_site_part

    part, rest = build_site_part(FedProxSite, {"mu": 0.25, "loss": "dice", "lr": 1e-3, "seed": 3})
    assert isinstance(part, FedProxSite) and part.mu == 0.25 and part.loss_name == "dice"
    assert rest == {"lr": 1e-3, "seed": 3}  # the site's; the site part took mu and loss
    part, rest = build_site_part(FedUAASegSite, {"seed": 3, "roc_level": "image"})
    assert rest == {"seed": 3}  # seed: both the site and FedUAA's ROC subsample

    generic = "feduq.flare.executor.FedUQExecutor"
    check_arguments(generic, {"site_part": "feduq.methods.fedprox.FedProxSite", "mu": 0.1, "lr": 1e-3}, "executor")
    for args, message in [
        ({"site_part": "feduq.methods.fedprox.FedProxSite", "muu": 0.1}, "did you mean 'mu'"),
        ({"mu": 0.1}, "unknown argument 'mu'"),  # FedAvg's site part takes no mu
        ({"site_part": "os.system"}, "expected a class in feduq.methods"),
        ({"site_part": "feduq.methods.fedprox.ProximalTerm"}, "is not a feduq.parts.site.SitePart"),
    ]:
        try:
            check_arguments(generic, args, "client executor")
        except JobConfigError as e:
            assert message in str(e) and "client executor" in str(e), str(e)
        else:
            raise AssertionError(f"accepted {args}")
