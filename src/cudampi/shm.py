"""MPI's shared-memory files in ``/dev/shm``: which belong to a job, which are stale, removing them.

MPICH (4.x and 5.x, ch4) names the segment its ranks on a node meet in ``mpich_shm_<id>_<node>``
(``mpich_vci_<id>_<node>`` with several VCIs), where ``<id>`` is the 32-bit FNV-1a hash of the
job's PMI key-value space name (``MPIR_Process.world_id``, src/util/mpir_pmi.c), and opens it with
``MPL_initshm_open``: the first rank creates it, every other rank opens the file that is there and
waits for the creator's ready flag. A job whose ranks are killed never unlinks it, and each such
segment holds 2-3 MiB of a tmpfs that containers often cap at 64 MiB.

A space name that repeats makes a later job open an earlier job's stale segment as its own: seen
here with cudampi's PMI server when it named the space ``kvs_<its pid>_0`` as Hydra did until
MPICH 4 (pids wrap at 32768 on many machines): ranks spinning in MPI_Init for ever, an "Invalid
GenQ flag" assertion, "Message from rank 1 and tag 7 truncated" in MPI_Init. Hydra 5 adds a random
number and the host (``kvs_<pid>_<pgid>_<random>_<host>``), which it tells only its ranks.

So cudampi's PMI server names each job's space uniquely (:func:`unique_kvsname`) and it and its
watchers remove a failed job's segments (:func:`remove_mpich_segments`); ``cudampi launch``, which
cannot learn Hydra's name, removes the segments left on its host by a failed job's ranks
(:func:`orphaned_mpich_segments`).

Open MPI 5's shared-memory transport makes one ``sm_segment.<host>.<uid>.<job>.<rank>`` per
process; killed ranks leave theirs, and an Open MPI 5.0 singleton (a script run without a launcher)
leaves its own at every exit, clean or not (5.0.11: 16 MiB, sparse, each run); a singleton that
makes a cudampi Communicator removes its own at exit (:func:`remove_singleton_segment_at_exit`).
``cudampi doctor`` reports ``/dev/shm``'s size and the stale segments of both (:func:`shm_state`);
``python -m cudampi.shm --remove`` removes those.
"""

from __future__ import annotations

import argparse
import atexit
import os
import secrets
import sys
from dataclasses import dataclass
from typing import Any

SHM_DIR = "/dev/shm"
MPICH_PREFIXES = ("mpich_shm_", "mpich_vci_")
"""Names of MPICH's segments."""
OPEN_MPI_PREFIX = "sm_segment."
"""Name of an Open MPI 5 process's segment."""
MPI_PREFIXES = (*MPICH_PREFIXES, OPEN_MPI_PREFIX)
"""Names of MPI shared-memory files: MPICH's, and Open MPI 5's shared-memory transport's."""


def mpich_world_id(kvsname: str) -> int:
    """MPICH's ``world_id`` of a job: the 32-bit FNV-1a hash of its PMI key-value space name
    (uthash's ``HASH_FNV``, as MPICH computes it in ``MPIR_pmi_init``)."""
    value = 2166136261
    for byte in kvsname.encode():
        value = ((value ^ byte) * 16777619) & 0xFFFFFFFF
    return value


def unique_kvsname(pid: int | None = None) -> str:
    """A key-value space name in Hydra's form, ``kvs_<pid>_<random>``: unique to the job even
    when the pid was an earlier job's (MPICH names its shared memory after it)."""
    return f"kvs_{os.getpid() if pid is None else pid}_{secrets.randbits(31)}"


def mpich_segments(kvsname: str, folder: str = SHM_DIR) -> list[str]:
    """Paths of the MPICH segments of the job named ``kvsname`` present in ``folder``."""
    tags = tuple(f"{prefix}{mpich_world_id(kvsname):x}_" for prefix in MPICH_PREFIXES)
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    return sorted(
        os.path.join(folder, name)
        for name in names
        if name.startswith(tags) and name.rsplit("_", 1)[-1].isdigit()
    )


def orphaned_mpich_segments(since: float, folder: str = SHM_DIR) -> list[str]:
    """MPICH segments in ``folder`` made at or after ``since`` (a ``time.time()``) by this user
    that no process maps: a job's that ended then without removing them. A live job's segment
    is mapped by its ranks from the moment it is made (``MPL_initshm_open``)."""
    return _unmapped(folder, MPICH_PREFIXES, since)


def stale_segments(folder: str = SHM_DIR) -> list[str]:
    """MPI shared-memory files of this user in ``folder`` that no process maps: MPICH's and
    Open MPI 5's (``sm_segment.<host>.<uid>.<job>.<rank>``, which killed ranks and every Open
    MPI singleton leave behind), of jobs that are over."""
    return _unmapped(folder, MPI_PREFIXES, 0.0)


