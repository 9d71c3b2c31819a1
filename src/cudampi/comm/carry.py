"""A small allreduce on host memory, carried in its own cross-rank check.

A host allreduce of a few bytes (a loss, a metric, a flag) costs two collectives on the wire:
the check that every rank makes the same call (:mod:`cudampi.comm.validate`), then MPI's
allreduce, and the second doubles its latency. Where the check is an allgather of signature
blocks (:func:`~cudampi.comm.validate.gathers`), the data of an allreduce of up to
:data:`~cudampi.comm.validate.CARRY_BYTES` travels in this rank's block instead: after the one
exchange every rank holds every rank's data and reduces it itself, in rank order, so every rank
computes the same result in the same order. Whether a call is carried follows from its
signature (size, dtype, path) and the communicator's size, so every rank that makes the same
call carries it, and ranks that disagree meet in the same exchange and raise.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cudampi.comm.arrays import Buf, flat
from cudampi.comm.arrays.numpy import NUMPY_OPS, NumpyOps
from cudampi.comm.validate import CARRY_BYTES, gathers

CARRIED_PATHS = ("host", "host-alg")
"""The path labels whose host allreduce is carried: MPI's own and cudampi's algorithm on host
memory, as auto (or ``path='host'``) takes them; a path asked for by another name runs as asked."""


def carries(size: int, x: Buf, label: str) -> bool:
    """Whether an allreduce of ``x`` on a communicator of ``size`` ranks, on the path labelled
    ``label``, travels in its check."""
    return (
        gathers(size)
        and x.device is None
        and x.lib in ("numpy", "torch")
        and x.nbytes <= CARRY_BYTES
        and x.dtype != "bfloat16"  # (NumPy has no bfloat16 to reduce it in)
        and label in CARRIED_PATHS
    )


@dataclass(slots=True)
class Carry:
    """One carried allreduce: the bytes this rank sends, where the result goes, how it is
    reduced. Made once per call shape (the repeat path keeps it with its arrays)."""

    data: Any
    """The input's bytes (a NumPy uint8 view of the caller's memory)."""
    out: Any
    """The output, flat (a NumPy view of the caller's memory)."""
    op: str
    dtype: str
    ops: NumpyOps
    _rows: Any = None
    _data: Any = None
    _parts: tuple[Any, ...] = ()
    _rest: tuple[Any, ...] = ()
    _shares: Any = None
    _combine: Any = None

    def finish(self, rows: Any) -> None:
        """Reduce every rank's data (``rows``: one row of bytes per rank, in rank order) into
        the output: rank 0's combined with rank 1's, then each next rank's combined into that
        (``avg``: each rank's share, divided before the sum, as every engine does)."""
        if rows is not self._rows:  # (the check returns the same rows call after call)
            self._bind(rows)
        combine, out, parts = self._combine, self.out, self._parts
        if self._shares is not None:
            self.ops.divide(self._shares, len(parts), self.dtype, self._data)
        combine(parts[0], parts[1], out)
        for part in self._rest:
            combine(out, part, out)

    def _bind(self, rows: Any) -> None:
        """The views of ``rows`` that every call with them reduces (made once)."""
        self._rows, data = rows, rows.view(self.out.dtype)
        self._data = data
        if self.op == "avg":
            self._shares = data.copy()
            data = self._shares
        self._parts = tuple(data[r] for r in range(data.shape[0]))
        self._rest = self._parts[2:]
        self._combine = self.ops.ufunc(self.op, self.dtype)


def carry(x: Buf, out: Buf, op: str) -> Carry:
    """The :class:`Carry` of an allreduce of ``x`` into ``out`` (host memory, see
    :func:`carries`)."""
    import numpy

    xf, of = _numpy(x), _numpy(out)
    return Carry(xf.view(numpy.uint8), of, op, x.dtype, NUMPY_OPS)


def _numpy(b: Buf) -> Any:
    """A flat NumPy view of host array ``b``'s memory (a torch CPU tensor's too)."""
    f = flat(b)
    return f.numpy() if b.lib == "torch" else f.reshape(-1)
