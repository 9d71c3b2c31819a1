"""The ``mpi`` engine: the MPI library's own collectives and point-to-point on the arrays' memory.

It runs the ``host`` and ``native`` paths, direct device point-to-point, and, on host buffers,
the inside of the staged engine. Buffers are handed to MPI by address, so the same calls serve
host arrays and, where `cudampi doctor` proved the library handles them, device arrays.
Reductions need an MPI datatype and op: float16 and bfloat16 have none here, so paths choose
cudampi's own algorithms (the ``alg`` engine) for them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cudampi.comm.algorithms import offsets
from cudampi.comm.deadline import wait_request
from cudampi.comm.engines.base import Engine
from cudampi.comm.handle import Handle
from cudampi.comm.ops import ArrayOps
from cudampi.comm.transport import mem, opens_sequence, recv_into, recv_rest, typed_mem

NO_MPI_TYPE = ("float16", "bfloat16")


_TYPES: dict[str, Any] = {}
_OPS: dict[tuple[str, bool], Any] = {}


def mpi_type(dtype: str) -> Any:
    """The MPI datatype for ``dtype``, or None where MPI has none cudampi trusts."""
    if dtype in NO_MPI_TYPE:
        return None
    if not _TYPES:
        from mpi4py import MPI

        _TYPES.update(
            {
                "bool": MPI.C_BOOL,
                "int8": MPI.INT8_T,
                "int16": MPI.INT16_T,
                "int32": MPI.INT32_T,
                "int64": MPI.INT64_T,
                "uint8": MPI.UINT8_T,
                "uint16": MPI.UINT16_T,
                "uint32": MPI.UINT32_T,
                "uint64": MPI.UINT64_T,
                "float32": MPI.FLOAT,
                "float64": MPI.DOUBLE,
                "complex64": MPI.C_FLOAT_COMPLEX,
                "complex128": MPI.C_DOUBLE_COMPLEX,
            }
        )
    return _TYPES[dtype]


def mpi_op(op: str, dtype: str) -> Any:
    """The MPI op for ``op`` on ``dtype`` (bool: logical ops; avg: SUM, divided afterwards)."""
    if not _OPS:
        from mpi4py import MPI

        for name, lop in (
            ("sum", MPI.LOR),
            ("max", MPI.LOR),
            ("bor", MPI.LOR),
            ("prod", MPI.LAND),
            ("min", MPI.LAND),
            ("band", MPI.LAND),
            ("bxor", MPI.LXOR),
        ):
            _OPS[(name, True)] = lop
        for name, aop in (
            ("sum", MPI.SUM),
            ("avg", MPI.SUM),
            ("prod", MPI.PROD),
            ("min", MPI.MIN),
            ("max", MPI.MAX),
            ("band", MPI.BAND),
            ("bor", MPI.BOR),
            ("bxor", MPI.BXOR),
        ):
            _OPS[(name, False)] = aop
    return _OPS[(op, dtype == "bool")]


def can_reduce(dtype: str) -> bool:
    return dtype not in NO_MPI_TYPE


def _typed(ops: ArrayOps, a: Any, dtype: str) -> Any:
    n = ops.nbytes(a)
    return typed_mem(ops.ptr(a), n, int(a.shape[0]), mpi_type(dtype))


def _bytes(ops: ArrayOps, a: Any) -> Any:
    return mem(ops.ptr(a), ops.nbytes(a))


def _vec(ops: ArrayOps, a: Any, counts: list[int], itemsize: int) -> Any:
    from mpi4py import MPI

    b = [c * itemsize for c in counts]
    buf = mem(ops.ptr(a), ops.nbytes(a))[0]
    return [buf, (b, offsets(b)), MPI.BYTE]


def _overlap(ops: ArrayOps, a: Any, b: Any) -> bool:
    na, nb = ops.nbytes(a), ops.nbytes(b)
    if not na or not nb:
        return False
    pa, pb = ops.ptr(a), ops.ptr(b)
    return pa < pb + nb and pb < pa + na


def _apart(ops: ArrayOps, a: Any, b: Any) -> Any:
    """``a``, or a copy of it where it overlaps ``b``: MPI forbids aliased send and receive
    buffers (MPICH checks: "Buffers must not be aliased"; FSDP2 all-gathers a shard that lives
    inside the output)."""
    if not _overlap(ops, a, b):
        return a
    tmp = ops.empty(max(1, int(a.shape[0])), a)[: int(a.shape[0])]
    ops.copy(tmp, a)
    ops.fence()
    return tmp


def _gather_send(
    ops: ArrayOps, send: Any, out: Any, counts: list[int], itemsize: int, rank: int
) -> Any:
    """The send buffer of an (all)gather: MPI_IN_PLACE when ``send`` is exactly this rank's
    block of ``out``; a copy when it overlaps ``out`` anywhere else."""
    from mpi4py import MPI

    if not _overlap(ops, send, out):
        return _bytes(ops, send)
    b = [c * itemsize for c in counts]
    if ops.ptr(send) == ops.ptr(out) + offsets(b)[rank] and ops.nbytes(send) == b[rank]:
        return MPI.IN_PLACE
    return _bytes(ops, _apart(ops, send, out))


def allreduce(comm: Any, ops: ArrayOps, send: Any, out: Any, op: str, dtype: str) -> None:
    """``out`` = reduction of every rank's ``send`` (``send is out``: in place)."""
    from mpi4py import MPI

    if int(out.shape[0]) == 0:
        return
    sbuf = MPI.IN_PLACE if send is out else _typed(ops, send, dtype)
    comm.Allreduce(sbuf, _typed(ops, out, dtype), mpi_op(op, dtype))


