"""The ``nccl`` engine: NVIDIA's NCCL, bootstrapped over MPI, on the caller's stream.

Where every rank of a communicator drives a GPU of its own and NCCL is importable, the engine
makes one NCCL communicator per cudampi communicator and device: rank 0 asks NCCL for a unique
id, MPI broadcasts it on the host, every rank calls ``ncclCommInitRank`` (no MASTER_ADDR, no TCP
store). NCCL's own settings (``NCCL_SOCKET_IFNAME``, ``NCCL_IB_*``...) come from the environment
``cudampi launch`` gives every rank. Ranks that share a GPU cannot use it (NCCL refuses them;
they keep ``ipc``): :func:`nccl_usable` says where it can run, for the path choice and the
doctor, from facts gathered on every rank.

The binding is CuPy's ``cupy.cuda.nccl`` (public, stream-ordered, raw pointers: it serves torch
tensors and CuPy arrays alike, and CuPy is already the ipc engine's dependency); docs/torch.md
says why not torch's ProcessGroupNCCL or nccl4py. Every call is enqueued on the caller's
current CUDA stream (``stream_ordered``) with no host synchronisation and no MPI call, so it can
be captured in a CUDA graph; errors surface at ``Communicator.synchronize()``, which also gives
up after ``CUDAMPI_TIMEOUT`` (NCCL itself would wait forever for a rank that never calls).

Reductions run in NCCL's datatypes (:func:`nccl_reduction`: float16/bfloat16/float32/float64,
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
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from cudampi.comm.algorithms import offsets
from cudampi.comm.arrays import COMPLEX, FLOAT, ArrayOps
from cudampi.comm.engines.base import CollectivesOnly, Engine, Engines, Setting, caller_stream
from cudampi.errors import CommError, DeviceError

AVG_SINCE = 21000
"""``ncclGetVersion`` code of NCCL 2.10.0, the first with ``ncclAvg``."""

_INT = {
    "int8": "NCCL_INT8",
    "uint8": "NCCL_UINT8",
    "int32": "NCCL_INT32",
    "uint32": "NCCL_UINT32",
    "int64": "NCCL_INT64",
    "uint64": "NCCL_UINT64",
}
_FLOAT = {
    "float16": "NCCL_FLOAT16",
    "bfloat16": "NCCL_BFLOAT16",
    "float32": "NCCL_FLOAT32",
    "float64": "NCCL_FLOAT64",
}
_COMPLEX = {"complex64": "NCCL_FLOAT32", "complex128": "NCCL_FLOAT64"}
_OPS = {"sum": "NCCL_SUM", "prod": "NCCL_PROD", "min": "NCCL_MIN", "max": "NCCL_MAX"}
_BOOL_OPS = {
    "sum": "NCCL_MAX",
    "max": "NCCL_MAX",
    "bor": "NCCL_MAX",
    "prod": "NCCL_MIN",
    "min": "NCCL_MIN",
    "band": "NCCL_MIN",
}
_ELSEWHERE = "Use path 'ipc' or 'gpu-ring' for it."


@dataclass(frozen=True)
class Reduction:
    """How one (dtype, op) reduction runs in NCCL."""

    dtype: str
    """The ``cupy.cuda.nccl`` datatype constant (``NCCL_FLOAT32``...)."""
    op: str
    """The ``cupy.cuda.nccl`` op constant (``NCCL_SUM``...)."""
    factor: int = 1
    """NCCL elements per element (complex: 2 reals)."""
    divide: bool = False
    """Finish ``avg`` by dividing the sum on the caller's stream."""


