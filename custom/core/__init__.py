"""FedUQ's core, no FLARE and no method: the training loop, networks, aggregation, evidential math, partial labels,
checkpoints, threads. How a segmentation is scored is :mod:`feduq.scores`, one floor up."""
