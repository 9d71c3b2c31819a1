"""Running ``cudampi launch`` for the job doctor and reading what it said (its summary of a
failed job, the MPI's own error line, the hosts it could not reach, the ranks' marker lines).

Every job of the doctor goes through here: ``python -m cudampi launch`` as a program (the doctor
and launch do not import each other), with ``--timeout``, stopped as Ctrl-C would stop it when a
node does not say it is there in time. Nothing here spells an mpiexec argv.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.doctor.node import HELLO
from cudampi.probe.runtime import launch_env

LAUNCH = (sys.executable, "-m", "cudampi", "launch")


@dataclass(frozen=True)
class Launched:
    """One ``cudampi launch`` run: its marker lines, how it ended and its message."""

    lines: tuple[str, ...]
    returncode: int | None
    message: str
    """The launcher's message (``cudampi launch``'s summary), one line; "" when it succeeded."""
    stderr: str
    wall_s: float
    timed_out: bool = False
    unanswered: tuple[str, ...] = ()
    """Nodes that did not say they were there in time (the job was stopped)."""


def summary_message(stderr: str) -> str:
    """``cudampi launch``'s summary of a failed job on one line (its head, each fault and the
    first line of each fault's error), with the MPI's own error where the summary has none; else
    the last line of stderr."""
    stderr = stderr.replace("\x00", "")  # Open MPI writes NUL bytes among its lines
    lines = stderr.splitlines()
    start = None
    for i, line in enumerate(lines):
        text = line.strip()
        if text.startswith("cudampi launch: ") and not text.startswith("cudampi launch: note"):
            start = i
    if start is None:
        tail = [ln.strip() for ln in lines if ln.strip()]
        return tail[-1] if tail else ""
    parts = [lines[start].strip().removeprefix("cudampi launch: ")]
    quoted = False
    for line in lines[start + 1 :]:
        text = line.strip()
        if text.startswith("- "):
            parts.append(text[2:])
            quoted = False
        elif text.startswith("| ") and not quoted:
            parts[-1] += f" ({text[2:]})"
            quoted = True
    said = mpi_error(stderr[: stderr.rfind(lines[start])] if lines[start] else stderr)
    if said and not any(said in p for p in parts):
        parts.append(f"the MPI said: {said}")
    return "; ".join(parts)


_ERROR_WORDS = ("Fatal error", "Aborting", "failed", "refused", "not found", "No route")


def mpi_error(text: str) -> str:
    """The line of an MPI's (or a launcher's) own output that says what went wrong: the last
    frame of an MPICH error stack, an Open MPI help message's error line, or the first line
    with an error word. "" when there is none."""
    lines = [ln.strip() for ln in text.splitlines()]
    for i, line in enumerate(lines):
        if line.endswith("error stack:"):
            stack = []
            for frame in lines[i + 1 :]:
                if not frame or frame.startswith(("-----", "[")):
                    break
                stack.append(frame)
            if stack:
                return stack[-1].split(":", 1)[-1].strip() or stack[-1]
    for i, line in enumerate(lines):
        if line.startswith("Error:") and i > 0 and lines[i - 1].startswith("Message:"):
            return f"{lines[i - 1].removeprefix('Message:').strip()}: {line[6:].strip()}"
    for line in lines:
        if any(w in line for w in _ERROR_WORDS) and not line.startswith(("cudampi", "- ")):
            return line[:200]
    return ""


def launch(
    args: Sequence[str],
    *,
    timeout: float,
    hello_from: Sequence[str] = (),
    hello_timeout: float | None = None,
    on_line: Callable[[str], None] | None = None,
) -> Launched:
    """Run ``cudampi launch ARGS`` with ``--timeout``; stop it when the nodes of ``hello_from``
    have not all printed a :data:`HELLO` line within ``hello_timeout`` s. Never waits longer
    than ``timeout`` plus the launcher's own stopping time."""
    argv = [*LAUNCH, "--timeout", f"{timeout:g}", *args]
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=launch_env(),
        start_new_session=True,
    )
    lines: list[str] = []
    said: set[str] = set()
    err: list[str] = []

    def read_out() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            line = line.rstrip("\n")
            if line.startswith(HELLO):
                try:
                    said.add(str(json.loads(line[len(HELLO) :]).get("name")))
                except ValueError:
                    pass
            if line.startswith(("CUDAMPI_", HELLO)):
                lines.append(line)
                if on_line is not None:
                    on_line(line)

    def read_err() -> None:
        assert proc.stderr is not None
        err.extend(proc.stderr)

    readers = [threading.Thread(target=f, daemon=True) for f in (read_out, read_err)]
    for r in readers:
        r.start()
    unanswered: tuple[str, ...] = ()
    hard = timeout + 15.0  # cudampi launch stops its job at --timeout; this is its last chance
    while proc.poll() is None:
        now = time.monotonic() - t0
        if hello_timeout is not None and now > hello_timeout and hello_from:
            missing = tuple(n for n in hello_from if n not in said)
            if missing:
                unanswered = missing
                _stop(proc)
                break
        if now > hard:
            _stop(proc)
            break
        time.sleep(0.05)
    proc.wait()
    for r in readers:
        r.join(timeout=5)
    stderr = "".join(err)
    wall = time.monotonic() - t0
    timed_out = proc.returncode == 124 or wall > hard or bool(unanswered)
    message = ""
    if proc.returncode != 0:
        message = summary_message(stderr)
        if unanswered:
            message = f"no answer from {', '.join(unanswered)} in {hello_timeout:g} s" + (
                f"; {message}" if message else ""
            )
    return Launched(tuple(lines), proc.returncode, message, stderr, wall, timed_out, unanswered)


def _stop(proc: subprocess.Popen[str]) -> None:
    """Stop ``cudampi launch`` as Ctrl-C does (it stops its job in order), then kill its group."""
    try:
        os.killpg(proc.pid, signal.SIGINT)
        proc.wait(timeout=8)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


_HOST_GONE = re.compile(r"host '?([^\s']+)'? (?:cannot be reached|was lost during the run)")


def unreachable(message: str) -> set[str]:
    """The hosts ``cudampi launch``'s summary says it could not reach or lost."""
    return set(_HOST_GONE.findall(message))


def markers(lines: Sequence[str], prefix: str) -> list[dict[str, Any]]:
    out = []
    for line in lines:
        if line.startswith(prefix):
            try:
                data = json.loads(line[len(prefix) :])
            except ValueError:
                continue
            if isinstance(data, dict):
                out.append(data)
    return out
