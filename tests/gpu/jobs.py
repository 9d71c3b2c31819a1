"""Many checks in one MPI job, and commands side by side: how the GPU suite pays for process
start-up once.

Starting ranks on the GPU machine costs seconds each (importing torch and CuPy, a CUDA context
per rank, CuPy's kernel loads), so a GPU test file declares its checks (:class:`Check`: a
function run on every rank, its arguments, a rank count) and every selected check of one rank
count runs in one ``mpiexec`` job, in the file's order. Each check runs on its own duplicate of
``MPI.COMM_WORLD``; rank 0 prints a line as each starts and one as it ends::

    CHECK <name> START
    CHECK <name> PASS|FAIL|SKIP <seconds>s <detail>

A rank whose check raises prints its traceback to stderr and its own FAIL line at once. The
ranks then meet (a non-blocking barrier, CHECK_WAIT seconds at most): after a failure the job
goes on with its next check; a rank stuck in a call that a failed peer never made ends the job
(MPI_Abort), and the checks not reached fail saying so. Each check is one pytest test
(``test_check[<name>]``, made by :func:`params`); the ``gpu_jobs`` fixture (tests/gpu/conftest.py)
runs a job when the first of its checks is tested. Run a job's checks by hand with
``mpiexec -n N python -m tests.gpu.jobs tests.gpu.test_ipc_gpu NAME...``.

The session's deadline (CUDAMPI_TEST_DEADLINE, seconds since the epoch, which
``tools/gpu-session.sh verify`` sets) caps every job and command started here: a test it cuts
short is skipped as "time ran out", which tools/gpu-summary.py counts as not run.
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import importlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

TIME_RAN_OUT = "time ran out"
"""How the skip reason of a test cut short by the session's deadline begins."""

CHECK_WAIT = float(os.environ.get("CUDAMPI_TEST_CHECK_WAIT") or 60)
"""Seconds a rank that ended a check waits for the others before it ends the job."""

STOPS = "CUDAMPI_TEST_JOB_STOPS"
"""When the test side stops the job (seconds since the epoch), set in its ranks' environment."""
STACKS_BEFORE = 4.0
"""Seconds before the job's stop when its ranks print their stacks."""

NAME = re.compile(r"[\w.+-]+(\[[\w.+,-]+\])?")
LINE = re.compile(r"^CHECK (\S+) (START|PASS|FAIL|SKIP)(?: ([0-9.]+)s)?(?: (.*))?$")

UCX_RECIPE = ("LD_PRELOAD", "UCX_MODULE_DIR", "OMPI_MCA_pml", "CUDAMPI_CUDA_AWARE")
"""The CUDA-aware UCX recipe a session may have exported (tools/gpu-session.sh does): the
system Open MPI "as shipped" and the doctor's own recipe run without it."""


class Skip(Exception):
    """Raised by a check, on every rank alike, that cannot run here: the reason is reported."""


@dataclasses.dataclass(frozen=True)
class Check:
    """One check of a GPU test file: ``func(comm, *args)`` on every rank of a ``ranks``-rank
    job (``comm`` a duplicate of COMM_WORLD), returning a detail to report (or None)."""

    name: str
    """Unique in its file: the old test's name and parameters, e.g. ``p2p_faults[size]``."""
    func: Callable[..., Any]
    args: tuple[Any, ...] = ()
    ranks: int = 2
    env: tuple[tuple[str, str], ...] = ()
    """Set in the ranks' environment while the check runs (CUDAMPI_PATH=ipc, ...)."""
    skip: str | None = None
    """Why it cannot run here, known without starting a job (no job starts for it)."""
    stack: str = "this"
    """``this``: the test's interpreter and its MPI; ``system``: the system Open MPI through
    CUDAMPI_TEST_SYSTEM_PYTHON, without the UCX recipe (:func:`system_env`)."""
    timeout: float = 300.0
    """Seconds it may take: past them its ranks print their stacks and end the job (a job may
    take the sum over its checks, plus start-up)."""

    def __post_init__(self) -> None:
        if not NAME.fullmatch(self.name):
            raise ValueError(f"check name {self.name!r}: letters, digits, _.+- and one [...]")
        if self.stack not in ("this", "system"):
            raise ValueError(f"check {self.name}: stack {self.stack!r} is not this or system")

    @property
    def job(self) -> tuple[int, str]:
        return (self.ranks, self.stack)


