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

from ...site.classification import ClassificationSite, classification_scores, predict
from .site import FedUAAClsSite

__all__ = ["FedUAAClassificationSite", "classification_scores", "predict"]


class FedUAAClassificationSite(ClassificationSite):
    """FedUAA's site for image-level classification (the paper's own form; see the module docstring): FedUQ's
    classification loop (:class:`feduq.site.classification.ClassificationSite`: SGD made anew every round,
    AUC/accuracy) around :class:`feduq.methods.feduaa.FedUAAClsSite`, with FedUAA's defaults.

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
        site = FedUAAClsSite(annealing_step=annealing_step, temperature=temperature, kl_weight=kl_weight,
                             local_bn=local_bn, threshold_source=threshold_source, seed=kwargs.get("seed", 0))
        super().__init__(momentum=momentum, lr=lr, method=site, **kwargs)
