"""Run a plan: start the launcher, pass its output through, supervise, summarize faults.

The launcher runs in its own session (so a Ctrl-C reaches only the supervisor, which then stops
the job in order: the launcher's own interrupt, then SIGTERM, then SIGKILL of its process group).
Its stderr passes through line by line while the ranks' tagged fault reports are collected; a
reported fault gives the launcher ``grace`` seconds to end the job itself (Open MPI does at once;
Hydra waits for the other ranks) before the supervisor ends it. Rank processes left on this host
afterwards (their launcher killed with -9) are killed from their fault-file pids.
"""

from __future__ import annotations

import codecs
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import IO

from cudampi.errors import LaunchError
from cudampi.launch.faults import JobResult, build_result, parse_launcher_output
from cudampi.launch.plan import Command, LaunchPlan, build_command, merge_env
from cudampi.launch.report import TAG, is_report_line, parse_reports

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
                if not _may_be_report(self.line):
                    self._write(self.line[self.flushed :])
                    self.flushed = len(self.line)
                return
            line, text = self.line + text[: nl + 1], text[nl + 1 :]
            if is_report_line(line) and self.flushed == 0:
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


_PREFIX = f"[{TAG} "


def _may_be_report(partial: str) -> bool:
    return partial.startswith(_PREFIX) or _PREFIX.startswith(partial)


class _Supervisor:
    def __init__(self, proc: subprocess.Popen[bytes], flavour: str) -> None:
        self.proc = proc
        self.flavour = flavour
        self.tail: deque[str] = deque(maxlen=400)
        self.report_lines: list[str] = []
        self.first_fault: float | None = None
        self.stopped_for_fault = False
        self.interrupts = 0
        self.lock = threading.Lock()

    def add_report(self, line: str) -> None:
        with self.lock:
            self.report_lines.append(line)
            if self.first_fault is None:
                self.first_fault = time.monotonic()

    def add_tail(self, line: str) -> None:
        with self.lock:
            self.tail.append(line)

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
        self.send(signal.SIGINT)
        if self.flavour == "slurm":
            time.sleep(0.2)
            self.send(signal.SIGINT)  # srun: a second Ctrl-C within 1 s kills the step
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


def _kill_leftovers(fault_files: Mapping[int, str]) -> list[int]:
    """SIGKILL rank processes of this job still alive on this host (orphans); their pids."""
    import socket

    here = socket.gethostname()
    killed = []
    for text in fault_files.values():
        first = text.splitlines()[0] if text else ""
        fields = dict(w.split("=", 1) for w in first.split() if "=" in w)
        if fields.get("host") != here or not fields.get("pid", "").isdigit():
            continue
        pid = int(fields["pid"])
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"cudampi.launch.rank" in cmdline:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


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
    cmd = command_for(plan, workdir)
    write_hostfile(cmd)
    report_dir = dict(plan.env).get("CUDAMPI_REPORT_DIR")
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
    start = time.monotonic()
    try:
        proc = subprocess.Popen(
            list(cmd.argv),
            env=merge_env(os.environ if env is None else env, cmd),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        raise LaunchError(f"could not start {cmd.argv[0]!r}: {exc}") from None
    sup = _Supervisor(proc, plan.launcher.flavour)
    assert proc.stdout is not None and proc.stderr is not None
    readers = [
        threading.Thread(target=sup.pump, args=(proc.stdout, out), daemon=True),
        threading.Thread(target=sup.pump, args=(proc.stderr, err), daemon=True),
    ]
    for reader in readers:
        reader.start()
    in_main = threading.current_thread() is threading.main_thread()
    old_int = signal.signal(signal.SIGINT, sup.on_sigint) if in_main else None
    old_term = signal.signal(signal.SIGTERM, sup.on_sigint) if in_main else None
    timed_out = False
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if sup.interrupts:
                sup.stop()
                break
            if sup.first_fault is not None and now - sup.first_fault > grace:
                sup.stopped_for_fault = True
                sup.stop()
                break
            if timeout is not None and now - start > timeout:
                timed_out = True
                sup.stop()
                break
            time.sleep(0.05)
    finally:
        if in_main:
            signal.signal(signal.SIGINT, old_int)
            signal.signal(signal.SIGTERM, old_term)
    proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    faults = _read_fault_files(report_dir)
    _kill_leftovers(faults)
    with sup.lock:
        text = "".join(sup.tail)
        reports = parse_reports(sup.report_lines)
    events = parse_launcher_output(text, plan.launcher.flavour)
    result = build_result(
        proc.returncode,
        reports,
        events,
        faults,
        interrupted=bool(sup.interrupts),
        stopped_for_fault=sup.stopped_for_fault,
        duration_s=time.monotonic() - start,
        argv=cmd.argv,
    )
    if timed_out:
        from dataclasses import replace

        real = tuple(f for f in result.failures if f.exit_code != 130)
        result = replace(result, exit_code=124, timed_out=timeout, failures=real)
    return result