def params(checks: Iterable[Check]) -> list[Any]:
    """``checks`` as pytest parameters named by the checks, skipped where ``skip`` says."""
    import pytest

    out, seen = [], set()
    for c in checks:
        if c.name in seen:
            raise ValueError(f"two checks are named {c.name!r}")
        seen.add(c.name)
        marks = [pytest.mark.skip(reason=c.skip)] if c.skip else []
        out.append(pytest.param(c, id=c.name, marks=marks))
    return out


# ----------------------------------------------------------------------------- the ranks' side


def main(argv: Sequence[str]) -> int:
    """A job's ranks: import the test module, run the named checks of its ``checks()``."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    module, *names = argv
    try:
        table = {c.name: c for c in importlib.import_module(module).checks()}
        run_checks(comm, [table.get(n, n) for n in names])
    except BaseException:
        from tests._rank_main import abort_job

        return abort_job(comm, "outside a check")
    return 0


def _say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def _one_line(text: str, limit: int = 1500) -> str:
    text = " | ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def run_checks(comm: Any, checks: Sequence[Check | str]) -> None:
    """Run ``checks`` in order (a name: a check the module does not have, which fails) and
    report each on rank 0; the ranks meet after each."""
    for check in checks:
        name = check if isinstance(check, str) else check.name
        if comm.rank == 0:
            _say(f"CHECK {name} START")
        t0 = time.monotonic()
        if isinstance(check, str):
            status, detail, sub = "FAIL", f"no check named {name!r} in this file's checks()", None
        else:
            status, detail, sub = _run_one(comm, check)
        secs = time.monotonic() - t0
        if status == "FAIL":
            _say(f"CHECK {name} FAIL {secs:.1f}s rank {comm.rank}: {_one_line(detail)}")
        _meet(comm, name)
        everyone = comm.allgather((status, _one_line(detail), secs))
        statuses = {s for s, _, _ in everyone}
        if statuses == {"PASS"} or statuses == {"SKIP"}:
            if sub is not None:
                sub.Free()
            status, detail = everyone[0][0], everyone[0][1]
        elif "FAIL" in statuses:
            status = "FAIL"
            detail = "; ".join(
                f"rank {r}: {d}" for r, (s, d, _) in enumerate(everyone) if s == "FAIL"
            )
        else:
            status = "FAIL"
            detail = "skipped on some ranks only: " + ", ".join(
                f"rank {r} {s}" for r, (s, _, _) in enumerate(everyone)
            )
        if comm.rank == 0:
            _say(f"CHECK {name} {status} {max(t for _, _, t in everyone):.1f}s {detail}".rstrip())


@contextlib.contextmanager
def _environ(pairs: Sequence[tuple[str, str]]) -> Iterator[None]:
    saved = {k: os.environ.get(k) for k, _ in pairs}
    os.environ.update(dict(pairs))
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _watch(check: Check | None) -> None:
    """Each rank prints where its threads are a few seconds before the test side stops the job
    (Jobs.timeline shows it under the check that was running), and ends the job with them
    where ``check`` outlasts its own timeout first (the checks after it do not run)."""
    stops = os.environ.get(STOPS)
    job_left = float(stops) - time.time() - STACKS_BEFORE if stops else None
    if check is not None and (job_left is None or check.timeout < job_left):
        faulthandler.dump_traceback_later(check.timeout, exit=True)
    elif job_left is not None:
        faulthandler.dump_traceback_later(max(1.0, job_left))
    else:
        faulthandler.cancel_dump_traceback_later()


def _run_one(comm: Any, check: Check) -> tuple[str, str, Any]:
    """(status, detail, the duplicate communicator) of one check on this rank."""
    sub = comm.Dup()
    _watch(check)
    try:
        with _environ(check.env):
            detail = check.func(sub, *check.args)
        return "PASS", "" if detail is None else str(detail), sub
    except Skip as exc:
        return "SKIP", str(exc), sub
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # a failed check is reported; the job goes on to the next
        import pytest

        if isinstance(exc, pytest.skip.Exception):  # pytest.skip in code shared with pytest
            return "SKIP", str(exc.msg), sub
        sys.stderr.write(f"--- rank {comm.rank} of {comm.size} failed in check {check.name}:\n")
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        return "FAIL", f"{type(exc).__name__}: {exc}", sub
    finally:
        _watch(None)
        _drop_torch_groups()


def _drop_torch_groups() -> None:
    """Destroy the torch process groups a check left (one that failed halfway through): the next
    check's init_process_group would otherwise fail with "trying to initialize the default
    process group twice", and every check after a failed torch check with it."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group()
    except Exception as exc:  # a group broken by the failure: the next check says if it matters
        sys.stderr.write(f"jobs: destroying the torch process groups a check left: {exc}\n")


