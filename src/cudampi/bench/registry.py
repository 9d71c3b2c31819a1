"""One small unit per collective: its buffers, its call on a path, and the data it must produce.

A unit knows nothing about timing or paths; :mod:`cudampi.bench.runner` times ``call`` and,
with checking on, refills the buffers, calls once more and counts wrong elements against
``expected`` (nccl-tests' initData / runColl / checkData split).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from cudampi.bench.metrics import Layout
from cudampi.comm.arrays import Checks
from cudampi.names import BITWISE_OPS


def pattern_kind(redop: str | None) -> str:
    """Which test pattern keeps ``redop``'s result exact (see :meth:`Checks.pattern64`)."""
    if redop == "prod":
        return "prod"
    if redop in BITWISE_OPS:
        return "bits"
    return "sum"


class PathOps(Protocol):
    """What a path adapter offers the units (see :mod:`cudampi.bench.adapters`)."""

    inplace_reduce: bool

    def allreduce(self, send: Any, recv: Any, op: str) -> None: ...
    def reduce(self, send: Any, recv: Any, op: str, root: int) -> None: ...
    def reduce_scatter(self, send: Any, recv: Any, op: str) -> None: ...
    def allgather(self, send: Any, recv: Any) -> None: ...
    def alltoall(self, send: Any, recv: Any) -> None: ...
    def broadcast(self, buf: Any, root: int) -> None: ...
    def sendrecv(self, send: Any, recv: Any, dest: int, source: int) -> None: ...
    def copy(self, send: Any, recv: Any) -> None: ...


@dataclass
class Buffers:
    send: Any
    recv: Any


@dataclass(frozen=True)
class Case:
    """Everything a unit needs to build and check one row."""

    lib: Checks
    layout: Layout
    rank: int
    nranks: int
    dtype: str
    redop: str | None
    root: int
    inplace: bool

    @property
    def kind(self) -> str:
        return pattern_kind(self.redop)

    def mine(self, count: int, offset: int = 0) -> Any:
        return self.lib.pattern(count, self.rank, self.kind, self.dtype, offset)

    def of(self, rank: int, count: int, offset: int = 0) -> Any:
        return self.lib.pattern64(count, rank, self.kind, offset)


class Unit:
    """A collective. ``reduces``: takes a reduction op; ``rooted``: takes a root."""

    name = "?"
    reduces = False
    rooted = False

    def prepare(self, c: Case) -> Buffers:
        raise NotImplementedError

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        raise NotImplementedError

    def expected(self, c: Case) -> Any | None:
        """float64 values the result must hold on this rank; None: nothing to check here."""
        raise NotImplementedError

    def result(self, b: Buffers) -> Any:
        return b.recv


def _reduced(c: Case, count: int, offset: int = 0) -> Any:
    assert c.redop is not None
    return c.lib.reduce64([c.of(r, count, offset) for r in range(c.nranks)], c.redop)


class AllReduce(Unit):
    name = "allreduce"
    reduces = True

    def prepare(self, c: Case) -> Buffers:
        send = c.mine(c.layout.send_count)
        recv = c.lib.empty((c.layout.recv_count,), c.dtype)
        if c.inplace:
            c.lib.copy_into(recv, send)
        return Buffers(send, recv)

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        assert c.redop is not None
        path.allreduce(b.send, b.recv, c.redop)

    def expected(self, c: Case) -> Any | None:
        return _reduced(c, c.layout.count)


class Reduce(AllReduce):
    name = "reduce"
    rooted = True

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        assert c.redop is not None
        path.reduce(b.send, b.recv, c.redop, c.root)

    def expected(self, c: Case) -> Any | None:
        return _reduced(c, c.layout.count) if c.rank == c.root else None


class ReduceScatter(Unit):
    name = "reduce_scatter"
    reduces = True

    def prepare(self, c: Case) -> Buffers:
        return Buffers(c.mine(c.layout.send_count), c.lib.empty((c.layout.recv_count,), c.dtype))

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        assert c.redop is not None
        path.reduce_scatter(b.send, b.recv, c.redop)

    def expected(self, c: Case) -> Any | None:
        k = c.layout.count
        return _reduced(c, k, offset=c.rank * k)


class AllGather(Unit):
    name = "allgather"

    def prepare(self, c: Case) -> Buffers:
        k = c.layout.count
        return Buffers(c.mine(k), c.lib.empty((c.nranks, k), c.dtype))

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        path.allgather(b.send, b.recv)

    def expected(self, c: Case) -> Any | None:
        k = c.layout.count
        return c.lib.concat([c.of(s, k) for s in range(c.nranks)])


class AllToAll(Unit):
    name = "alltoall"

    def prepare(self, c: Case) -> Buffers:
        return Buffers(c.mine(c.layout.send_count), c.lib.empty((c.layout.recv_count,), c.dtype))

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        path.alltoall(b.send, b.recv)

    def expected(self, c: Case) -> Any | None:
        # block s of the result is block `rank` of rank s's input
        k = c.layout.count
        return c.lib.concat([c.of(s, k, offset=c.rank * k) for s in range(c.nranks)])


class Broadcast(Unit):
    name = "broadcast"
    rooted = True

    def prepare(self, c: Case) -> Buffers:
        if c.rank == c.root:
            buf = c.mine(c.layout.count)
        else:
            buf = c.lib.empty((c.layout.count,), c.dtype)
            c.lib.fill(buf, 0)  # the pattern is never 0 for the "sum" kind
        return Buffers(buf, buf)

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        path.broadcast(b.recv, c.root)

    def expected(self, c: Case) -> Any | None:
        return c.of(c.root, c.layout.count)


class SendRecv(Unit):
    """nccl-tests' sendrecv: every rank sends to rank+1 and receives from rank-1 (a ring)."""

    name = "sendrecv"

    def prepare(self, c: Case) -> Buffers:
        recv = c.lib.empty((c.layout.count,), c.dtype)
        c.lib.fill(recv, 0)
        return Buffers(c.mine(c.layout.count), recv)

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        n = c.nranks
        path.sendrecv(b.send, b.recv, (c.rank + 1) % n, (c.rank - 1) % n)

    def expected(self, c: Case) -> Any | None:
        return c.of((c.rank - 1) % c.nranks, c.layout.count)


class Copy(Unit):
    """The raw-copy peer: one device-to-device (or host memcpy) copy of the same size."""

    name = "copy"

    def prepare(self, c: Case) -> Buffers:
        return Buffers(c.mine(c.layout.count), c.lib.empty((c.layout.count,), c.dtype))

    def call(self, path: PathOps, b: Buffers, c: Case) -> None:
        path.copy(b.send, b.recv)

    def expected(self, c: Case) -> Any | None:
        return c.of(c.rank, c.layout.count)


UNITS: dict[str, Unit] = {
    u.name: u
    for u in (
        AllReduce(),
        ReduceScatter(),
        AllGather(),
        AllToAll(),
        Broadcast(),
        Reduce(),
        SendRecv(),
        Copy(),
    )
}
"""Every unit by name, in the order ``all`` runs them (nccl-tests'); ``copy`` is the raw-copy
peer, measured once per dtype."""

COLLECTIVES = tuple(name for name in UNITS if name != "copy")
"""Every collective ``cudampi bench`` measures, in the order ``all`` runs them."""
