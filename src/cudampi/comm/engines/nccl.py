"""The ``nccl`` engine: NVIDIA's NCCL, bootstrapped over MPI, on the caller's stream.

Where every rank of a communicator drives a GPU of its own and NCCL is importable, the engine
makes one NCCL communicator per cudampi communicator and device: rank 0 asks NCCL for a unique
id, MPI broadcasts it on the host, every rank calls ``ncclCommInitRank`` (no MASTER_ADDR, no TCP
store). NCCL's own settings (``NCCL_SOCKET_IFNAME``, ``NCCL_IB_*``...) come from the environment
``cudampi launch`` gives every rank. Ranks that share a GPU cannot use it (NCCL refuses them;
they keep ``ipc``): :func:`~cudampi.comm.engines.nccl_support.nccl_usable` says where it can run, for the path choice and the
doctor, from facts gathered on every rank.

The binding is CuPy's ``cupy.cuda.nccl`` (public, stream-ordered, raw pointers: it serves torch
tensors and CuPy arrays alike, and CuPy is already the ipc engine's dependency); docs/torch.md
says why not torch's ProcessGroupNCCL or nccl4py. Every call is enqueued on the caller's
current CUDA stream (``stream_ordered``) with no host synchronisation and no MPI call, so it can
be captured in a CUDA graph; errors surface at ``Communicator.synchronize()``, which also gives
up after ``CUDAMPI_TIMEOUT`` (NCCL itself would wait forever for a rank that never calls).

Reductions run in NCCL's datatypes (:func:`~cudampi.comm.engines.nccl_support.nccl_reduction`: float16/bfloat16/float32/float64,
int8/uint8/int32/uint32/int64/uint64; bool as uint8 max/min; complex sum/avg as pairs of reals;
``avg`` is NCCL's own from 2.10, else a sum divided on the stream); the rest is refused with a
:class:`~cudampi.errors.CommError` that names the paths that take it. Moving collectives
(broadcast, the gathers, scatter, alltoall) move bytes, so every dtype goes. Uneven counts run
as grouped send/recv (gathers, scatter, alltoall) or grouped rooted reduces (reduce_scatter).
Point-to-point stays MPI's.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

from cudampi.comm.algorithms import offsets
from cudampi.comm.arrays import COMPLEX, FLOAT, ArrayOps, Flat
from cudampi.comm.choice import Ask, DeviceSupport, Facts, PathChoice, Verdict
from cudampi.comm.engines import nccl_support as fit
from cudampi.comm.engines.base import CollectivesOnly, Engine, Engines, Setting, caller_stream
from cudampi.errors import CommError, DeviceError
from cudampi.names import CALLS

# ------------------------------------------------------------------ the engine


class NcclComm:
    """One NCCL communicator: a cudampi communicator's on one device, shared by its engines."""

    def __init__(self, comm: Any, device: int, version: int) -> None:
        self.comm = comm
        self.device = device
        self.version = version
        self.closed = False

    @classmethod
    def open(cls, s: Setting, device: int) -> NcclComm:
        """Collective over ``s.coll``: every rank checks what it has, all agree, rank 0's unique
        id goes to every rank over MPI, every rank joins. Every rank raises the same error."""
        why = fit.available()
        me = fit.RankGpu(socket.gethostname(), None)
        if why is None:
            try:
                me = fit.local_gpu(device)
            except Exception as exc:  # a CUDA error on this rank: the others must hear of it
                why = f"cuda:{device} cannot be queried ({type(exc).__name__}: {exc})"
        seen = s.coll.allgather((why, me))
        usable = fit.nccl_usable([g for _, g in seen], [w for w, _ in seen])
        if usable is not None:
            raise DeviceError(f"the nccl engine cannot run here: {usable}")
        from cupy.cuda import nccl

        uid = nccl.get_unique_id() if s.rank == 0 else None
        uid = s.coll.bcast(uid, root=0)
        comm: Any = None
        error: str | None = None
        try:
            import cupy

            with cupy.cuda.Device(device):
                comm = nccl.NcclCommunicator(s.size, uid, s.rank)
        except Exception as exc:  # NcclError, CUDA errors: every rank must hear of it
            error = f"{type(exc).__name__}: {exc}"
        errors = s.coll.allgather(error)
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            if comm is not None:
                comm.destroy()
            r, e = failed[0]
            raise DeviceError(
                "the nccl engine: creating the NCCL communicator failed on rank(s) "
                f"{fit.ranks_text([r for r, _ in failed])} (rank {r} on {seen[r][1].host}: {e}). Check "
                "the NCCL_* settings with `cudampi doctor`, or use path 'ipc'."
            )
        return cls(comm, device, int(nccl.get_version()))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.comm.destroy()


