"""FedUAA's FLARE glue (Wang et al., MICCAI 2023): the segmentation job's executor and FedUAA's controller.

The method is :mod:`feduq.methods.feduaa`: its site parts (:class:`~feduq.methods.feduaa.FedUAASegSite`: softplus
evidence, a local segmentation head, the Youden threshold θ_k; :class:`~feduq.methods.feduaa.FedUAAClsSite` for the
classification job, :mod:`feduq.flare.feduaa_cls`) and its server part (:class:`~feduq.methods.feduaa.FedUAAServer`:
``w = softmax(θ)`` over the accepted sites). The classes here only map the job's arguments onto them.
"""

from __future__ import annotations

from ..methods.feduaa import FedUAAServer, FedUAASegSite
from .controller import FedUQController
from .executor import FedUQExecutor


class FedUAASegExecutor(FedUQExecutor):
    """FedUAA client for segmentation (FedEvi's FedUAA baseline): FedUQ's executor with
    :class:`feduq.methods.feduaa.FedUAASegSite`.

    The head never leaves the site, and the ``test`` task scores the best global model with the head the site
    validated it with (:class:`feduq.local_entries.LocalEntries`, kept across a restarted site process).

    Args:
        kl_weight, annealing_step, dice_variant, temperature, threshold_source, roc_level, pixels_per_image,
            image_dice_cutoff: :class:`feduq.methods.feduaa.FedUAASegSite`.
        **kwargs: see :class:`FedUQExecutor`.
    """

    def __init__(self, kl_weight: float = 0.01, annealing_step: int = 10, dice_variant: str = "mean",
                 temperature: float | None = None, threshold_source: str = "train", roc_level: str = "pixel",
                 pixels_per_image: int = 1024, image_dice_cutoff: float = 0.5, **kwargs):
        site = FedUAASegSite(kl_weight=kl_weight, annealing_step=annealing_step, dice_variant=dice_variant,
                             temperature=temperature, threshold_source=threshold_source, roc_level=roc_level,
                             pixels_per_image=pixels_per_image, image_dice_cutoff=image_dice_cutoff,
                             seed=kwargs.get("seed", 0))
        super().__init__(method=site, **kwargs)


class FedUAAController(FedUQController):
    """FedUAA's round: FedUQ's round loop with :class:`feduq.methods.feduaa.FedUAAServer` (softmax(θ) weights).

    Args:
        default_threshold: θ of a site without a usable history (:class:`feduq.methods.feduaa.FedUAAServer`).
        **kwargs: :class:`feduq.flare.controller.FedUQController`.
    """

    def __init__(self, *, num_rounds: int = 200, default_threshold: float = 0.5, **kwargs):
        super().__init__(server=FedUAAServer(default_threshold=default_threshold), num_rounds=num_rounds, **kwargs)
