"""One call, prepared: a :class:`Request` (the arguments of a Communicator method) goes through
:func:`prepare` to a :class:`Plan` (its cross-rank signature, the engine chosen for it, and what
runs it), as NCCL's ``ncclInfo`` goes through ``ncclEnqueueCheck``.

What differs between collectives is read from the call table (:data:`cudampi.names.CALLS`):
whether the call reduces, is rooted or takes per-rank counts, its ``form`` (how its output
follows from its input: one preparer each below) and the engine method that runs it. A new
collective of an existing form is a row of the table, the engine methods that run it and its
Communicator method; nothing here changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from cudampi.comm import args
from cudampi.comm.arrays import ArrayOps, Buf, check_op, flat, result, same_memory, written
from cudampi.comm.carry import Carry, carries, carry
from cudampi.comm.choice import PathChoice
from cudampi.comm.engines.base import Engine
from cudampi.comm.validate import Signature
from cudampi.errors import CommError
from cudampi.names import CALLS, Call


@dataclass(slots=True)
class Request:
    """One call's arguments as its Communicator method got them."""

    call: Call
    x: Any = None
    op: str = ""
    root: int = -1
    out: Any = None
    counts: Any = None
    """Per-rank counts (allgatherv, reduce_scatter); alltoall's send counts."""
    recv_counts: Any = None
    path: str | None = None
    remember: bool = False
    """Remember the arrays for the repeat path (an allreduce with ``out``, not async)."""
    seq: int = -1
    """The call's number on its communicator (set when it is made, in the caller's order)."""


@dataclass
class Plan:
    """One call, prepared in the caller's thread."""

    sig: Signature
    run: Callable[[], Any] | None = None
    engine: Engine | None = None
    token: Any = None
    error: BaseException | None = None
    carry: Carry | None = None
    """The call's data travels in its check (:mod:`cudampi.comm.carry`): it is reduced from
    what the check returns, and ``run`` only finishes the call."""

    @property
    def ops(self) -> ArrayOps | None:
        return self.engine.ops if self.engine is not None else None


class Front(Protocol):
    """What the preparers use of the Communicator."""

    rank: int
    size: int

    def _buf(self, x: Any, what: str) -> Buf: ...

    def _out(self, x: Buf, out: Any, shape: tuple[int, ...], what: str = "out") -> Buf: ...

    def _choose(self, call: str, b: Buf, path: str | None) -> PathChoice: ...

    def _engine(self, choice: PathChoice, b: Buf) -> Engine: ...

    def _remember(
        self, r: Request, engine: Engine, dtype: str, sig: Signature, carried: Carry | None
    ) -> None: ...

    def _check_counts(self, r: Request, error: BaseException | None) -> None: ...


def prepare(f: Front, r: Request) -> Plan:
    """The plan of ``r``: its arguments checked on this rank, its path chosen, its signature."""
    return _FORMS[r.call.form](f, r)


def _elementwise(f: Front, r: Request) -> Plan:
    """The output has the input's shape: allreduce, reduce (written on the root only),
    broadcast (in place)."""
    c = r.call
    xb = f._buf(r.x, "x")
    if c.reduces:
        check_op(r.op, xb.dtype)
    if c.rooted:
        args.check_root(r.root, f.size)
    if c.reduces:
        ob = f._out(xb, r.out, xb.shape)
    else:  # in place: x is the output where it is written
        if f.rank != r.root:
            args.check_writable(xb, "x")
        ob = xb
    choice = f._choose(c.name, xb, r.path)
    engine = f._engine(choice, xb)
    sig = Signature(
        c.name,
        r.op,
        xb.dtype,
        root=r.root if c.rooted else -1,
        count=xb.count,
        path=choice.label,
        algo=engine.algo if c.reduces else 0,
        shape=xb.shape,
    )
    method = getattr(engine, c.engine)
    carried = None
    if (
        c.reduces
        and not c.rooted
        and not engine.stream_ordered
        and carries(f.size, xb, choice.label)
    ):
        carried = carry(xb, ob, r.op)
        sig = dataclasses.replace(sig, carried=True)
    if not c.reduces:

        def run_in_place() -> Any:
            method(flat(xb), r.root)
            return written(xb)

        return Plan(sig, run_in_place, engine)
    inplace = ob is xb or same_memory(xb, ob)
    tail = (r.root,) if c.rooted else ()

    def run() -> Any:
        if carried is None:  # (a carried call's data was reduced from its check)
            of = flat(ob)
            method(of if inplace else flat(xb), of, r.op, xb.dtype, *tail)
        if r.remember:
            f._remember(r, engine, xb.dtype, sig, carried)
        return result(r.out, ob)

    return Plan(sig, run, engine, carry=carried)


def _gather(f: Front, r: Request) -> Plan:
    """Every rank's input, stacked (allgather, gather) or concatenated by counts (allgatherv),
    on every rank or on the root."""
    c = r.call
    xb = f._buf(r.x, "x")
    if c.rooted:
        args.check_root(r.root, f.size)
    counts = r.counts if c.vector else None
    cs, shape = args.gather_layout(xb, counts, f.size, f.rank)
    receives = not c.rooted or f.rank == r.root
    ob = f._out(xb, r.out, shape) if receives else None
    choice = f._choose(c.name, xb, r.path)
    engine = f._engine(choice, xb)
    sig = Signature(
        c.name,
        "",
        xb.dtype,
        root=r.root if c.rooted else -1,
        count=-1 if counts is not None else xb.count,
        counts=tuple(cs) if counts is not None else (),
        path=choice.label,
        algo=engine.algo,
        shape=xb.shape if counts is None else None,
    )
    method = getattr(engine, c.engine)
    tail = (r.root,) if c.rooted else ()

    def run() -> Any:
        method(flat(xb), flat(ob) if ob is not None else None, cs, *tail)
        return result(r.out, ob) if ob is not None else None

    return Plan(sig, run, engine)