def _unmapped(folder: str, prefixes: tuple[str, ...], since: float) -> list[str]:
    try:
        names = [n for n in os.listdir(folder) if n.startswith(prefixes)]
    except OSError:
        return []
    made = []
    for name in names:
        path = os.path.join(folder, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == os.getuid() and st.st_ctime >= since:
            made.append(path)
    if not made:
        return []
    mapped = _mapped_files(folder)
    return sorted(path for path in made if path not in mapped)


@dataclass(frozen=True)
class ShmState:
    """What the doctor reports of ``/dev/shm``: where the ranks of a node meet."""

    folder: str
    size: int
    """Bytes the file system may hold."""
    free: int
    stale: tuple[str, ...]
    """:func:`stale_segments`."""
    stale_bytes: int
    """Memory those hold (blocks in use: the segments are sparse)."""


def shm_state(folder: str = SHM_DIR) -> ShmState | None:
    """``folder``'s size, free space and stale MPI segments; None where there is no such folder."""
    try:
        fs = os.statvfs(folder)
    except OSError:
        return None
    stale = stale_segments(folder)
    used = 0
    for path in stale:
        try:
            used += os.stat(path).st_blocks * 512
        except OSError:
            continue
    return ShmState(
        folder, fs.f_blocks * fs.f_frsize, fs.f_bavail * fs.f_frsize, tuple(stale), used
    )


def _mapped_files(folder: str, only: str | None = None) -> set[str]:
    """Files under ``folder`` that some process on this host maps (those /proc lets us read), or
    the process ``only`` (a pid or "self")."""
    mapped: set[str] = set()
    prefix = folder.rstrip("/") + "/"
    for pid in [only] if only else os.listdir("/proc"):
        if not (pid.isdigit() or pid == "self"):
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    path = line.rstrip("\n").partition(prefix)[2]
                    if path:
                        mapped.add(prefix + path.removesuffix(" (deleted)"))
        except OSError:
            continue
    return mapped


def remove(paths: list[str]) -> list[str]:
    """Unlink ``paths`` (leaving those this user may not remove); the paths removed."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            continue
        removed.append(path)
    return removed


def remove_mpich_segments(kvsname: str, folder: str = SHM_DIR) -> list[str]:
    """Unlink the job's MPICH segments on this host (those this user may remove); the paths
    removed. Safe while ranks of the job still run: their mappings stay valid, only the name goes.
    """
    return remove(mpich_segments(kvsname, folder))


_SINGLETON_EXIT: list[str] = []
"""The segments this process removes at exit (:func:`remove_singleton_segment_at_exit`)."""


def remove_singleton_segment_at_exit(MPI: Any, folder: str = SHM_DIR) -> list[str]:
    """Where this process is an Open MPI world of one (a singleton; ``mpirun -n 1``'s session
    cleanup would remove it anyway), remove the shared-memory segment it maps when it exits,
    which an Open MPI 5.0 singleton never does; the segments so registered (once a process; none
    in a larger job or under another MPI). The handler may run before MPI_Finalize: only the name
    goes, and nothing attaches to the segment of a process that is exiting. A child forked later
    inherits the handler and leaves the segment alone (it is its parent's)."""
    if _SINGLETON_EXIT or MPI.COMM_WORLD.Get_size() != 1:
        return []
    if not MPI.Get_library_version().startswith("Open MPI"):
        return []
    mine = sorted(
        p for p in _mapped_files(folder, "self") if os.path.basename(p).startswith(OPEN_MPI_PREFIX)
    )
    if mine:
        _SINGLETON_EXIT[:] = mine
        atexit.register(_remove_if_mine, os.getpid(), mine)
    return mine


def _remove_if_mine(pid: int, paths: list[str]) -> None:
    if os.getpid() == pid:
        remove(paths)


def main(argv: list[str] | None = None) -> int:
    """``python -m cudampi.shm [--remove]``: list (or remove) this user's stale MPI segments."""
    p = argparse.ArgumentParser(prog="python -m cudampi.shm", description=stale_segments.__doc__)
    p.add_argument("--remove", action="store_true", help="remove them")
    p.add_argument("--folder", default=SHM_DIR)
    a = p.parse_args(argv)
    stale = stale_segments(a.folder)
    done = remove(stale) if a.remove else stale
    for path in done:
        print(path)
    if a.remove and len(done) < len(stale):
        print(f"could not remove {len(stale) - len(done)} of them", file=sys.stderr)
        return 1
    return 0


__all__ = [
    "mpich_segments",
    "mpich_world_id",
    "orphaned_mpich_segments",
    "remove",
    "remove_mpich_segments",
    "remove_singleton_segment_at_exit",
    "shm_state",
    "stale_segments",
    "unique_kvsname",
]


if __name__ == "__main__":
    sys.exit(main())