def nccl_reduction(dtype: str, op: str, version: int) -> Reduction | str:
    """How NCCL ``version`` (``ncclGetVersion``'s code) reduces ``dtype`` with ``op``, or why it
    cannot (a sentence naming the value and what to use instead). ``op`` is valid for ``dtype``
    (the Communicator checked it)."""
    has_avg = version >= AVG_SINCE
    if dtype in _FLOAT or dtype in _COMPLEX:
        nd = _FLOAT.get(dtype) or _COMPLEX[dtype]
        factor = 2 if dtype in _COMPLEX else 1
        if op == "avg":
            if has_avg:
                return Reduction(nd, "NCCL_AVG", factor)
            return Reduction(nd, "NCCL_SUM", factor, divide=True)
        if dtype in _COMPLEX and op != "sum":
            return f"NCCL reduces {dtype} as pairs of reals: sum and avg, not {op!r}. {_ELSEWHERE}"
        return Reduction(nd, _OPS[op], factor)
    if dtype == "bool":
        if op not in _BOOL_OPS:
            return f"NCCL has no logical xor ({op!r} on bool). {_ELSEWHERE}"
        return Reduction("NCCL_UINT8", _BOOL_OPS[op])
    if dtype in _INT:
        if op in ("band", "bor", "bxor"):
            return f"NCCL has no bitwise reductions ({op!r} on {dtype}). {_ELSEWHERE}"
        if op == "avg":
            if dtype in ("uint32", "uint64"):
                return f"avg of {dtype} (the sum floor-divided) is not done here. {_ELSEWHERE}"
            return Reduction(_INT[dtype], "NCCL_SUM", divide=True)
        return Reduction(_INT[dtype], _OPS[op])
    return f"NCCL has no {dtype} datatype to reduce in. {_ELSEWHERE}"


# ------------------------------------------------------------------ where it can run


@dataclass(frozen=True)
class RankGpu:
    """One rank's GPU, as the ranks tell each other (:func:`local_gpu`)."""

    host: str
    gpu: str | None
    """The GPU's PCI bus id (unique on its host; MIG instances of one GPU share it); None: no
    GPU."""


def nccl_usable(
    ranks_gpus: Sequence[RankGpu],
    importable: str | Sequence[str | None] | None,
    measured: str | None = None,
) -> str | None:
    """None where the nccl engine can run a communicator of these ranks, else why not.

    ``ranks_gpus``: every rank's GPU, in rank order. ``importable``: why NCCL cannot be imported
    (:func:`available`), one value for every rank or one per rank; None: it can. ``measured``:
    why the probe did not prove NCCL here (:func:`measured_why`); None: it did, or the caller
    does not ask for it (an explicit request). Every rank needs a GPU of its own: NCCL refuses
    two ranks on one GPU ("Duplicate GPU detected"), and those ranks keep ``ipc``.
    """
    if importable is None or isinstance(importable, str):
        whys = [importable] * len(ranks_gpus)
    else:
        whys = list(importable)
    for rank, why in enumerate(whys):
        if why is not None:
            return f"NCCL is not importable on rank {rank}: {why}"
    no_gpu = [r for r, g in enumerate(ranks_gpus) if g.gpu is None]
    if no_gpu:
        return f"rank(s) {_ranks(no_gpu)} have no GPU; NCCL moves device memory only"
    owners: dict[tuple[str, str], list[int]] = {}
    for rank, g in enumerate(ranks_gpus):
        assert g.gpu is not None
        owners.setdefault((g.host, g.gpu), []).append(rank)
    shared = [(key, ranks) for key, ranks in owners.items() if len(ranks) > 1]
    if shared:
        (host, gpu), ranks = shared[0]
        return (
            f"ranks {_ranks(ranks)} share the GPU at PCI {gpu} on {host}"
            + (f" ({len(shared)} GPUs are shared)" if len(shared) > 1 else "")
            + "; NCCL needs one GPU per rank (ranks that share a GPU keep 'ipc')"
        )
    if measured is not None:
        return f"NCCL was not measured here: {measured}"
    return None


def ranks_can_use(coll: Any, proven: bool) -> str | None:
    """Collective over ``coll`` (ranks of one node): None where auto may give this
    communicator's device collectives to the nccl engine, else why not. ``proven``: this rank's
    probe result proves NCCL (every rank must say so); then each rank's current CUDA device is
    what NCCL would run on (set it before making the communicator, as torch asks)."""
    me: tuple[bool, str | None, RankGpu | None] = (proven, None, None)
    if proven:
        why = available()
        gpu = None
        if why is None:
            try:
                gpu = local_gpu(current_device())
            except Exception as exc:  # no usable device on this rank: say so, on every rank
                why = f"no CUDA device to query ({type(exc).__name__}: {exc})"
        me = (True, why, gpu)
    seen = coll.allgather(me) if coll.size > 1 else [me]
    if not all(p for p, _, _ in seen):
        return "not every rank's probe result proves the nccl engine"
    return nccl_usable([g or RankGpu("", None) for _, _, g in seen], [w for _, w, _ in seen])


