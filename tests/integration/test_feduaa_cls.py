"""FedUAA's original image-level classification form: the breast benign/malignant dataset, the ResNet + TWEU
network, the client executor without a FLARE runtime (fake engine), and a small simulator run."""

import csv

import numpy as np
import pytest
import torch
from nvflare.apis.fl_constant import ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from conftest import SHARED_DATA, read_table, run_simulator
from feduq import data as fdata
from feduq.common.wire import FedUQMetaKey, FedUQMetric
from feduq.flare.executor import FedUQExecutor
from feduq.methods.feduaa.classification import FedUAAClassificationSite, classification_scores

SITE_CLASS = "feduq.methods.feduaa.classification.FedUAAClassificationSite"
from feduq.core.classification_networks import ResNetTWEU

BREAST = SHARED_DATA / "breast_us"
CENTER = "BUSI-Baheya-Cairo"


@pytest.fixture(scope="module")
def breast_root():
    if not (BREAST / CENTER / "classes.csv").is_file():
        pytest.skip(f"breast data not found at {BREAST}")
    return SHARED_DATA


def _classes(center):
    with open(BREAST / center / "classes.csv") as f:
        return {r["image"]: r["class"] for r in csv.DictReader(f)}


def test_dataset_yields_images_and_labels_from_classes_csv(breast_root):
    ds = fdata.get_classification_dataset("breast", CENTER, "test", breast_root, image_size=32, max_items=6)
    names = fdata.classification_classes("breast")
    truth = _classes(CENTER)
    assert len(ds) == 6
    for i in range(len(ds)):
        s = ds[i]
        assert tuple(s["image"].shape) == (1, 32, 32) and s["image"].dtype == torch.float32
        assert 0.0 <= float(s["image"].min()) and float(s["image"].max()) <= 1.0
        stem = ds.data[i]["image"].rsplit("/", 1)[-1].rsplit(".", 1)[0]
        assert names[s["label"]] == truth[stem]
    train = fdata.get_classification_dataset("breast", CENTER, "train", breast_root, image_size=32, max_items=2)
    assert tuple(train[0]["image"].shape) == (1, 32, 32)


def test_dataset_names_site_and_file_for_a_missing_label(breast_root, tmp_path):
    import shutil

    root = tmp_path / "data"
    shutil.copytree(BREAST / CENTER, root / "breast_us" / CENTER)
    path = root / "breast_us" / CENTER / "classes.csv"
    lines = path.read_text().splitlines()
    split = fdata.load_split("breast", CENTER, breast_root)["testing"]
    first = split[0]["image"].rsplit("/", 1)[-1].rsplit(".", 1)[0]
    path.write_text("\n".join(line for line in lines if not line.startswith(first + ",")) + "\n")
    with pytest.raises(fdata.DataError, match=rf"{CENTER}.*{first}.*classes.csv"):
        fdata.get_classification_dataset("breast", CENTER, "test", root, image_size=32, max_items=2)
    with pytest.raises(fdata.DataError, match="no image-level classes"):
        fdata.classification_classes("polyp")


def test_network_shapes_and_seeded_init():
    a, b = ResNetTWEU(), ResNetTWEU()
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    a.eval()
    assert tuple(a(torch.rand(3, 1, 32, 32)).shape) == (3, 2)
    assert tuple(a.features(torch.rand(1, 1, 32, 32)).shape) == (1, 512)
    assert set(a.head_keys()) == {k for k in a.state_dict() if k.startswith("classifier.")}


def test_classification_scores():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [1.0, 0.0], [0.0, 1.0]])
    s = classification_scores(logits, torch.tensor([0, 1, 1, 1]))
    assert s["auc"] == 1.0 and s["accuracy"] == 0.75 and s["num_images"] == 4
    assert np.isnan(classification_scores(logits, torch.tensor([1, 1, 1, 1]))["auc"])


from conftest import FakeEngine as _Engine  # noqa: E402


