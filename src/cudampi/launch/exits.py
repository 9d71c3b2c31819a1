"""Where the ranks of a job whose scripts all finished are, when the job does not end.

Every rank says "finished" when its script has run to the end and "exiting" once Python's exit
handlers have run after that (:mod:`cudampi.launch.rank`); a rank on this host also left its pid
in its fault file, so the supervisor can read its process's state from ``/proc``. Together they
place each rank at one stage of its exit (:data:`STAGES`), and :func:`describe` says in words
whether the ranks are stuck in their own teardown (and which, where, for how long) or every rank
process is gone and the launcher itself has not exited.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

RANK_MARK = b"cudampi.launch.rank"
"""What a rank bootstrap's command line holds (a pid reused by another program has not)."""

STAGES = {
    "python": "in Python's exit (a non-daemon thread or an atexit handler)",
    "teardown": (
        "past Python's exit handlers, in the interpreter's teardown, MPI_Finalize or C++/CUDA "
        "teardown"
    ),
    "kernel": (
        "ending in the kernel (its memory is released, its files not yet closed: e.g. the GPU "
        "driver tearing down its context)"
    ),
    "zombie": "exited, but its parent (the launcher's daemon) has not collected it",
    "gone": "exited and collected",
    "remote": "past Python's exit handlers (its process, on another host, is not visible here)",
    "remote-python": (
        "in Python's exit or before it (its process, on another host, is not visible here)"
    ),
}
"""Each stage of a finished rank's exit, in words."""

ENDED = ("zombie", "gone")
"""Stages of a rank whose process has exited."""
IN_PYTHON = ("python", "remote-python")
"""Stages in which the script's own exit handlers run (real work, an upload, or a wait)."""


def local_rank_pids(fault_files: Mapping[int, str]) -> dict[int, int]:
    """rank -> pid of the ranks that ran on this host (the first line of their fault file)."""
    import socket

    here = socket.gethostname()
    out = {}
    for rank, text in fault_files.items():
        first = text.splitlines()[0] if text else ""
        fields = dict(w.split("=", 1) for w in first.split() if "=" in w)
        if fields.get("host") == here and fields.get("pid", "").isdigit():
            out[rank] = int(fields["pid"])
    return out


def process_state(pid: int) -> str:
    """``running``, ``exiting`` (in the kernel's exit: its memory is gone, so its command line
    reads empty), ``zombie`` or ``gone`` (also: the pid now belongs to another program)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"
    if state in ("Z", "X"):
        return "zombie"
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "gone"
    if RANK_MARK in cmdline:
        return "running"
    return "exiting" if not cmdline else "gone"


@dataclass(frozen=True)
class RankExit:
    """One finished rank, seen while the job had not ended."""

    rank: int
    stage: str
    """A key of :data:`STAGES`."""
    since: float
    """Seconds since it said its script finished."""
    pid: int | None = None
    host: str | None = None

    def describe(self) -> str:
        where = [f"pid {self.pid}"] if self.pid else []
        where += [f"on host {self.host}"] if self.host else []
        who = f"rank {self.rank}" + (f" ({' '.join(where)})" if where else "")
        return f"{who} {STAGES[self.stage]}, {self.since:.0f} s after its script finished"


def stage_of(state: str | None, said_exiting: bool) -> str:
    """A finished rank's stage from its process state (None: not on this host) and whether it
    said it is past Python's exit handlers."""
    if state is None:
        return "remote" if said_exiting else "remote-python"
    if state == "running":
        return "teardown" if said_exiting else "python"
    if state == "exiting":
        return "kernel"
    return state


def stuck(exits: Iterable[RankExit]) -> list[RankExit]:
    """The ranks whose processes had not exited (or cannot be seen from here)."""
    return [e for e in exits if e.stage not in ENDED]


def in_own_exit(exits: Iterable[RankExit]) -> list[RankExit]:
    """The ranks still running their script's exit handlers or threads: the job waits for
    them (they may be doing real work), where a rank stuck past them is stopped."""
    return [e for e in exits if e.stage in IN_PYTHON]


def waiting_note(exits: Iterable[RankExit], grace: float) -> str:
    """What the job waits for when ranks are still in their own exit ``grace`` s after every
    rank's script finished (said once, while it waits)."""
    ranks = in_own_exit(sorted(exits, key=lambda e: e.rank))
    shown = "; ".join(e.describe() for e in ranks[:8]) + ("; ..." if len(ranks) > 8 else "")
    return (
        f"every rank finished its script {grace:g} s ago and the job waits for: {shown}. An "
        "exit handler may be doing real work (an upload, a final log): cudampi launch waits "
        "for it (--timeout ends the job, Ctrl-C stops it). One that waits for other ranks (a "
        "collective or a barrier at exit, a process group left open) never ends"
    )


def describe(exits: Iterable[RankExit], launcher: str, grace: float) -> str:
    """Why a job whose ranks all finished their scripts had not ended ``grace`` s later."""
    exits = sorted(exits, key=lambda e: e.rank)
    alive = stuck(exits)
    if alive:
        shown = "; ".join(e.describe() for e in alive[:8]) + ("; ..." if len(alive) > 8 else "")
        done = len(exits) - len(alive)
        rest = f" ({done} other rank{'s' if done != 1 else ''} had exited)" if done else ""
        return (
            f"every rank finished its script, but {grace:g} s later the job had not ended: "
            f"{shown}{rest}. cudampi launch stopped the job (the scripts' results stand). "
            "Fix: look for exit-time work that waits (an atexit handler or a thread that waits "
            "for other ranks, a communicator or process group left open, a collective at exit)"
        )
    zombies = [e.rank for e in exits if e.stage == "zombie"]
    how = (
        f"; rank{'s' if len(zombies) > 1 else ''} {', '.join(map(str, zombies))} exited but "
        f"{launcher} had not collected {'them' if len(zombies) > 1 else 'it'}"
        if zombies
        else ""
    )
    return (
        f"{launcher} had not exited {grace:g} s after every rank's process had ended (each "
        f"finished its script well{how}): the launcher itself lingered, and cudampi launch "
        "stopped it"
    )
