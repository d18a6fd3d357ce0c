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

    Its arguments ``kl_weight``, ``annealing_step``, ``dice_variant``, ``temperature``, ``threshold_source``,
    ``roc_level``, ``pixels_per_image``, ``image_dice_cutoff`` are :class:`feduq.methods.feduaa.FedUAASegSite`'s
    (``seed`` is the site's too); the others are :class:`feduq.site2d.Site2D`'s.
    """

    SITE_PART = FedUAASegSite


class FedUAAController(FedUQController):
    """FedUAA's round: FedUQ's round loop with :class:`feduq.methods.feduaa.FedUAAServer` (softmax(θ) weights).

    Its workflow argument ``default_threshold`` (θ of a site without a usable history) is
    :class:`feduq.methods.feduaa.FedUAAServer`'s; the others :class:`feduq.flare.controller.FedUQController`'s.
    """

    SERVER_PART = FedUAAServer
