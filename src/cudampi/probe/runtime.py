"""The runtime probe: really move host and device buffers between ranks, each test in its own
``mpiexec`` child, and turn whatever happens (correct data, wrong data, a segfault, a clean MPI
error, a hang) into a :class:`~cudampi.probe.capabilities.ProbeOutcome` with a diagnosis.

Pure parts: :func:`parse_probe_failure` (stderr -> where it crashed), :func:`classify`,
:func:`mpiexec_argv` and :func:`ranks_env`. Thin I/O: :func:`run_test` and :func:`run_probes`.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudampi.config import PROBE_TIMEOUT
from cudampi.mpiexec import ROOT_ENV, Mpiexec, launcher_never_started
from cudampi.names import OPEN_MPI
from cudampi.probe.capabilities import ProbeOutcome
from cudampi.probe.worker import MARKER, STAGE

HOST_TESTS = ("host_p2p", "host_allreduce")
DEVICE_TESTS = ("device_p2p", "device_allreduce", "host_staged", "device_ipc", "device_nccl")

LAUNCHER_ENV_PREFIXES = (
    "PMIX_",
    "PMI_",
    "OMPI_COMM_WORLD_",
    "OMPI_UNIVERSE_SIZE",
    "OMPI_FILE_LOCATION",
    "OMPI_APP_CTX",
    "OMPI_FIRST_RANKS",
    "OMPI_NUM_APP_CTX",
    "OMPI_MCA_orte_",
    "OMPI_MCA_ess",
    "OMPI_MCA_pmix",
    "OMPI_MCA_initial_wdir",
    "OMPI_MCA_num_procs",
    "OMPI_MCA_cpu_type",
    "OMPI_MCA_PREFIXES",
    "PRTE_",
    "MPI_LOCALRANKID",
    "MPI_LOCALNRANKS",
    "HYDRA_",
    "MPIR_CVAR_CH3",
)
"""Variables a launcher sets for its own ranks: the doctor may itself run inside a job, and its
child mpiexec must start a fresh job, not join (or confuse) that one."""


@dataclass(frozen=True)
class ProbeFailure:
    """What a failed probe's output says happened."""

    kind: str
    """segfault, signal, pml-unavailable, mpi-error, python-error, launch-error or unknown."""
    signal: str | None = None
    where: str | None = None
    """The MPI component at the top of the native backtrace: ``btl vader``, ``btl sm``,
    ``coll base allreduce``, ``pml ob1``, ``UCX``; or the MPI error's origin."""
    call: str | None = None
    """The MPI call that was running: ``MPI_Send``, ``MPI_Allreduce``..."""
    message: str = ""

    @property
    def summary(self) -> str:
        if self.kind in ("segfault", "signal"):
            what = "segfaults" if self.kind == "segfault" else f"is killed by {self.signal}"
            call = self.call or "the MPI call"
            return f"{call} {what}" + (f" in {self.where}" if self.where else "")
        if self.kind == "pml-unavailable":
            return f"no usable PML: {self.message}"
        if self.kind in ("mpi-error", "python-error"):
            call = f"{self.call}: " if self.call else ""
            return f"{call}{self.message}"
        return self.message or self.kind


_FRAME = re.compile(
    r"(?:\[\s*\d+\]\s+|^\s*\d+\s+(?=/))(?P<lib>[^\s(\[]+)\((?P<sym>[^)+]*)\+0x[0-9a-fA-F]+\)", re.M
)
"""A native frame: Open MPI's ``[ 2] /path/lib.so(sym+0x1f)[0x..]`` or UCX's
``  2  /path/lib.so(sym+0x1f) [0x..]``."""
_UCX_SIGNAL = re.compile(r"Caught signal (\d+) \(([^:)]+)")
_SIGNAL = re.compile(r"Signal:\s*([A-Za-z][\w ]*?)\s*\((\d+)\)")
_EXITED_ON = re.compile(r"exited on\s+signal\s+(\d+)\s*\(([^)]+)\)", re.S)
_HYDRA_EXIT = re.compile(r"EXIT CODE:\s*(\d+)")
_HYDRA_STRING = re.compile(r"EXIT STRING:\s*([A-Za-z][\w ]*?)\s*\(signal (\d+)\)")
_PY_FATAL = re.compile(r"Fatal Python error:\s*(\w[\w ]*)")


