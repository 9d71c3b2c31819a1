"""The ``mpi`` engine: the MPI library's own collectives and point-to-point on the arrays' memory.

It runs the ``host`` and ``native`` paths, direct device point-to-point, and, on host buffers,
the inside of the staged engine. Buffers are handed to MPI by address, so the same calls serve
host arrays and, where `cudampi doctor` proved the library handles them, device arrays.
Reductions need an MPI datatype and op: float16 and bfloat16 have none here, so paths choose
cudampi's own algorithms (the ``alg`` engine) for them. What the reductions promise
(:data:`cudampi.comm.arrays.base.SEMANTICS`) holds here too: MPI's MAX and MIN drop NaN on
floats (C's comparisons), so float max/min on host memory reduce with a user op of NumPy's
``maximum``/``minimum`` (:func:`nan_op`; docs/reliability.md has its cost), and on device memory
with cudampi's algorithm; ``avg`` divides each rank's value before MPI's SUM.

Counts and displacements are C ints in MPI's classic calls (and the large-count ``_c`` calls of
the Open MPI 5.0 wheel refuse more with MPI_ERR_ARG): messages of 2 GiB and more run in pieces
(allreduce, reduce, broadcast) or, for the vector collectives, through cudampi's algorithms,
whose messages are cut to size (:data:`cudampi.comm.transport.COUNT_LIMIT`); user messages as
a chunk sequence (:mod:`cudampi.comm.engines.p2p`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cudampi.comm import transport
from cudampi.comm.algorithms import offsets
from cudampi.comm.arrays import ArrayOps, Flat, nan_aware
from cudampi.comm.choice import Ask, DeviceSupport, Facts, PathChoice, Verdict
from cudampi.comm.engines.base import Engine
from cudampi.comm.engines.p2p import DirectP2P, apart, bytes_spec, message_route, overlap
from cudampi.comm.transport import mem, pieces, typed_mem
from cudampi.errors import DeviceError

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

NO_MPI_TYPE = ("float16", "bfloat16")


_TYPES: dict[str, Any] = {}
_OPS: dict[tuple[str, str], Any] = {}


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
    """The MPI op for ``op`` on ``dtype`` in host memory (bool: logical ops; avg: SUM of the
    divided values; float max/min: :func:`nan_op`)."""
    found = _OPS.get((op, dtype))
    if found is None:
        found = _OPS[(op, dtype)] = _make_op(op, dtype)
    return found


def _make_op(op: str, dtype: str) -> Any:
    from mpi4py import MPI

    if nan_aware(op, dtype):
        return nan_op(op)
    if dtype == "bool":
        logical = {"sum": "LOR", "max": "LOR", "bor": "LOR", "prod": "LAND", "min": "LAND"}
        return getattr(MPI, logical.get(op) or {"band": "LAND", "bxor": "LXOR"}[op])
    return getattr(MPI, "SUM" if op == "avg" else op.upper())


_NAN_OPS: dict[str, Any] = {}


def nan_op(op: str) -> Any:
    """A commutative MPI user op for float max/min that propagates NaN: NumPy's ``maximum`` /
    ``minimum`` on the two buffers MPI hands it (host memory, float32 or float64)."""
    if op not in _NAN_OPS:
        import numpy
        from mpi4py import MPI

        fn = numpy.maximum if op == "max" else numpy.minimum

        def combine(inbuf: Any, inoutbuf: Any, datatype: Any) -> None:
            kind = numpy.float32 if datatype.Get_size() == 4 else numpy.float64
            acc = numpy.frombuffer(inoutbuf, dtype=kind)
            fn(numpy.frombuffer(inbuf, dtype=kind), acc, out=acc)

        _NAN_OPS[op] = MPI.Op.Create(combine, commute=True)
    return _NAN_OPS[op]


def can_reduce(dtype: str) -> bool:
    return dtype not in NO_MPI_TYPE


def _typed(ops: ArrayOps, a: Flat, dtype: str) -> Any:
    if ops.lib == "numpy":  # mpi4py reads a NumPy array's buffer itself, cheaper than an address
        return [a, int(a.shape[0]), mpi_type(dtype)]
    n = ops.nbytes(a)
    return typed_mem(ops.ptr(a), n, int(a.shape[0]), mpi_type(dtype))


def _vec(ops: ArrayOps, a: Flat, counts: list[int], itemsize: int) -> Any:
    from mpi4py import MPI

    b = [c * itemsize for c in counts]
    buf = mem(ops.ptr(a), ops.nbytes(a))[0]
    return [buf, (b, offsets(b)), MPI.BYTE]


def _gather_send(
    ops: ArrayOps, send: Flat, out: Flat, counts: list[int], itemsize: int, rank: int
) -> Any:
    """The send buffer of an (all)gather: MPI_IN_PLACE when ``send`` is exactly this rank's
    block of ``out``; a copy when it overlaps ``out`` anywhere else."""
    from mpi4py import MPI

    if not overlap(ops, send, out):
        return bytes_spec(ops, send)
    b = [c * itemsize for c in counts]
    if ops.ptr(send) == ops.ptr(out) + offsets(b)[rank] and ops.nbytes(send) == b[rank]:
        return MPI.IN_PLACE
    return bytes_spec(ops, apart(ops, send, out))


def allreduce(comm: Comm, ops: ArrayOps, send: Flat, out: Flat, op: str, dtype: str) -> None:
    """``out`` = reduction of every rank's ``send`` (``send is out``: in place)."""
    from mpi4py import MPI

    if int(out.shape[0]) == 0:
        return
    sbuf = MPI.IN_PLACE if send is out else _typed(ops, send, dtype)
    comm.Allreduce(sbuf, _typed(ops, out, dtype), mpi_op(op, dtype))