def _site(tmp_path, root, monkeypatch, **args):
    monkeypatch.setenv("FEDUQ_DATA_ROOT", str(root))
    ctx = FLContext()
    ctx.set_prop(ReservedKey.ENGINE, _Engine(tmp_path), private=True, sticky=False)
    ctx.set_prop(ReservedKey.RUN_NUM, "job", private=True, sticky=False)
    ctx.set_prop(ReservedKey.IDENTITY_NAME, CENTER, private=True, sticky=False)
    ex = FedUQExecutor(site_class=SITE_CLASS, task="breast", image_size=32, batch_size=4, max_items=8, num_threads=1,
                       device="cpu", **args)
    from feduq.site.classification import ClassificationSite

    assert isinstance(ex, FedUAAClassificationSite)
    assert type(ex).__mro__[1:4] == (FedUAAClassificationSite, ClassificationSite, FedUQExecutor)
    ex.site = CENTER
    ex._setup(ctx)
    return ex, ctx


@pytest.mark.parametrize("local_bn", ["name", "none"])
def test_client_sends_no_head_and_a_threshold(tmp_path, breast_root, monkeypatch, local_bn):
    ex, ctx = _site(tmp_path, breast_root, monkeypatch, local_bn=local_bn)
    head = {k for k in ex.trainer.model.state_dict() if k.startswith("classifier.")}
    bn = {k for k in ex.trainer.model.state_dict() if "bn" in k}
    assert head and head <= ex.local_keys()
    assert (bn <= ex.local_keys()) == (local_bn == "name")
    server_model = {k: v.copy() for k, v in ex.trainer.get_params().items()}
    for k in head:
        server_model[k] = np.full_like(server_model[k], 7.0)

    sent = ex.train(FLModel(params=server_model, params_type=ParamsType.FULL, current_round=0))

    assert not ex.local_keys() & set(sent.params), "a local entry left the site"
    assert set(sent.params) == set(server_model) - ex.local_keys()
    theta = sent.meta[FedUQMetaKey.FEDUAA_THRESHOLD]
    assert theta is None or 0.0 <= theta <= 1.0
    assert ex.method.last_point.num_samples == 8  # every training image seen in the local epoch (2 batches of 4)
    assert 0.0 <= sent.metrics[FedUQMetric.VAL_AUC] <= 1.0
    assert isinstance(ex.trainer.optimizer, torch.optim.SGD) and ex.trainer.optimizer.defaults["momentum"] == 0
    assert all(not torch.all(ex.trainer.model.state_dict()[k] == 7.0) for k in head)
    metrics = ex.test(FLModel(params=server_model)).metrics
    assert ex.eval_local == "matched"
    assert set(metrics) == {"auc", "accuracy", "num_images"} and metrics["num_images"] == len(ex.test_ds)
    assert 0.0 <= metrics["auc"] <= 1.0 and 0.0 <= metrics["accuracy"] <= 1.0
    val = ex.validate(FLModel(params=sent.params)).metrics
    assert set(val) == {FedUQMetric.VAL_AUC, FedUQMetric.VAL_ACCURACY}


def test_client_rejects_unknown_switches():
    with pytest.raises(ValueError, match="local_bn"):
        FedUAAClassificationSite(local_bn="some")  # FLARE-free
    with pytest.raises(ValueError, match="threshold_source"):
        FedUQExecutor(site_class=SITE_CLASS, threshold_source="test")
    with pytest.raises(ValueError, match="site_class='feduq.site.site2d.Site2D': expected a class in feduq.methods"):
        FedUQExecutor(site_class="feduq.site.site2d.Site2D")


