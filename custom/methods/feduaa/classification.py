"""FedUAA in its original, image-level classification form (Wang et al., MICCAI 2023, and its official code).

:class:`FedUAAClassificationSite` is the site side, FLARE-free: FedUQ's 2D site (:class:`feduq.site.site2d.Site2D`)
with its own classification loop. On FLARE a job names it as the site class of FedUQ's one executor
(``{"path": "feduq.flare.executor.FedUQExecutor", "args": {"site_class":
"feduq.methods.feduaa.classification.FedUAAClassificationSite", ...}}``); the server is
:class:`feduq.flare.controller.FedUQController` with :class:`feduq.methods.feduaa.FedUAAServer`
(``w = softmax(theta_1..theta_N)`` over the shared entries), unchanged from the segmentation job.

Per round, on a site:

1. the received global model overwrites the shared entries only (the TWEU head ``classifier.*`` and, by
   default, every state entry whose name contains ``"bn"`` stay local, as the official code's filter);
2. the received model (with the site's own head) is scored on the validation split: AUC of
   ``softmax(raw output)`` (as the official code; not of the belief ``b``) and accuracy;
3. one local epoch of SGD (lr 0.01, no momentum, **a new optimiser every round**) on
   ``FedUAALoss`` = mean[L_Ice + a(r)·KL] + L_Tce(tau = 0.05) with softplus evidence and
   ``a(r) = min(1, r / 101)``;
4. θ_k = the Youden-optimal threshold of ``u = K/S`` against ``argmax b != y`` over every training sample
   seen during that epoch (train mode, weights changing; :class:`feduq.methods.feduaa.YoudenCollector`);
   it is sent in ``meta[FedUQMetaKey.FEDUAA_THRESHOLD]`` (None when undefined: the server keeps the previous).

The ``test`` task reports per-site test AUC and accuracy of the best global model with the head the site had
when it validated that model (see :class:`feduq.methods.feduaa.FedUAASegSite`).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch

from nvflare.app_common.abstract.fl_model import FLModel

from ... import data as fdata
from ...common.wire import FedUQMetaKey, FedUQMetric
from ...core.training import LocalTrainer, resolve_device
from .site import FedUAAClsSite
from ...site.setup import CLIENT_STATE_FILE
from ...site.site2d import Site2D


def classification_scores(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """AUC and accuracy of ``[N, K]`` raw outputs against ``[N]`` class indices (FedUAA's evaluation).

    AUC is sklearn's ``roc_auc_score`` on ``softmax(logits)`` (binary: the positive-class column; K > 2: one-vs-rest
    macro average); it is NaN when a class is missing from ``labels`` (undefined). Accuracy is of ``argmax logits``
    (the same class as ``argmax`` of the belief, softplus being monotone).

    Returns:
        ``{"auc": float, "accuracy": float, "num_images": int}``.
    """
    from sklearn.metrics import roc_auc_score

    logits, labels = logits.detach().double().cpu(), labels.detach().long().cpu().reshape(-1)
    num_classes = logits.shape[1]
    prob = torch.softmax(logits, dim=1).numpy()
    y = labels.numpy()
    accuracy = float((logits.argmax(1).numpy() == y).mean()) if y.size else math.nan
    if y.size == 0 or len(np.unique(y)) < num_classes:
        auc = math.nan
    elif num_classes == 2:
        auc = float(roc_auc_score(y, prob[:, 1]))
    else:
        auc = float(roc_auc_score(y, prob, multi_class="ovr", average="macro"))
    return {"auc": auc, "accuracy": accuracy, "num_images": int(y.size)}


@torch.no_grad()
def predict(model: torch.nn.Module, loader, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw outputs ``[N, K]`` and labels ``[N]`` of ``model`` (eval mode) over ``loader``."""
    model.eval()
    logits, labels = [], []
    for batch in loader:
        logits.append(model(batch["image"].to(device)).float().cpu())
        labels.append(torch.as_tensor(batch["label"]).reshape(-1).long())
    if not logits:
        return torch.zeros(0, 2), torch.zeros(0, dtype=torch.long)
    return torch.cat(logits), torch.cat(labels)


