"""FedUQ: uncertainty-aware federated medical image segmentation on NVIDIA FLARE.

The source lives in the repository's ``custom/`` folder and installs as the package ``feduq``.

Layers (data flows top to bottom):

* :mod:`feduq.data` -- one dataset API for every task: ``(task, center, split)`` -> samples (over
  :mod:`feduq.tasks`, the task registry and site folders, and :mod:`feduq.transforms`, the MONAI transforms).
* :mod:`feduq.evidential`, :mod:`feduq.methods` -- the method math, pure torch/numpy.
* :mod:`feduq.networks`, :mod:`feduq.engine`, :mod:`feduq.metrics` -- the shared training and
  evaluation core (no FLARE).
* :mod:`feduq.flare` -- thin NVFlare glue: one module per method (``fedprox``, ``fedbn``, ``fedevi``,
  ``feduaa``, ``feduaa_cls``) over a shared executor base, aggregators and workflows.
"""

__version__ = "0.1.0"
