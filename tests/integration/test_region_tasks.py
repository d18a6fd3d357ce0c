"""Nested structures (nnU-Net's regions) first-class (issue 69): a fundus task in nnU-Net's region syntax
(``optic_disc: [1, 2], optic_cup: 2``) whose four sites (tests/nnunet_sites.py, built at test time from ../shared/data)
include one annotating the disc only and one the cup only. A site's structures are matched by name to the task's
regions, each of its values stands for a group of the task's classes, and it trains with the marginal loss over the
groups (p(disc) = p_rim + p_cup); a site whose labels cannot be read as the task's is refused by the data check a job
runs before FLARE starts."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import nnunet_sites
from feduq.core.partial_labels import as_groups, group_names, marginal_logits, partial_label_loss, scored_columns
from feduq.data import DataError, get_task
from feduq.sites import nnunet_raw as nr


@pytest.fixture(scope="module")
def region_task(tmp_path_factory, data_root):
    """``(data root, task file)``: EyeClinic-C annotates the cup only, EyeClinic-D the disc only, 4 images a site."""
    root = tmp_path_factory.mktemp("regions")
    task = nnunet_sites.fundus_region_task(data_root, root, disc_only=("EyeClinic-D",), cup_only=("EyeClinic-C",),
                                           max_items=5)
    return root, task


def test_a_sites_structures_are_the_tasks_regions_by_name(region_task):
    root, task = region_task
    spec = get_task(str(task))
    assert spec.class_names == ("background", "optic_disc", "optic_cup")  # painted values 1 (rim), 2 (cup)
    folder = root / spec.folder
    full = nr.read_site_labels(folder / "EyeClinic-A", spec, "EyeClinic-A")
    assert full.annotated == ((0,), (1,), (2,)) and not full.partial and full.value_to_class == {0: 0, 1: 1, 2: 2}
    disc = nr.read_site_labels(folder / "EyeClinic-D", spec, "EyeClinic-D")  # its value 1 = rim or cup
    assert disc.annotated == ((0,), (1, 2)) and disc.partial and disc.value_to_class == {0: 0, 1: 1}
    assert disc.names == ("optic_disc",)
    cup = nr.read_site_labels(folder / "EyeClinic-C", spec, "EyeClinic-C")  # its background holds the rim
    assert cup.annotated == ((0, 1), (2,)) and cup.value_to_class == {0: 0, 1: 2}
    assert nr.annotated_classes(str(task), root, "EyeClinic-A") is None
    assert nr.annotated_classes(str(task), root, "EyeClinic-D") == ((0,), (1, 2))
    # scored on what it annotates: the disc site on the disc (a union of its groups), not the cup; the cup site on the
    # cup only
    regions = spec.eval_regions
    assert regions == {"optic_disc": (1, 2), "optic_cup": (2,)}
    assert scored_columns(spec.class_names, regions, disc.annotated)[1] == [0]
    assert scored_columns(spec.class_names, regions, cup.annotated)[1] == [1]
    assert group_names(spec.class_names, regions, disc.annotated) == ["optic_disc"]
    assert group_names(spec.class_names, regions, cup.annotated) == ["optic_cup"]
    # the disc site's labels read as the task's classes: every disc pixel class 1, so the disc region (class >= 1)
    # is its mask
    items = nr.nnunet_items(str(task), "EyeClinic-D", "train", data_root=root)
    assert items and set(np.unique(np.concatenate([it["label"].ravel() for it in items])).tolist()) == {0, 1}


def test_labels_that_are_no_union_of_the_tasks_values_are_refused_before_flare_starts(region_task, tmp_path):
    root, task = region_task
    spec = get_task(str(task))
    import shutil

    data = tmp_path / "data"
    shutil.copytree(root / spec.folder, data / spec.folder)
    site = data / spec.folder / "EyeClinic-B"
    own = json.loads((site / "dataset.json").read_text())
    # a nested cup as a plain label beside the disc: a pixel of value 1 would be disc but not cup, i.e. the rim, and
    # value 2 cup but not disc: no class of the task
    own["labels"] = {"background": 0, "optic_disc": 1, "optic_cup": 2}
    own.pop("regions_class_order", None)
    (site / "dataset.json").write_text(json.dumps(own))
    with pytest.raises(DataError) as e:
        nr.check_site_declarations(str(task), data, spec.centers)
    message = str(e.value)
    assert message.startswith(f"site 'EyeClinic-B': {site / 'dataset.json'}: label value 2 (optic_cup) stands for "
                              "none of task 'Dataset903_FundusRegions''s classes") and "\n" not in message
    # the job's own check, before FLARE starts (the simulator's data check), in well under a second
    from feduq.recipes.recipe import FedUQRecipe
    from nvflare.recipe import SimEnv
    import time

    recipe = FedUQRecipe("fedavg", task=str(task), data_root=str(data), image_size=32, num_rounds=1,
                         executor_args={"network": {"name": "light"}})
    t0 = time.perf_counter()
    with pytest.raises(DataError, match="site 'EyeClinic-B'"):
        recipe.run(SimEnv(clients=recipe.sites, workspace_root=str(tmp_path / "ws")))
    assert time.perf_counter() - t0 < 5
    # a numTraining that does not match imagesTr/ is said (nnU-Net's dataset check would stop)
    own = json.loads((root / spec.folder / "EyeClinic-A" / "dataset.json").read_text())
    own["numTraining"] = 30
    shutil.copy(root / spec.folder / "EyeClinic-A" / "dataset.json", tmp_path / "keep.json")
    (data / spec.folder / "EyeClinic-A" / "dataset.json").write_text(json.dumps(own))
    (site / "dataset.json").write_text((root / spec.folder / "EyeClinic-B" / "dataset.json").read_text())
    notes = nr.check_site_declarations(str(task), data, spec.centers)
    assert notes == [f"site 'EyeClinic-A': {data / spec.folder / 'EyeClinic-A' / 'dataset.json'} says numTraining 30, "
                     "imagesTr/ holds 5 cases; FedUQ reads the 5 that are there (nnU-Net's dataset check would stop "
                     "here)"]


def test_the_marginal_loss_of_a_disc_only_site_is_the_cross_entropy_of_the_discs_probability():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 4, 4)
    label = torch.randint(0, 2, (2, 1, 4, 4))  # the disc site's classes as read: 0 background, 1 disc (rim or cup)
    groups = ((0,), (1, 2))
    merged = marginal_logits(logits, groups)
    p = torch.softmax(logits, 1)
    np.testing.assert_allclose(torch.softmax(merged, 1)[:, 1].numpy(), (p[:, 1] + p[:, 2]).numpy(), rtol=1e-6)
    ce = lambda z, y, r: torch.nn.functional.cross_entropy(z, y[:, 0].long())  # noqa: E731
    loss = partial_label_loss(ce, groups, 3)(logits, label, 0)
    by_hand = -torch.where(label[:, 0] == 1, torch.log(p[:, 1] + p[:, 2]), torch.log(p[:, 0])).mean()
    assert math.isclose(loss.item(), by_hand.item(), rel_tol=1e-6)
    # the flat form of before (annotated classes) is the same partition with the others in the background
    assert as_groups((0, 2), 3) == ((0, 1), (2,))
    with pytest.raises(ValueError, match="must partition"):
        as_groups(((0,), (1,)), 3)


METHODS = ("fedavg", "fedprox", "fedbn", "fedavgm", "fedper", "fedevi", "feduaa", "graphfedseg")


@pytest.mark.parametrize("method", METHODS)
def test_every_2d_method_trains_a_round_on_a_disc_only_site(region_task, method, tmp_path):
    """One local round of every 2D segmentation method on the disc-only site, off FLARE: finite weights, the site's
    start line naming its annotation, its validation scored on the disc only."""
    from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

    from feduq.registry import method_site_part, network_args, spec_of
    from feduq.site.site2d import Site2D

    root, task = region_task
    spec = spec_of(method)
    lines = []
    site = Site2D(method=method_site_part(method)(**spec.site_args), task=str(task), image_size=32, batch_size=2,
                  local_epochs=1, max_items=2, network={**network_args(method), "name": "light"}, num_threads=1,
                  device="cpu")
    site.log = lines.append
    site.start("EyeClinic-D", {"data_root": str(root)}, tmp_path)
    assert site.ready()
    assert sum("partial labels: annotates ['optic_disc'] (marginal loss over the others)" in m for m in lines) == 1
    init = site.trainer.get_params()
    out = site.train(FLModel(params={k: v.copy() for k, v in init.items()}, params_type=ParamsType.FULL,
                             current_round=0, total_rounds=2))
    assert all(np.isfinite(np.asarray(v)).all() for v in out.params.values())
    assert any(not np.array_equal(np.asarray(out.params[k]), init[k]) for k in out.params)
    assert site.regions == {"optic_disc": (1, 2)}


@pytest.mark.sim
@pytest.mark.parametrize("method", ["fedevi", "fedavg"])
def test_a_region_task_runs_in_flares_simulator_with_every_structures_columns(region_task, method, tmp_path):
    """FedEvi and FedAvg in FLARE's simulator on the four fundus sites (one disc-only, one cup-only): every site's
    row of the per-client table has disc and cup columns, blank where the site does not annotate the structure."""
    import csv

    from nvflare.recipe import SimEnv

    from feduq.recipes.recipe import FedUQRecipe

    root, task = region_task
    recipe = FedUQRecipe(method, task=str(task), data_root=str(root), image_size=32, num_rounds=1, local_epochs=1,
                         executor_args={"network": {"name": "light"}, "num_threads": 1})
    assert recipe.sites == list(nnunet_sites.FUNDUS_SITES.values())
    recipe.run(SimEnv(clients=recipe.sites, workspace_root=str(tmp_path / "work")))
    ws = tmp_path / "work" / recipe.name
    rows = {r["client"]: r for r in csv.DictReader(open(ws / "server" / "simulate_job" / "results" /
                                                        "per_client_table.csv"))}
    assert set(recipe.sites) <= set(rows)
    for site, row in rows.items():
        if site not in recipe.sites:
            continue
        for structure in ("optic_disc", "optic_cup"):
            blank = (site, structure) in {("EyeClinic-C", "optic_disc"), ("EyeClinic-D", "optic_cup")}
            assert (row[f"dice_{structure}"] == "") == blank, (site, structure, row)
            if not blank:
                assert 0.0 <= float(row[f"dice_{structure}"]) <= 1.0
    log = (ws / "EyeClinic-D" / "log.txt").read_text()
    assert "partial labels: annotates ['optic_disc'] (marginal loss over the others)" in log
    # each site's own per-image test file has each structure it is scored on (feduq compare's paired tests per structure)
    per_image = list(csv.DictReader(open(ws / "EyeClinic-A" / "simulate_job" / "per_image_test.csv")))
    assert per_image and all(np.mean([float(r[f"dice_{s}"]) for s in ("optic_disc", "optic_cup")])
                             == pytest.approx(float(r["dice"]), abs=1e-6) for r in per_image)
