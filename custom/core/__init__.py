"""FedUQ's core, no FLARE and no method: the training loop, networks, metrics, aggregation, evidential math,
uncertainty maps and their quality, checkpoints, threads."""
