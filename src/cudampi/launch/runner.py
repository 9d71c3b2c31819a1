"""Run a plan: start the launcher, pass its output through, supervise, summarize faults.

The launcher runs in its own session (so a Ctrl-C reaches only the supervisor, which then stops
the job in order: the launcher's own interrupt, then SIGTERM, then SIGKILL of its process group),
and it cannot outlive the supervisor: killed even with -9, the supervisor's death sends the
launcher SIGTERM (``PR_SET_PDEATHSIG``), on which it stops its ranks (each rank also dies with
the launcher daemon that started it, see :mod:`cudampi.launch.rank`).

Its stderr passes through line by line while the ranks' tagged lines, carrying this job's token
(:mod:`cudampi.launch.rankreport`), are collected. A fault, reported by a rank or by the
launcher itself, gives the launcher ``grace`` seconds to end the job (Open MPI does at once;
Hydra waits for the other ranks) before the supervisor ends it; so does a launcher that lingers
after every rank has ended (prterun sometimes hangs once its ranks have died), and a job whose
ranks all said their scripts finished but have not all exited (a rank stuck in its exit: an
atexit handler, a thread, MPI_Finalize); the summary then says which rank is where
(:mod:`cudampi.launch.exits`). A launcher that exits 0 without having started every rank is a
failure; one that fails with a known transient start-up message before any rank ran is started
again (:data:`LAUNCH_RETRIES`). Rank processes left on this host afterwards (their launcher
killed with -9) are killed from their fault-file pids.
"""

from __future__ import annotations

import codecs
import dataclasses
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO

from cudampi.errors import LaunchError
from cudampi.launch.argv import Command, build_command, merge_env
from cudampi.launch.exits import (
    ENDED,
    RankExit,
    describe,
    in_own_exit,
    local_rank_pids,
    process_state,
    stage_of,
    stuck,
    waiting_note,
)
from cudampi.launch.faults import (
    JobResult,
    LauncherEvents,
    build_result,
    launcher_crash,
    parse_launcher_output,
)
from cudampi.launch.launchers import LauncherFamily, family
from cudampi.launch.plan import LaunchPlan
from cudampi.launch.rankreport import (
    TOKEN_ENV,
    is_report_line,
    new_token,
    parse_marks,
    parse_reports,
    parse_started,
    report_prefix,
)
from cudampi.mpiexec import launcher_never_started

STOP_STEPS = (3.0, 3.0)
"""Seconds to wait after the launcher's interrupt, then after SIGTERM, before SIGKILL."""


def command_for(plan: LaunchPlan, workdir: str) -> Command:
    """The plan's command with its hostfile placed in ``workdir``."""
    return build_command(plan, os.path.join(workdir, "hostfile") if plan.hosts else None)


def write_hostfile(cmd: Command) -> None:
    if cmd.hostfile_path and cmd.hostfile_text is not None:
        Path(cmd.hostfile_path).write_text(cmd.hostfile_text)


class _Stream:
    """Pass one of the launcher's streams through as it comes (partial lines too: progress
    bars), keep its last lines for the fault parser, and hold back the ranks' tagged reports."""

    def __init__(self, sup: _Supervisor, out: IO[str]) -> None:
        self.sup = sup
        self.out = out
        self.line = ""
        self.flushed = 0

    def _write(self, text: str) -> None:
        if not text:
            return
        try:
            self.out.write(text)
            self.out.flush()
        except (OSError, ValueError):
            pass

    def feed(self, text: str) -> None:
        while text:
            nl = text.find("\n")
            if nl < 0:
                self.line += text
                if not _may_be_report(self.line, self.sup.prefix):
                    self._write(self.line[self.flushed :])
                    self.flushed = len(self.line)
                return
            line, text = self.line + text[: nl + 1], text[nl + 1 :]
            if is_report_line(line, self.sup.token) and self.flushed == 0:
                self.sup.add_report(line)
            else:
                self._write(line[self.flushed :])
                self.sup.add_tail(line)
            self.line, self.flushed = "", 0

    def close(self) -> None:
        if self.line:
            self._write(self.line[self.flushed :])
            self.sup.add_tail(self.line)
            self.line, self.flushed = "", 0


