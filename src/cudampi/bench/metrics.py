"""Bandwidth formulas of nccl-tests (doc/PERFORMANCE.md, src/*.cu), pure.

``algbw = S / t`` with ``S`` the size column of the table, and ``busbw = algbw * factor(n)``:

=============== ==============  =============================================
collective      factor          size S (nccl-tests' ``max(sendBytes, recvBytes)``)
=============== ==============  =============================================
allreduce       2(n-1)/n        the buffer
reduce_scatter  (n-1)/n         the whole input (n per-rank blocks)
allgather       (n-1)/n         the whole output (n per-rank blocks)
alltoall        (n-1)/n         the whole buffer (n blocks)
broadcast       1               the buffer
reduce          1               the buffer
sendrecv        1               the buffer
copy            1               the buffer (the raw-copy peer, not a collective)
=============== ==============  =============================================

Bandwidths are in GB/s with G = 1e9, as nccl-tests prints them.
"""

from __future__ import annotations

from dataclasses import dataclass

from cudampi.names import CALLS

_FACTORS = {
    "2(n-1)/n": lambda n: 2.0 * (n - 1.0) / n,
    "(n-1)/n": lambda n: (n - 1.0) / n,
    "1": lambda n: 1.0,
}


def busbw_factor(op: str, nranks: int) -> float:
    """nccl-tests' bus-bandwidth correction factor for ``op`` on ``nranks`` ranks (the call
    table's :attr:`~cudampi.names.Call.bus`; ``copy``, the raw-copy peer: 1)."""
    if nranks < 1:
        raise ValueError(f"nranks must be >= 1, got {nranks!r}")
    if op == "copy":
        return 1.0  # the raw-copy peer, bytes copied per second
    call = CALLS.get(op)
    if call is None or not call.data:
        known = ", ".join(n for n, c in CALLS.items() if c.data)
        raise ValueError(f"unknown collective {op!r}; expected one of {known}, or copy")
    return float(_FACTORS[call.bus](float(nranks)))


def algbw(size_bytes: int, seconds: float) -> float:
    """Algorithm bandwidth in GB/s (1e9 bytes per second): ``size / time``."""
    if seconds <= 0:
        return float("inf") if size_bytes > 0 else 0.0
    return size_bytes / 1.0e9 / seconds


def busbw(op: str, size_bytes: int, seconds: float, nranks: int) -> float:
    """Bus bandwidth in GB/s: :func:`algbw` times :func:`busbw_factor`."""
    return algbw(size_bytes, seconds) * busbw_factor(op, nranks)


@dataclass(frozen=True)
class Layout:
    """How many elements each rank sends and receives for one row of the table.

    ``count`` is the table's count column (nccl-tests' ``paramcount``: per-rank block for the
    blocked collectives, the whole buffer otherwise); ``size`` is the table's size column.
    """

    op: str
    itemsize: int
    nranks: int
    count: int
    send_count: int
    recv_count: int

    @property
    def size(self) -> int:
        return max(self.send_count, self.recv_count) * self.itemsize

    @property
    def send_bytes(self) -> int:
        return self.send_count * self.itemsize

    @property
    def recv_bytes(self) -> int:
        return self.recv_count * self.itemsize


def collective_layout(op: str, nbytes: int, itemsize: int, nranks: int) -> Layout:
    """The buffers nccl-tests uses for a requested size ``nbytes`` (its ``setupArgs``)."""
    busbw_factor(op, nranks)  # validates op and nranks
    if itemsize < 1:
        raise ValueError(f"itemsize must be >= 1, got {itemsize!r}")
    count = nbytes // itemsize
    if op != "copy" and CALLS[op].blocked:
        align = max(16 // itemsize, 1)
        base = (count // nranks) & ~(align - 1)
        if op == "allgather":
            return Layout(op, itemsize, nranks, base, base, base * nranks)
        if op == "reduce_scatter":
            return Layout(op, itemsize, nranks, base, base * nranks, base)
        return Layout(op, itemsize, nranks, base, base * nranks, base * nranks)
    return Layout(op, itemsize, nranks, count, count, count)
