"""What each communication call looks like from outside, as NCCL_DEBUG and Horovod's timeline
show it: a log line, a torch.profiler range, an NVTX range, a Chrome-trace event.

- ``CUDAMPI_LOG=info`` logs, once per new (op, size, dtype), the path chosen and why;
  ``CUDAMPI_LOG=debug`` every call with its time. Standard :mod:`logging` (logger ``cudampi``),
  lines prefixed with host and rank, on rank 0 (``CUDAMPI_LOG_RANKS=all``: every rank).
- While a torch.profiler runs, every call is a ``record_function`` range; under a tool that
  records NVTX (Nsight Systems, Nsight Compute: they set ``NVTX_INJECTION64_PATH``, without
  which NVTX ranges go nowhere) and once torch has initialized CUDA, an NVTX range too. Both
  are named ``cudampi.<op> <size> <dtype> <path>``.
- ``CUDAMPI_TRACE=DIR``: every rank writes its calls to ``DIR/cudampi-trace-rank<R>.json``
  (Chrome trace events); :func:`merge_traces` joins them into one timeline (``cudampi trace``).

The Communicator calls :meth:`Observer.call` in one place, its dispatch; with everything off it
costs a dictionary lookup and a flag test per call.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cudampi.atomic import why, write_text
from cudampi.config import Config, human_size

LOGGER = "cudampi"
TRACE_FILE = "cudampi-trace-rank{rank}.json"


human_bytes = human_size
"""``4194304`` -> ``4 MiB``; ``1000`` -> ``1000 B`` (:func:`cudampi.config.human_size`)."""


def world_rank() -> tuple[int, int]:
    """(rank, size) of this process in its job, from the launcher's variables (no MPI call)."""
    from cudampi.rankenv import rank_env

    try:
        info = rank_env(os.environ)
    except Exception:
        return 0, 1
    return info.rank, info.world_size


_HANDLER_MARK = "_cudampi_rank_handler"


def rank_logger(config: Config, rank: int, size: int, host: str | None = None) -> logging.Logger:
    """The ``cudampi`` logger, set up from ``config.log`` for this rank (once per process).

    A process that set up the ``cudampi`` logger itself keeps its own handlers and level."""
    logger = logging.getLogger(LOGGER)
    level = {"info": logging.INFO, "debug": logging.DEBUG}.get(config.log)
    if level is None or (config.log_ranks == "0" and rank != 0):
        return logger
    if logger.handlers and not any(getattr(h, _HANDLER_MARK, False) for h in logger.handlers):
        return logger  # configured by the program: leave it alone
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        setattr(handler, _HANDLER_MARK, True)
        where = host or socket.gethostname()
        handler.setFormatter(
            logging.Formatter(f"[cudampi {where} rank {rank}/{size}] %(levelname)s %(message)s")
        )
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level)
    return logger


@dataclass
class TraceRecorder:
    """Chrome trace events of one rank, written to its file at close (and at exit)."""

    folder: str
    rank: int
    host: str

    def __post_init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.threads: dict[int, int] = {}
        self.written = False
        self.failed = ""
        """Why the file could not be written (said once)."""
        atexit.register(self.write)

    def add(self, name: str, start_us: float, dur_us: float, args: dict[str, Any]) -> None:
        with self.lock:
            tid = self.threads.setdefault(threading.get_ident(), len(self.threads))
            self.events.append(
                {
                    "name": name,
                    "cat": "cudampi",
                    "ph": "X",
                    "ts": round(start_us, 3),
                    "dur": round(dur_us, 3),
                    "pid": self.rank,
                    "tid": tid,
                    "args": args,
                }
            )

    def document(self) -> dict[str, Any]:
        meta = [
            {
                "name": "process_name",
                "ph": "M",
                "pid": self.rank,
                "args": {"name": f"rank {self.rank} ({self.host})"},
            },
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": self.rank,
                "args": {"sort_index": self.rank},
            },
        ]
        with self.lock:
            return {"traceEvents": meta + list(self.events), "displayTimeUnit": "ms"}

    def write(self) -> Path | None:
        """Write (again) this rank's file, whole or not at all; None when it cannot be written
        (said once on stderr: a full disk must not leave an empty file and no word)."""
        path = Path(self.folder) / TRACE_FILE.format(rank=self.rank)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            write_text(path, json.dumps(self.document()))
        except OSError as exc:
            if not self.failed:
                self.failed = why(exc)
                sys.stderr.write(
                    f"cudampi: rank {self.rank} on {self.host} could not write its trace "
                    f"{path}: {self.failed}; its {len(self.events)} calls are not saved "
                    "(CUDAMPI_TRACE: give a folder with room)\n"
                )
                sys.stderr.flush()
            return None
        self.written = True
        return path