def _may_be_report(partial: str, prefix: str) -> bool:
    return partial.startswith(prefix) or prefix.startswith(partial)


class _Supervisor:
    def __init__(
        self, proc: subprocess.Popen[bytes], flavour: str, token: str, remote: tuple[str, ...]
    ) -> None:
        self.proc = proc
        self.flavour = flavour
        self.family: LauncherFamily = family(flavour)
        self.remote = remote
        self.token = token
        self.prefix = report_prefix(token)
        self.tail: deque[str] = deque(maxlen=400)
        self.tail_seen = 0
        """Lines added to ``tail`` so far (the launcher's messages are parsed when it grows)."""
        self.report_lines: list[str] = []
        self.finished_at: dict[int, float] = {}
        """rank -> when its "finished" line came (its script ran to the end, status 0)."""
        self.first_fault: float | None = None
        self.stopped_for_fault = False
        self.interrupts = 0
        self.stopped_by: int | None = None  # the first signal that asked to stop the job
        self.lock = threading.Lock()

    def add_report(self, line: str) -> None:
        with self.lock:
            self.report_lines.append(line)
            if self.first_fault is None and parse_reports([line], self.token):
                self.first_fault = time.monotonic()
            for rank in parse_started([line], self.token, "finished"):
                self.finished_at.setdefault(rank, time.monotonic())

    def add_tail(self, line: str) -> None:
        with self.lock:
            self.tail.append(line)
            self.tail_seen += 1

    def launcher_events(self) -> LauncherEvents:
        with self.lock:
            text = "".join(self.tail)
        return parse_launcher_output(text, self.flavour, self.remote)

    def pump(self, pipe: IO[bytes], out: IO[str]) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        stream = _Stream(self, out)
        fd = pipe.fileno()
        while True:
            try:
                chunk = os.read(fd, 65536)
            except OSError:
                break
            if not chunk:
                break
            stream.feed(decoder.decode(chunk))
        stream.feed(decoder.decode(b"", final=True))
        stream.close()

    def on_sigint(self, signum: int, frame: FrameType | None) -> None:
        self.interrupts += 1
        self.stopped_by = self.stopped_by or signum
        if self.interrupts > 1:
            self.kill_group(signal.SIGKILL)

    def send(self, sig: int) -> None:
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError:
            pass

    def kill_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self) -> None:
        """End the job: the launcher's interrupt, SIGTERM, then SIGKILL of its group."""
        self.family.interrupt(self.send)
        for wait_s, sig in zip(STOP_STEPS, (signal.SIGTERM, signal.SIGKILL)):
            try:
                self.proc.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                if sig == signal.SIGKILL:
                    self.kill_group(sig)
                else:
                    self.send(sig)
        self.proc.wait()


def _read_fault_files(report_dir: str | None) -> dict[int, str]:
    out: dict[int, str] = {}
    if not report_dir or not os.path.isdir(report_dir):
        return out
    for p in Path(report_dir).glob("rank-*.fault"):
        try:
            out[int(p.stem.split("-", 1)[1])] = p.read_text(errors="replace")
        except (OSError, ValueError):
            continue
    return out


def _rank_alive(pid: int) -> bool:
    """Is ``pid`` still a rank bootstrap that has not exited: running, or still inside the
    kernel's exit (not gone, not a zombie, not reused)?"""
    return process_state(pid) not in ENDED


def _kill_leftovers(fault_files: Mapping[int, str]) -> list[int]:
    """SIGKILL rank processes of this job still alive on this host (orphans); their pids."""
    killed = []
    for pid in local_rank_pids(fault_files).values():
        if _rank_alive(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def _die_with_supervisor() -> Callable[[], None]:
    """A ``preexec_fn`` that makes the kernel send the launcher SIGTERM when the supervisor dies.

    libc's prctl is looked up here, before the fork: the child only calls it."""
    try:
        import ctypes

        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return lambda: None
    pr_set_pdeathsig = 1

    def preexec() -> None:
        prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)

    return preexec


def _all_ranks_ended(report_dir: str | None, nprocs: int) -> bool:
    """Every one of the ``nprocs`` ranks ran on this host, and every one has ended."""
    if not report_dir:
        return False
    pids = local_rank_pids(_read_fault_files(report_dir))
    return len(pids) >= nprocs and not any(_rank_alive(pid) for pid in pids.values())


