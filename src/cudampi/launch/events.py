"""What a launcher's own output says went wrong, as records: failed ranks and hosts, and
launcher-level problems. Each launcher family (:mod:`cudampi.launch.launchers`) reads its
launcher's messages into a :class:`Seen`; :mod:`cudampi.launch.faults` merges them with the
ranks' own reports into the job's result.
"""

from __future__ import annotations

import re
import signal as _signal
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class RankFailure:
    rank: int | None
    host: str | None
    exit_code: int | None = None
    signal: int | None = None
    lines: tuple[str, ...] = ()
    """First lines of its error (its traceback's last line first)."""
    pid: int | None = None

    def describe(self) -> str:
        who = f"rank {self.rank}" if self.rank is not None else "a rank"
        where = f" on host {self.host}" if self.host else ""
        if self.signal is not None:
            how = f"was killed by signal {self.signal} ({signal_name(self.signal)})"
        elif self.exit_code is not None:
            how = f"exited with code {self.exit_code}"
        else:
            how = "failed"
        return f"{who}{where} {how}"


@dataclass(frozen=True)
class HostFailure:
    host: str
    problem: str
    """unreachable (its daemon never started) or lost (it went away during the run)."""
    detail: str = ""

    def describe(self) -> str:
        what = "cannot be reached" if self.problem == "unreachable" else "was lost during the run"
        return f"host {self.host} {what}" + (f": {self.detail}" if self.detail else "")


@dataclass(frozen=True)
class LauncherEvents:
    ranks: tuple[RankFailure, ...] = ()
    hosts: tuple[HostFailure, ...] = ()
    problems: tuple[str, ...] = ()
    """Launcher-level failures in words, each with its fix."""


def signal_name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


SIGNAL_WORDS = {
    "Killed": 9,
    "Segmentation fault": 11,
    "Aborted": 6,
    "Terminated": 15,
    "Bus error": 7,
    "Floating point exception": 8,
    "Interrupt": 2,
    "Hangup": 1,
    "Illegal instruction": 4,
}
"""How a shell (and launchers after it) names the signal that ended a process."""

_SSH = re.compile(
    r"ssh: (?:connect to host (\S+) port \d+: (.+)|Could not resolve hostname ([^:\s]+): (.+))"
)
_SSH_TIMEOUT = re.compile(r"Connection to (\S+) port \d+ timed out")
_SSH_CLOSED = re.compile(r"^Connection to (\S+) closed by remote host\.?\r?$", re.M)


def same_host(host: str, short: str) -> bool:
    """Is ``short`` (how Open MPI names a node: its own, often short, hostname) ``host``?"""
    return host == short or host.split(".")[0] == short


class Seen:
    """What the launcher's output said so far: failed ranks and hosts, problems, and ssh's own
    words about each host (they name a host best: Open MPI shortens names in its messages)."""

    def __init__(self, text: str, remote: Sequence[str] = ()) -> None:
        self.remote = tuple(remote)
        """The hosts that are not this machine, in the order given: Open MPI numbers their
        daemons 1, 2, ... in that order (0 is the launcher's own)."""
        self.ranks: dict[int | None, RankFailure] = {}
        self.hosts: dict[str, HostFailure] = {}
        self.problems: list[str] = []
        self.ssh_detail: dict[str, str] = {}
        for m in _SSH.finditer(text):
            host = m.group(1) or m.group(3)
            self.ssh_detail[host] = (m.group(2) or m.group(4) or "").strip()
        for m in _SSH_TIMEOUT.finditer(text):
            self.ssh_detail[m.group(1)] = "ssh connection timed out"
        self.lost = {m.group(1) for m in _SSH_CLOSED.finditer(text)}
        for host in self.lost:
            self.ssh_detail[host] = "its ssh connection closed"

    def add_rank(self, f: RankFailure) -> None:
        old = self.ranks.get(f.rank)
        if old is None:
            self.ranks[f.rank] = f
            return
        self.ranks[f.rank] = RankFailure(
            f.rank,
            old.host or f.host,
            old.exit_code if old.exit_code is not None else f.exit_code,
            old.signal if old.signal is not None else f.signal,
            old.lines or f.lines,
        )

    def add_host(self, h: HostFailure) -> None:
        old = self.hosts.get(h.host)
        if old is None or (not old.detail and h.detail):
            self.hosts[h.host] = h

    def ssh_name(self, short: str) -> str:
        """Open MPI names a remote node by its own hostname; ssh by the name we gave it."""
        for h in self.ssh_detail:
            if same_host(h, short):
                return h
        unnamed = [h for h in self.ssh_detail if h not in self.hosts]
        return unnamed[0] if len(unnamed) == 1 else short

    def events(self) -> LauncherEvents:
        """What was seen, with every host ssh spoke of that no launcher message named."""
        for host, detail in self.ssh_detail.items():
            if host not in self.hosts:
                problem = "lost" if host in self.lost else "unreachable"
                self.add_host(HostFailure(host, problem, detail))
        return LauncherEvents(
            tuple(self.ranks.values()), tuple(self.hosts.values()), tuple(self.problems)
        )