def _frame_label(lib: str, sym: str) -> tuple[int, str] | None:
    """(priority, label) of one native frame; lower priority wins (btl > coll > pml > UCX)."""
    base = Path(lib).name
    if m := re.match(r"mca_(btl|coll|pml|osc|mtl|smsc)_(\w+?)\.so", base):
        fw, comp = m.groups()
        return ({"btl": 0, "smsc": 0, "coll": 1, "pml": 2}.get(fw, 3), f"{fw} {comp}")
    if m := re.match(r"mca_(btl|smsc)_([a-z0-9]+)_", sym):
        return (0, f"{m.group(1)} {m.group(2)}")
    if m := re.match(r"(?:ompi|mca)_coll_([a-z0-9]+)_([a-z]+?)_", sym):
        return (1, f"coll {m.group(1)} {m.group(2)}")
    if m := re.match(r"mca_pml_([a-z0-9]+)_", sym):
        return (2, f"pml {m.group(1)}")
    if re.match(r"uc[pts]_", sym) or re.match(r"libuc[pts]\.so", base):
        return (3, "UCX")
    return None


def _mpi_call(text: str) -> str | None:
    for frame in _FRAME.finditer(text):
        if c := re.match(r"P?(MPI_[A-Z][a-z_]+?)(?:_c)?$", frame.group("sym")):
            return c.group(1)
    if m := re.search(r"internal_(\w+?)(?:_c)?\(\d+\)", text):
        return f"MPI_{m.group(1)}"
    if m2 := re.search(r"\b(?:P?MPI_)([A-Z][a-z]+)(?:_c)?\(", text):
        return f"MPI_{m2.group(1)}"
    return None


def parse_probe_failure(text: str) -> ProbeFailure | None:
    """Classify the stdout+stderr of a failed probe job; None when nothing in it looks wrong.

    Knows Open MPI's and Python's segfault reports, ``mpirun noticed ... exited on signal``,
    MPICH hydra's ``BAD TERMINATION ... EXIT CODE``, "No components were able to be opened in the
    pml framework" / "PML ucx cannot be selected", MPI error stacks (``process_vm_readv failed
    (errno 14)``) and Python tracebacks.
    """
    frames = [(m.group("lib"), m.group("sym")) for m in _FRAME.finditer(text)]
    labels = [lab for lib, sym in frames if (lab := _frame_label(lib, sym))]
    where = min(labels, key=lambda pl: pl[0])[1] if labels else None
    call = _mpi_call(text)
    stages = re.findall(re.escape(STAGE) + r"(\S+) (.+)", text)
    if call is None and stages:
        call = stages[-1][1].split("/")[0].split(" ")[0]

    sig_name: str | None = None
    sig_num: int | None = None
    if m := _SIGNAL.search(text):
        sig_name, sig_num = m.group(1), int(m.group(2))
    elif (m := _UCX_SIGNAL.search(text)) or (m := _EXITED_ON.search(text)):
        sig_num, sig_name = int(m.group(1)), m.group(2).strip()
    elif m := _PY_FATAL.search(text):
        sig_name = m.group(1).strip()
        sig_num = 11 if "Segmentation" in sig_name else None
    elif m := _HYDRA_STRING.search(text):
        sig_name, sig_num = m.group(1).strip(), int(m.group(2))
    elif (m := _HYDRA_EXIT.search(text)) and int(m.group(1)) > 128 and "BAD TERMINATION" in text:
        sig_num = int(m.group(1)) - 128
        try:
            sig_name = signal.Signals(sig_num).name
        except ValueError:
            sig_name = f"signal {sig_num}"
    # A segfault/abort/bus error is the cause; SIGTERM/SIGKILL are usually the launcher or a
    # timeout cleaning up after the real error, which is looked for first.
    fatal = sig_num not in (None, 9, 15) or (sig_num is None and sig_name is not None)
    if fatal:
        kind = "segfault" if sig_num == 11 or "Segmentation" in (sig_name or "") else "signal"
        return ProbeFailure(kind, signal=sig_name, where=where, call=call)
    cause = _error_cause(text, call)
    if cause is not None:
        return cause
    if sig_num is not None:
        return ProbeFailure("signal", signal=sig_name, where=where, call=call)
    return _launch_error(text)


