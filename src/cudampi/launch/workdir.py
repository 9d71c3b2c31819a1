"""The work folder of one ``cudampi launch`` (``$TMPDIR/cudampi-launch-*``: the hostfile, the
ranks' fault files), and the removal of those whose launch is gone.

A folder names its owner (pid and start time, so a reused pid is not taken for it). One whose
owner was killed (``kill -9`` runs no cleanup) is removed by the next launch of the same user;
a folder without an owner is kept: a dry run leaves its hostfile for the command it printed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "cudampi-launch-"
OWNER = "owner"


def new_workdir() -> str:
    """A fresh work folder owned by this process (stale ones are removed first)."""
    remove_stale()
    path = tempfile.mkdtemp(prefix=PREFIX)
    me = os.getpid()
    Path(path, OWNER).write_text(f"{me} {start_time(me)}\n")
    return path


def keep(path: str) -> None:
    """Let ``path`` outlive its launch (a dry run's hostfile): it no longer names an owner."""
    Path(path, OWNER).unlink(missing_ok=True)


def release(path: str, *, keep_it: bool = False) -> None:
    """The launch that made ``path`` is done with it."""
    if keep_it:
        keep(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale(folder: str | None = None) -> list[str]:
    """Remove this user's work folders in ``folder`` (the temporary folder) whose owner has
    ended; the folders removed."""
    removed = []
    for path in Path(folder or tempfile.gettempdir()).glob(PREFIX + "*"):
        try:
            st = path.lstat()
            if not path.is_dir() or path.is_symlink() or st.st_uid != os.getuid():
                continue
            pid_text, _, started = Path(path, OWNER).read_text().partition(" ")
            pid = int(pid_text)
        except (OSError, ValueError):
            continue  # not ours, kept on purpose, or still being made
        if start_time(pid) == started.strip():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(str(path))
    return removed


def start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, ``/proc/PID/stat``'s 22nd field),
    or "" when there is no such process."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return ""
    return fields[19] if len(fields) > 19 else ""
