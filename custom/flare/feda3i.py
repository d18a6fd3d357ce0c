"""FedA3I's FLARE glue (Wu et al., AAAI 2024): the job's executor and controller classes.

The method is :mod:`feduq.methods.feda3i`: its site part (:class:`~feduq.methods.feda3i.FedA3ISite`: BCE or
0.5·BCE + 0.5·Dice, Adam recreated every round, the ``estimate_noise`` task returning q_k) and its server part
(:class:`~feduq.methods.feda3i.FedA3IServer`: FedAvg warm-up, the noise-estimation exchange after round T1 − 1,
the GMM grouping and the frozen layer-wise weights of Eq. 6–7). The classes here only map the job's arguments onto
them.
"""

from __future__ import annotations

from ..methods import feda3i as fm
from .controller import FedUQController
from .executor import FedAvgExecutor

LOSSES = ("ce", "dc")


class FedA3IExecutor(FedAvgExecutor):
    """FedA3I site: FedUQ's executor with :class:`feduq.methods.feda3i.FedA3ISite` (its ``loss``, ``reset_optimizer``);
    the other arguments are :class:`feduq.site2d.Site2D`'s (the job: lr 5e-3, lr_gamma 1, batch 8, 5 local epochs,
    256 px, ``intensity: raw``, network ``feda3i_unet``)."""

    SITE_PART = fm.FedA3ISite


class FedA3IController(FedUQController):
    """FedA3I's rounds: FedUQ's round loop with :class:`feduq.methods.feda3i.FedA3IServer`.

    Its workflow arguments ``warmup_rounds``, ``r``, ``layer_weight``, ``layer_power``, ``layer_bias``, ``gmm_seed`` are
    :class:`feduq.methods.feda3i.FedA3IServer`'s (a setting out of range: ValueError, named); the others
    :class:`feduq.flare.controller.FedUQController`'s (paper: 100 rounds).
    """

    SERVER_PART = fm.FedA3IServer
    DEFAULT_ROUNDS = 100