def _error_cause(text: str, call: str | None) -> ProbeFailure | None:
    if (
        "No components were able to be opened in the pml framework" in text
        or "cannot be selected" in text
    ):
        m = re.search(r"PML (\w+) cannot be selected", text)
        msg = (
            f"PML {m.group(1)} cannot be selected"
            if m
            else ("no component of the pml framework could be opened")
        )
        return ProbeFailure(
            "pml-unavailable", where=f"pml {m.group(1)}" if m else "pml", message=msg
        )

    if m := re.search(r"process_vm_readv failed \(errno (\d+)\)", text):
        return ProbeFailure(
            "mpi-error",
            where=f"CMA (process_vm_readv errno {m.group(1)})",
            call=call,
            message=f"process_vm_readv failed (errno {m.group(1)}): the MPI copied with CMA, "
            "which cannot read device memory",
        )
    if m := re.search(r"mpi4py\.MPI\.Exception:\s*(.+)", text):
        return ProbeFailure("mpi-error", call=call, message=m.group(1).strip())
    if m := re.search(r"^--- rank \d+ of \d+: (.+)$", text, re.M):
        return ProbeFailure("python-error", call=call, message=m.group(1).strip())
    if m := re.search(r"^(\w+(?:Error|Exception)): (.+)$", text, re.M):
        return ProbeFailure("python-error", call=call, message=f"{m.group(1)}: {m.group(2)}")
    return None


def _launch_error(text: str) -> ProbeFailure | None:
    for pattern in (
        r"(ORTE was unable to reliably start .*)",
        r"(There are not enough slots available .*)",
        r"(mpirun was unable to launch .*)",
        r"(prterun was unable to launch .*)",
        r"(\S*mpiexec\S*: [^\n]*(?:not found|No such file)[^\n]*)",
    ):
        if m := re.search(pattern, text):
            return ProbeFailure("launch-error", message=m.group(1).strip())
    return None


_RULE = re.compile(r"^\s*-{20,}\s*$", re.M)
"""The dashed line above and below each of Open MPI's help messages."""
_NOTICES = (
    "detected that one or more processes exited with non-zero status",
    "noticed that process rank",
    "Primary job  terminated normally",
    "MPI_ABORT was invoked",
)
"""The launcher's own notices that a rank ended: they follow the real message, never are it."""


def launcher_message(text: str, limit: int = 400) -> str:
    """The message a failed job's launcher or MPI library printed, on one line (pure).

    Open MPI frames each message between dashed rules; the first framed block that is not the
    launcher's "a process exited" notice is the cause ("The user requested CUDA support ...
    but the library was not compiled with any support"). Without a framed message, the last
    line of output. Never a bare rule: the cause is what a reader needs.
    """
    blocks = [" ".join(b.split()) for b in _RULE.split(text)]
    framed = [b for b in blocks[1:] if b and not any(n in b for n in _NOTICES)]
    if framed and len(blocks) > 2:
        message = framed[0]
    else:
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not _RULE.match(ln)]
        message = lines[-1] if lines else "no output"
    return message if len(message) <= limit else message[: limit - 3] + "..."


def explain(test: str, failure: ProbeFailure | None) -> str:
    """What a failure of ``test`` means for device memory, in one sentence fragment."""
    if failure is None:
        return ""
    if not test.startswith("device"):
        return ""
    where = failure.where or ""
    if failure.kind == "segfault":
        if where.startswith(("btl", "smsc", "pml ob1")):
            return "this MPI dereferenced a device pointer on the CPU: no CUDA support on this path"
        if where.startswith("coll"):
            return "this MPI's collective reduces on the CPU against device pointers"
        return "this MPI cannot handle device buffers here"
    if failure.kind == "mpi-error" and "CMA" in where:
        return "this MPI is not CUDA-aware (it tried a host memory copy of a device buffer)"
    return ""


def _marker(stdout: str) -> dict[str, Any] | None:
    for line in stdout.splitlines():
        if line.startswith(MARKER):
            try:
                data = json.loads(line[len(MARKER) :])
            except ValueError:
                return None
            return data if isinstance(data, dict) else None
    return None


