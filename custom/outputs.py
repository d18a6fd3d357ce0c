"""Output folders of FedUQ's tools: never delete what the tool did not create, write all at once.

Every tool that writes a folder (``feduq simulate -w``, ``feduq configure -o``, ``feduq resume -o``,
the converters) follows the same rules, checked before anything is written or removed:

* the output is not, does not contain and does not lie inside any of the tool's inputs (the job, the data root, a
  checkpoint, and always the data root in ``$FEDUQ_DATA_ROOT``); ``--force`` does not lift this;
* a FedUQ tool records, file by file, what it wrote into a folder (the manifest :data:`OUTPUT_MARKER`). An existing
  non-empty output folder is replaced only when every file in it is listed there (or it has the shape of an older
  FedUQ output); otherwise the error names a file the tool did not write. ``--force`` replaces what the manifest lists
  and **keeps every other file** (a name the new output also uses is refused);
* an older manifest without a file list (``{"tool": ...}``) never licenses removing a file the tool does not write:
  only files unchanged since the manifest under a name the tool writes (its known layout, :data:`TOOL_LAYOUTS`, or
  the names the new output writes) are the tool's; every other file is kept;
* a new folder is built beside the output (:func:`staged_folder`) and moved into place only when it is complete, so a
  refused or failed call leaves the old folder as it was.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from .common.errors import DataError

#: A small JSON file a FedUQ tool writes into every folder it creates (``{"tool": ...}``).
OUTPUT_MARKER = ".feduq-output.json"

__all__ = ["OUTPUT_MARKER", "TOOL_LAYOUTS", "OutputFolderError", "check_output_file", "check_output_folder",
           "claim_output_folder", "staged_folder", "usual_permissions", "user_files", "write_marker"]

#: A job folder as ``feduq configure`` and ``feduq resume`` write it (``fnmatch`` patterns, relative
#: POSIX paths): the job's files, its README and, with ``--byoc``, FedUQ's code in ``app/custom/feduq``.
JOB_FOLDER_LAYOUT = ("meta.json", "README.md", "app/config/config_fed_*.json", "app/custom/README.md",
                     "app/custom/feduq/*")
#: What each tool writes into its output folder, for an older manifest that does not list its files (``{"tool":
#: ...}``): there, a file is the tool's only when it is unchanged since the manifest and matches one of these (or a name
#: the new output writes); every other file is the user's. A tool not named here: only the new output's names.
TOOL_LAYOUTS = {
    "feduq configure": JOB_FOLDER_LAYOUT,
    "feduq resume": JOB_FOLDER_LAYOUT,
    "feduq compare": ("runs/*", "jobs/*", "holdout-*", "report/*", "results.md", "results_tidy.csv", "curves.csv",
                   "weights.csv", "dice_per_round.png", "test_dice_per_round.png", "weights_per_round.png",
                   "graph_W_*.png", "dp_sweep.csv", "dice_vs_epsilon.png", "per_image_test.csv", "paired_tests*.csv",
                   "holdout*.md", "holdout*.csv", "report.md", "uncertainty_quality.csv", "reliability_*.png",
                   "risk_coverage*.png", "images_*.png"),
}


def _json_with(*keys: str) -> Callable[[Path], bool]:
    """A check that a file is a JSON object with ``keys`` (what a FedUQ tool writes under that name)."""
    def holds(path: Path) -> bool:
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and all(k in record for k in keys)

    return holds


#: What a tool's older-layout files hold (``fnmatch`` pattern -> check of the file): under an older manifest a file's
#: timestamp cannot tell the tool's from a user's file written in the same tick as the manifest (a folder copied
#: together), so a file under one of these names whose content is not of the tool's form is the user's, kept.
JOB_FOLDER_CONTENT = {"meta.json": _json_with("name", "deploy_map"),
                      "app/config/config_fed_*.json": _json_with("format_version")}
TOOL_CONTENT = {"feduq configure": JOB_FOLDER_CONTENT, "feduq resume": JOB_FOLDER_CONTENT}


class OutputFolderError(DataError):
    """An output folder the tool must not write to; the message is one line naming the folder and the reason."""


def _within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` (relative POSIX paths), the manifest itself excepted."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p.relative_to(folder).as_posix() != OUTPUT_MARKER)


def _manifest(folder: Path):
    """The manifest's file list; ``...`` for an older manifest without one; None without a readable manifest."""
    try:
        record = json.loads((folder / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    return record.get("files", ...)


def user_files(folder: str | os.PathLike, recognise: Callable[[Path], bool] | None = None,
               writes: Sequence[str] = ()) -> list[str]:
    """The files under ``folder`` no FedUQ tool listed as its own: those missing from the manifest; every file when
    there is no (readable) manifest and ``recognise`` does not call the folder an older FedUQ output. Under an older
    manifest without a file list (``{"tool": ...}``), the tool wrote its manifest last, and it only ever wrote the
    names it writes: a file is the tool's when it is unchanged since the manifest and its name is one the tool writes
    (``writes``: ``fnmatch`` patterns of the new output's names, and the manifest's tool's layout in
    :data:`TOOL_LAYOUTS`) and, where :data:`TOOL_CONTENT` says what the tool writes under that name, its content is
    of that form; every other file is the user's. Under the manifest of a run that was claimed and never
    finished (killed: :func:`claim_output_folder`'s ``"running"`` record), the user's files are those it recorded as
    kept at the claim; every other file is the interrupted run's."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    try:
        record = json.loads((folder / OUTPUT_MARKER).read_text())
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict) and record.get("running"):  # claimed, never finished: all but the kept files
        return sorted(set(_files(folder)) & set(map(str, record.get("kept", []))))
    listed = _manifest(folder)
    if listed is None:
        return [] if recognise is not None and recognise(folder) else _files(folder)
    if listed is ...:
        # the tool wrote its files, then the manifest: a file modified after the manifest (by any time) is the user's,
        # and so is any file under a name the tool does not write, however old
        from fnmatch import fnmatchcase

        since = (folder / OUTPUT_MARKER).stat().st_mtime_ns
        tool = str(record.get("tool", ""))
        layout = (*writes, *TOOL_LAYOUTS.get(tool, ()))
        content = TOOL_CONTENT.get(tool, {})

        def not_its_form(f: str) -> bool:  # the tool's name, another's content (the same tick tells nothing)
            return any(fnmatchcase(f, pattern) and not holds(folder / f) for pattern, holds in content.items())

        return [f for f in _files(folder) if (folder / f).lstat().st_mtime_ns > since
                or not any(fnmatchcase(f, pattern) for pattern in layout) or not_its_form(f)]
    return sorted(set(_files(folder)) - set(map(str, listed)))


def edited_since_marker(folder: str | os.PathLike) -> list[str]:
    """The files FedUQ's manifest lists under ``folder`` that changed after the manifest was written (a table the user
    edited): what a tool continuing its own run (``--resume``) must not write over. Empty without a listing manifest."""
    folder = Path(folder)
    listed = _manifest(folder) if folder.is_dir() else None
    if not listed or listed is ...:
        return []
    since = (folder / OUTPUT_MARKER).stat().st_mtime_ns
    return sorted(f for f in map(str, listed) if (folder / f).is_file() and (folder / f).lstat().st_mtime_ns > since)


def _data_root_env() -> dict[str, str]:
    value = os.environ.get("FEDUQ_DATA_ROOT")
    return {"data root ($FEDUQ_DATA_ROOT)": value} if value else {}


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
    env_data_root: bool = True,
) -> Path:
    """Check that ``tool`` may (re)create the folder ``out``; nothing is written or removed.

    Args:
        out: the output folder, absolute or relative to the current folder.
        inputs: what the tool reads, by the name an error should use (``{"job": ..., "data root": ...}``); ``None``
            values are skipped. Files and folders alike.
        tool: the tool's name for the messages (``"feduq configure"``).
        force: replace an existing non-empty folder that no FedUQ tool made (never one that overlaps an input).
        recognise: ``folder -> bool``, true for an output this tool made before the marker file existed.
        env_data_root: also keep clear of ``$FEDUQ_DATA_ROOT`` (False for a tool that writes a data root).

    Returns:
        ``out`` resolved to an absolute path.

    Raises:
        OutputFolderError: ``out`` is, contains or lies inside an input; is the file-system root or the home
            folder; exists and is not a folder; or is a non-empty folder without :data:`OUTPUT_MARKER` (and not
            ``recognise``-d) while ``force`` is false. The message names the folder, the input or one unexpected
            file, and what to do.
    """
    out = Path(out).expanduser().resolve()
    if out == Path(out.anchor) or out == Path.home().resolve():
        raise OutputFolderError(f"{tool}: refusing to use {out} as an output folder")
    for name, path in {**(_data_root_env() if env_data_root else {}), **inputs}.items():
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
    if out.exists() and not out.is_dir():
        raise OutputFolderError(f"{tool}: the output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        if _manifest(out) is ... and _files(out):  # no list of what FedUQ wrote: every file is protected
            raise OutputFolderError(
                f"{tool}: the output folder {out} holds an older FedUQ output that does not list its files (e.g. "
                f"{_files(out)[0]}); choose a new or empty folder, or pass --force to replace only the files "
                f"{tool.split()[0]} writes (every other file, and any changed after FedUQ wrote it, is kept)")
        theirs = user_files(out, recognise)
        if theirs:
            raise OutputFolderError(
                f"{tool}: the output folder {out} holds files no FedUQ tool wrote there (e.g. {theirs[0]}); choose "
                f"a new or empty folder, or pass --force to replace only what FedUQ wrote and keep them")
    return out


def claim_output_folder(out: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None], tool: str,
                        force: bool = False, env_data_root: bool = True, writes: Sequence[str] = ()
                        ) -> tuple[Path, list[str]]:
    """For a tool that writes its files straight into ``out``: :func:`check_output_folder`, then remove what FedUQ
    wrote there before (the user's files stay), create ``out`` and write a "running" manifest that records the user's
    files kept there, so that the folder of a run killed before it finished (no ``finally`` runs after SIGKILL) is
    still FedUQ's: the next claim replaces every file but the kept ones. Call :func:`write_marker` with
    ``exclude=keep`` when done; it replaces the running record with the list of the tool's files.

    Args:
        writes: the files the tool writes into ``out`` (relative paths; ``fnmatch`` patterns such as
            ``best_model_*.pt``): a user's file under one of them is never written over, ``force`` or not.

    Returns:
        ``(out resolved, keep)``: ``keep`` the user's files found there (with ``force``), never listed as the tool's.

    Raises:
        OutputFolderError: as :func:`check_output_folder`, or a user's file lies where the tool writes (the message
            names it: "... is not FedUQ's and the new output writes the same name; move it away first"); nothing
            written.
    """
    out = check_output_folder(out, inputs, tool, force=force, env_data_root=env_data_root)
    keep = user_files(out, writes=writes)
    refuse_clashes(out, keep, writes, tool)
    if out.is_dir():
        for rel in set(_files(out)) - set(keep):
            (out / rel).unlink()
    mark_running(out, tool, keep)
    return out, keep


def mark_running(out: Path, tool: str, keep: Sequence[str]) -> None:
    """Create ``out`` and write the "running" manifest: until :func:`write_marker` replaces it, every file in ``out``
    but ``keep`` (the user's) is the running tool's, so that a run killed or failed midway leaves a folder FedUQ
    still recognises as its own (a resumed sweep continues in it without --force)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / OUTPUT_MARKER).write_text(json.dumps({"tool": tool, "files": [], "running": True,
                                                 "kept": sorted(keep)}) + "\n")


def refuse_clashes(out: Path, keep: Sequence[str], writes: Sequence[str], tool: str) -> None:
    """Raise :class:`OutputFolderError` when one of the user's files ``keep`` (relative to ``out``) matches a name the
    tool writes (``writes``: relative paths or ``fnmatch`` patterns); the one message every tool gives."""
    from fnmatch import fnmatchcase

    clash = [rel for rel in keep if any(fnmatchcase(rel, w) for w in writes)]
    if clash:
        raise _clash(tool, Path(out) / clash[0])


def _clash(tool: str, path: Path) -> OutputFolderError:
    return OutputFolderError(f"{tool}: {path} is not FedUQ's and the new output writes the same name; move it away "
                             "first (nothing was changed)")


def check_output_file(path: str | os.PathLike, inputs: Mapping[str, str | os.PathLike | None], tool: str,
                      force: bool = False, in_data_root: bool = False) -> Path:
    """Check that ``tool`` may write the single file ``path`` (a log, a split file): not inside or equal to an input
    (and the data root of ``$FEDUQ_DATA_ROOT``, unless ``in_data_root``: a site's own split file), not a folder, and
    not an existing file unless ``force``.

    Raises:
        OutputFolderError: naming the file and the reason (one line).
    """
    path = Path(path).expanduser().resolve()
    for name, given in {**({} if in_data_root else _data_root_env()), **inputs}.items():
        if given is None or str(given) == "":
            continue
        given = Path(given).expanduser().resolve()
        if path == given or _within(path, given):
            raise OutputFolderError(f"{tool}: {path} is {'the' if path == given else 'inside the'} {name} {given}; "
                                    "write it elsewhere")
    if path.is_dir():
        raise OutputFolderError(f"{tool}: {path} is a folder, not a file")
    if path.exists() and not force:
        raise OutputFolderError(f"{tool}: {path} exists; choose another file or pass --force to replace it")
    return path


def write_marker(folder: str | os.PathLike, tool: str, files: list[str] | None = None, exclude=()) -> Path:
    """Write the manifest :data:`OUTPUT_MARKER` (``{"tool": tool, "files": [...]}``) into ``folder``; return its path.

    Args:
        files: the files (relative POSIX paths) the tool wrote; None: every file now in ``folder`` but ``exclude``
            (the user's files that were there before).
    """
    folder = Path(folder)
    if files is None:
        skip = set(exclude)
        files = [f for f in _files(folder) if f not in skip]
    path = folder / OUTPUT_MARKER
    path.write_text(json.dumps({"tool": tool, "files": sorted(files)}) + "\n")
    return path


def _as_written_to(e: OSError, stage: Path, out: Path) -> OSError:
    """``e`` (an :class:`OSError`, or a :class:`shutil.Error` of a folder copy) with the staged path replaced by the
    path the file was meant to have in ``out``, so that the message names the user's output, not a removed folder."""
    if isinstance(e, shutil.Error) and e.args and isinstance(e.args[0], list) and e.args[0]:
        _, dst, why = e.args[0][0]
        found = re.match(r"\[Errno (\d+)\] ([^:]+)", str(why))
        code, reason, name = (int(found[1]), found[2], dst) if found else (None, str(why), dst)
    else:
        code, reason, name = e.errno, e.strerror or str(e), e.filename
    if name is not None and _within(Path(name), stage):
        name = str(out / Path(name).relative_to(stage))
    return OSError(code, reason, name)


def usual_permissions(folder: Path) -> Path:
    """Give a folder made by :func:`tempfile.mkdtemp` (private, mode 0700) the permissions of any folder the user
    makes (0777 less the umask), as its files get theirs. Returns the folder."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    return folder


@contextlib.contextmanager
def staged_folder(out: str | os.PathLike, overwrite: bool = False, what: str = "output",
                  marker: str | None = None, recognise: Callable[[Path], bool] | None = None) -> Iterator[Path]:
    """Write a folder all at once: yield an empty hidden folder beside ``out``, move it to ``out`` on success.

    Args:
        out: the folder to create (its parent is created if needed).
        overwrite: replace an existing non-empty ``out`` (only after the new folder is complete): what a FedUQ tool
            wrote there goes, every other file (:func:`user_files`) is moved into the new folder.
        what: how the message of an error names the output (e.g. ``"CVC-ClinicDB"``).
        marker: the tool's name: write the manifest :data:`OUTPUT_MARKER` of the new folder's files.
        recognise: ``folder -> bool``, true for an older output of this tool without a manifest.

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
    usual_permissions(stage)
    try:
        yield stage
        if marker:
            write_marker(stage, marker)
    except OSError as e:  # disk full, a size limit, ...: named by the path it was meant to have
        shutil.rmtree(stage, ignore_errors=True)
        raise _as_written_to(e, stage, out) from e
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    if out.exists():
        import glob

        keep = user_files(out, recognise, writes=[glob.escape(f) for f in _files(stage)])
        clash = [rel for rel in keep if (stage / rel).exists()]
        if clash:
            shutil.rmtree(stage, ignore_errors=True)
            raise _clash(what, out / clash[0])
        moved = []
        try:  # the user's files go into the new folder, then the folders are swapped
            for rel in keep:
                (stage / rel).parent.mkdir(parents=True, exist_ok=True)
                os.replace(out / rel, stage / rel)
                moved.append(rel)
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        except BaseException:
            for rel in moved:  # put them back where they were
                os.replace(stage / rel, out / rel)
            shutil.rmtree(stage, ignore_errors=True)
            raise
        os.replace(stage, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(stage, out)
