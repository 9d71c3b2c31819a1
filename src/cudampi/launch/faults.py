"""What went wrong in a job: rank reports + the launcher's own messages -> one summary.

``parse_launcher_output(text, flavour)`` reads the failure messages of Open MPI (prterun), MPICH
Hydra and srun (tested on real captured output in tests/fixtures/launch); ``build_result`` merges
them with the ranks' tagged reports (:mod:`cudampi.launch.rankreport`) and fault files into a
:class:`JobResult` naming host, rank, exit code or signal and the first lines of the error.
"""

from __future__ import annotations

import dataclasses
import re
import signal as _signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.launch.rankreport import RankReport


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


@dataclass(frozen=True)
class JobResult:
    """The outcome of one launch; ``exit_code`` is what ``cudampi launch`` exits with."""

    exit_code: int
    launcher_rc: int
    failures: tuple[RankFailure, ...] = ()
    hosts: tuple[HostFailure, ...] = ()
    problems: tuple[str, ...] = ()
    interrupted: bool = False
    timed_out: float | None = None
    """The --timeout (seconds) that stopped the job, if it did."""
    duration_s: float = 0.0
    argv: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return self.exit_code == 0

    def summary(self) -> str:
        """Human summary (empty when the job succeeded, but for notes on how it ended)."""
        if self.ok:
            return "".join(f"cudampi launch: note: {p}\n" for p in self.problems).rstrip("\n")
        head = "cudampi launch: "
        if self.timed_out is not None:
            head += f"stopped after --timeout {self.timed_out:g} s: every rank was stopped"
        elif self.interrupted:
            head += "interrupted (Ctrl-C): every rank was stopped"
        else:
            head += f"the job failed (launcher exit status {self.launcher_rc})"
        out = [head]
        for p in self.problems:
            out.append(f"  - {p}")
        for h in self.hosts:
            out.append(f"  - {h.describe()}")
        for f in self.failures:
            out.append(f"  - {f.describe()}")
            out += [f"      | {ln}" for ln in f.lines[:8]]
        quiet = self.interrupted or self.timed_out is not None
        if not self.failures and not self.hosts and not self.problems and not quiet:
            out.append("  - no rank reported an error; see the launcher's output above")
        if any(h.problem == "unreachable" for h in self.hosts):
            out.append(
                "  fix: check that each host resolves and accepts key-based ssh "
                "(ssh HOST true), and that the same python and cudampi exist there"
            )
        return "\n".join(out)

    def to_json(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["ok"] = self.ok
        return d


def signal_name(sig: int) -> str:
    try:
        return _signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


_SIG_BY_TEXT = {
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

_WS = r"\s+"
_OMPI_EXIT = re.compile(r"Process name:\s*\[[^\]]*?,(\d+)\]\s+Exit code:\s*(\d+)")
_OMPI_SIGNAL = re.compile(
    r"process rank (\d+) with PID \d+ on node (\S+) exited on\s+signal (\d+)", re.S
)
_OMPI_ABORT = re.compile(
    r"MPI_ABORT was invoked on rank (\d+) in communicator \S+.*?Errorcode:\s*(-?\d+)", re.S
)
_OMPI_ABORT_NODE = re.compile(r'process rank (\d+) with PID \d+ on node (\S+) calling\s+"abort"')
_OMPI_IMPROPER = re.compile(r"process rank (\d+) with PID \d+ on node (\S+) exiting\s+improperly")
_OMPI_DAEMON = re.compile(r"Remote host:\s+(\S+)\s+Daemon exit status:\s*(-?\d+)")
_OMPI_LOST = re.compile(
    r"lost communication with a remote daemon\.(?:.*?\n)*?\s*Remote daemon:\s*\[[^\]]*?,(\d+)\]"
    r"\s+on node\s+(\S+)",
)
_SSH = re.compile(
    r"ssh: (?:connect to host (\S+) port \d+: (.+)|Could not resolve hostname ([^:\s]+): (.+))"
)
_SSH_TIMEOUT = re.compile(r"Connection to (\S+) port \d+ timed out")
_SSH_CLOSED = re.compile(r"^Connection to (\S+) closed by remote host\.?\r?$", re.M)
_HYDRA_BAD = re.compile(r"PID (\d+) RUNNING AT (\S+)\s*\n=\s*EXIT CODE:\s*(\d+)")
_HYDRA_SIGNAL = re.compile(r"EXIT STRING: .*?\(signal (\d+)\)")
_HYDRA_ABORT = re.compile(r"Abort\((-?\d+)\) on node \d+ \(rank (\d+) in comm 0\)")
_SRUN_MPI_PLUGIN = re.compile(r"srun: error: Couldn't load specified plugin name for mpi/(\w+)")
_SRUN = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)$", re.M)


def _ranks(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            out += list(range(int(lo), int(hi or lo) + 1))
    return out


def _names(host: str, short: str) -> bool:
    """Is ``short`` (how Open MPI names a node: its own, often short, hostname) ``host``?"""
    return host == short or host.split(".")[0] == short


class _Seen:
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
            if _names(h, short):
                return h
        unnamed = [h for h in self.ssh_detail if h not in self.hosts]
        return unnamed[0] if len(unnamed) == 1 else short


def _openmpi_output(text: str, seen: _Seen) -> None:
    if "Unable to get the user home directory" in text:
        seen.problems.append(
            "Open MPI cannot start without a home folder (HOME is unset or not a folder "
            "where the launcher or a rank runs). Fix: export HOME=/path/to/a/folder"
        )
    for m in _OMPI_EXIT.finditer(text):
        seen.add_rank(RankFailure(int(m.group(1)), None, exit_code=int(m.group(2))))
    for m in _OMPI_SIGNAL.finditer(text):
        seen.add_rank(RankFailure(int(m.group(1)), m.group(2), signal=int(m.group(3))))
    for m in _OMPI_ABORT.finditer(text):
        seen.add_rank(RankFailure(int(m.group(1)), None, exit_code=int(m.group(2))))
    for m in _OMPI_ABORT_NODE.finditer(text):
        seen.add_rank(RankFailure(int(m.group(1)), m.group(2)))
    for m in _OMPI_IMPROPER.finditer(text):
        seen.add_rank(
            RankFailure(int(m.group(1)), m.group(2), lines=("exited without finalizing MPI",))
        )
    for m in _OMPI_DAEMON.finditer(text):
        name = seen.ssh_name(m.group(1))
        detail = seen.ssh_detail.get(name, f"its daemon exited with status {m.group(2)}")
        if name != m.group(1):
            detail += f" (Open MPI calls it {m.group(1)})"
        seen.add_host(HostFailure(name, "lost" if name in seen.lost else "unreachable", detail))
    for m in _OMPI_LOST.finditer(text):
        vpid, node = int(m.group(1)), m.group(2)
        name = seen.ssh_name(node)
        given = [h for h in seen.remote if _names(h, node)]
        if given:
            name = given[0]
        elif name == node and 1 <= vpid <= len(seen.remote):
            name = seen.remote[vpid - 1]  # the name the user gave, not the node's own
        detail = "its daemon stopped answering"
        if name != node:
            detail += f" (Open MPI calls it {node})"
        seen.add_host(HostFailure(name, "lost", detail))


def _hydra_output(text: str, seen: _Seen) -> None:
    for m in _HYDRA_ABORT.finditer(text):
        seen.add_rank(RankFailure(int(m.group(2)), None, exit_code=int(m.group(1))))
    sig = _HYDRA_SIGNAL.search(text)
    for m in _HYDRA_BAD.finditer(text):
        # Hydra's PID is the first process of that host's proxy that did not exit by itself
        # (pmiserv_cb.c: the first !WIFEXITED status): one killed by a signal. Its fault file
        # names its rank (build_result).
        pid, host, code = int(m.group(1)), m.group(2), int(m.group(3))
        if sig is not None and int(sig.group(1)) == code:
            seen.add_rank(RankFailure(None, host, signal=code, pid=pid))
        else:
            seen.add_rank(RankFailure(None, host, exit_code=code, pid=pid))


def _srun_output(text: str, seen: _Seen) -> None:
    for m in _SRUN_MPI_PLUGIN.finditer(text):
        seen.problems.append(
            f"srun cannot start MPI ranks: its mpi/{m.group(1)} plugin failed to load (Slurm "
            f"without PMIx support, e.g. libpmix missing). Fix: run "
            f"`cudampi launch --launcher mpirun` inside the allocation, or install PMIx for Slurm"
        )
    for m in _SRUN.finditer(text):
        host, what = m.group(1), m.group(3).strip()
        code_m = re.match(r"Exited with exit code (\d+)", what)
        for r in _ranks(m.group(2)):
            if code_m:
                seen.add_rank(RankFailure(r, host, exit_code=int(code_m.group(1))))
            else:
                name = what.replace(" (core dumped)", "")
                seen.add_rank(RankFailure(r, host, signal=_SIG_BY_TEXT.get(name), lines=(what,)))
    if re.search(r"CANCELLED AT|_step_signal: Terminating", text):
        # --kill-on-bad-exit: srun terminated the others because one failed; not their fault.
        first = [k for k, f in seen.ranks.items() if f.signal != 15]
        if first:
            seen.ranks = {k: f for k, f in seen.ranks.items() if f.signal != 15}


_OUTPUT_OF = {"openmpi": _openmpi_output, "mpich": _hydra_output, "slurm": _srun_output}


def parse_launcher_output(text: str, flavour: str, remote: Sequence[str] = ()) -> LauncherEvents:
    """Rank and host failures that the launcher itself reported in ``text`` (its stderr);
    ``remote``: the job's hosts that are not this machine, in the order given."""
    seen = _Seen(text, remote)
    if flavour in _OUTPUT_OF:
        _OUTPUT_OF[flavour](text, seen)
    for host, detail in seen.ssh_detail.items():
        if host not in seen.hosts:
            seen.add_host(HostFailure(host, "lost" if host in seen.lost else "unreachable", detail))
    return LauncherEvents(
        tuple(seen.ranks.values()), tuple(seen.hosts.values()), tuple(seen.problems)
    )


def exit_status(returncode: int) -> int:
    """A Popen returncode as a shell exit status (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def build_result(
    launcher_rc: int,
    reports: Iterable[RankReport],
    events: LauncherEvents,
    fault_files: Mapping[int, str] | None = None,
    *,
    interrupted: bool = False,
    stopped_for_fault: bool = False,
    duration_s: float = 0.0,
    argv: Iterable[str] = (),
) -> JobResult:
    """Merge the ranks' own reports (exact host, rank, traceback) with the launcher's view
    (signals, lost hosts) and fault files (a crashed rank's Python stack)."""
    merged: dict[int | None, RankFailure] = {}
    for r in reports:
        merged[r.rank] = RankFailure(r.rank, r.host, exit_code=r.code, lines=r.lines)
    by_pid = {
        (_fault_field(t, "host"), _fault_field(t, "pid")): r for r, t in (fault_files or {}).items()
    }
    for f in events.ranks:
        if f.rank is None and f.pid is not None:
            # Hydra names host and pid; the rank's fault file says which rank that pid was. The
            # host as Hydra names it (the host list's name, e.g. an address) may not be the
            # rank's own name: then a pid that only one rank had.
            rank = by_pid.get((f.host, str(f.pid)))
            if rank is None:
                ranks = [r for (_, pid), r in by_pid.items() if pid == str(f.pid)]
                rank = ranks[0] if len(ranks) == 1 else None
            if rank is not None:
                f = dataclasses.replace(f, rank=rank)
        old = merged.get(f.rank)
        if old is None and f.rank is None:
            # Hydra names the host, not the rank: attach to a reported rank on that host.
            same = [k for k, v in merged.items() if v.host == f.host]
            if same:
                old, f = merged[same[0]], dataclasses.replace(f, rank=same[0])
        if old is None:
            merged[f.rank] = f
        else:
            merged[old.rank] = RankFailure(
                old.rank,
                old.host or f.host,
                old.exit_code if f.signal is None else None,
                f.signal if f.signal is not None else old.signal,
                old.lines or f.lines,
            )
    for rank, text in (fault_files or {}).items():
        lines = _fault_lines(text) if "Fatal Python error" in text else []
        if not lines:
            continue
        old = merged.get(rank)
        host = _fault_host(text)
        if old is None:
            merged[rank] = RankFailure(rank, host, lines=tuple(lines))
        elif not old.lines:
            merged[rank] = dataclasses.replace(old, host=old.host or host, lines=tuple(lines))
    failures = tuple(sorted(merged.values(), key=lambda f: (f.rank is None, f.rank or 0)))
    real = tuple(f for f in failures if not _only_stopped(f))
    if real and not interrupted:
        # Ranks stopped by the job's own end (Ctrl-C sent to them) are not its faults.
        failures = real
    code = exit_status(launcher_rc)
    first = next((f for f in real if f.exit_code or f.signal), None) if real else None
    if first is not None and code != 0:
        # The failing rank's own status (launchers differ: srun says 143, Hydra 9 for kill -9).
        code = 128 + first.signal if first.signal else int(first.exit_code or 1)
    elif stopped_for_fault and real:
        code = 1
    if code == 0 and (failures or events.hosts or events.problems):
        code = 1
    if interrupted:
        code = 130
    return JobResult(
        exit_code=code,
        launcher_rc=launcher_rc,
        failures=failures,
        hosts=events.hosts,
        problems=events.problems,
        interrupted=interrupted,
        duration_s=duration_s,
        argv=tuple(argv),
    )


def _only_stopped(f: RankFailure) -> bool:
    return f.exit_code == 130 and f.signal is None and f.lines[:1] == ("KeyboardInterrupt",)


def _fault_field(text: str, name: str) -> str | None:
    first = text.splitlines()[0] if text else ""
    m = re.search(rf"(?:^|\s){name}=(\S+)", first)
    return m.group(1) if m else None


def _fault_host(text: str) -> str | None:
    return _fault_field(text, "host")


def _fault_lines(text: str) -> list[str]:
    """faulthandler's dump -> 'Fatal Python error: ...' and the innermost frames."""
    lines = [ln.rstrip() for ln in text.splitlines()[1:] if ln.strip()]
    if not lines:
        return []
    head = [ln for ln in lines if ln.startswith("Fatal Python error")][:1]
    frames = [ln.strip() for ln in lines if ln.strip().startswith("File ")][:6]
    return head + frames
