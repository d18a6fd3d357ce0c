"""A FedUQ job folder read and checked, no FLARE engine: its three files (:mod:`feduq.jobs.job_files`) and one
validation of its configuration before a job is written and at start-up (:mod:`feduq.jobs.jobcheck`). Importing it
defers MONAI's import as :mod:`feduq.flare` does (:mod:`feduq.common.lean_monai`), so a tool that only checks a job
loads no MONAI."""

from ..common.lean_monai import defer_monai_lean as _defer_monai_lean

_defer_monai_lean()