def measured_why(outcome: Any) -> str | None:
    """Why a probe outcome (a :class:`~cudampi.probe.capabilities.ProbeOutcome` or None) does not
    prove NCCL here; None where it does."""
    if outcome is None:
        return "no NCCL probe result for this stack (run `cudampi doctor`)"
    if not outcome.ok:
        detail = f": {outcome.detail}" if outcome.detail else ""
        return f"the probe found NCCL {outcome.status}{detail}"
    return None


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def available() -> str | None:
    """None where NCCL can be imported here (CuPy's binding and a libnccl it loads), else why."""
    try:
        from cupy.cuda import nccl
    except ImportError as exc:
        return f"CuPy is not installed ({exc}); pip install 'cudampi[cu12]' or 'cudampi[cu13]'"
    if not getattr(nccl, "available", False):
        return (
            "CuPy finds no NCCL library; pip install nvidia-nccl-cu12 or nvidia-nccl-cu13 (the "
            "wheel torch's CUDA builds use)"
        )
    return None


def current_device() -> int:
    """The CUDA runtime's current device of this thread (what torch.cuda.set_device and CuPy's
    Device.use set)."""
    import cupy

    return int(cupy.cuda.runtime.getDevice())


def local_gpu(device: int | None) -> RankGpu:
    """This rank's :class:`RankGpu` for CUDA ``device`` (None: no GPU)."""
    host = socket.gethostname()
    if device is None:
        return RankGpu(host, None)
    import cupy

    return RankGpu(host, str(cupy.cuda.runtime.deviceGetPCIBusId(device)))


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
        why = available()
        me = RankGpu(socket.gethostname(), None)
        if why is None:
            try:
                me = local_gpu(device)
            except Exception as exc:  # a CUDA error on this rank: the others must hear of it
                why = f"cuda:{device} cannot be queried ({type(exc).__name__}: {exc})"
        seen = s.coll.allgather((why, me))
        usable = nccl_usable([g for _, g in seen], [w for w, _ in seen])
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
                f"{_ranks([r for r, _ in failed])} (rank {r} on {seen[r][1].host}: {e}). Check "
                "the NCCL_* settings with `cudampi doctor`, or use path 'ipc'."
            )
        return cls(comm, device, int(nccl.get_version()))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.comm.destroy()


class NcclEngine(CollectivesOnly):
    name = "nccl"
    stream_ordered = True

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

    def _ptr(self, a: Any, offset: int = 0) -> int:
        return 0 if a is None else self.ops.ptr(a) + offset * self.ops.itemsize(a)

    def _red(self, dtype: str, op: str) -> Reduction:
        r = nccl_reduction(dtype, op, self.nc.version)
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
        """Finish ``avg`` on the caller's stream (the ArrayOps divide on their own stream)."""
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

    def allreduce(self, xf: Any, of: Any, op: str, dtype: str) -> None:
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
        self, xf: Any, of: Any, op: str, dtype: str, root: int, *, scratch: bool = False
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

    def broadcast(self, xf: Any, root: int) -> None:
        nbytes = self.ops.nbytes(xf)
        if not nbytes:
            return
        with self._calls("broadcast") as st:
            p = self._ptr(xf)
            self.nc.comm.broadcast(p, p, nbytes, self._k("NCCL_UINT8"), root, st)

    def allgatherv(self, xf: Any, of: Any, counts: list[int]) -> None:
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

    def gatherv(self, xf: Any, of: Any | None, counts: list[int], root: int) -> None:
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

    def scatterv(self, xf: Any | None, of: Any, counts: list[int], root: int) -> None:
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

    def alltoallv(self, xf: Any, send_counts: list[int], of: Any, recv_counts: list[int]) -> None:
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
        self, xf: Any, of: Any, counts: list[int], op: str, dtype: str, *, scratch: bool = False
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