def reduce(comm: Any, ops: ArrayOps, send: Any, out: Any, op: str, dtype: str, root: int) -> None:
    from mpi4py import MPI

    if int(send.shape[0]) == 0:
        return
    if comm.rank == root:
        sbuf = MPI.IN_PLACE if send is out else _typed(ops, send, dtype)
        comm.Reduce(sbuf, _typed(ops, out, dtype), mpi_op(op, dtype), root)
    else:
        comm.Reduce(_typed(ops, send, dtype), None, mpi_op(op, dtype), root)


def broadcast(comm: Any, ops: ArrayOps, data: Any, root: int) -> None:
    if ops.nbytes(data):
        comm.Bcast(_bytes(ops, data), root)


def allgatherv(
    comm: Any, ops: ArrayOps, send: Any, out: Any, counts: list[int], itemsize: int
) -> None:
    sbuf = _gather_send(ops, send, out, counts, itemsize, comm.rank)
    comm.Allgatherv(sbuf, _vec(ops, out, counts, itemsize))


def gatherv(
    comm: Any, ops: ArrayOps, send: Any, out: Any, counts: list[int], itemsize: int, root: int
) -> None:
    if comm.rank != root:
        comm.Gatherv(_bytes(ops, send), None, root)
        return
    sbuf = _gather_send(ops, send, out, counts, itemsize, root)
    comm.Gatherv(sbuf, _vec(ops, out, counts, itemsize), root)


def scatterv(
    comm: Any, ops: ArrayOps, send: Any, out: Any, counts: list[int], itemsize: int, root: int
) -> None:
    sbuf = _vec(ops, _apart(ops, send, out), counts, itemsize) if comm.rank == root else None
    comm.Scatterv(sbuf, _bytes(ops, out), root)


def reduce_scatterv(
    comm: Any, ops: ArrayOps, send: Any, out: Any, counts: list[int], op: str, dtype: str
) -> None:
    if sum(counts) == 0:
        return
    comm.Reduce_scatter(
        _typed(ops, _apart(ops, send, out), dtype),
        _typed(ops, out, dtype),
        counts,
        mpi_op(op, dtype),
    )


def alltoallv(
    comm: Any,
    ops: ArrayOps,
    send: Any,
    scounts: list[int],
    out: Any,
    rcounts: list[int],
    itemsize: int,
) -> None:
    sbuf = _vec(ops, _apart(ops, send, out), scounts, itemsize)
    comm.Alltoallv(sbuf, _vec(ops, out, rcounts, itemsize))


# ---------------------------------------------------------------------------- point-to-point


def request_handle(what: str, req: Any, keep: Any = None, timeout: float | None = None) -> Handle:
    """A handle over one MPI request; ``keep`` (a staging buffer) lives until it completes;
    ``timeout``: its wait's deadline."""

    def poll(block: bool) -> bool:
        _ = keep
        if block:
            req.Wait()
            return True
        return bool(req.Test())

    return Handle(what, poll, timeout)