def reduce(
    comm: Comm, ops: ArrayOps, send: Flat, out: Flat, op: str, dtype: str, root: int
) -> None:
    from mpi4py import MPI

    if int(send.shape[0]) == 0:
        return
    if comm.rank == root:
        sbuf = MPI.IN_PLACE if send is out else _typed(ops, send, dtype)
        comm.Reduce(sbuf, _typed(ops, out, dtype), mpi_op(op, dtype), root)
    else:
        comm.Reduce(_typed(ops, send, dtype), None, mpi_op(op, dtype), root)


def broadcast(comm: Comm, ops: ArrayOps, data: Flat, root: int) -> None:
    if ops.nbytes(data):
        comm.Bcast(bytes_spec(ops, data), root)


def allgatherv(
    comm: Comm, ops: ArrayOps, send: Flat, out: Flat, counts: list[int], itemsize: int
) -> None:
    sbuf = _gather_send(ops, send, out, counts, itemsize, comm.rank)
    comm.Allgatherv(sbuf, _vec(ops, out, counts, itemsize))


def gatherv(
    comm: Comm,
    ops: ArrayOps,
    send: Flat,
    out: Flat | None,
    counts: list[int],
    itemsize: int,
    root: int,
) -> None:
    if comm.rank != root:
        comm.Gatherv(bytes_spec(ops, send), None, root)
        return
    assert out is not None  # (the root has the output)
    sbuf = _gather_send(ops, send, out, counts, itemsize, root)
    comm.Gatherv(sbuf, _vec(ops, out, counts, itemsize), root)


def scatterv(
    comm: Comm,
    ops: ArrayOps,
    send: Flat | None,
    out: Flat,
    counts: list[int],
    itemsize: int,
    root: int,
) -> None:
    sbuf = None
    if comm.rank == root:
        assert send is not None  # (the root has the input)
        sbuf = _vec(ops, apart(ops, send, out), counts, itemsize)
    comm.Scatterv(sbuf, bytes_spec(ops, out), root)


def reduce_scatterv(
    comm: Comm, ops: ArrayOps, send: Flat, out: Flat, counts: list[int], op: str, dtype: str
) -> None:
    if sum(counts) == 0:
        return
    comm.Reduce_scatter(
        _typed(ops, apart(ops, send, out), dtype),
        _typed(ops, out, dtype),
        counts,
        mpi_op(op, dtype),
    )


