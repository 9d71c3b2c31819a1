"""What went wrong in a job: rank reports + the launcher's own messages -> one summary.

``parse_launcher_output(text, flavour)`` has the launcher's family read its failure messages
(Open MPI's prterun, MPICH's Hydra, srun: tested on real captured output in
tests/fixtures/launch); ``build_result`` merges them with the ranks' tagged reports
(:mod:`cudampi.launch.rankreport`) and fault files into a :class:`JobResult` naming host, rank,
exit code or signal and the first lines of the error.
"""

from __future__ import annotations

import dataclasses
import os
import re
import signal as _signal
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.launch.events import (
    HostFailure,
    LauncherEvents,
    RankFailure,
    Seen,
    signal_name,
)
from cudampi.launch.launchers import family
from cudampi.launch.rankreport import RankReport

__all__ = [
    "HostFailure",
    "JobResult",
    "LauncherEvents",
    "RankFailure",
    "build_result",
    "exit_status",
    "launcher_crash",
    "parse_launcher_output",
    "signal_name",
]


@dataclass(frozen=True)
class JobResult:
    """The outcome of one launch; ``exit_code`` is what ``cudampi launch`` exits with."""

    exit_code: int
    launcher_rc: int
    failures: tuple[RankFailure, ...] = ()
    hosts: tuple[HostFailure, ...] = ()
    problems: tuple[str, ...] = ()
    interrupted: bool = False
    stopped_by: int | None = None
    """The signal that stopped ``cudampi launch`` (and so the job): SIGINT (Ctrl-C), SIGTERM."""
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
        elif self.interrupted and self.stopped_by not in (None, _signal.SIGINT):
            sig = self.stopped_by or 0
            head += f"terminated ({signal_name(sig)}): every rank was stopped"
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


def parse_launcher_output(text: str, flavour: str, remote: Sequence[str] = ()) -> LauncherEvents:
    """Rank and host failures that the launcher itself reported in ``text`` (its stderr), read
    by its family; ``remote``: the job's hosts that are not this machine, in the order given."""
    seen = Seen(text, remote)
    family(flavour).read_output(text, seen)
    return seen.events()


CRASH_SIGNALS = (
    _signal.SIGSEGV,
    _signal.SIGBUS,
    _signal.SIGABRT,
    _signal.SIGILL,
    _signal.SIGFPE,
)
"""Signals a process gets from its own fault: the launcher that dies of one crashed."""


def launcher_crash(path: str, name: str, sig: int, remote: Sequence[str] = ()) -> str:
    """What the launcher at ``path`` (``name``: its MPI) dying of signal ``sig``, which cudampi
    launch did not send, means: the launcher's fault, not a rank's; its ranks went with it."""
    launcher = f"the launcher {os.path.basename(path)} ({name})"
    if sig in CRASH_SIGNALS:
        what = f"{launcher} itself crashed (killed by signal {sig}, {signal_name(sig)})"
        fix = "run the job again; if it crashes again, report it to the MPI's developers"
    else:
        what = (
            f"{launcher} itself was killed by signal {sig} ({signal_name(sig)}), not by "
            "cudampi launch"
        )
        fix = "find what killed it (the OOM killer: dmesg; a batch system's time limit)"
    where = " and on the other hosts" if remote else ""
    return (
        f"{what}: the launcher failed, not a rank; the ranks on this host{where} were stopped "
        f"with it. Fix: {fix}"
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
    stopped_by: int | None = None,
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
        code = 128 + (stopped_by or _signal.SIGINT)
    return JobResult(
        exit_code=code,
        launcher_rc=launcher_rc,
        failures=failures,
        hosts=events.hosts,
        problems=events.problems,
        interrupted=interrupted,
        stopped_by=stopped_by if interrupted else None,
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