def _not_started(nprocs: int, said: set[int], with_files: set[int]) -> str | None:
    """Why a launcher that exited 0 did not run the job, or None.

    ``said``: ranks whose "started" line came through; ``with_files``: ranks whose fault file
    appeared on this host. No rank at all is a failure; so are missing ranks once lines came
    through (a launcher whose output went elsewhere, e.g. to --output-filename, sends none)."""
    ran = said | with_files
    if not ran:
        return (
            f"the launcher exited with status 0 but started none of the {nprocs} ranks (raw "
            "launcher flags after -- such as --version or --help make it print and exit). "
            "Fix: check the launcher flags"
        )
    missing = sorted(set(range(nprocs)) - ran)
    if said and missing:
        shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
        return (
            f"the launcher exited with status 0 but only {nprocs - len(missing)} of {nprocs} "
            f"ranks started (missing: {shown}). Fix: check the launcher flags after --"
        )
    return None


def execute(
    plan: LaunchPlan,
    workdir: str,
    *,
    grace: float = 10.0,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    err: IO[str] | None = None,
    out: IO[str] | None = None,
) -> JobResult:
    """Run ``plan`` to the end and return what happened (the summary is not printed here)."""
    err = sys.stderr if err is None else err
    out = sys.stdout if out is None else out
    token = new_token()
    # The token reaches the ranks through the launcher's environment (not its argv).
    plan = dataclasses.replace(plan, forward=(*plan.forward, TOKEN_ENV))
    cmd = command_for(plan, workdir)
    write_hostfile(cmd)
    report_dir = dict(plan.env).get("CUDAMPI_REPORT_DIR")
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
    start = time.monotonic()
    env = os.environ if env is None else env
    for attempt in range(1 + LAUNCH_RETRIES):
        proc, sup, watch = _run_once(
            cmd, env, token, plan, report_dir, grace, timeout, start, out, err
        )
        if attempt == LAUNCH_RETRIES or not _never_started(proc, sup, watch, token):
            break
        launcher = plan.launcher.name or os.path.basename(plan.launcher.path)
        err.write(
            f"cudampi launch: {launcher} failed before it started any rank (a known intermittent "
            f"start-up failure of the launcher itself); starting the job again (attempt "
            f"{attempt + 2} of {1 + LAUNCH_RETRIES})\n"
        )
    return _outcome(plan, cmd, proc, sup, watch, token)


LAUNCH_RETRIES = 2
"""How many times a launcher that failed before starting any rank, with one of the known
transient messages (:func:`cudampi.mpiexec.launcher_never_started`), is started again."""


