"""Files written whole or not at all, and standard output that may fail.

Every file cudampi writes for the user (the doctor's ``--save-json``, ``cudampi env write``'s
files, ``bench --json``/``--csv``, the capabilities cache, a rank's ``CUDAMPI_TRACE`` file) goes
through :func:`write_text`: the text goes into a new file beside the target, is flushed to the
disk, and only then renamed over the target. A full disk or a quota leaves the old file as it
was (or none), never a truncated or empty one, and removes the temporary file.
"""

from __future__ import annotations

import os
import secrets
import stat
import sys
from pathlib import Path


def write_text(
    path: str | os.PathLike[str],
    text: str,
    *,
    follow_symlinks: bool = True,
    mode: int | None = None,
) -> Path:
    """Write ``text`` to ``path`` atomically; the path written (a symlink's target when
    ``follow_symlinks``, else the link itself is replaced).

    The file gets ``mode``; without it a new file gets the permissions a plain
    ``open(path, "w")`` would give it (the umask's), a replaced file keeps its own. A target that is not a regular file (``/dev/stdout``, a FIFO)
    is written in place: there is nothing to rename over. ``OSError`` (the original one) when
    the folder cannot be written or the data does not fit; the temporary file is gone then.
    """
    target = Path(path)
    try:
        st = os.stat(target) if follow_symlinks else os.lstat(target)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode) and not stat.S_ISLNK(st.st_mode):
        with open(target, "w") as f:
            f.write(text)
        return target
    if follow_symlinks:
        target = Path(os.path.realpath(target))
    tmp = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    # O_EXCL: never through a link or a file someone else put there; 0o666: the umask decides
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
    try:
        with open(fd, "w", closefd=True) as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            elif st is not None and stat.S_ISREG(st.st_mode):
                os.fchmod(f.fileno(), stat.S_IMODE(st.st_mode))
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target


def why(exc: OSError) -> str:
    """An OSError as a user reads it: ``No space left on device``, not ``[Errno 28] ...``."""
    return exc.strerror or str(exc)


def write_stdout(text: str) -> str:
    """Write ``text`` to standard output and flush it; ``""``, or why it could not be written
    (a full disk, a closed pipe). After a failure standard output is pointed at the null
    device, so Python's own flush at exit does not fail again with a traceback."""
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except OSError as exc:
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):
            pass
        return why(exc)
    return ""