@pytest.mark.sim
def test_simulator_feduaa_cls_writes_per_site_auc(tmp_path, breast_root):
    ws = tmp_path / "ws"
    proc = run_simulator("feduaa_cls", ws, breast_root, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = read_table(ws)
    assert set(table) == {"BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil", "Avg", "Std"}
    for site in ("BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"):
        assert 0.0 <= float(table[site]["auc"]) <= 1.0
        assert 0.0 <= float(table[site]["accuracy"]) <= 1.0
    log = (ws / "simulate_job" / "log.txt") if (ws / "simulate_job" / "log.txt").is_file() else None
    text = proc.stdout + proc.stderr + (log.read_text() if log else "")
    assert "feduaa_youden_threshold" in text


def test_fedavgs_classification_part_is_cross_entropy_and_entropy_by_hand():
    """FedAvg's image-level site part (FedUAA's baseline, jobs/fedavg_cls): the loss is the mean cross-entropy, the
    uncertainty the predictive entropy (ln 2 for equal logits), nothing stays local."""
    import math

    from feduq.parts.site import ClassificationPart
    from feduq.site.classification import ClassificationSite

    part = ClassificationPart()
    logits, label = torch.tensor([[2.0, 0.0], [0.0, 0.0]]), torch.tensor([[0], [1]])
    by_hand = (math.log(1 + math.exp(-2.0)) + math.log(2.0)) / 2
    assert float(part.loss(None)(logits, label, 1)) == pytest.approx(by_hand, rel=1e-6)
    u = part.uncertainty()(logits)["total"]
    assert float(u[1]) == pytest.approx(math.log(2.0), rel=1e-6) and float(u[0]) < float(u[1])
    assert part.local_keys(ResNetTWEU()) == frozenset() and part.output == "classification"
    with pytest.raises(ValueError, match="site part SitePart does not classify images"):
        from feduq.parts.site import SitePart

        ClassificationSite(method=SitePart())


@pytest.mark.sim
def test_simulator_fedavg_cls_averages_with_sample_counts_and_writes_per_site_auc(tmp_path, breast_root):
    """jobs/fedavg_cls on the two breast sites: FedUQ's image-level loop with FedAvg's part; the server's weights are
    the sites' training counts over their sum (hand-computed from each site's FEDUQ_TRAIN line), the table has AUC and
    accuracy per site."""
    import json
    import re

    ws = tmp_path / "ws"
    proc = run_simulator("fedavg_cls", ws, breast_root, timeout=600, max_items=5)
    assert proc.returncode == 0, proc.stderr[-4000:]
    table = read_table(ws)
    assert set(table) == {"BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil", "Avg", "Std"}
    for site in ("BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"):
        assert 0.0 <= float(table[site]["accuracy"]) <= 1.0
    counts = {}
    for site in ("BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"):
        rec = json.loads(re.search(r"FEDUQ_TRAIN (\{.*\})", (ws / site / "log.txt").read_text()).group(1))
        counts[site] = rec["feduq_num_samples"]
    agg = json.loads(re.search(r"FEDUQ_AGGREGATION (\{.*\})", (ws / "server" / "log.txt").read_text()).group(1))
    assert agg["weights"] == pytest.approx({s: n / sum(counts.values()) for s, n in counts.items()}, abs=1e-6)
    assert "0 local entries" in (ws / "BUSI-Baheya-Cairo" / "log.txt").read_text()
    # each site's per-image test file (for the paired tests) gives back the table's accuracy and AUC
    from sklearn.metrics import roc_auc_score

    for site in ("BUSI-Baheya-Cairo", "BUS-BRA-INCa-Brazil"):
        with open(ws / site / "simulate_job" / "per_image_test.csv") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == 5 and all(abs(float(r["p_0"]) + float(r["p_1"]) - 1) < 1e-9 for r in rows)
        assert np.mean([int(r["correct"]) for r in rows]) == pytest.approx(float(table[site]["accuracy"]), abs=1e-6)
        labels = [int(r["label"]) for r in rows]
        if len(set(labels)) == 2:
            auc = roc_auc_score(labels, [float(r["p_1"]) for r in rows])
            assert auc == pytest.approx(float(table[site]["auc"]), abs=1e-6)
