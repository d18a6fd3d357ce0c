"""FedUQ: uncertainty-aware federated medical image segmentation on NVIDIA FLARE.

The source lives in the repository's ``custom/`` folder and installs as the package ``feduq``.

Layers (data flows top to bottom):

* :mod:`feduq.data` -- one dataset API for every task: ``(task, center, split)`` -> samples (over
  :mod:`feduq.tasks.spec`, the task registry and site folders, and :mod:`feduq.io.transforms`, the MONAI transforms).
* :mod:`feduq.core.evidential`, :mod:`feduq.methods` -- the methods, no FLARE: each one's math, its site part
  (:mod:`feduq.parts.site`) and its server part (:mod:`feduq.parts.server`, with the one round loop).
* :mod:`feduq.core.networks`, :mod:`feduq.core.training`, :mod:`feduq.scores.metrics` -- the shared training and
  evaluation core (no FLARE); :mod:`feduq.site.site2d` -- the 2D site that runs it, without FLARE's engine.
* :mod:`feduq.flare` -- thin NVFlare glue: one executor (:mod:`feduq.flare.executor`) and one controller
  (:mod:`feduq.flare.controller`) that run the methods' parts, the final test, quorum, job checks, the ledger.
"""

__version__ = "0.1.0"
