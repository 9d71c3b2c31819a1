"""Repeated calls on the same arrays, without the whole front end again.

A training loop reduces the same tensors call after call (DDP's buckets, a model's gradients),
and a pipeline or halo exchange sends and receives the same buffers message after message. The
Communicator's front end (adapting the arrays, the local checks, the path and engine choice)
decides the same thing every time, and costs as much as the work below it (a stream-ordered
allreduce is one kernel launch, a small MPI message a microsecond or so; docs/benchmarks.md
has the per-call figures). :class:`Repeats` remembers what the full path decided for a call on NumPy arrays or torch
tensors; the next call with the same array objects, op (for messages: send or receive) and path,
whose arrays still have the same layout (shape, strides, dtype; a tensor's data pointer, which
changes with its storage or device; the output's writability), goes straight to the engine.
Nothing else the full path checks can change without changing those. The engine still runs
every call and checks what it checks (ranks, tags, sizes, deadlines), and the Communicator
keeps its per-call work: a device engine that is not stream-ordered still waits for the
caller's stream, and a collective on host memory still runs the cross-rank check, with the
signature the full path made (its peers may have changed their call), before the engine: the
check's own exchange prepared once (:class:`~cudampi.comm.validate.Recheck`), so a small
allreduce carried in it (:mod:`cudampi.comm.carry`) costs little more than that exchange.

Entries hold the arrays weakly (an array that dies takes its entry with it) and the table is
bounded.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cudampi.comm.arrays.torch import flat_tensor

LIMIT = 256
"""Entries at most (a model's buckets are tens); the table starts over when full."""


def _tensor_facts(t: Any, out: Any) -> tuple[Any, ...]:
    if out is t:
        return (t.data_ptr(), t.shape, t.stride(), t.dtype)
    return (t.data_ptr(), t.shape, t.stride(), t.dtype,
            out.data_ptr(), out.shape, out.stride(), out.dtype)  # fmt: skip


def _ndarray_facts(a: Any, out: Any) -> tuple[Any, ...]:
    # no address: MPI reads it per call, and nothing the front end decides depends on it; of
    # writability, the output's alone (the full path checks no other)
    if out is a:
        return (a.shape, a.strides, a.dtype, a.flags.writeable)
    return (a.shape, a.strides, a.dtype, out.shape, out.strides, out.dtype, out.flags.writeable)


def _ndarray_flat(a: Any) -> Any:
    return a.reshape(-1)


@dataclass(frozen=True, slots=True)
class Kind:
    """One array library this table takes: what must not change, and the flat view."""

    facts: Callable[[Any, Any], tuple[Any, ...]]
    """What must not have changed since the full path checked ``x`` and ``out`` (one call)."""
    flat: Callable[[Any], Any]


TENSOR = Kind(_tensor_facts, flat_tensor)
NDARRAY = Kind(_ndarray_facts, _ndarray_flat)


def kind_of(x: Any) -> Kind | None:
    """The kind of a contiguous torch tensor or NumPy array; None for anything else."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return TENSOR if x.is_contiguous() else None
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(x, numpy.ndarray):
        return NDARRAY if x.flags.c_contiguous else None
    return None


@dataclass(slots=True)
class Entry:
    x: Any
    """weakref to the input array"""
    out: Any
    """weakref to the output array (the same object for in-place calls and messages)"""
    op: str
    path: str | None
    key: tuple[Any, ...]
    engine: Any
    dtype: str
    kind: Kind
    check: Any = None
    """The call's cross-rank check where the host runs it (an engine that is not
    stream-ordered): a :class:`~cudampi.comm.validate.Recheck`; None where the engine checks on
    the GPU."""
    carry: Any = None
    """Where the call's data travels in its check (:mod:`cudampi.comm.carry`): how it is
    reduced from what the check returns."""

    def run(self, x: Any, out: Any, op: str) -> None:
        """The allreduce of ``x`` into ``out`` on the engine (after its check, if any)."""
        xf = self.kind.flat(x)
        self.engine.allreduce(xf, xf if out is x else self.kind.flat(out), op, self.dtype)


class Repeats:
    """The calls that may skip the front end (see the module doc)."""

    def __init__(self) -> None:
        self._table: dict[tuple[int, int, str, str | None], Entry] = {}
        self._last: Entry | None = None

    def __len__(self) -> int:
        return len(self._table)

    def remember(
        self,
        x: Any,
        out: Any,
        op: str,
        path: str | None,
        engine: Any,
        dtype: str,
        check: Any = None,
        carry: Any = None,
    ) -> None:
        """After the full path checked a call and chose ``engine`` for it (``check``: the
        call's cross-rank check, where the host runs it)."""
        kind = kind_of(x)
        if kind is None or (out is not x and kind_of(out) is not kind):
            return
        table = self._table
        if len(table) >= LIMIT:
            table.clear()
        k = (id(x), id(out), op, path)

        def drop(_: Any, table: dict[Any, Entry] = table, k: Any = k) -> None:
            table.pop(k, None)

        table[k] = self._last = Entry(weakref.ref(x, drop), weakref.ref(out, drop), op, path,
                                      kind.facts(x, out), engine, dtype, kind, check, carry)  # fmt: skip

    def lookup(self, x: Any, out: Any, op: str, path: str | None) -> Entry | None:
        """The entry for this call, if nothing it depends on changed."""
        e = self._last  # (a loop that repeats one call finds it here, without a key to hash)
        if (
            e is None
            or e.x() is not x
            or e.out() is not out
            or e.op is not op
            or e.path is not path
        ):
            try:
                e = self._table.get((id(x), id(out), op, path))
            except TypeError:  # an unhashable op or path: the full path says what is wrong
                return None
            if e is None or e.x() is not x or e.out() is not out:
                return None
            self._last = e
        return e if e.kind.facts(x, out) == e.key else None

    def forget(self) -> None:
        self._table.clear()
        self._last = None
