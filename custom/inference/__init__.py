"""A trained model applied outside training, FLARE-free: the cases and per-case files of a prediction
(:mod:`feduq.inference.files`), the review flag of cases a person must check (:mod:`feduq.inference.review`) and the
export as a MONAI Bundle (:mod:`feduq.inference.bundle`). The command is ``feduq predict``."""
