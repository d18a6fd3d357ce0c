"""A FLARE job folder's three files read, and the error every job check raises (no FLARE here): the job check
(:mod:`feduq.jobs.jobcheck`), the simulator runner and the tools read a job through :func:`read_job`."""

from __future__ import annotations

import json
from pathlib import Path

CLIENT_CONFIG = "config_fed_client.json"
SERVER_CONFIG = "config_fed_server.json"


class JobConfigError(ValueError):
    """The job's configuration cannot run; the message names the component, key or value."""


def read_job(job_dir: str | Path) -> tuple[dict, dict, dict | None]:
    """``(client config, server config, meta or None)`` of a job folder or of an app folder.

    Raises:
        JobConfigError: a config file is missing or is not valid JSON (names the file).
    """
    root = Path(job_dir)
    config = root / "app" / "config" if (root / "app" / "config").is_dir() else root / "config"
    loaded = []
    for path in (config / CLIENT_CONFIG, config / SERVER_CONFIG, root / "meta.json"):
        if not path.is_file():
            if path.name == "meta.json":
                loaded.append(None)
                continue
            raise JobConfigError(f"{path} not found")
        try:
            loaded.append(json.loads(path.read_text()))
        except json.JSONDecodeError as e:
            raise JobConfigError(f"{path} is not valid JSON: {e}") from None
    return loaded[0], loaded[1], loaded[2]