def _meet(comm: Any, name: str) -> None:
    """Wait for every rank to end the check; a rank still inside it after CHECK_WAIT seconds
    is taken for stuck (in a call a failed rank never made): end the job."""
    req = comm.Ibarrier()
    deadline = time.monotonic() + CHECK_WAIT
    while not req.Test():
        if time.monotonic() > deadline:
            _say(
                f"CHECK {name} FAIL {CHECK_WAIT:.0f}s rank {comm.rank}: another rank did not end "
                f"this check within {CHECK_WAIT:.0f} s of this one (stuck in a call a failed rank "
                "never made?): ending the job"
            )
            comm.Abort(1)
        time.sleep(0.005)


# ----------------------------------------------------------------------------- the test side


def parse_checks(stdout: str) -> tuple[dict[str, tuple[str, float, str]], list[str]]:
    """The job's CHECK lines: each reported check's (status, seconds, detail), a FAIL line of
    any rank winning (the details of every rank's FAIL lines, each once), and the checks that
    started, in order."""
    ended: dict[str, tuple[str, float, str]] = {}
    fails: dict[str, list[str]] = {}
    started: list[str] = []
    for raw in stdout.splitlines():
        m = LINE.match(raw.strip())
        if not m:
            continue
        name, status, secs, detail = m[1], m[2], float(m[3] or 0), m[4] or ""
        if status == "START":
            started.append(name)
        elif status == "FAIL":
            fails.setdefault(name, [])
            if not any(detail in d for d in fails[name]):
                fails[name] = [d for d in fails[name] if d not in detail] + [detail]
            before = ended.get(name)
            secs = max(secs, before[1]) if before and before[0] == "FAIL" else secs
            ended[name] = (status, secs, " || ".join(fails[name]))
        elif name not in ended:
            ended[name] = (status, secs, detail)
    return ended, started


MIN_LEFT = 10.0
"""A test starts only with this many seconds left before the session's deadline."""

_RAN: set[tuple[str, tuple[int, str]]] = set()
"""(module, job) of each job this session ran (:class:`Jobs`)."""


def deadline_skip(module: str, check: Any) -> str | None:
    """Why a test (of ``check``, a GPU file's check; anything else for a plain test) of
    ``module`` must not start: the session's deadline is less than MIN_LEFT away. None where
    it may, and for a check whose job already ran: that test only reports what its job
    reported, however late (the checks a job ended before the deadline stopped it passed or
    failed; only those it never reached ran out of time)."""
    left = deadline_left()
    if left is None or left >= MIN_LEFT:
        return None
    if isinstance(check, Check) and (module, check.job) in _RAN:
        return None
    return (
        f"{TIME_RAN_OUT}: {max(0.0, left):.0f} s were left before the session's deadline "
        "(CUDAMPI_TEST_DEADLINE)"
    )


