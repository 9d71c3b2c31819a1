"""One runtime probe, run on real ranks: ``mpiexec -n 2 python -m cudampi.probe.worker TEST BYTES
[BACKEND]``.

TEST is one of :data:`TESTS`. ``copy`` runs without MPI (one process). Rank 0 prints one line
``CUDAMPI_PROBE {json}`` on stdout; every rank writes ``CUDAMPI_STAGE <test> <call>`` to stderr
before each MPI call with a device buffer, so a crash names the call that crashed. A Python
exception on any rank is printed and the job aborted (no hang); a segfault inside MPI kills the
job and is classified by :mod:`cudampi.probe.runtime` from the exit status and stderr.
BACKEND is ``cupy`` or ``torch`` (device tests only).
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from typing import Any

from cudampi.abort import abort_job

TESTS = (
    "host_p2p",
    "host_allreduce",
    "device_p2p",
    "device_allreduce",
    "host_staged",
    "device_ipc",
    "device_nccl",
    "copy",
)
MARKER = "CUDAMPI_PROBE "
STAGE = "CUDAMPI_STAGE "
WARMUP = 2


PERIOD = 1021
"""Test data is ``i % PERIOD + rank``: small integers, so float32 sums are exact at any size and
rank count (a plain arange loses integer precision past 2**24 elements)."""


def pattern(n: int, offset: float) -> Any:
    """The host test data: ``(arange(n) % PERIOD) + offset`` as float32."""
    import numpy as np

    return (np.arange(n, dtype=np.int64) % PERIOD).astype(np.float32) + np.float32(offset)


def _stage(test: str, call: str) -> None:
    sys.stderr.write(f"{STAGE}{test} {call}\n")
    sys.stderr.flush()


class _Device:
    """The few device operations the probe needs, on CuPy or torch.cuda."""

    def __init__(self, backend: str, local_rank: int) -> None:
        self.backend = backend
        if backend == "cupy":
            import cupy

            self.cp = cupy
            count = cupy.cuda.runtime.getDeviceCount()
            self.index = local_rank % count
            cupy.cuda.Device(self.index).use()
            props = cupy.cuda.runtime.getDeviceProperties(self.index)
            name = props["name"]
            self.name = name.decode() if isinstance(name, bytes) else str(name)
        elif backend == "torch":
            import torch

            self.torch = torch
            count = torch.cuda.device_count()
            self.index = local_rank % count
            torch.cuda.set_device(self.index)
            self.name = torch.cuda.get_device_name(self.index)
        else:
            raise ValueError(f"device backend must be cupy or torch, got {backend!r}")

    def arange(self, n: int, offset: float) -> Any:
        """:func:`pattern` on the device."""
        if self.backend == "cupy":
            return (self.cp.arange(n, dtype=self.cp.int64) % PERIOD).astype(
                self.cp.float32
            ) + offset
        t = self.torch.arange(n, dtype=self.torch.int64, device="cuda") % PERIOD
        return t.to(self.torch.float32) + offset

    def empty(self, n: int) -> Any:
        if self.backend == "cupy":
            return self.cp.zeros(n, dtype=self.cp.float32)
        return self.torch.zeros(n, dtype=self.torch.float32, device="cuda")

    def sync(self) -> None:
        if self.backend == "cupy":
            self.cp.cuda.Device().synchronize()
        else:
            self.torch.cuda.synchronize()

    def equal(self, a: Any, b: Any) -> bool:
        if self.backend == "cupy":
            return bool(self.cp.array_equal(a, b))
        return bool(self.torch.equal(a, b))

    def pinned(self, n: int) -> Any:
        """A numpy float32 array in pinned (page-locked) host memory."""
        import numpy as np

        if self.backend == "cupy":
            mem = self.cp.cuda.alloc_pinned_memory(n * 4)
            return np.frombuffer(mem, np.float32, n)
        t = self.torch.empty(n, dtype=self.torch.float32, pin_memory=True)
        self._keep = [*getattr(self, "_keep", []), t]
        return t.numpy()

    def to_host(self, src: Any, dst: Any) -> None:
        if self.backend == "cupy":
            src.get(out=dst)
        else:
            self.torch.from_numpy(dst).copy_(src)

    def to_device(self, src: Any, dst: Any) -> None:
        if self.backend == "cupy":
            dst.set(src)
        else:
            dst.copy_(self.torch.from_numpy(src))


def _timed(comm: Any, iters: int, body: Any, sync: Any = None) -> float:
    """Seconds per iteration of ``body`` after :data:`WARMUP` untimed ones."""
    t0 = 0.0
    for i in range(WARMUP + iters):
        if i == WARMUP:
            if sync:
                sync()
            comm.Barrier()
            t0 = time.perf_counter()
        body()
    if sync:
        sync()
    return (time.perf_counter() - t0) / iters


def _p2p(comm: Any, test: str, x: Any, y: Any, iters: int, sync: Any) -> float:
    """Ping-pong between ranks 0 and 1; seconds per one-way message."""
    rank = comm.rank

    def body() -> None:
        if rank == 0:
            comm.Send(x, dest=1, tag=7)
            comm.Recv(y, source=1, tag=8)
        elif rank == 1:
            comm.Recv(y, source=0, tag=7)
            comm.Send(x, dest=0, tag=8)

    _stage(test, "MPI_Send/MPI_Recv")
    return _timed(comm, iters, body, sync) / 2


def _kernels(
    comm: Any, dev: _Device, x: Any, n: int, iters: int, extra: dict[str, Any], path: str
) -> tuple[float, bool]:
    """A stream-ordered engine of cudampi (``ipc``: GPU kernels over CUDA IPC; ``nccl``: NCCL
    bootstrapped over MPI): allreduce and allgather checked, the latency of a 4 KiB allreduce
    (stream-ordered calls back to back, as a training loop makes them) and the seconds of an
    allreduce of ``x``. No MPI call touches device memory."""
    from cudampi.comm import Communicator
    from cudampi.probe.gpu import mps_active

    size = comm.size
    test = f"device_{path}"
    with Communicator(comm, path=path) as c:
        _stage(test, f"{path} allreduce")
        y = c.allreduce(x)
        ok = dev.equal(y, dev.arange(n, 0.0) * size + float(sum(range(size))))
        m = min(n, 4099)
        g = c.allgather(x[:m])
        c.synchronize()
        for r in range(size):
            ok = ok and dev.equal(g[r], dev.arange(m, float(r)))
        small, out = dev.arange(1024, float(comm.rank)), dev.empty(1024)
        lat = _timed(comm, max(50, iters * 20), lambda: c.allreduce(small, out=out), dev.sync)
        secs = _timed(comm, iters, lambda: c.allreduce(x, out=y), dev.sync)
        c.synchronize()
    shared = len(set(comm.allgather(dev.index))) < size  # the probe's ranks share one node
    extra.update(latency_us=lat * 1e6, mps=mps_active(), shared_gpu=shared)
    return secs, bool(ok)


def run_test(comm: Any, test: str, nbytes: int, backend: str | None, iters: int) -> dict[str, Any]:
    """Run one test on ``comm``; every rank returns the same dict (ok, gbps, ...)."""
    import numpy as np

    n = max(1, nbytes // 4)
    nbytes = n * 4
    rank, size = comm.rank, comm.size
    peer = 1 - rank if rank < 2 else rank
    local_ok = True
    extra: dict[str, Any] = {}
    if test.startswith("host_p2p"):
        x = pattern(n, rank)
        y = np.zeros(n, dtype=np.float32)
        secs = _p2p(comm, test, x, y, iters, None)
        if rank < 2:
            local_ok = bool(np.array_equal(y, pattern(n, peer)))
    elif test == "host_allreduce":
        x = pattern(n, rank)
        y = np.zeros(n, dtype=np.float32)
        _stage(test, "MPI_Allreduce")
        secs = _timed(comm, iters, lambda: comm.Allreduce(x, y))
        local_ok = bool(np.array_equal(y, pattern(n, 0) * size + sum(range(size))))
    else:
        if backend is None:
            raise ValueError(f"test {test!r} needs a device backend (cupy or torch)")
        from cudampi.rankenv import launched_by

        local_rank = launched_by(os.environ).local_rank
        local_rank = rank if local_rank is None else local_rank
        dev = _Device(backend, local_rank)
        extra.update(device=dev.name, device_index=dev.index, backend=backend)
        x = dev.arange(n, float(rank))
        dev.sync()
        if test == "device_p2p":
            y = dev.empty(n)
            secs = _p2p(comm, test, x, y, iters, dev.sync)
            if rank < 2:
                local_ok = dev.equal(y, dev.arange(n, float(peer)))
        elif test == "device_allreduce":
            y = dev.empty(n)
            _stage(test, "MPI_Allreduce")
            secs = _timed(comm, iters, lambda: comm.Allreduce(x, y), dev.sync)
            local_ok = dev.equal(y, dev.arange(n, 0.0) * size + float(sum(range(size))))
        elif test == "host_staged":
            hx, hy = dev.pinned(n), dev.pinned(n)
            y = dev.empty(n)

            def body() -> None:
                dev.to_host(x, hx)
                dev.sync()
                comm.Allreduce(hx, hy)
                dev.to_device(hy, y)
                dev.sync()

            _stage(test, "MPI_Allreduce (host buffers)")
            secs = _timed(comm, iters, body, dev.sync)
            local_ok = dev.equal(y, dev.arange(n, 0.0) * size + float(sum(range(size))))
        elif test in ("device_ipc", "device_nccl"):
            secs, local_ok = _kernels(comm, dev, x, n, iters, extra, test.removeprefix("device_"))
        else:
            raise ValueError(f"unknown probe test {test!r}; known: {', '.join(TESTS)}")
    all_ok = bool(comm.allreduce(int(local_ok)) == size)
    return {
        "ok": all_ok,
        "gbps": nbytes / secs / 1e9 if secs > 0 else None,
        "bytes": nbytes,
        **extra,
    }


def run_copy(nbytes: int, backend: str, iters: int) -> dict[str, Any]:
    """Pinned host<->device copy rates of one process (no MPI): the bar for silent staging."""
    import numpy as np

    n = max(1, nbytes // 4)
    dev = _Device(backend, 0)
    x = dev.arange(n, 1.0)
    h = dev.pinned(n)
    dev.sync()

    def rate(fn: Any) -> float:
        for _ in range(WARMUP):
            fn()
        dev.sync()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        dev.sync()
        return n * 4 * iters / (time.perf_counter() - t0) / 1e9

    d2h = rate(lambda: dev.to_host(x, h))
    ok = bool(np.array_equal(h, pattern(n, 1.0)))
    y = dev.empty(n)
    h2d = rate(lambda: dev.to_device(h, y))
    ok = ok and dev.equal(x, y)
    return {
        "ok": ok,
        "d2h_gbps": d2h,
        "h2d_gbps": h2d,
        "gbps": min(d2h, h2d),
        "bytes": n * 4,
        "device": dev.name,
        "backend": backend,
    }


def _library_facts(mpi: Any) -> dict[str, Any]:
    """What the rank itself sees: library, MPIX_Query_cuda_support, its capabilities key."""
    import ctypes

    from cudampi.probe.capabilities import stack_env, stack_key

    lib_version = mpi.Get_library_version()
    mpix: int | None = None
    # mpi4py dlopens libmpi RTLD_LOCAL: look the symbol up in that library, not the global scope.
    with open("/proc/self/maps") as maps:
        libs = [ln.split()[-1] for ln in maps if "/libmpi.so" in ln or "/libmpi_abi.so" in ln]
    for lib in [*libs[:1], None]:
        try:
            fn = ctypes.CDLL(lib).MPIX_Query_cuda_support
        except (AttributeError, OSError):
            continue
        fn.restype = ctypes.c_int
        mpix = int(fn())
        break
    return {
        "library_version": lib_version,
        "key": stack_key(lib_version, os.environ),
        "env": stack_env(os.environ),
        "mpix_query_cuda_support": mpix,
        "size": mpi.COMM_WORLD.size,
        "host": mpi.Get_processor_name(),
        "hostname": socket.gethostname(),  # what a Communicator on this host compares with
    }


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or args[0] not in TESTS:
        sys.stderr.write(
            f"usage: python -m cudampi.probe.worker {{{','.join(TESTS)}}} BYTES [cupy|torch]\n"
        )
        return 2
    test, nbytes = args[0], int(args[1])
    backend = args[2] if len(args) > 2 and args[2] != "-" else None
    iters = int(args[3]) if len(args) > 3 else 5
    if test == "copy":
        if backend is None:
            sys.stderr.write("the copy test needs a backend: cupy or torch\n")
            return 2
        try:
            result = run_copy(nbytes, backend, iters)
        except Exception:
            sys.stderr.write(traceback.format_exc())
            return 1
        print(MARKER + json.dumps({"test": test, **result}), flush=True)
        return 0

    from mpi4py import MPI

    # No faulthandler: on a segfault the MPI library's (or UCX's) own handler prints the native
    # backtrace that cudampi.probe.runtime parses, exactly as in the fixtures; the CUDAMPI_STAGE
    # line already names the Python-level call.
    comm = MPI.COMM_WORLD
    try:
        if comm.size < 2:
            raise RuntimeError(
                "this rank sees a world of 1 rank: the mpiexec that started it is not the MPI "
                "that mpi4py loads (or it was started without mpiexec)"
            )
        facts = _library_facts(MPI)
        result = run_test(comm, test, nbytes, backend, iters)
    except Exception as exc:
        head = f"--- rank {comm.rank} of {comm.size}: {type(exc).__name__}: {exc}\n"
        abort_job(3, head + traceback.format_exc(), comm)
        return 3
    if comm.rank == 0:
        print(MARKER + json.dumps({"test": test, **facts, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