def _run_once(
    cmd: Command,
    env: Mapping[str, str],
    token: str,
    plan: LaunchPlan,
    report_dir: str | None,
    grace: float,
    timeout: float | None,
    start: float,
    out: IO[str],
    err: IO[str],
) -> tuple[subprocess.Popen[bytes], _Supervisor, _Watch]:
    """Start the launcher, pass its output through and supervise it until it has ended."""
    since = time.time() - 1.0  # file times come from a coarser clock than time.time()
    proc = _start(cmd, env, token)
    sup = _Supervisor(proc, plan.launcher.flavour, token, plan.remote_hosts)
    assert proc.stdout is not None and proc.stderr is not None
    readers = [
        threading.Thread(target=sup.pump, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=sup.pump, args=(proc.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    watch = _Watch(plan.nprocs, report_dir, grace, timeout, start, err=err)
    _supervise(proc, sup, watch)
    proc.wait()
    # Whatever the launcher left in its process group (a wrapper's children, a rank it lost
    # track of) goes with it. Its pid cannot have been reused while the group has members.
    sup.kill_group(signal.SIGKILL)
    sup.family.after_run(proc.returncode, since)
    for reader in readers:
        reader.join(timeout=10)
    return proc, sup, watch


def _never_started(proc: subprocess.Popen[bytes], sup: _Supervisor, w: _Watch, token: str) -> bool:
    """The launcher failed on its own, with a known transient message, before any rank ran (no
    rank's started line, no fault file), and nobody stopped it: starting it again is safe."""
    if sup.interrupts or w.timed_out or sup.stopped_for_fault:
        return False
    with sup.lock:
        text = "".join(sup.tail)
        said = parse_started(sup.report_lines, token)
    if said or _read_fault_files(w.report_dir):
        return False
    return launcher_never_started(proc.returncode, text)


def _start(cmd: Command, env: Mapping[str, str], token: str) -> subprocess.Popen[bytes]:
    """The launcher, in a session of its own that dies with this supervisor."""
    launcher_env = merge_env(env, cmd)
    launcher_env[TOKEN_ENV] = token
    try:
        return subprocess.Popen(
            list(cmd.argv),
            env=launcher_env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_supervisor(),  # only calls prctl (looked up before the fork)
        )
    except OSError as exc:
        raise LaunchError(f"could not start {cmd.argv[0]!r}: {exc}") from None


@dataclass
class _Watch:
    """What the supervision loop waits for, and what it saw."""

    nprocs: int
    report_dir: str | None
    grace: float
    timeout: float | None
    start: float
    timed_out: bool = False
    lingered: float | None = None
    """When every rank was seen ended while the launcher still ran."""
    finished: float | None = None
    """When every rank had said its script finished, while the launcher still ran."""
    stopped: str | None = None
    """Why the supervisor stopped a job whose ranks all finished: "lingered" (every rank's
    process had exited, the launcher had not) or "teardown" (a rank's process had not)."""
    exits: tuple[RankExit, ...] = ()
    """Where each finished rank was when the supervisor stopped the job."""
    err: IO[str] | None = None
    """Where the supervisor says, once, that the job waits for ranks in their own exit."""
    told: bool = False
    own_exit_seen: float | None = None
    """When a rank was last seen in its own exit (the teardown's grace counts from then)."""


def _supervise(proc: subprocess.Popen[bytes], sup: _Supervisor, w: _Watch) -> None:
    """Wait for the launcher; stop it on Ctrl-C, ``grace`` seconds after a fault or after every
    rank ended, or at the timeout."""
    in_main = threading.current_thread() is threading.main_thread()
    old_int = signal.signal(signal.SIGINT, sup.on_sigint) if in_main else None
    old_term = signal.signal(signal.SIGTERM, sup.on_sigint) if in_main else None
    parsed_at, checked_at = 0, 0.0
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if sup.interrupts:
                sup.stop()
                break
            if now - checked_at >= 0.5:
                checked_at = now
                # The launcher's own words about a failed rank or host start the grace too: a
                # rank that died in C (MPI_Init) reports nothing, and prterun may then hang.
                if sup.first_fault is None and sup.tail_seen != parsed_at:
                    parsed_at = sup.tail_seen
                    ev = sup.launcher_events()
                    if ev.ranks or ev.hosts or ev.problems:
                        sup.first_fault = now
                if w.lingered is None and _all_ranks_ended(w.report_dir, w.nprocs):
                    w.lingered = now
                if w.finished is None and len(sup.finished_at) >= w.nprocs:
                    w.finished = max(sup.finished_at.values())
                if _stuck_in_teardown(sup, w, now):
                    w.stopped = "teardown"
                    sup.stop()
                    break
            if sup.first_fault is not None and now - sup.first_fault > w.grace:
                sup.stopped_for_fault = True
                sup.stop()
                break
            if w.lingered is not None and now - w.lingered > w.grace:
                w.stopped = "lingered"
                w.exits = _rank_exits(sup, w, now)
                sup.stop()
                break
            if w.timeout is not None and now - w.start > w.timeout:
                w.timed_out = True
                sup.stop()
                break
            time.sleep(0.05)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)


def _rank_exits(sup: _Supervisor, w: _Watch, now: float) -> tuple[RankExit, ...]:
    """Where each rank that said its script finished is now (see :mod:`cudampi.launch.exits`)."""
    faults = _read_fault_files(w.report_dir)
    pids = local_rank_pids(faults)
    with sup.lock:
        finished = parse_marks(sup.report_lines, sup.token, "finished")
        exiting = set(parse_marks(sup.report_lines, sup.token, "exiting"))
        at = dict(sup.finished_at)
    out = []
    for rank, host in sorted(finished.items()):
        pid = pids.get(rank)
        state = process_state(pid) if pid is not None else None
        since = now - at.get(rank, now)
        out.append(RankExit(rank, stage_of(state, rank in exiting), since, pid, host))
    return tuple(out)


def _stuck_in_teardown(sup: _Supervisor, w: _Watch, now: float) -> bool:
    """Every rank said its script finished ``grace`` s ago, nothing failed, and some rank's
    process has still not exited (the launcher rightly waits for it: the rank is stuck in its
    exit). Records where each rank is. A rank still in its script's own exit handlers or
    threads is waited for (said once): they may be doing real work that stopping would lose;
    its teardown after them gets ``grace`` s from then."""
    if w.finished is None or w.lingered is not None or sup.first_fault is not None:
        return False
    if now - w.finished <= w.grace:
        return False
    exits = _rank_exits(sup, w, now)
    if not stuck(exits):
        return False  # they all exited just now: the launcher gets its own grace (lingered)
    if in_own_exit(exits):
        w.own_exit_seen = now
        if not w.told and w.err is not None:
            w.told = True
            w.err.write(f"cudampi launch: note: {waiting_note(exits, w.grace)}\n")
            w.err.flush()
        return False
    if w.own_exit_seen is not None and now - w.own_exit_seen <= w.grace:
        return False
    w.exits = exits
    return True


def _outcome(
    plan: LaunchPlan,
    cmd: Command,
    proc: subprocess.Popen[bytes],
    sup: _Supervisor,
    w: _Watch,
    token: str,
) -> JobResult:
    """The job's result from the ranks' reports, the launcher's words and how it ended."""
    faults = _read_fault_files(w.report_dir)
    _kill_leftovers(faults)
    with sup.lock:
        text = "".join(sup.tail)
        reports = parse_reports(sup.report_lines, token)
        said = parse_started(sup.report_lines, token)
        finished = parse_started(sup.report_lines, token, "finished")
    events = parse_launcher_output(text, plan.launcher.flavour, plan.remote_hosts)
    # Only a launcher the supervisor did stop lingered: one seen after its ranks had ended that
    # then exited on its own within the grace did not (the poll often lands in between).
    lingered_only = w.stopped is not None and not sup.stopped_for_fault and not w.timed_out
    # Every rank said its script finished well: the job succeeded, whatever the launcher did
    # after, and whatever a rank's exit did after (the summary says which it was).
    done_well = lingered_only and len(finished) >= plan.nprocs and not reports
    hung = lingered_only and not done_well and w.stopped == "lingered"
    launcher = plan.launcher.name or os.path.basename(plan.launcher.path)
    if done_well and w.stopped == "teardown":
        # The launcher's words about the ranks it then stopped are not the job's faults.
        events = dataclasses.replace(events, ranks=())
    if hung:
        events = dataclasses.replace(
            events,
            problems=(
                *events.problems,
                f"{launcher} had not exited {w.grace:g} s after every rank ended "
                "(a launcher that hangs once its ranks are gone): cudampi launch stopped it",
            ),
        )
    result = build_result(
        proc.returncode,
        reports,
        events,
        faults,
        interrupted=bool(sup.interrupts),
        stopped_by=sup.stopped_by,
        stopped_for_fault=sup.stopped_for_fault or hung,
        duration_s=time.monotonic() - w.start,
        argv=cmd.argv,
    )
    if hung and not [f for f in result.failures if f.exit_code or f.signal]:
        result = dataclasses.replace(result, exit_code=1)
    stopped = sup.interrupts or w.timed_out or sup.stopped_for_fault or w.stopped
    if proc.returncode < 0 and not stopped:
        crash = launcher_crash(plan.launcher.path, launcher, -proc.returncode, plan.remote_hosts)
        result = dataclasses.replace(result, problems=(crash, *result.problems))
    if done_well and not result.failures and not result.hosts:
        note = describe(w.exits, launcher, w.grace)
        result = dataclasses.replace(result, exit_code=0, problems=(*result.problems, note))
    if w.timed_out:
        real = tuple(f for f in result.failures if f.exit_code != 130)
        result = dataclasses.replace(result, exit_code=124, timed_out=w.timeout, failures=real)
    elif result.ok:
        why = _not_started(plan.nprocs, said, set(faults))
        if why is not None:
            result = dataclasses.replace(result, exit_code=1, problems=(*result.problems, why))
    return result