_RECORDERS: dict[tuple[str, int], TraceRecorder] = {}
_RECORDERS_LOCK = threading.Lock()


def recorder(folder: str, rank: int, host: str) -> TraceRecorder:
    """The one recorder of this process for ``folder`` (every Communicator of a rank shares it:
    one file per rank)."""
    key = (os.path.abspath(os.path.expanduser(folder)), rank)
    with _RECORDERS_LOCK:
        if key not in _RECORDERS:
            _RECORDERS[key] = TraceRecorder(key[0], rank, host)
        return _RECORDERS[key]


def merge_traces(folder: str | os.PathLike[str]) -> dict[str, Any]:
    """Every rank's file in ``folder`` as one Chrome trace (chrome://tracing, Perfetto)."""
    events: list[dict[str, Any]] = []
    files = sorted(Path(folder).glob(TRACE_FILE.format(rank="*")))
    for f in files:
        try:
            events += json.loads(f.read_text()).get("traceEvents", [])
        except (OSError, ValueError):
            continue
    events.sort(key=lambda e: (e.get("ph") != "M", e.get("ts", 0)))
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"ranks": len(files)}}


def _torch_profiling() -> Any:
    """torch, when it is imported and its profiler records (else None)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch if torch._C._autograd._profiler_enabled() else None
    except AttributeError:
        return None


NVTX_TOOL = ("NVTX_INJECTION64_PATH", "NVTX_INJECTION32_PATH")
"""How a tool that records NVTX ranges attaches itself (NVTX's own mechanism): with neither
set, an NVTX range records nothing, and building one costs a small call ~5 us on the host."""


def _torch_nvtx() -> Any:
    """torch.cuda.nvtx once torch has initialized CUDA (else None)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda.nvtx if torch.cuda.is_initialized() else None
    except AttributeError:
        return None


class Observer:
    """Logging, profiler ranges and the timeline of one Communicator's calls."""

    def __init__(self, config: Config, rank: int | None = None, size: int | None = None) -> None:
        wr, ws = world_rank()
        self.rank = wr if rank is None else rank
        self.size = ws if size is None else size
        self.host = socket.gethostname()
        self.logger = rank_logger(config, wr, ws, self.host)
        self.logs = self.logger.isEnabledFor(logging.INFO)
        """Read once: the logging set up when the Communicator was made (CUDAMPI_LOG)."""
        self.seen: set[tuple[str, int, str]] = set()
        self.trace = recorder(config.trace, wr, self.host) if config.trace else None
        self.nvtx = any(os.environ.get(v) for v in NVTX_TOOL)
        """NVTX ranges are made only under a tool that records them (read once)."""

    def close(self) -> None:
        if self.trace is not None:
            self.trace.write()

    @contextlib.contextmanager
    def _observed(self, op: str, nbytes: int, dtype: str, path: str, why: str) -> Iterator[None]:
        name = f"cudampi.{op} {human_bytes(nbytes)} {dtype} {path}"
        logger = self.logger
        key = (op, nbytes, dtype)
        if key not in self.seen and self.logs:
            self.seen.add(key)
            logger.info("%s %s %s: path %s (%s)", op, human_bytes(nbytes), dtype, path, why)
        torch = _torch_profiling()
        nvtx = _torch_nvtx() if self.nvtx else None
        with contextlib.ExitStack() as stack:
            if torch is not None:
                stack.enter_context(torch.profiler.record_function(name))
            if nvtx is not None:
                nvtx.range_push(name)
                stack.callback(nvtx.range_pop)
            start_wall = time.time_ns() / 1000
            t0 = time.perf_counter()
            yield
            dur = (time.perf_counter() - t0) * 1e6
        if self.logs and logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s %s %s %.1f us", op, human_bytes(nbytes), dtype, path, dur)
        if self.trace is not None:
            self.trace.add(
                name,
                start_wall,
                dur,
                {"op": op, "bytes": nbytes, "dtype": dtype, "path": path, "why": why},
            )

    def quiet(self) -> bool:
        """Nothing observes calls now (no trace, no log, no profiler, no NVTX tool)."""
        return (
            self.trace is None
            and not self.logs
            and _torch_profiling() is None
            and (not self.nvtx or _torch_nvtx() is None)
        )

    def call(self, op: str, nbytes: int, dtype: str, path: str, why: str) -> Any:
        """The context one call runs in (a no-op context when nothing observes)."""
        if self.quiet():
            return QUIET
        return self._observed(op, nbytes, dtype, path, why)


QUIET = contextlib.nullcontext()
"""The context of a call nothing observes (callers may skip entering it)."""
