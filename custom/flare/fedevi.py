"""FedEvi's FLARE glue (Chen et al., MICCAI 2024): the job's executor and controller classes.

The method is :mod:`feduq.methods.fedevi`: its site part (:class:`~feduq.methods.fedevi.FedEviSite`: evidential
training, A_k after training, G_k in the ``validate_surrogate`` task) and its server part
(:class:`~feduq.methods.fedevi.FedEviServer`: the surrogate θ̂ = Σ_k β_k^{r-1} θ_k, β by Eq. 8, θ^r = Σ_k β_k^r θ_k).
The classes here only map the job's arguments onto them; FedUQ's executor and round loop run them.
"""

from __future__ import annotations

from ..methods.fedevi import FedEviServer, FedEviSite
from .controller import FedUQController
from .executor import FedUQExecutor


class FedEviExecutor(FedUQExecutor):
    """FedEvi client: FedUQ's executor with :class:`feduq.methods.fedevi.FedEviSite` (evidential training, A_k, G_k;
    its ``kl_weight``, ``annealing_step``, ``dice_variant``, ``clamp_max``); the other arguments are
    :class:`feduq.site2d.Site2D`'s."""

    SITE_PART = FedEviSite


class FedEviController(FedUQController):
    """FedEvi's two-exchange round: FedUQ's round loop with :class:`feduq.methods.fedevi.FedEviServer`.

    Per round r (0-based here; FedEvi's 1-based r is r + 1): ``train`` -> θ_k, N_k, A_k, R_k; every update is
    checked; ``validate_surrogate`` with θ̂ = Σ β_k^{r-1} θ_k -> G_k; β^r by Eq. 8; θ^r = Σ β_k^r θ_k. A site that
    fails or times out in either exchange is left out of that round (its β carried forward, the others
    renormalised); fewer valid answers than the quorum stops the job with ``FEDUQ_JOB_FAILED`` naming every
    failed site and why. β is logged (``FEDEVI_BETA``) and checkpointed with the model.

    Its workflow arguments: ``surrogate_timeout`` (seconds to wait for ``validate_surrogate``, 0 = no limit) and the
    FedEvi switches ``delta``, ``reliability``, ``clip_min``, ``renormalize_after_clip``, ``initial_weights``
    (:meth:`feduq.methods.fedevi.FedEviServer.from_job`, :class:`feduq.methods.fedevi.FedEviConfig`); the others are
    :class:`feduq.flare.controller.FedUQController`'s.
    """

    SERVER_PART = FedEviServer