def _scatter(f: Front, r: Request) -> Plan:
    """Block i of the root's input (shape ``(size, *s)``) lands in rank i's output (shape
    ``s``); other ranks pass ``out``, or an ``x`` of the same shape and dtype as a template."""
    c = r.call
    args.check_root(r.root, f.size)
    is_root = f.rank == r.root
    if r.x is None and is_root:
        raise CommError(f"{c.name}: the root (rank {r.root}) must pass x")
    if r.x is None:
        if r.out is None:
            raise CommError(f"{c.name}: a non-root rank must pass out (or an x template)")
        tb = f._buf(r.out, "out")
        block: tuple[int, ...] = tb.shape
    else:
        tb = f._buf(r.x, "x")
        if not tb.shape or tb.shape[0] != f.size:
            raise CommError(
                f"{c.name}: x has shape {tb.shape}; its first axis must be the number of "
                f"ranks ({f.size})"
            )
        block = tb.shape[1:]
    ob = f._out(tb, r.out, block)
    k = ob.count
    choice = f._choose(c.name, tb, r.path)
    engine = f._engine(choice, tb)
    sig = Signature(c.name, "", tb.dtype, root=r.root, count=k, path=choice.label, shape=block)
    method = getattr(engine, c.engine)

    def run() -> Any:
        xf = flat(tb) if (is_root and r.x is not None) else None
        method(xf, flat(ob), [k] * f.size, r.root)
        return result(r.out, ob)

    return Plan(sig, run, engine)


def _reduce_scatter(f: Front, r: Request) -> Plan:
    """Reduce the input over ranks and give rank i block i: ``x.shape[0] == size*k`` gives an
    output of shape ``(k, *x.shape[1:])``; with counts, rank i gets ``counts[i]`` elements."""
    c = r.call
    xb = f._buf(r.x, "x")
    check_op(r.op, xb.dtype)
    cs, shape = args.reduce_scatter_layout(xb, r.counts, f.size, f.rank)
    ob = f._out(xb, r.out, shape)
    if same_memory(xb, ob) and f.size > 1 and xb.count:
        raise CommError(f"{c.name}: out must not be x (the output is a block of x)")
    choice = f._choose(c.name, xb, r.path)
    engine = f._engine(choice, xb)
    sig = Signature(
        c.name,
        r.op,
        xb.dtype,
        count=xb.count,
        counts=tuple(cs),
        path=choice.label,
        algo=engine.algo,
        shape=xb.shape,
    )
    method = getattr(engine, c.engine)

    def run() -> Any:
        method(flat(xb), flat(ob), cs, r.op, xb.dtype)
        return result(r.out, ob)

    return Plan(sig, run, engine)


def _exchange(f: Front, r: Request) -> Plan:
    """Block i of the input goes to rank i and block j of the output comes from rank j: the
    first axis split in equal parts, or a flat input split by send counts (receive counts may be
    omitted: then they are exchanged, and checked where given)."""
    c = r.call
    varying = r.counts is not None
    xb = f._buf(r.x, "x")
    sc, rc = args.alltoall_counts(xb, r.counts, r.recv_counts, f.size)
    shape = xb.shape if not varying else None if rc is None else (sum(rc),)
    ob = None if shape is None else f._out(xb, r.out, shape)
    if ob is not None and same_memory(xb, ob) and xb.count and f.size > 1:
        raise CommError(f"{c.name}: out must not be x")
    choice = f._choose(c.name, xb, r.path)
    engine = f._engine(choice, xb)
    sig = Signature(
        c.name,
        "",
        xb.dtype,
        count=-1 if varying else xb.count,
        counts=(1,) if varying else (),
        path=choice.label,
        shape=None if varying else xb.shape,
    )
    method = getattr(engine, c.engine)

    def run() -> Any:
        nonlocal rc, ob
        if varying:
            got = [int(n) for n in engine.setting.coll.alltoall(sc)]
            f._check_counts(r, args.recv_counts_error(f.rank, rc, got))
            rc = got
            if ob is None:
                ob = f._out(xb, r.out, (sum(rc),))
        assert rc is not None and ob is not None
        method(flat(xb), sc, flat(ob), rc)
        return result(r.out, ob)

    return Plan(sig, run, engine)


def _sync(f: Front, r: Request) -> Plan:
    """No data: every rank has called (barrier)."""
    return Plan(Signature(r.call.name), lambda: None)


_FORMS: dict[str, Callable[[Front, Request], Plan]] = {
    "elementwise": _elementwise,
    "gathering": _gather,
    "scattering": _scatter,
    "block_reduction": _reduce_scatter,
    "exchange": _exchange,
    "sync": _sync,
}
assert {c.form for c in CALLS.values() if not c.p2p} <= set(_FORMS)

__all__ = ["Plan", "Request", "prepare"]