def classify(
    test: str, returncode: int | None, stdout: str, stderr: str, timed_out: bool = False
) -> tuple[ProbeOutcome, ProbeFailure | None, dict[str, Any] | None]:
    """Turn one probe job's exit status and output into an outcome, a failure and its report."""
    report = _marker(stdout)
    text = stdout + "\n" + stderr
    failure = (
        parse_probe_failure(text) if (timed_out or returncode != 0 or report is None) else None
    )
    meaning = explain(test, failure)

    def detail(prefix: str) -> str:
        parts = [p for p in (prefix, failure.summary if failure else "", meaning) if p]
        return ": ".join(parts)

    gbps = report.get("gbps") if report else None
    if timed_out:
        outcome = ProbeOutcome("timeout", detail("hung (killed after the probe timeout)"))
    elif report is not None and returncode == 0:
        if report.get("ok"):
            outcome = ProbeOutcome("ok", "correct data", gbps)
        else:
            outcome = ProbeOutcome("wrong", "ran but delivered wrong data", gbps)
    elif failure is not None and failure.kind in ("segfault", "signal"):
        outcome = ProbeOutcome("crash", detail(""))
    elif returncode is not None and (returncode < 0 or returncode > 128):
        sig = -returncode if returncode < 0 else returncode - 128
        outcome = ProbeOutcome("crash", detail(f"killed by signal {sig}"))
    else:
        tail = "" if failure else launcher_message(text)
        outcome = ProbeOutcome(
            "error", detail(f"exit {returncode}" + (f": {tail}" if tail else ""))
        )
    return outcome, failure, report


PROBE_BYTES = 16 << 20
"""The runtime probes' message size (the doctor's --size default)."""
PROBE_RANKS = 2
"""How many ranks a probe job runs (the doctor's --ranks default)."""


@dataclass(frozen=True)
class ProbeSpec:
    """How to launch the probe ranks: which mpiexec, python, MCA settings and exported vars."""

    mpiexec: str
    python: str = sys.executable
    vendor: str | None = OPEN_MPI
    mca: tuple[tuple[str, str], ...] = ()
    exports: tuple[tuple[str, str], ...] = ()
    nbytes: int = PROBE_BYTES
    ranks: int = PROBE_RANKS
    iters: int = 5
    timeout: float = PROBE_TIMEOUT


def mpiexec_argv(spec: ProbeSpec, test: str, backend: str | None) -> list[str]:
    """The argv of one probe job (pure). Open MPI gets ``--mca``/``-x``; MPICH ``-genv``."""
    tail = [
        spec.python,
        "-m",
        "cudampi.probe.worker",
        test,
        str(spec.nbytes),
        backend or "-",
        str(spec.iters),
    ]
    if test == "copy":
        return tail
    flavour = "openmpi" if spec.vendor == OPEN_MPI else "mpich"
    if spec.mca and flavour != "openmpi":
        raise ValueError(
            f"--mca {spec.mca[0][0]} {spec.mca[0][1]} is an Open MPI setting but the MPI is "
            f"{spec.vendor or 'unknown'}; use -x VAR=VAL (MPIR_CVAR_*) instead"
        )
    job = Mpiexec(
        spec.mpiexec,
        flavour,
        spec.ranks,
        tuple(tail),
        oversubscribe=True,
        mca=spec.mca,
        env=spec.exports,
    )
    return job.argv()


def ranks_env(spec: ProbeSpec, base: Mapping[str, str]) -> dict[str, str]:
    """The environment the ranks will see: ``--mca k v`` arrives as ``OMPI_MCA_k=v`` and
    ``-x VAR=VAL`` as ``VAR=VAL`` (pure; used to predict the capabilities key)."""
    env = {k: v for k, v in base.items() if not k.startswith(LAUNCHER_ENV_PREFIXES)}
    if spec.vendor == OPEN_MPI:
        env.update({f"OMPI_MCA_{k}": v for k, v in spec.mca})
    env.update(dict(spec.exports))
    return env