class FedUAAClassificationSite(Site2D):
    """FedUAA's site for image-level classification (the paper's own form; see the module docstring): its own
    classification loop (SGD made anew every round, AUC/accuracy) around :class:`feduq.methods.feduaa.FedUAAClsSite`.

    Network: :class:`feduq.core.classification_networks.ResNetTWEU` (MONAI ResNet backbone, shared; TWEU head, local). Data:
    :func:`feduq.data.get_classification_dataset` (the task's committed splits, classes from ``classes.csv``).

    Args:
        annealing_step, temperature, kl_weight, local_bn, threshold_source: :class:`feduq.methods.feduaa.FedUAAClsSite`
            (``local_bn="name"``, the official code's filter, keeps with MONAI's ResNet the stem ``bn1`` and the
            blocks' ``bn1``/``bn2`` on the site, while the ``downsample.1`` BNs are aggregated, as in the official
            code).
        momentum: SGD momentum (official: 0). ``lr`` (default 0.01) is the SGD learning rate; the optimiser is
            recreated every round, so no state carries over. ``betas``, ``weight_decay`` and ``lr_gamma`` are
            accepted (shared job arguments) but unused.
        network: ``{"name": "resnet_tweu", "backbone": ..., "hidden": ...}`` (:class:`feduq.core.classification_networks.ResNetTWEU`).
        **kwargs: see :class:`feduq.site.site2d.Site2D` (``task``, ``image_size``, ``batch_size``,
            ``local_epochs``, ``max_items``, ``seed``, ``device``, ``num_threads``, ...).
    """

    SITE_PART = FedUAAClsSite  # built here, with the job's seed and its own defaults

    def __init__(
        self,
        annealing_step: int = 101,
        temperature: float | None = 0.05,
        kl_weight: float = 1.0,
        local_bn: str = "name",
        momentum: float = 0.0,
        threshold_source: str = "train",
        lr: float = 0.01,
        **kwargs,
    ):
        for unused in ("dice_variant", "roc_level", "pixels_per_image", "image_dice_cutoff"):
            kwargs.pop(unused, None)
        kwargs.setdefault("task", "breast")
        kwargs.setdefault("image_size", 256)
        kwargs.setdefault("batch_size", 32)
        kwargs.setdefault("local_epochs", 1)
        site = FedUAAClsSite(annealing_step=annealing_step, temperature=temperature, kl_weight=kl_weight,
                             local_bn=local_bn, threshold_source=threshold_source, seed=kwargs.get("seed", 0))
        super().__init__(method=site, lr=lr, **kwargs)
        if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
            raise ValueError(f"FedUAA: momentum must be in [0, 1), got {momentum!r}")
        self.momentum = float(momentum)
        self.sgd_lr = float(lr)

    def build_network(self, spec) -> torch.nn.Module:
        """ResNet backbone + TWEU head for the task's image-level classes (see :class:`ResNetTWEU`)."""
        self.network_args.setdefault("name", "resnet_tweu")
        return self._build_named_network(spec.in_channels, len(fdata.classification_classes(self.task_name)))

    # -- setup -----------------------------------------------------------------------------------
    def _start(self, cfg: dict, run_folder: Path) -> None:
        spec, data_root = self._site_context(cfg)
        if self.resize != "stretch":
            raise fdata.DataError(f"site {self.site!r}: resize={self.resize!r} applies to segmentation jobs only; "
                                  "the classification job resizes each image to image_size")
        self.class_names = fdata.classification_classes(self.task_name)
        self.num_classes = len(self.class_names)
        common = dict(data_root=data_root, image_size=self.image_size, max_items=self.max_items,
                      on_bad_file=cfg.get("on_bad_file", "error"), seed=self.seed)
        # FedUAA drops the last incomplete batch; >= 2 images so no batch of 1 reaches the head's BatchNorm1d
        self.device = resolve_device(self.device_name)
        self._build_splits(fdata.get_classification_dataset, common, eval_batch_size=self.batch_size, min_train=2)
        model = self.build_network(spec)
        self.trainer = LocalTrainer(model, self.device, lr=self.sgd_lr)
        self._new_optimizer()
        self.eval_model = copy.deepcopy(self.trainer.model)
        self.loss = self.build_loss()
        self.state_path = run_folder / CLIENT_STATE_FILE
        self._start_local_entries()  # the head and BNs, and the copies per validated global model
        self.log(
            f"site {self.site!r} center {self.center!r}: FedUAA classification {list(self.class_names)}, "
            f"train/val/test = {len(self.train_ds)}/{len(self.val_ds)}/{len(self.test_ds)} images at "
            f"{self.image_size}px, {len(self.local_keys())} local entries (local_bn={self.method.local_bn}), device {self.device}",
        )

    def _new_optimizer(self) -> None:
        """FedUAA: ``optim.SGD(lr=0.01)`` created anew every round (no momentum state across rounds)."""
        sgd = torch.optim.SGD(self.trainer.model.parameters(), lr=self.sgd_lr, momentum=self.momentum)
        self.trainer.set_optimizer(sgd, torch.optim.lr_scheduler.StepLR(sgd, step_size=1, gamma=1.0))

    # -- evaluation ------------------------------------------------------------------------------
    def _val_scores(self, model: torch.nn.Module) -> dict[str, float]:
        """Validation AUC / accuracy of ``model``. An undefined AUC (a class missing from the site's validation split)
        is reported as 0.5 with ``val_auc_defined = False``: constant over rounds, it cannot move the server's
        best-model selection (the weighted mean over sites), while NaN would block it for every site."""
        s = classification_scores(*predict(model, self.val_loader, self.device))
        defined = not math.isnan(s["auc"])
        return {
            FedUQMetric.VAL_AUC: s["auc"] if defined else 0.5,
            FedUQMetric.VAL_ACCURACY: s["accuracy"],
            "val_auc_defined": defined,
        }

    # -- tasks -----------------------------------------------------------------------------------
    def train(self, received: FLModel) -> FLModel:
        round_index = int(received.current_round or 0)
        self._ensure_privacy(received)
        self._remember_local(received)  # the head this round validates the received model with
        self._load_received(received.params)
        val = self._val_scores(self.trainer.model)  # the received model with this site's own head
        self._new_optimizer()
        self.method.before_round(self, round_index)  # the Youden collector starts this round's samples
        stats = self.trainer.train_epochs(
            self.train_loader,
            self.local_epochs,
            lambda lo, la: self.loss(lo, la, round_index + 1),
            regularizer=self.regularizer(received),
        )
        self.local_entries.save(self.trainer.model)
        return self._round_result(
            round_index,
            stats,
            {k: val[k] for k in (FedUQMetric.VAL_AUC, FedUQMetric.VAL_ACCURACY)},
            val_auc_defined=val["val_auc_defined"],
        )

    def validate(self, received: FLModel) -> FLModel:
        self._remember_local(received)  # the last global model, validated after the final round, is tested so too
        val = self._val_scores(self._load_eval_model(received))
        return FLModel(
            metrics={k: val[k] for k in (FedUQMetric.VAL_AUC, FedUQMetric.VAL_ACCURACY)},
            meta={FedUQMetaKey.NUM_VAL_SAMPLES: len(self.val_ds)},
        )

    def test(self, received: FLModel) -> FLModel:
        """Per-site test AUC and accuracy of the received model (AUC NaN when a class is missing from the split)."""
        if len(self.test_ds) == 0:
            self.warn(f"site {self.site!r}: the test split is empty; no test scores to report")
            return FLModel(metrics={}, meta={FedUQMetaKey.SITE: self.site})
        model = self._load_eval_model(received)
        s = classification_scores(*predict(model, self.test_loader, self.device))
        metrics = {FedUQMetric.AUC: s["auc"], FedUQMetric.ACCURACY: s["accuracy"], "num_images": s["num_images"]}
        self.log("FEDUQ_TEST " + json.dumps({"site": self.site, **metrics}))
        self._log_test_local()
        return FLModel(metrics=metrics, meta={FedUQMetaKey.SITE: self.site})