def irecv_handle(
    comm: Any,
    ptr: int,
    nbytes: int,
    source: int,
    tag: int,
    chunk_bytes: int,
    then: Callable[[int], None] | None = None,
    timeout: float | None = None,
) -> Handle:
    """A non-blocking receive of up to ``nbytes`` at ``ptr`` that also accepts a staged sender's
    chunk sequence; ``then(got)`` runs once the bytes are in (the staged engine copies them to
    the device there)."""
    from mpi4py import MPI

    status = MPI.Status()
    req = comm.Irecv(mem(ptr, nbytes), source, tag)

    def finish() -> None:
        got = status.Get_count(MPI.BYTE)
        if opens_sequence(got, nbytes, chunk_bytes):
            # a chunked (staged) sender: the rest follows from the same rank
            recv_rest(comm, ptr, nbytes, got, status.Get_source(), tag)
            got = nbytes
        if then is not None:
            then(got)

    def poll(block: bool) -> bool:
        if block:
            req.Wait(status)
        elif not req.Test(status):
            return False
        finish()
        return True

    return Handle(f"irecv from rank {source} (tag {tag})", poll, timeout)


# ---------------------------------------------------------------------------- the engine


class DirectP2P(Engine):
    """User point-to-point straight on the arrays' memory (the ``mpi`` and ``alg`` engines);
    every wait has the communicator's deadline."""

    def send(self, f: Any, dest: int, tag: int) -> None:
        req = self.setting.p2p.Isend(mem(self.ops.ptr(f), self.ops.nbytes(f)), dest, tag)
        wait_request(req, self.setting.config.timeout, f"send to rank {dest} (tag {tag})")

    def recv(self, f: Any, source: int, tag: int) -> None:
        s = self.setting
        recv_into(
            s.p2p,
            self.ops.ptr(f),
            self.ops.nbytes(f),
            source,
            tag,
            s.config.chunk_bytes,
            s.config.timeout,
        )

    def isend(self, f: Any, dest: int, tag: int) -> Handle:
        req = self.setting.p2p.Isend(mem(self.ops.ptr(f), self.ops.nbytes(f)), dest, tag)
        return request_handle(
            f"isend to rank {dest} (tag {tag})", req, timeout=self.setting.config.timeout
        )

    def irecv(self, f: Any, source: int, tag: int) -> Handle:
        s = self.setting
        return irecv_handle(
            s.p2p,
            self.ops.ptr(f),
            self.ops.nbytes(f),
            source,
            tag,
            s.config.chunk_bytes,
            timeout=s.config.timeout,
        )


class MpiEngine(DirectP2P):
    """MPI's own collectives on the arrays (see :mod:`cudampi.comm.engines.base`)."""

    name = "mpi"

    def _isz(self, a: Any) -> int:
        return self.ops.itemsize(a)

    def allreduce(self, xf: Any, of: Any, op: str, dtype: str) -> None:
        allreduce(self.setting.coll, self.ops, xf, of, op, dtype)
        self.finish_avg(of, op, dtype)

    def reduce(
        self, xf: Any, of: Any, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        reduce(self.setting.coll, self.ops, xf, of, op, dtype, root)
        if self.setting.rank == root:
            self.finish_avg(of, op, dtype)

    def broadcast(self, xf: Any, root: int) -> None:
        broadcast(self.setting.coll, self.ops, xf, root)

    def allgatherv(self, xf: Any, of: Any, counts: list[int]) -> None:
        allgatherv(self.setting.coll, self.ops, xf, of, counts, self._isz(xf))

    def gatherv(self, xf: Any, of: Any | None, counts: list[int], root: int) -> None:
        gatherv(self.setting.coll, self.ops, xf, of, counts, self._isz(xf), root)

    def scatterv(self, xf: Any | None, of: Any, counts: list[int], root: int) -> None:
        scatterv(self.setting.coll, self.ops, xf, of, counts, self._isz(of), root)

    def reduce_scatterv(
        self, xf: Any, of: Any, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        reduce_scatterv(self.setting.coll, self.ops, xf, of, counts, op, dtype)
        self.finish_avg(of, op, dtype)

    def alltoallv(self, xf: Any, send_counts: list[int], of: Any, recv_counts: list[int]) -> None:
        alltoallv(self.setting.coll, self.ops, xf, send_counts, of, recv_counts, self._isz(xf))
