"""FedUQ jobs: a registered method rendered to FLARE's job files and checked (:mod:`feduq.recipes.jobspec`,
:mod:`feduq.recipes.job_folders`), as a FLARE 2.9 Recipe with its add-ons (:mod:`feduq.recipes.recipe`,
:mod:`feduq.recipes.addons`), run in the simulator or a POC (:mod:`feduq.recipes.simulation`,
:mod:`feduq.recipes.poc`), followed round by round (:mod:`feduq.recipes.progress`) and judged
(:mod:`feduq.recipes.outcome`).

    from feduq.recipes import FedUQRecipe
"""

from .recipe import FedUQJob, FedUQRecipe

__all__ = ["FedUQJob", "FedUQRecipe"]
