"""A job folder copied with changed settings, checked before it is written and written all at once (what
``feduq configure``, ``feduq compare`` and the benchmarks make their jobs with)."""

from __future__ import annotations

import shutil
from pathlib import Path

from . import jobspec, settings
from ..outputs import check_output_folder, staged_folder


def configure(
    job_dir: Path,
    out_dir: Path,
    *,
    task: str | None = None,
    image_size: int | None = None,
    num_rounds: int | None = None,
    local_epochs: int | None = None,
    batch_size: int | None = None,
    max_items: int | None = None,
    seed: int | None = None,
    sites: list[str] | None = None,
    min_clients: int | None = None,
    train_timeout: int | None = None,
    executor_args: dict | None = None,
    byoc: bool = False,
    allow_listed: bool = False,
    any_site_names: bool = False,
    network: str | None = None,
    workflow_args: dict | None = None,
    force: bool = False,
    select_on: str | None = None,
    official_protocol: bool = False,
    resource_spec: dict | None = None,
    test_sites: str | list[str] | None = None,
    configuration: str | None = None,
    plans=None,
    tool: str = "feduq configure",
) -> Path:
    """Write a modified copy of ``job_dir`` to ``out_dir`` and return it (absolute).

    ``out_dir`` is replaced only if a FedUQ tool made it (or ``force``), and never when it is, contains or lies inside
    ``job_dir`` (:func:`feduq.outputs.check_output_folder`); the new job is built beside it and moved into place only
    when it is complete and valid, so a refused call leaves an existing ``out_dir`` untouched.

    The result is validated before it is written (:func:`feduq.jobs.jobcheck.validate_configs`,
    the same check every FedUQ workflow runs at start-up): unknown keys, values out of range, an
    image size the network cannot take, sites that are not centers of the task (unless
    ``any_site_names``), a server model that does not fit the task. Nothing is written then.

    ``workflow_args`` updates the training workflow's arguments (the first workflow; e.g. FedA3I's
    ``warmup_rounds``, GraphFedSeg's ``gamma``); unknown names are refused by the job check.

    The committed jobs carry ``app/custom/README.md`` (no code), which makes them bring-your-own-code for FLARE, so
    the simulator and POC sites build FedUQ's classes without an allow-list. ``byoc`` ships FedUQ's code there as
    well; ``allow_listed`` drops the folder, for sites whose policy refuses custom code and allow-lists ``feduq.``.

    ``select_on`` picks the global model the final test scores: ``"val_dice"`` (the jobs' default: the highest mean
    validation Dice over the sites) or ``"val_loss"`` (the lowest mean validation Dice loss on the probabilities, as
    the official FedEvi code selects). ``official_protocol`` sets the official FedEvi code's whole protocol
    (:data:`feduq.recipes.settings.OFFICIAL_PROTOCOL`): selection on ``val_loss``, plain resize with PIL's bicubic
    filter (``stretch_bicubic``) and x / max, the test at the training resolution with 4-connected components and a
    test every round, and for executors with FedAvg's loss the official FedAvg loss (``loss="dice"``); explicit
    arguments still win.

    ``network`` replaces the network's name (``fedevi_unet``, ``light``; its other options stay); the
    server's persistor model always follows the sites' network (``--set network=...`` included).

    ``test_sites`` (``"per-center"`` or a list of the job's sites) names the sites that run the final test; virtual
    sites of one center share its test list, so ``"per-center"`` scores it once
    (:func:`feduq.recipes.settings.per_center_test_sites`).

    ``configuration`` ``"3d_fullres"`` with ``plans`` (a plans file or dict): a volume task's sites train nnU-Net's
    3D network of the plan, carried in the job (:func:`feduq.recipes.settings.volume_settings`).

    Raises:
        FileNotFoundError: ``job_dir`` is not a job folder (no meta.json / app/config).
        feduq.outputs.OutputFolderError: ``out_dir`` must not be written (see above); nothing is touched.
        feduq.jobs.jobcheck.JobConfigError: the configured job would not run (message names the key or value).
    """
    job_dir, out_dir = Path(job_dir), Path(out_dir)
    files = jobspec.read_job_files(job_dir)  # FileNotFoundError: not a job folder
    out_dir = check_output_folder(out_dir, {"job": job_dir}, tool, force=force)
    files = settings.configure(  # JobConfigError before anything is written
        files, out_dir.name, task=task, image_size=image_size, num_rounds=num_rounds, local_epochs=local_epochs,
        batch_size=batch_size, max_items=max_items, seed=seed, sites=sites, min_clients=min_clients,
        train_timeout=train_timeout, executor_args=executor_args, any_site_names=any_site_names, network=network,
        workflow_args=workflow_args, select_on=select_on, official_protocol=official_protocol,
        allow_listed=allow_listed, resource_spec=resource_spec, test_sites=test_sites, configuration=configuration,
        plans=plans)
    with staged_folder(out_dir, overwrite=True, what=tool, marker=tool) as stage:
        shutil.copytree(job_dir, stage, dirs_exist_ok=True)  # the job's other files (its README, shipped code)
        if allow_listed:  # not bring-your-own-code: no app/custom at all
            shutil.rmtree(stage / "app" / "custom", ignore_errors=True)
        jobspec.write_job(files, stage, byoc=byoc)
    return out_dir
