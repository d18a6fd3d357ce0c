"""Multi-head abdominal CT on FLARE (FedAvg on the FIVA setting; the base of FIVA and FUNAvg).

Every site trains nnU-Net's 2D network from the job's shared plans (:mod:`feduq.nnunet.pipeline`) on its own
organs (:mod:`feduq.data.ct`) with its own segmentation head. In training only the backbone crosses the
wire (``named_parameters()`` minus ``decoder.seg_layers``, each tensor once); once, after the last
round, each training site sends its final head so the released model is the multi-head model
(backbone + every head) that FIVA's inference needs; the server then sends that model to every site,
held-out sites included, for the ``test`` task.

* :class:`CTExecutor` -- site side, the nnU-Net back-end of FedUQ's site executor
  (:class:`feduq.flare.site_executor.SiteExecutor`): nnU-Net preprocessing and training, ``submit_head``, ``test``
  with K-sample inference, the naive merge and the "+UN" background reweighting. What a method changes is its site
  part (:class:`feduq.parts.site.CTSitePart`: FedAvg draws nothing, FIVA samples the backbone posterior, FUNAvg
  MC dropout).
* :class:`CTController` -- server side: FedUQ's round loop with :class:`feduq.parts.ct_server.CTServer` (rounds over
  the training sites, held-out sites never train; fused by training cases here, FIVA plugs in its own server
  part), then heads, test, per-organ table.
* :class:`BackboneModel` -- what the persistor checkpoints: the backbone by parameter name (and, for
  FIVA, the global variance beside it, so a resumed job continues it).
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch
from torch import nn

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from ..common.saving import save_torch
from ..data import ct as fct
from .. import data as fdata
from ..nnunet import pipeline as nc
from ..common.wire import FedUQMetaKey, FedUQTask
from ..core.checkpoints import load_checkpoint
from ..ct.inference import build_heads, load_backbone, multi_head_slice, backbone_samples
from ..core.training import resolve_device
from ..parts.site import CTSitePart
from ..scores.metrics import calibration_error, segmentation_scores
from ..scores.tables import PER_IMAGE_TEST_FILE, write_rows
from ..site.settings import track_scalars
from ..ct.settings import ct_site_arguments, ct_site_settings
from .site_config import read_site_config, site_run_folder
from ..parts.ct_server import HEAD_WIRE_PREFIX, META_HEAD_ORGANS, SUBMIT_HEAD, VAR_PREFIX, CTServer  # noqa: F401
from .controller import FedUQController
from .site_executor import SiteExecutor

ECE_BINS = 15  # FIVA reports ECE with 15 bins


#: a CT training site's SGD momentum and AMP scaler state, in the site's run folder
CT_STATE_FILE = "feduq_ct_site_state.pt"


class BackboneModel(nn.Module):
    """The persisted global model: nnU-Net backbone parameters by name (no aliases, no head).

    Args:
        plans: shipped plans name or path (:func:`feduq.nnunet.pipeline.load_plans`).
        dropout: as the sites' networks (names do not change with dropout; kept for the record).
        variance: also hold sigma^2 per backbone tensor (FIVA), initialised to ones (paper and code).
    """

    def __init__(self, plans: str = "ct_2d", dropout: float = 0.0, variance: bool = False):
        super().__init__()
        torch.manual_seed(0)  # every run starts from the same backbone
        net = nc.SitePipeline(nc.load_plans(plans), ("organ",), dropout).build_network()
        self._params = OrderedDict((n, p.detach().clone()) for n, p in net.named_parameters()
                                   if not n.startswith(nc.HEAD_PREFIX))
        if variance:
            self._params.update((VAR_PREFIX + n, torch.ones_like(p)) for n, p in list(self._params.items()))

    def state_dict(self, *args, **kwargs):  # the persistor's view
        return OrderedDict((k, v.clone()) for k, v in self._params.items())

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        unknown = sorted(set(state_dict) - set(self._params))
        if strict and unknown:
            raise ValueError(f"BackboneModel: unexpected entries {unknown[:5]}")
        for k, v in state_dict.items():
            if k in self._params:
                self._params[k] = torch.as_tensor(np.asarray(v) if not torch.is_tensor(v) else v).clone()
        return None


class CTExecutor(SiteExecutor):
    """Multi-head CT site (FedAvg behaviour): nnU-Net training of the backbone and the site's own head.

    Args:
        tracking_writer_id: the site's TBWriter component (the round's loss and learning rate go to the server's
            TensorBoard, ``<run dir>/tb_events/<site>/``); None or a job without one: no streaming.
        per_site: site -> its own ``device``, ``batch_size``, ``num_threads`` (FLARE's ``set_per_site_config``).
        method: a site part made by code; a job names it instead by ``site_part`` (a dotted path) with its
            arguments.
        **kwargs: the site's settings and its part's arguments, :func:`feduq.ct.settings.ct_site_settings` (plans,
            intensity, iterations, batch_size, lr, weight_decay, num_rounds, dropout, inference_samples, max_items,
            seed, device, amp, num_threads, site_part, ...).

    A training site keeps its SGD momentum and AMP scaler state in its run folder (:data:`CT_STATE_FILE`) after every
    round, so a site process restarted within a job continues them (the poly learning rate follows the round).
    """

    def __init__(self, tracking_writer_id: str | None = "tb_writer", per_site: dict | None = None,
                 method: CTSitePart | None = None, **kwargs):
        super().__init__(per_site)
        settings = ct_site_settings(method=method, **kwargs)  # ValueError naming the argument
        for name in settings.__dataclass_fields__:
            setattr(self, name, getattr(settings, name))
        self.net, self.held_out, self._scratch = None, False, None
        self.tracking_writer_id, self.writer, self.state_path = tracking_writer_id, None, None

    @classmethod
    def job_arguments(cls, args: dict) -> set[str]:
        """The arguments a job may give this executor (:func:`feduq.ct.settings.ct_site_arguments`)."""
        return {"tracking_writer_id", "per_site"} | ct_site_arguments(args)

    # -- setup ---------------------------------------------------------------------------------------
    def _setup(self, fl_ctx: FLContext) -> None:
        cfg = read_site_config(fl_ctx)
        self.center = cfg.get("center", self.site)
        root = fdata.resolve_data_root(cfg.get("data_root"), site=self.site)
        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        else:  # 0: this site's share of the host's cores among the FedUQ processes computing now (feduq.core.threads)
            self.share_cores(fl_ctx)
        torch.manual_seed(self.seed)
        self.device = resolve_device(self.device_name)
        self.organs = fct.site_organs(root, self.center)
        self.lut = fct.site_label_lut(root, self.center)
        self.held_out = self.center in fct.HELD_OUT
        self.plans = nc.load_plans(self.plans_name)
        note = " (SLIM test/demo architecture, not the paper's)" if nc.is_slim(self.plans) else ""
        cap = lambda xs: xs[: self.max_items] if self.max_items else xs  # noqa: E731
        self.test_items = cap(fct.ct_items(root, self.center, "test"))
        train_cases = []
        if not self.held_out:
            train_items = cap(fct.ct_items(root, self.center, "train"))
            if not train_items:
                raise fdata.DataError(f"site {self.site!r}: no training slices")
            train_cases = [(it["name"], *fct.read_case(it, self.lut, self.site)) for it in train_items]
            self.num_cases = len({it.get("case", it["name"]) for it in train_items})
            props = nc.foreground_intensity_properties([(c[1], c[2]) for c in train_cases])
        else:  # a held-out site never trains; it normalises its test images with its own statistics
            props = nc.foreground_intensity_properties([fct.read_case(it, self.lut, self.site)[:2] for it in self.test_items])
        self.pipeline = nc.SitePipeline(nc.site_plans(self.plans, self.intensity, props), self.organs, self.dropout)
        self.net = self.pipeline.build_network().to(self.device)
        self.backbone = nc.backbone_names(self.net)
        self.amp_on = self.device.type == "cuda" and self.amp in ("auto", True)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.amp_on)
        self.optimizer = nc.make_optimizer(self.net, self.lr, self.weight_decay)
        from nnunetv2.training.lr_scheduler.polylr import PolyLRScheduler

        self.poly = PolyLRScheduler(self.optimizer, self.lr, self.num_rounds)
        if train_cases:
            self._scratch = tempfile.TemporaryDirectory(prefix=f"feduq-ct-{self.site}-")
            ids = self.pipeline.preprocess_to_folder(train_cases, Path(self._scratch.name))
            self.loader = self.pipeline.make_loader(Path(self._scratch.name), ids, self.batch_size, seed=self.seed)
            self.loss_fn = self.pipeline.build_loss()
            self.num_slices = len(ids)
        t = self.iterations.get(self.center, self.iterations.get("default", 250)) if isinstance(self.iterations, dict) else self.iterations
        self.steps_per_round = int(t)
        if self.tracking_writer_id:
            self.writer = fl_ctx.get_engine().get_component(self.tracking_writer_id)
        self.state_path = site_run_folder(fl_ctx) / CT_STATE_FILE
        if train_cases and self.state_path.is_file():  # this site's process was restarted within the job
            state = load_checkpoint(self.state_path, map_location=self.device, what="site state")
            self.optimizer.load_state_dict(state["optimizer"])
            self.scaler.load_state_dict(state["scaler"])
            self.log_info(fl_ctx, f"restored the SGD momentum and AMP scaler state of round {state.get('round')}")
        self.log_info(fl_ctx, f"FedUQ CT site {self.site}: organs {list(self.organs)}, "
                              f"{'held-out (test only)' if self.held_out else f'{self.num_slices} training slices'}, "
                              f"{len(self.test_items)} test slices, plans {self.plans_name}{note}, device {self.device}")

    # -- tasks ---------------------------------------------------------------------------------------
    def ready(self) -> bool:
        return self.net is not None

    def _setup_failed(self) -> None:
        self.net = None

    def _teardown(self) -> None:
        """Delete the preprocessed training slices (a private temporary folder, 0700) when the run ends."""
        if self._scratch is not None:
            self._scratch.cleanup()
            self._scratch, self.loader = None, None

    def task_handlers(self) -> dict:
        return {FedUQTask.TRAIN: self.train, SUBMIT_HEAD: self.submit_head, FedUQTask.TEST: self.test}

    def check_task(self, task_name: str) -> str | None:
        return f"site {self.site!r} is a held-out test site: it never trains" if self.held_out and task_name != FedUQTask.TEST else None

    def train(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        r = int(received.current_round or 0)
        load_backbone(self.net, self.backbone, received.params)
        self.poly.step(min(r, self.num_rounds - 1))  # nnU-Net's poly schedule, one step per round (FIVA)
        lr = float(self.optimizer.param_groups[0]["lr"])
        on_gradients, on_step = self.method.start_round(self.backbone, received.params)
        if self.cores is not None:  # re-read this site's share of the cores every step
            method_step, refresh = on_step, self.cores.refresh
            on_step = (lambda net: (refresh(), method_step(net))) if method_step is not None else (lambda net: refresh())
        stats = nc.train_iterations(self.net, self.loader, self.loss_fn, self.optimizer, self.steps_per_round,
                                    self.device, self.scaler, on_gradients=on_gradients, on_step=on_step)
        named = dict(self.net.named_parameters())
        params = {n: named[n].detach().cpu().numpy() for n in self.backbone}
        params.update(self.method.statistics(stats["steps"], lr))
        save_torch({"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict(), "round": r},
                   self.state_path)  # a failed write names the file (a file-size limit, a full disk)
        record = {"round": r, "site": self.site, "loss": round(stats["loss"], 5), "lr": lr, "steps": stats["steps"]}
        self.log_info(fl_ctx, "FEDUQ_TRAIN " + json.dumps(record))
        track_scalars(self.writer, {"train_loss": stats["loss"], "lr": lr}, r)
        return FLModel(params=params, params_type=ParamsType.FULL, current_round=r,
                       meta={FedUQMetaKey.NUM_SAMPLES: self.num_cases, FedUQMetaKey.SITE: self.site},
                       metrics={"train_loss": stats["loss"]})

    def submit_head(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        last = self.net.decoder.seg_layers[-1]
        return FLModel(params={"weight": last.weight.detach().cpu().numpy(), "bias": last.bias.detach().cpu().numpy()},
                       params_type=ParamsType.FULL, meta={META_HEAD_ORGANS: list(self.organs), FedUQMetaKey.SITE: self.site})

    @torch.no_grad()
    def test(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        """Score the multi-head model on this site's test slices, per organ it labels (naive and +UN); the slices go
        through it as :mod:`feduq.predict` runs them (:func:`feduq.ct.inference.multi_head_slice`)."""
        organs_by_head = dict(received.meta.get(META_HEAD_ORGANS) or {})
        if not organs_by_head:
            raise ValueError("test task carries no heads")
        model = nc.MultiHeadNet(copy.deepcopy(self.net), build_heads(received.params, organs_by_head)).to(self.device)
        mc = nc.set_mc_dropout(model, self.method.sampling == "mc_dropout")
        if self.method.sampling == "mc_dropout" and mc == 0:
            raise ValueError("MC-dropout inference needs a network with dropout (executor argument dropout > 0)")
        site_ids = fct.local_to_global(self.organs)  # site-local id -> global id
        gen = torch.Generator().manual_seed(self.seed)
        cases = [fct.read_case(it, self.lut, self.site) for it in self.test_items]
        prepped = [self.pipeline.preprocess(img, msk, sp) for img, msk, sp in cases]
        sums: dict[str, list] = {}
        over, per_slice = [], []
        samples = backbone_samples(self.method, self.backbone, received.params, gen, self.inference_samples)
        for item, (data, seg, _) in zip(self.test_items, prepped):
            for z in range(data.shape[1]):
                x = torch.as_tensor(data[:, z][None]).to(self.device)
                r = multi_head_slice(model, self.backbone, samples, x, self.pipeline.patch_size, organs_by_head)
                over.append(r.fraction_over_one)
                target = torch.as_tensor(np.maximum(seg[:, z], 0)).long()[None]
                target = torch.as_tensor(np.asarray(site_ids))[target]  # global ids
                image = item["name"] if data.shape[1] == 1 else f"{item['name']}#z{z}"
                per_slice.append(slice_row(self.site, image, item.get("case", item["name"]),
                                           self._score(sums, r.naive, r.un, target)))
        write_rows(self.state_path.parent / PER_IMAGE_TEST_FILE, per_slice)
        metrics = {"num_images": float(sum(d.shape[1] for d, _, _ in prepped)), "frac_sum_u_over_1": float(np.mean(over) if over else 0.0)}
        for k, v in sums.items():
            metrics[k] = float(np.mean(v))
        dice = [metrics[f"dice_{o}"] for o in self.organs if f"dice_{o}" in metrics]
        dice_un = [metrics[f"dice_un_{o}"] for o in self.organs if f"dice_un_{o}" in metrics]
        metrics.update(dice=float(np.mean(dice)) if dice else float("nan"), dice_un=float(np.mean(dice_un)) if dice_un else float("nan"))
        hd = [metrics[f"hd95_{o}"] for o in self.organs if f"hd95_{o}" in metrics]
        metrics["hd95"] = float(np.mean(hd)) if hd else float("nan")
        self.log_info(fl_ctx, "FEDUQ_CT_TEST " + json.dumps({"site": self.site, **{k: round(v, 5) for k, v in metrics.items()}}))
        return FLModel(params={}, metrics=metrics, meta={FedUQMetaKey.SITE: self.site})

    def _score(self, sums: dict, naive: torch.Tensor, un: torch.Tensor, target: torch.Tensor) -> dict[str, float]:
        """Per organ this site labels and present in the slice: hard Dice (naive, +UN) and HD95 (pixels of the plan's
        grid), appended to ``sums``; returns this slice's scores (``{"dice_<organ>", "dice_un_<organ>",
        "hd95_<organ>", "ece"}``)."""
        mine: dict[str, float] = {}
        pred = {"": naive.argmax(1, keepdim=True), "un_": un.argmax(1, keepdim=True)}
        for organ in self.organs:
            g = fct.ORGANS.index(organ)
            t = (target == g).long()
            if not t.any():
                continue  # FIVA's protocol: labels absent from the slice are not scored
            for tag, p in pred.items():
                s = segmentation_scores((p == g).long(), t, 2, hd95=not tag)
                mine[f"dice_{tag}{organ}"] = float(s["dice"][0, 0])
                if not tag:
                    mine[f"hd95_{organ}"] = float(s["hd95"][0, 0])
        probs = naive.clamp_min(0)
        probs = probs / probs.sum(1, keepdim=True).clamp_min(1e-8)
        mine["ece"] = float(calibration_error(probs, target, num_bins=ECE_BINS)[0])
        for k, v in mine.items():
            sums.setdefault(k, []).append(v)
        return mine


def slice_row(site: str, image: str, case: str, scores: dict[str, float]) -> dict:
    """One test slice's row of a CT site's :data:`~feduq.scores.tables.PER_IMAGE_TEST_FILE`: ``site``, ``image`` (the
    file stem; ``<stem>#z<k>`` for slice k of a volume), ``case`` (the patient, the unit of a paired test), ``dice`` and
    ``dice_un`` (fractions: means over the organs this site labels that are present in the slice; NaN when none is),
    then ``dice_<organ>``, ``dice_un_<organ>``, ``hd95_<organ>`` (pixels of the plan's grid) of each present organ and
    the slice's ``ece`` (15 bins). What ``feduq compare`` pairs over patients."""
    naive = [v for k, v in scores.items() if k.startswith("dice_") and not k.startswith("dice_un_")]
    un = [v for k, v in scores.items() if k.startswith("dice_un_")]
    return {"site": site, "image": image, "case": case, "dice": float(np.mean(naive)) if naive else float("nan"),
            "dice_un": float(np.mean(un)) if un else float("nan"), **scores}


class CTController(FedUQController):
    """Rounds over the training sites, then heads and the multi-head test on every site: FedUQ's round loop with
    :class:`feduq.parts.ct_server.CTServer` (FedAvg's fusion by training cases), or the CT server part a job names
    (FIVA: ``server_part: "feduq.methods.fiva.FIVAServer"`` with its ``eps``, ``forgetting``, ``floor``, ``mode``).

    Args:
        num_rounds, persistor_id, min_clients, train_timeout, server_part, server: :class:`feduq.flare.controller.FedUQController`
            (``server``: a :class:`feduq.parts.ct_server.CTServer` made by code).
        test_timeout: seconds for ``submit_head`` and ``test`` (0 = no limit).
        method, results_dir: :class:`feduq.parts.ct_server.CTServer`'s (and every CT server part's).
    """

    SERVER_PART = CTServer  # when the job names no server_part
    timeout_args = CTServer.timeout_args

    def __init__(self, *, num_rounds: int = 1500, test_timeout: int = 0, **kwargs):
        super().__init__(num_rounds=num_rounds, **kwargs)
        if not isinstance(self.server, CTServer):
            raise ValueError(f"CTController: server_part={kwargs.get('server_part')!r} is not a CT server part "
                             "(feduq.parts.ct_server.CTServer subclass)")
        self.test_timeout = test_timeout
