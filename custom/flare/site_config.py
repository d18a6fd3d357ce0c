"""Where FLARE keeps a FedUQ site's settings and run folder (the FLARE side of :mod:`feduq.site.settings`)."""

from __future__ import annotations

from pathlib import Path

from nvflare.apis.fl_context import FLContext

from ..site.settings import read_site_config_file


def read_site_config(fl_ctx: FLContext) -> dict:
    """The site-local FedUQ settings (``local/feduq_site.json`` in the site's FLARE workspace), or ``{}``.

    Raises:
        ValueError: the file exists but is not a JSON object (message names the file).
    """
    return read_site_config_file(fl_ctx.get_engine().get_workspace().get_site_config_dir())


def site_run_folder(fl_ctx: FLContext) -> Path:
    """This site's folder of the running job (where its restart state lives)."""
    return Path(fl_ctx.get_engine().get_workspace().get_run_dir(fl_ctx.get_job_id()))
