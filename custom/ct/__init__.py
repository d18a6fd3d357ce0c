"""Multi-head abdominal CT with nnU-Net v2, FLARE-free: the pipeline used as a library (:mod:`feduq.nnunet.pipeline`), a
CT job's site settings (:mod:`feduq.ct.settings`) and what scores and predicts a multi-head model
(:mod:`feduq.ct.inference`). The CT data (labels, splits, reading) is :mod:`feduq.data.ct`; the FLARE side
:mod:`feduq.flare.ct`."""