def alltoallv(
    comm: Comm,
    ops: ArrayOps,
    send: Flat,
    scounts: list[int],
    out: Flat,
    rcounts: list[int],
    itemsize: int,
) -> None:
    sbuf = _vec(ops, apart(ops, send, out), scounts, itemsize)
    comm.Alltoallv(sbuf, _vec(ops, out, rcounts, itemsize))


# ---------------------------------------------------------------------------- the engine


class MpiEngine(DirectP2P):
    """MPI's own collectives on the arrays (see :mod:`cudampi.comm.engines.base`): the ``host``
    path, and ``native`` on device arrays where the probe proved MPI's device collectives."""

    name = "mpi"
    paths = ("host", "native")

    @classmethod
    def verdict(cls, facts: Facts) -> Verdict:
        mpi = facts.mpi
        return Verdict(mpi.collectives, mpi.collectives_why)

    @classmethod
    def route(cls, ask: Ask, support: DeviceSupport) -> PathChoice | None:
        if ask.call.p2p:
            return message_route(ask, support)
        if not ask.on_device:
            if ask.no_mpi:
                return None  # the alg engine reduces what MPI cannot
            return PathChoice("host", "host memory: MPI's own collective", "mpi")
        if support.collectives and not ask.no_mpi:
            return PathChoice("native", f"device memory, {support.collectives_why}", "mpi")
        return None

    @classmethod
    def forced(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        asked = ask.requested
        if ask.call.p2p:
            route = message_route(ask, support)
            assert route is not None  # (None only for auto)
            return route
        if not ask.on_device:
            if ask.no_mpi:
                return PathChoice(
                    asked,
                    f"host memory; MPI has no {ask.dtype} reduction, so cudampi's algorithm "
                    "reduces it",
                    "alg",
                )
            return PathChoice(asked, "host memory: MPI's own collective", "mpi")
        call = ask.call.name
        if asked == "host":
            raise DeviceError(
                f"{call}: path='host' takes host arrays, got a device array. Use path='staged' "
                "(or auto) for device arrays, or pass a host array."
            )
        if not support.collectives:
            raise DeviceError(
                f"{call}: path='native' hands device buffers to MPI's own collectives, which is "
                f"not proven here ({support.collectives_why}); on stacks that fail this probe it "
                "segfaults. Use path='gpu-ring' or 'staged', or set CUDAMPI_NATIVE_COLLECTIVES=yes."
            )
        if not ask.no_mpi:
            return PathChoice("native", f"requested; {support.collectives_why}", "mpi")
        if support.p2p:
            return PathChoice(
                "native",
                f"requested; MPI has no {ask.dtype} reduction, so cudampi's algorithm runs over "
                "device p2p",
                "alg",
            )
        return PathChoice(
            "staged",
            f"requested native, but MPI has no {ask.dtype} reduction and device p2p is not "
            f"proven ({support.p2p_why}): staged",
            "staged",
            "alg",
        )

    def _isz(self, a: Flat) -> int:
        return self.ops.itemsize(a)

    def _large(self) -> Engine:
        """cudampi's algorithms on the same arrays, for vector collectives over the limit."""
        return self.peer("alg")

    def _nan_on_device(self, op: str, dtype: str) -> bool:
        """Float max/min on device memory: MPI's MAX/MIN drop NaN and a user op cannot read
        device memory, so cudampi's algorithm reduces them (on the same arrays)."""
        return self.ops.device is not None and nan_aware(op, dtype)

    def _shares(
        self, xf: Flat, dtype: str, into: Flat | None = None, scratch: bool = False
    ) -> Flat:
        """``avg``: this rank's share, ``xf`` divided by the number of ranks (before the sum:
        :data:`~cudampi.comm.arrays.base.SEMANTICS`), into ``into`` (else in place where ``xf``
        is a scratch copy, else a new array), ready for MPI to read."""
        if into is None:
            into = xf if scratch else self.ops.scratch(int(xf.shape[0]), xf)
        self.ops.divide(into, self.setting.size, dtype, None if into is xf else apart(
            self.ops, xf, into))  # fmt: skip
        self.ops.fence()
        return into

    def allreduce(self, xf: Flat, of: Flat, op: str, dtype: str) -> None:
        if self._nan_on_device(op, dtype):
            return self.peer("alg").allreduce(xf, of, op, dtype)
        if op == "avg":
            xf = self._shares(xf, dtype, of)
        if int(of.shape[0]) <= transport.COUNT_LIMIT:  # one MPI call (nearly every call)
            allreduce(self.setting.coll, self.ops, xf, of, op, dtype)
            return
        for lo, hi in pieces(int(of.shape[0])):
            out = of if hi - lo == int(of.shape[0]) else of[lo:hi]
            send = out if xf is of else (xf if out is of else xf[lo:hi])
            allreduce(self.setting.coll, self.ops, send, out, op, dtype)
        return None

    def reduce(
        self, xf: Flat, of: Flat, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        if self._nan_on_device(op, dtype):
            return self.peer("alg").reduce(xf, of, op, dtype, root, scratch=scratch)
        is_root = self.setting.rank == root
        if op == "avg":
            xf = self._shares(xf, dtype, of if is_root else None, scratch)
        n = int(xf.shape[0])
        for lo, hi in pieces(n):
            whole = hi - lo == n
            if is_root:
                out = of if whole else of[lo:hi]
                send = out if xf is of else (xf if whole else xf[lo:hi])
            else:
                send = out = xf if whole else xf[lo:hi]  # no output off the root
            reduce(self.setting.coll, self.ops, send, out, op, dtype, root)
        return None

    def broadcast(self, xf: Flat, root: int) -> None:
        n, isz = int(xf.shape[0]), self._isz(xf)
        for lo, hi in pieces(n * isz):
            a, b = -(-lo // isz), min(n, -(-hi // isz))  # pieces on element bounds
            broadcast(self.setting.coll, self.ops, xf if b - a == n else xf[a:b], root)

    def _over(self, counts: list[int], a: Flat) -> bool:
        return sum(counts) * self._isz(a) > transport.COUNT_LIMIT

    def allgatherv(self, xf: Flat, of: Flat, counts: list[int]) -> None:
        if self._over(counts, xf):
            return self._large().allgatherv(xf, of, counts)
        allgatherv(self.setting.coll, self.ops, xf, of, counts, self._isz(xf))

    def gatherv(self, xf: Flat, of: Flat | None, counts: list[int], root: int) -> None:
        if self._over(counts, xf):
            return self._large().gatherv(xf, of, counts, root)
        gatherv(self.setting.coll, self.ops, xf, of, counts, self._isz(xf), root)

    def scatterv(self, xf: Flat | None, of: Flat, counts: list[int], root: int) -> None:
        if self._over(counts, of):
            return self._large().scatterv(xf, of, counts, root)
        scatterv(self.setting.coll, self.ops, xf, of, counts, self._isz(of), root)

    def reduce_scatterv(
        self, xf: Flat, of: Flat, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        if self._over(counts, xf) or self._nan_on_device(op, dtype):
            return self._large().reduce_scatterv(xf, of, counts, op, dtype, scratch=scratch)
        if op == "avg":
            xf = self._shares(xf, dtype, scratch=scratch)
        reduce_scatterv(self.setting.coll, self.ops, xf, of, counts, op, dtype)
        return None

    def alltoallv(self, xf: Flat, send_counts: list[int], of: Flat, recv_counts: list[int]) -> None:
        import numpy
        from mpi4py import MPI

        # Send and receive counts differ between ranks: whether any rank is over the limit is
        # agreed first, so all ranks take the same way.
        over = self._over(send_counts, xf) or self._over(recv_counts, xf)
        flag = numpy.array([int(over)], dtype=numpy.int64)
        self.setting.coll.Allreduce(MPI.IN_PLACE, flag, MPI.MAX)
        if flag[0]:
            return self._large().alltoallv(xf, send_counts, of, recv_counts)
        alltoallv(self.setting.coll, self.ops, xf, send_counts, of, recv_counts, self._isz(xf))
