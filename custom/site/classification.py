"""Image-level classification on FedUQ's 2D site: one training loop for every method that classifies whole images.

:class:`ClassificationSite` is FLARE-free: FedUQ's 2D site (:class:`feduq.site.site2d.Site2D`) with a loop of its
own, since an image has one label: per round it

1. loads the received global model into the shared entries (the site part's local entries stay),
2. scores the received model (with the site's local entries) on the validation split: AUC of ``softmax(raw output)``
   (scikit-learn's ``roc_auc_score``) and accuracy,
3. trains ``local_epochs`` of SGD (``lr``, ``momentum``; **a new optimiser every round**, as FedUAA's official code)
   on the site part's loss (:class:`feduq.parts.site.ClassificationPart`: cross-entropy, FedAvg; FedUAA's part:
   its evidential loss),
4. sends the shared entries, N_k and what the site part adds (FedUAA: its Youden threshold).

The ``test`` task reports per-site test AUC and accuracy of the received model with the site's own entries from the
round it validated that model. On FLARE a job names it as the site class of FedUQ's one executor (``{"path":
"feduq.flare.executor.FedUQExecutor", "args": {"site_class": "feduq.site.classification.ClassificationSite", ...}}``);
a method with its own site part subclasses it (:class:`feduq.methods.feduaa.classification.FedUAAClassificationSite`)
or names the part (``site_part``).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import numpy as np
import torch

from nvflare.app_common.abstract.fl_model import FLModel

from .. import data as fdata
from ..common.wire import FedUQMetaKey, FedUQMetric
from ..scores.tables import PER_IMAGE_TEST_FILE, write_rows
from ..core.training import LocalTrainer, resolve_device
from ..parts.site import ClassificationPart, build_site_part, job_site_part
from .setup import CLIENT_STATE_FILE
from .site2d import Site2D

__all__ = ["classification_scores", "predict", "ClassificationSite"]


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


class ClassificationSite(Site2D):
    """Image-level classification on a site (see the module docstring): its own loop (SGD made anew every round,
    AUC/accuracy) around a classification site part; this class with its default part is FedAvg's.

    Network: :class:`feduq.core.classification_networks.ResNetTWEU` (MONAI ResNet backbone and an FC-BN-ReLU-FC head;
    which entries stay local is the site part's :meth:`~feduq.parts.site.SitePart.local_keys`: none for FedAvg).
    Data: :func:`feduq.data.get_classification_dataset` (the task's committed splits, classes from ``classes.csv``).

    Args:
        momentum: SGD momentum (default 0). lr: the SGD learning rate (default 0.01); the optimiser is recreated every
            round, so no state carries over. ``betas``, ``weight_decay`` and ``lr_gamma`` are accepted (shared job
            arguments) but unused.
        method: the site part; None: the job's ``site_part`` (a dotted path) or :attr:`SITE_PART`, built from the
            arguments it names (:func:`feduq.parts.site.build_site_part`).
        network: ``{"name": "resnet_tweu", "backbone": ..., "hidden": ...}``.
        **kwargs: see :class:`feduq.site.site2d.Site2D` (``task`` default ``breast``, ``image_size`` 256,
            ``batch_size`` 32, ``local_epochs`` 1, ``max_items``, ``seed``, ``device``, ``num_threads``, ...).

    Raises:
        ValueError: ``momentum`` outside [0, 1); a site part that does not classify.
    """

    SITE_PART = ClassificationPart

    def __init__(self, momentum: float = 0.0, lr: float = 0.01, method=None, **kwargs):
        kwargs.setdefault("task", "breast")
        kwargs.setdefault("image_size", 256)
        kwargs.setdefault("batch_size", 32)
        kwargs.setdefault("local_epochs", 1)
        if method is None:  # the job's site_part, else this class's
            method, kwargs = build_site_part(job_site_part(type(self), kwargs.pop("site_part", None)), kwargs)
        if getattr(method, "output", None) != "classification":
            raise ValueError(f"classification site: site part {type(method).__name__} does not classify images "
                             f"(its output is {getattr(method, 'output', None)!r})")
        super().__init__(method=method, lr=lr, **kwargs)
        if not (isinstance(momentum, (int, float)) and 0.0 <= momentum < 1.0):
            raise ValueError(f"classification site: momentum must be in [0, 1), got {momentum!r}")
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
        # the last incomplete batch is dropped (FedUAA's code); >= 2 images so no batch of 1 reaches the head's BN
        self.device = resolve_device(self.device_name)
        self._build_splits(fdata.get_classification_dataset, common, eval_batch_size=self.batch_size, min_train=2)
        model = self.build_network(spec)
        self.trainer = LocalTrainer(model, self.device, lr=self.sgd_lr)
        self._new_optimizer()
        self.eval_model = copy.deepcopy(self.trainer.model)
        self.loss = self.build_loss()
        self.state_path = run_folder / CLIENT_STATE_FILE
        self._start_local_entries()  # the site part's local entries, and their copies per validated model
        self.log(
            f"site {self.site!r} center {self.center!r}: {type(self.method).__name__} classification "
            f"{list(self.class_names)}, "
            f"train/val/test = {len(self.train_ds)}/{len(self.val_ds)}/{len(self.test_ds)} images at "
            f"{self.image_size}px, {len(self.local_keys())} local entries, device {self.device}",
        )

    def _new_optimizer(self) -> None:
        """``optim.SGD(lr, momentum)`` created anew every round (FedUAA's official code; no state across rounds)."""
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
        self._remember_local(received)  # the local entries this round validates the received model with
        self._load_received(received.params)
        val = self._val_scores(self.trainer.model)  # the received model with this site's own entries
        self._new_optimizer()
        self.method.before_round(self, round_index)  # e.g. FedUAA's threshold collector starts the round
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
        logits, labels = predict(model, self.test_loader, self.device)
        s = classification_scores(logits, labels)
        metrics = {FedUQMetric.AUC: s["auc"], FedUQMetric.ACCURACY: s["accuracy"], "num_images": s["num_images"]}
        # per image, in the split's order (the test loader does not shuffle): it stays on the site; feduq compare
        # pairs two methods' images (feduq.results.paired.classification_tests)
        prob = torch.softmax(logits.double(), dim=1)
        stems = [Path(str(item["image"])).stem for item in getattr(self.test_ds, "data", [])]
        write_rows(self.state_path.parent / PER_IMAGE_TEST_FILE, [
            {"site": self.site, "image": stem, "label": int(y), "predicted": int(p.argmax()),
             "correct": int(int(p.argmax()) == int(y)), **{f"p_{k}": float(p[k]) for k in range(p.numel())}}
            for stem, y, p in zip(stems, labels.tolist(), prob)])
        self.log("FEDUQ_TEST " + json.dumps({"site": self.site, **metrics}))
        self._log_test_local()
        return FLModel(metrics=metrics, meta={FedUQMetaKey.SITE: self.site})