class NcclEngine(CollectivesOnly):
    """NVIDIA's NCCL on the caller's stream, one NCCL communicator per device (module doc)."""

    name = "nccl"
    paths = ("nccl",)
    device_only = True
    stream_ordered = True

    @classmethod
    def available(cls) -> str | None:
        return fit.available()

    @classmethod
    def verdict(cls, facts: Facts) -> Verdict:
        caps = facts.caps
        ok, why, span = fit.nccl_support(caps, facts.verdict("ipc").ok, fit.nccl_missing(caps))
        v = Verdict(ok, why, span)
        return v if facts.ranks is None else fit.for_these_ranks(facts.ranks, v)

    @classmethod
    def refuses(cls, call: str, dtype: str, op: str | None) -> str | None:
        if op is None or not CALLS[call].reduces:
            return None
        from cupy.cuda import nccl

        how = fit.nccl_reduction(dtype, op, int(nccl.get_version()))
        return how if isinstance(how, str) else None

    @classmethod
    def route(cls, ask: Ask, support: DeviceSupport) -> PathChoice | None:
        v = support.verdict(cls.name)
        if fit.auto_takes(ask.call) and ask.dtype in fit.NCCL_AUTO_DTYPES and v.takes(ask.nbytes):
            return PathChoice("nccl", f"device memory, {v.why}", "nccl")
        return None

    @classmethod
    def forced(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        return PathChoice(
            "nccl", "requested: NCCL on the caller's stream, bootstrapped over MPI", "nccl"
        )

    def __init__(self, setting: Setting, ops: ArrayOps, nc: NcclComm) -> None:
        super().__init__(setting, ops)
        self.nc = nc
        from cupy.cuda import nccl

        self._nccl = nccl

    @classmethod
    def make(cls, engines: Engines, ops: ArrayOps, inner: str) -> Engine:
        if ops.device is None:
            raise DeviceError("the nccl engine moves device arrays; this is host memory")
        s, dev = engines.setting, ops.device
        return cls(s, ops, engines.keep(("nccl", dev), lambda: NcclComm.open(s, dev)))

    def close(self) -> None:
        self.nc.close()  # shared by this device's engines; closing twice is a no-op

    # ------------------------------------------------------------------ helpers

    def _where(self) -> str:
        return f"rank {self.setting.rank} of {self.setting.size} on {socket.gethostname()}"

    def _k(self, name: str) -> int:
        return int(getattr(self._nccl, name))

    def _ptr(self, a: Flat | None, offset: int = 0) -> int:
        return 0 if a is None else self.ops.ptr(a) + offset * self.ops.itemsize(a)

    def _red(self, dtype: str, op: str) -> fit.Reduction:
        r = fit.nccl_reduction(dtype, op, self.nc.version)
        if isinstance(r, str):
            raise CommError(f"nccl engine ({self._where()}): {r}")
        return r

    @contextlib.contextmanager
    def _calls(self, what: str, *, group: bool = False) -> Iterator[int]:
        """Run NCCL calls on the caller's stream (yielded) and device, grouped (one launch)
        where ``group``; NCCL's errors become CommErrors naming this rank."""
        with self.ops.device_ctx():
            stream = caller_stream(self.ops)
            try:
                if group:
                    self._nccl.groupStart()
                try:
                    yield stream
                finally:
                    if group:
                        self._nccl.groupEnd()
            except self._nccl.NcclError as exc:
                raise CommError(
                    f"nccl {what} failed on {self._where()}: {exc}. Every rank must make the "
                    "same calls; `cudampi doctor` checks NCCL's settings."
                ) from exc

    def _copy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """This rank's own block: a device copy on the stream (no NCCL self send/recv)."""
        if nbytes and dst != src:
            import cupy

            cupy.cuda.runtime.memcpyAsync(
                dst, src, nbytes, cupy.cuda.runtime.memcpyDeviceToDevice, stream
            )

    def _divide(self, a: Any, dtype: str) -> None:
        """Finish ``avg`` on the caller's stream (the ArrayOps divide on their own stream);
        ``a`` is a torch tensor or a CuPy array, divided with its library's own ops."""
        n = self.setting.size
        if self.ops.lib == "torch":
            import torch

            if dtype in FLOAT or dtype in COMPLEX:
                a.div_(n)
            else:
                torch.floor_divide(a, n, out=a)
            return
        import cupy

        if dtype in FLOAT or dtype in COMPLEX:
            cupy.true_divide(a, a.dtype.type(n), out=a)
        else:
            cupy.floor_divide(a, a.dtype.type(n), out=a)

    # ------------------------------------------------------------------ collectives

    def allreduce(self, xf: Flat, of: Flat, op: str, dtype: str) -> None:
        n = int(xf.shape[0])
        if not n:
            return
        r = self._red(dtype, op)
        with self._calls("allreduce") as st:
            self.nc.comm.allReduce(
                self._ptr(xf), self._ptr(of), n * r.factor, self._k(r.dtype), self._k(r.op), st
            )
            if r.divide:
                self._divide(of, dtype)

    def reduce(
        self, xf: Flat, of: Flat, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        n = int(xf.shape[0])
        if not n:
            return
        r = self._red(dtype, op)
        with self._calls("reduce") as st:
            self.nc.comm.reduce(
                self._ptr(xf), self._ptr(of), n * r.factor, self._k(r.dtype), self._k(r.op),
                root, st,
            )  # fmt: skip
            if r.divide and self.setting.rank == root:
                self._divide(of, dtype)

    def broadcast(self, xf: Flat, root: int) -> None:
        nbytes = self.ops.nbytes(xf)
        if not nbytes:
            return
        with self._calls("broadcast") as st:
            p = self._ptr(xf)
            self.nc.comm.broadcast(p, p, nbytes, self._k("NCCL_UINT8"), root, st)

    def allgatherv(self, xf: Flat, of: Flat, counts: list[int]) -> None:
        isz = self.ops.itemsize(of)
        me = self.setting.rank
        if len(set(counts)) == 1:
            if counts[0]:
                with self._calls("allgather") as st:
                    self.nc.comm.allGather(
                        self._ptr(xf), self._ptr(of), counts[0] * isz, self._k("NCCL_UINT8"), st
                    )
            return
        offs = offsets(counts)
        with self._calls("allgatherv", group=True) as st:
            for p in range(self.setting.size):
                if p == me:
                    self._copy(self._ptr(of, offs[me]), self._ptr(xf), counts[me] * isz, st)
                    continue
                self._send(self._ptr(xf), counts[me] * isz, p, st)
                self._recv(self._ptr(of, offs[p]), counts[p] * isz, p, st)

    def gatherv(self, xf: Flat, of: Flat | None, counts: list[int], root: int) -> None:
        isz = self.ops.itemsize(xf)
        me = self.setting.rank
        offs = offsets(counts)
        with self._calls("gatherv", group=True) as st:
            if me != root:
                self._send(self._ptr(xf), counts[me] * isz, root, st)
                return
            for p in range(self.setting.size):
                if p == me:
                    self._copy(self._ptr(of, offs[me]), self._ptr(xf), counts[me] * isz, st)
                else:
                    self._recv(self._ptr(of, offs[p]), counts[p] * isz, p, st)

    def scatterv(self, xf: Flat | None, of: Flat, counts: list[int], root: int) -> None:
        isz = self.ops.itemsize(of)
        me = self.setting.rank
        offs = offsets(counts)
        with self._calls("scatterv", group=True) as st:
            if me != root:
                self._recv(self._ptr(of), counts[me] * isz, root, st)
                return
            for p in range(self.setting.size):
                if p == me:
                    self._copy(self._ptr(of), self._ptr(xf, offs[me]), counts[me] * isz, st)
                else:
                    self._send(self._ptr(xf, offs[p]), counts[p] * isz, p, st)

    def alltoallv(self, xf: Flat, send_counts: list[int], of: Flat, recv_counts: list[int]) -> None:
        isz = self.ops.itemsize(of)
        me = self.setting.rank
        so, ro = offsets(send_counts), offsets(recv_counts)
        with self._calls("alltoallv", group=True) as st:
            for p in range(self.setting.size):
                if p == me:
                    nbytes = send_counts[me] * isz  # == recv_counts[me]
                    self._copy(self._ptr(of, ro[me]), self._ptr(xf, so[me]), nbytes, st)
                    continue
                self._send(self._ptr(xf, so[p]), send_counts[p] * isz, p, st)
                self._recv(self._ptr(of, ro[p]), recv_counts[p] * isz, p, st)

    def reduce_scatterv(
        self, xf: Flat, of: Flat, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        if not any(counts):
            return
        r = self._red(dtype, op)
        me = self.setting.rank
        if len(set(counts)) == 1:
            with self._calls("reduce_scatter") as st:
                self.nc.comm.reduceScatter(
                    self._ptr(xf), self._ptr(of), counts[0] * r.factor, self._k(r.dtype),
                    self._k(r.op), st,
                )  # fmt: skip
                if r.divide:
                    self._divide(of, dtype)
            return
        # Uneven blocks: block i is a rooted reduce onto rank i, all of them in one group (the
        # receive buffer of a reduce is only written on its root).
        offs = offsets(counts)
        with self._calls("reduce_scatterv", group=True) as st:
            for root, count in enumerate(counts):
                if count:
                    self.nc.comm.reduce(
                        self._ptr(xf, offs[root]), self._ptr(of), count * r.factor,
                        self._k(r.dtype), self._k(r.op), root, st,
                    )  # fmt: skip
        if r.divide and counts[me]:
            with self._calls("reduce_scatterv"):
                self._divide(of, dtype)

    def _send(self, ptr: int, nbytes: int, peer: int, stream: int) -> None:
        if nbytes:
            self.nc.comm.send(ptr, nbytes, self._k("NCCL_UINT8"), peer, stream)

    def _recv(self, ptr: int, nbytes: int, peer: int, stream: int) -> None:
        if nbytes:
            self.nc.comm.recv(ptr, nbytes, self._k("NCCL_UINT8"), peer, stream)

    # ------------------------------------------------------------------ waiting

    def synchronize(self) -> None:
        """Wait for what this rank enqueued on the caller's stream, at most CUDAMPI_TIMEOUT
        (then the NCCL communicator is aborted: a rank is missing or mismatched), and raise
        what NCCL reported asynchronously."""
        import cupy

        timeout = self.setting.config.timeout
        with cupy.cuda.Device(self.ops.device):
            done = cupy.cuda.Event(disable_timing=True)
            done.record(cupy.cuda.ExternalStream(caller_stream(self.ops), self.ops.device))
            deadline = time.monotonic() + timeout
            while not done.done:
                self._check_async()
                if time.monotonic() > deadline:
                    self.nc.comm.abort()
                    self.nc.closed = True
                    raise CommError(
                        f"nccl: {self._where()} waited {timeout:g} s (CUDAMPI_TIMEOUT) for its "
                        "collectives to complete; another rank did not make the same call, or "
                        "died. The NCCL communicator was aborted: make a new Communicator."
                    )
                time.sleep(0.001)
        self._check_async()

    def _check_async(self) -> None:
        try:
            self.nc.comm.check_async_error()
        except self._nccl.NcclError as exc:
            raise CommError(f"nccl reported an error on {self._where()}: {exc}") from exc