def launch_env(base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of the child mpiexec: the caller's minus any enclosing job's launcher
    variables, plus cudampi importable in the ranks and Open MPI allowed to run as root."""
    base = os.environ if base is None else base
    env = {k: v for k, v in base.items() if not k.startswith(LAUNCHER_ENV_PREFIXES)}
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        for key, value in ROOT_ENV.items():
            env.setdefault(key, value)
    return env


@dataclass(frozen=True)
class ProbeRun:
    """One probe job: what ran, what came back, what it means."""

    test: str
    argv: tuple[str, ...]
    outcome: ProbeOutcome
    returncode: int | None
    wall_s: float
    failure: ProbeFailure | None = None
    report: dict[str, Any] | None = None
    stderr_tail: str = ""


def run_test(
    spec: ProbeSpec, test: str, backend: str | None = None, env: Mapping[str, str] | None = None
) -> ProbeRun:
    """Run one probe job in its own process group; a hang is killed after ``spec.timeout``."""
    argv = mpiexec_argv(spec, test, backend)
    child_env = launch_env(env)
    t0 = time.perf_counter()
    for _attempt in range(2):
        try:
            proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=child_env,
                start_new_session=True,
            )
        except OSError as exc:
            outcome = ProbeOutcome("error", f"could not start {argv[0]!r}: {exc}")
            return ProbeRun(test, tuple(argv), outcome, None, 0.0)
        timed_out = False
        try:
            stdout, stderr = proc.communicate(timeout=spec.timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            stdout, stderr = proc.communicate()
        if timed_out or not launcher_never_started(proc.returncode, stderr):
            break
    wall = time.perf_counter() - t0
    outcome, failure, report = classify(test, proc.returncode, stdout, stderr, timed_out)
    return ProbeRun(
        test, tuple(argv), outcome, proc.returncode, wall, failure, report, stderr[-4000:]
    )


@dataclass(frozen=True)
class RuntimeResult:
    """Every probe job of one doctor run, by test name."""

    runs: dict[str, ProbeRun] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)
    """test -> why it was not run (no GPU, no CuPy/torch, host probe failed...)."""

    def outcome(self, test: str) -> ProbeOutcome:
        if test in self.runs:
            return self.runs[test].outcome
        return ProbeOutcome("skipped", self.skipped.get(test, "not probed"))

    @property
    def rank_facts(self) -> dict[str, Any] | None:
        """The library facts a rank reported (key, env, MPIX value), from the first good run."""
        for run in self.runs.values():
            if run.report and "key" in run.report:
                return run.report
        return None


def staging_verdict(p2p_gbps: float | None, copy_gbps: float | None) -> bool | None:
    """True when device p2p is no faster than one pinned host<->device copy: the bytes are
    (silently) going through host memory. None when either rate is unknown."""
    if p2p_gbps is None or copy_gbps is None or copy_gbps <= 0:
        return None
    return p2p_gbps <= copy_gbps


def run_probes(
    spec: ProbeSpec,
    backend: str | None,
    no_device_reason: str | None = None,
    env: Mapping[str, str] | None = None,
    tests: Sequence[str] | None = None,
    on_test: Callable[[str], None] | None = None,
    cannot: Mapping[str, str] | None = None,
) -> RuntimeResult:
    """Host tests always; device tests (and the copy-rate test) only with a ``backend``.
    ``on_test(name)`` is called as each probe job starts (the doctor's progress lines);
    ``cannot`` names the tests this machine cannot run, with why (skipped, no job started)."""
    runs: dict[str, ProbeRun] = {}
    skipped: dict[str, str] = {}
    wanted = list(tests) if tests is not None else [*HOST_TESTS, *DEVICE_TESTS, "copy"]
    for test in (t for t in wanted if t in HOST_TESTS):
        if on_test is not None:
            on_test(test)
        runs[test] = run_test(spec, test, None, env)
    for test in (t for t in wanted if t in (*DEVICE_TESTS, "copy")):
        if backend is None:
            skipped[test] = no_device_reason or "no GPU"
            continue
        if cannot and test in cannot:
            skipped[test] = cannot[test]
            continue
        if on_test is not None:
            on_test(test)
        runs[test] = run_test(spec, test, backend, env)
    return RuntimeResult(runs, skipped)