def deadline_left() -> float | None:
    """Seconds to the session's deadline (CUDAMPI_TEST_DEADLINE), None without one."""
    raw = os.environ.get("CUDAMPI_TEST_DEADLINE")
    return float(raw) - time.time() if raw else None


def time_left(limit: float) -> float:
    """``limit``, or fewer seconds where the session's deadline comes first (at least 1)."""
    left = deadline_left()
    return limit if left is None else max(1.0, min(limit, left))


def time_sliced(ranks: int) -> bool:
    """Whether ``ranks`` ranks of one job on this machine time-slice a GPU: more ranks than
    GPUs and no MPS daemon. Their kernels then never run side by side: an ipc kernel that waits
    for its peers' holds the GPU until its slice ends, a slice per step of every call, where
    with MPS (or a GPU per rank) the step takes microseconds."""
    from cudampi.probe.gpu import driver_gpus, mps_active

    return not mps_active() and len(driver_gpus() or ()) < ranks


def without_recipe(env: Mapping[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in UCX_RECIPE}


def system_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` for the system Open MPI stack as shipped: no UCX recipe, and not the wheels'
    bin folder (their mpirun) on PATH."""
    out = without_recipe(env)
    wheels = os.environ.get("CUDAMPI_TEST_WHEEL_PYTHON")
    if wheels:
        drop = str(Path(wheels).parent)
        out["PATH"] = os.pathsep.join(p for p in out.get("PATH", "").split(os.pathsep) if p != drop)
    return out


def system_python() -> str | None:
    return os.environ.get("CUDAMPI_TEST_SYSTEM_PYTHON")


def system_stack_skip() -> str | None:
    """Why the system-stack checks cannot run here (None: they can)."""
    python = system_python()
    if not python:
        return (
            "set CUDAMPI_TEST_SYSTEM_PYTHON to the interpreter whose mpi4py loads the system Open "
            "MPI (tools/gpu-session.sh verify does)"
        )
    if not Path(python).exists():
        return f"CUDAMPI_TEST_SYSTEM_PYTHON={python!r} does not exist"
    if Path(python).absolute() == Path(sys.executable).absolute():
        return "CUDAMPI_TEST_SYSTEM_PYTHON is this interpreter: its checks ran on this stack"
    return None


@dataclasses.dataclass(frozen=True)
class Ran:
    """A finished (or stopped) command: what subprocess.run returns, and how it ended."""

    argv: list[str]
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    timed_out: bool
    """Stopped at its limit."""
    deadline: bool
    """... and the limit was the session's deadline, not the command's own."""

    def tail(self, n: int = 6000) -> str:
        return f"exit {self.returncode}\nstdout:\n{self.stdout[-n:]}\nstderr:\n{self.stderr[-n:]}"


class Started:
    """A command running in a process session of its own, its output going to files (nothing
    waits on a full pipe); past its limit SIGTERM goes to its process group (mpiexec passes it
    on to the ranks), then SIGKILL."""

    def __init__(self, argv: Sequence[str], *, env: Mapping[str, str], cwd: Path, timeout: float):
        self.argv = [str(a) for a in argv]
        self.limit = time_left(timeout)
        self.deadline = self.limit < timeout
        # the command's output: files that outlive this call, closed once read in wait()
        self._files = contextlib.ExitStack()
        self._out = self._files.enter_context(tempfile.TemporaryFile("w+", errors="replace"))  # noqa: SIM115
        self._err = self._files.enter_context(tempfile.TemporaryFile("w+", errors="replace"))  # noqa: SIM115
        self._t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.argv,
            stdout=self._out,
            stderr=self._err,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )

    def wait(self) -> Ran:
        timed_out = False
        try:
            self.proc.wait(timeout=max(0.1, self.limit - (time.monotonic() - self._t0)))
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            if self.proc.poll() is None:
                self.stop()
        with self._files:
            self._out.seek(0)
            self._err.seek(0)
            out, err = self._out.read(), self._err.read()
        return Ran(
            self.argv,
            self.proc.returncode,
            out,
            err,
            time.monotonic() - self._t0,
            timed_out,
            timed_out and self.deadline,
        )

    def stop(self) -> None:
        """SIGTERM to the command (mpiexec ends its ranks, which it puts in process groups of
        their own), then SIGKILL to whatever is left of its session."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        for pid in session_pids(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait()


def session_pids(sid: int) -> list[int]:
    """The processes of session ``sid`` still running (not zombies)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
        if int(fields[3]) == sid and fields[0] not in ("Z", "X"):
            out.append(int(entry))
    return out


def run(argv: Sequence[str], *, env: Mapping[str, str], timeout: float, cwd: Path = ROOT) -> Ran:
    return Started(argv, env=env, cwd=cwd, timeout=timeout).wait()


class Background:
    """Commands started together, each awaited by the test that checks it: for a file whose
    tests each run a command that leaves the GPU mostly idle (the doctor, a launcher), the file
    takes as long as its longest command instead of their sum."""

    def __init__(self) -> None:
        self._started: dict[str, Started] = {}
        self._done: dict[str, Ran] = {}
        self._skipped: dict[str, str] = {}

    def start(
        self,
        key: str,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        timeout: float,
        cwd: Path = ROOT,
    ) -> None:
        self._started[key] = Started(argv, env=env, cwd=cwd, timeout=timeout)

    def skip(self, key: str, reason: str) -> None:
        """``key``'s test skips with ``reason`` (found while starting the commands)."""
        self._skipped[key] = reason

    def result(self, key: str) -> Ran:
        """``key``'s finished command (skipping the test where it was skipped or cut short by the
        session's deadline)."""
        import pytest

        if key in self._skipped:
            pytest.skip(self._skipped[key])
        if key not in self._done:
            if key not in self._started:
                raise AssertionError(f"no command {key!r} was started for this test")
            self._done[key] = self._started[key].wait()
        ran = self._done[key]
        if ran.deadline:
            pytest.skip(f"{TIME_RAN_OUT}: {' '.join(ran.argv)[:300]} stopped at the deadline")
        if ran.timed_out:
            raise AssertionError(
                f"hung for {ran.seconds:.0f} s: {' '.join(ran.argv)}\n{ran.tail()}"
            )
        return ran

    def close(self) -> None:
        for key, started in self._started.items():
            if key not in self._done and started.proc.poll() is None:
                started.stop()


def selected_params(request: Any, fixture: str) -> list[dict[str, Any]]:
    """The parameters of each test of ``request``'s module the session runs that uses
    ``fixture`` (an empty dict for a test without parameters), in order."""
    out = []
    for item in request.session.items:
        if getattr(item, "module", None) is request.module and fixture in item.fixturenames:
            callspec = getattr(item, "callspec", None)
            out.append({"test": item.originalname, **(callspec.params if callspec else {})})
    return out


class Jobs:
    """The jobs of one test file: each runs when the first of its checks is tested, with every
    check of its rank count and stack that the session runs."""

    def __init__(self, module: str, selected: Sequence[Check]) -> None:
        self.module = module
        self.selected = [c for c in selected if c.skip is None]
        self.reports: dict[
            tuple[int, str], tuple[Ran, dict[str, tuple[str, float, str]], list[str]]
        ] = {}

    def verify(self, check: Check) -> None:
        """Pass, skip or fail ``check`` as its job reported it."""
        import pytest

        if check.job not in self.reports:
            try:
                ran = self._run(check.job)
            except BaseException as exc:  # (pytest-timeout): the job's other checks say so
                self.reports[check.job] = (_interrupted(exc), {}, [])
                raise
            self.reports[check.job] = (ran, *parse_checks(ran.stdout))
            _RAN.add((self.module, check.job))
            print(self.timeline(check.job))
        ran, ended, started = self.reports[check.job]
        where = f"{check.ranks}-rank job ({check.stack} stack)"
        if check.name in ended:
            status, secs, detail = ended[check.name]
            if status == "PASS":
                print(
                    f"{check.name}: {detail} ({secs:.1f} s in the {where} of {ran.seconds:.0f} s)"
                )
                return
            if status == "SKIP":
                pytest.skip(detail)
            pytest.fail(
                f"{check.name} failed ({secs:.1f} s) in the {where}: {detail}\n\n"
                f"{_tracebacks(ran.stderr, check.name)}",
                pytrace=False,
            )
        running = started[-1] if started else None
        during = (
            "while it ran"
            if running == check.name
            else (f"before it ran (during {running})" if running else "before any check ran")
        )
        if ran.deadline:
            pytest.skip(
                f"{TIME_RAN_OUT}: the {where} was stopped at the session's deadline {during}"
            )
        how = f"hung ({ran.seconds:.0f} s)" if ran.timed_out else f"ended (exit {ran.returncode})"
        pytest.fail(f"{check.name}: the {where} {how} {during}\n{ran.tail()}", pytrace=False)

    def timeline(self, job: tuple[int, str]) -> str:
        """Each check of a job that ran, in order, with its status and seconds, and the one
        it was in when it ended otherwise (which check a slow or stopped job spent its time on:
        the checks after it report only that they did not run)."""
        ran, ended, started = self.reports[job]
        how = f"exit {ran.returncode}"
        if ran.deadline:
            how = "stopped at the session's deadline"
        elif ran.timed_out:
            how = f"stopped after its {ran.seconds:.0f} s (hung)"
        lines = [f"the {job[0]}-rank job ({job[1]} stack): {ran.seconds:.0f} s, {how}"]
        for name in started:
            if name in ended:
                status, secs, _ = ended[name]
                lines.append(f"  {name} {status} {secs:.1f} s")
            else:
                lines.append(f"  {name} RUNNING when the job ended")
                lines += [f"    {ln}" for ln in _stacks(ran.stderr).splitlines()]
        return "\n".join(lines)

    def _run(self, job: tuple[int, str]) -> Ran:
        from cudampi.mpiexec import launcher_never_started
        from tests.mpirun import mpi_env, mpiexec_argv

        ranks, stack = job
        mine = [c for c in self.selected if c.job == job]
        env, python, launcher = mpi_env(), sys.executable, None
        if stack == "system":
            env, python = system_env(env), system_python() or sys.executable
            launcher = shutil.which("mpiexec", path=env.get("PATH")) or "mpiexec"
        argv = [*mpiexec_argv(ranks, launcher), python, "-m", "tests.gpu.jobs", self.module]
        argv += [c.name for c in mine]
        timeout = 60 + sum(c.timeout for c in mine)
        for attempt in range(3):
            env[STOPS] = str(time.time() + time_left(timeout))
            ran = run(argv, env=env, timeout=timeout)
            if "CHECK " in ran.stdout or not launcher_never_started(ran.returncode, ran.stderr):
                break
            sys.stderr.write(f"jobs: the launcher failed to start (attempt {attempt + 1}), again\n")
        return ran


def _interrupted(exc: BaseException) -> Ran:
    return Ran(
        [], None, "", f"the job was interrupted: {type(exc).__name__}: {exc}", 0, False, False
    )


STACK = re.compile(r"(?m)^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$")


def _stacks(stderr: str, limit: int = 6000) -> str:
    """Where the ranks' threads were just before the job was stopped (what faulthandler
    printed), the last ``limit`` characters."""
    first = STACK.search(stderr)
    return stderr[first.start() :][-limit:] if first else "(no rank printed its stack)"


def _tracebacks(stderr: str, name: str) -> str:
    """The tracebacks the ranks printed for check ``name``."""
    blocks = re.split(r"(?m)^(?=--- rank )", stderr)
    mine = [
        b
        for b in blocks
        if b.startswith("--- rank ") and f" in check {name}:" in b.split("\n", 1)[0]
    ]
    return "\n".join(b[-4000:] for b in mine) or "(no traceback on stderr)"


if __name__ == "__main__":
    from tests.gpu.jobs import main as _main  # the package's module, whose Skip the checks raise

    sys.exit(_main(sys.argv[1:]))
