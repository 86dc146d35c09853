"""The outputs of ``geotrain local``: its run directory and its ``--json`` summary, checked before anything starts.

A run directory holds one run. What an earlier ``geotrain local`` run left there (its logs, event files, join
address, coordinator state, Prometheus data, summary) is removed before the new run starts, so that nothing of
it is read as the new run's (the coordinator's old address, old epochs in the event files, old checkpoints).
A directory holding anything else is refused, and so is one another ``geotrain local`` is using.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
from pathlib import Path
from typing import IO

from geotrain.config import RESOLVED_CONFIG_NAME
from geotrain.errors import UserError

LOCK_NAME = "local.lock"
_OWN_FILES = re.compile(r"^(peer-\d+\.(log|jsonl)|coordinator\.log|initial_peers\.(txt|tmp)|summary\.json|"
                        + re.escape(RESOLVED_CONFIG_NAME) + "|" + re.escape(LOCK_NAME) + r")$")
_OWN_DIRECTORIES = {"coordinator", "prometheus"}  # the coordinator's --state-dir; --prometheus' files


def check_outputs(run_dir: Path, json_path: Path | None) -> None:
    """Raise :class:`UserError` when the run directory or the summary file cannot be written as asked."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"--run-dir {run_dir} is a file; expected a directory for the run's logs and events "
                        "(it is created if missing): give a directory path")
    _check_can_create(run_dir, "--run-dir", run_dir)
    previous_run_entries(run_dir, json_path)  # refuses a directory holding something else
    if json_path is None:
        return
    if json_path.is_dir():
        raise UserError(f"--json {json_path} is a directory; expected the path of a file to write the summary to, "
                        f"e.g. {json_path / 'summary.json'}")
    if json_path.exists() and not os.access(json_path, os.W_OK):
        raise UserError(f"--json {json_path}: this user cannot write that file; give another path")
    if json_path.absolute() == run_dir.absolute():
        raise UserError(f"--json {json_path} is the run directory; expected a file, e.g. {json_path / 'summary.json'}")
    if not _inside(json_path.parent, run_dir):  # the run directory's own subfolders are created with it
        _check_can_create(json_path.parent, "--json", json_path)


def previous_run_entries(run_dir: Path, json_path: Path | None = None) -> list[Path]:
    """What an earlier ``geotrain local`` run left in ``run_dir``; :class:`UserError` if it holds anything else."""
    if not run_dir.is_dir():
        return []
    own, foreign = [], []
    for entry in sorted(run_dir.iterdir()):
        if entry.is_symlink():
            foreign.append(entry)
        elif entry.is_dir():
            (own if entry.name in _OWN_DIRECTORIES else foreign).append(entry)
        elif _OWN_FILES.match(entry.name) or (json_path is not None and entry.absolute() == json_path.absolute()):
            own.append(entry)
        else:
            foreign.append(entry)
    if foreign:
        names = ", ".join(entry.name + ("/" if entry.is_dir() else "") for entry in foreign[:5])
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise UserError(f"--run-dir {run_dir} holds files that no `geotrain local` run wrote ({names}{more}); "
                        "expected a new directory or one an earlier run wrote (a run directory holds one run, "
                        "and its files are replaced): give another --run-dir, or move those files out")
    return own


def lock_run_dir(run_dir: Path) -> IO:
    """Create ``run_dir`` and hold its lock for this process's life; refuse one another run is using."""
    run_dir.mkdir(parents=True, exist_ok=True)
    handle = open(run_dir / LOCK_NAME, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        raise UserError(f"--run-dir {run_dir} is in use by another `geotrain local` that is still running; "
                        "give another --run-dir, or stop that run first") from None
    return handle


def clear_previous_run(run_dir: Path, json_path: Path | None = None) -> list[str]:
    """Remove what an earlier run left in ``run_dir`` (the lock excepted); the names removed."""
    removed = []
    for entry in previous_run_entries(run_dir, json_path):
        if entry.name == LOCK_NAME:
            continue
        try:
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
        except OSError as error:
            raise UserError(f"--run-dir {run_dir}: cannot remove {entry.name}, left by an earlier run "
                            f"({error.strerror}); remove it, or give another --run-dir") from None
        removed.append(entry.name + ("/" if entry.name in _OWN_DIRECTORIES else ""))
    return removed


def _check_can_create(path: Path, flag: str, given: Path) -> None:
    """``path`` exists as a writable directory, or its nearest existing ancestor is one (it can be created)."""
    existing = path.absolute()
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{flag} {given}: {existing} is a file, not a directory; give a path whose parents are "
                        "directories")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {given}: this user cannot write in {existing}; give a path this user can write")


def _inside(path: Path, directory: Path) -> bool:
    return path.absolute() == directory.absolute() or directory.absolute() in path.absolute().parents
