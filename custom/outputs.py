"""Output folders of FedUQ's tools: never delete what the tool did not create, write all at once.

Every tool that writes a folder (``tools/simulate.py -w``, ``tools/configure_job.py -o``, ``tools/resume_job.py -o``,
the converters) follows the same rules, checked before anything is written or removed:

* the output is not, does not contain and does not lie inside any of the tool's inputs (the job, the data root, a
  checkpoint); ``--force`` does not lift this;
* an existing non-empty output folder is replaced only when a FedUQ tool made it (it holds the marker file
  :data:`OUTPUT_MARKER`, or has the shape of such an output) or the user passed ``--force``; otherwise the error names a
  file the tool did not write;
* a new folder is built beside the output (:func:`staged_folder`) and moved into place only when it is complete, so a
  refused or failed call leaves the old folder as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping

from feduq.tasks import DataError

#: A small JSON file a FedUQ tool writes into every folder it creates (``{"tool": ...}``).
OUTPUT_MARKER = ".feduq-output.json"

__all__ = ["OUTPUT_MARKER", "OutputFolderError", "check_output_folder", "staged_folder", "write_marker"]


class OutputFolderError(DataError):
    """An output folder the tool must not write to; the message is one line naming the folder and the reason."""


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _first_file(folder: Path) -> str:
    for path in sorted(folder.rglob("*")):
        if path.is_file() or path.is_symlink():
            return path.relative_to(folder).as_posix()
    return next(iter(sorted(p.name for p in folder.iterdir())), "")


def check_output_folder(
    out: str | os.PathLike,
    inputs: Mapping[str, str | os.PathLike | None],
    tool: str,
    force: bool = False,
    recognise: Callable[[Path], bool] | None = None,
) -> Path:
    """Check that ``tool`` may (re)create the folder ``out``; nothing is written or removed.

    Args:
        out: the output folder, absolute or relative to the current folder.
        inputs: what the tool reads, by the name an error should use (``{"job": ..., "data root": ...}``); ``None``
            values are skipped. Files and folders alike.
        tool: the tool's name for the messages (``"configure_job.py"``).
        force: replace an existing non-empty folder that no FedUQ tool made (never one that overlaps an input).
        recognise: ``folder -> bool``, true for an output this tool made before the marker file existed.

    Returns:
        ``out`` resolved to an absolute path.

    Raises:
        OutputFolderError: ``out`` is, contains or lies inside an input; is the file-system root or the home
            folder; exists and is not a folder; or is a non-empty folder without :data:`OUTPUT_MARKER` (and not
            ``recognise``-d) while ``force`` is false. The message names the folder, the input or one unexpected
            file, and what to do.
    """
    out = Path(out).expanduser().resolve()
    for name, path in inputs.items():
        if path is None or str(path) == "":
            continue
        path = Path(path).expanduser().resolve()
        if out == path:
            raise OutputFolderError(f"{tool}: the output folder {out} is the {name}; choose another output folder")
        if _within(path, out):
            raise OutputFolderError(f"{tool}: the output folder {out} contains the {name} {path}; choose an output "
                                    f"folder outside it")
        if _within(out, path):
            raise OutputFolderError(f"{tool}: the output folder {out} lies inside the {name} {path}; choose an "
                                    f"output folder outside it")
    if out == Path(out.anchor) or out == Path.home().resolve():
        raise OutputFolderError(f"{tool}: refusing to use {out} as an output folder")
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{tool}: the output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        if not ((out / OUTPUT_MARKER).is_file() or (recognise is not None and recognise(out))):
            raise OutputFolderError(
                f"{tool}: the output folder {out} holds files {tool} did not write (e.g. {_first_file(out)}); choose "
                f"a new or empty folder, or pass --force to replace it")
    return out


def write_marker(folder: str | os.PathLike, tool: str) -> Path:
    """Write :data:`OUTPUT_MARKER` (``{"tool": tool}``) into ``folder`` and return its path."""
    path = Path(folder) / OUTPUT_MARKER
    path.write_text(json.dumps({"tool": tool}) + "\n")
    return path


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike, overwrite: bool = False, what: str = "output",
                  marker: str | None = None) -> Iterator[Path]:
    """Write a folder all at once: yield an empty hidden folder beside ``out``, move it to ``out`` on success.

    Args:
        out: the folder to create (its parent is created if needed).
        overwrite: replace an existing non-empty ``out`` (only after the new folder is complete).
        what: how the message of an error names the output (e.g. ``"CVC-ClinicDB"``).
        marker: the tool's name: write :data:`OUTPUT_MARKER` into the new folder.

    Yields:
        The staging folder (``<parent>/.<name>.partial-XXXX``); write everything there.

    Raises:
        OutputFolderError: ``out`` exists and is not a folder, or is not empty while ``overwrite`` is false
            (checked before anything is written). Whatever the body raises is re-raised after the staging folder is
            removed; ``out`` is then unchanged.
    """
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{what}: output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputFolderError(f"{what}: output folder {out} exists and is not empty (use --overwrite)")
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(stage, 0o777 & ~umask)  # mkdtemp makes it private; the output gets the usual permissions
    try:
        yield stage
        if marker:
            write_marker(stage, marker)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.replace(out, old / out.name)
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)
