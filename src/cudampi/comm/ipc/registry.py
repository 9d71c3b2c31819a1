"""Registering user buffers with a node's ranks, so the ipc kernels read and write them where they
lie instead of through staging copies (large allreduces: each byte then crosses memory once less).

An allocation (the cudaMalloc'd segment a torch or CuPy buffer lies in, known by its base, size
and CUDA's buffer id, so a segment freed and made again at the same address is a new one) is
exported once with cudaIpcGetMemHandle and published in a mailbox in host memory shared by the
node's ranks (an MPI shared-memory window). Every rank, at its calls, maps what its peers
published, writes the mapping into its own workspace's table and records the launch from which
its kernels see it. A rank uses a registered buffer at a launch only if every peer's kernels see
it by then; otherwise it stages, and the kernels take each rank's choice from its barrier slot.
So no rank ever waits for another on the host, and the kernels never meet a buffer they cannot
address. Registrations live until the communicator closes (at most MAX_REGS per rank; past that,
buffers are staged). A torch block freed and reused inside a kept segment is simply the same
registration at another offset; nothing is ever read from a segment that was given back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy

from cudampi.comm.ipc import layout as L

SEGMENT = numpy.dtype(
    [
        ("count", numpy.int64),
        ("handles", numpy.uint8, (L.MAX_REGS, 64)),
        ("sizes", numpy.int64, (L.MAX_REGS,)),
        ("mapped_at", numpy.int64, (L.MAX_RANKS, L.MAX_REGS)),
    ]
)
"""One rank's part of the mailbox: what it published, and for every peer's entry k the launch
(plus one; 0: not mapped) from which this rank's kernels address it."""

Query = Callable[[int], "tuple[int, int, int] | None"]
"""pointer -> (allocation base, size, buffer id), or None where the pointer is not a device
allocation the driver can describe."""


class Registry:
    """One rank's registrations within one ipc communicator (see the module doc).

    ``segments[r]`` is rank r's mailbox segment (a NumPy structured scalar over shared memory);
    ``query``, ``export`` (base -> 64-byte IPC handle), ``open_`` (handle -> base mapped here),
    ``close`` (unmap) and ``write_table`` (rank, entry, mapped base -> this rank's workspace
    table) are the CUDA side, passed in so the logic runs on the CPU in the tests.
    """

    def __init__(
        self,
        rank: int,
        segments: list[Any],
        *,
        query: Query,
        export: Callable[[int], bytes],
        open_: Callable[[bytes], int],
        close: Callable[[int], None],
        write_table: Callable[[int, int, int], None],
        sync: Callable[[], None] = lambda: None,
    ) -> None:
        self.rank = rank
        self.segments = segments
        self.mine = segments[rank]
        self._query, self._export, self._open = query, export, open_
        self._close, self._write, self._sync = close, write_table, sync
        self._own: dict[tuple[int, int], int] = {}
        self._refused: set[tuple[int, int]] = set()
        self._seen = [0] * len(segments)
        self._mapped: list[int] = []

    def step(self, launch: int) -> None:
        """Map every entry the peers published since the last step; this rank's kernels see
        them from ``launch`` (the number of the next launch) on. Not while a CUDA graph is being
        captured (the table is written with a synchronous copy)."""
        self._sync()
        for p, seg in enumerate(self.segments):
            if p == self.rank:
                continue
            count = int(seg["count"])
            for k in range(self._seen[p], count):
                base = self._open(bytes(seg["handles"][k]))
                self._mapped.append(base)
                self._write(p, k, base)
                self.mine["mapped_at"][p][k] = launch + 1
            self._seen[p] = count
        self._sync()

    def lookup(self, ptr: int, launch: int, *, publish: bool = True) -> tuple[int, int]:
        """(1 + entry, byte offset of ``ptr`` in it) when every peer's kernels address ``ptr``'s
        allocation at ``launch``; (0, 0) otherwise, publishing the allocation for later calls
        (unless ``publish`` is False: inside a capture)."""
        got = self._entry(ptr, publish)
        if got is None:
            return 0, 0
        k, base = got
        for p, seg in enumerate(self.segments):
            at = int(seg["mapped_at"][self.rank][k]) if p != self.rank else 1
            if at == 0 or at - 1 > launch:
                return 0, 0
        return k + 1, ptr - base

    def lookup_peer(self, ptr: int, peer: int, *, publish: bool = True) -> tuple[int, int]:
        """As :meth:`lookup`, for one peer's kernels of any launch from now on: (1 + entry,
        offset) once ``peer`` mapped ``ptr``'s allocation: a point-to-point send that ``peer``
        reads in place. Its table was written before it said so, and its kernels learn the
        entry only from a post of this rank's kernels, launched after this returns."""
        got = self._entry(ptr, publish)
        if got is None:
            return 0, 0
        k, base = got
        if int(self.segments[peer]["mapped_at"][self.rank][k]) == 0:  # (never itself: 0)
            return 0, 0
        return k + 1, ptr - base

    def _entry(self, ptr: int, publish: bool) -> tuple[int, int] | None:
        """(entry, allocation base) of ``ptr``'s allocation where this rank published it; None
        otherwise, publishing it for later calls (unless ``publish`` is False)."""
        info = self._query(ptr)
        if info is None:
            return None
        base, size, buffer_id = info
        key = (base, buffer_id)
        k = self._own.get(key)
        if k is None:
            if publish and key not in self._refused:
                self._publish(key, base, size)
            return None
        return k, base

    def _publish(self, key: tuple[int, int], base: int, size: int) -> None:
        k = int(self.mine["count"])
        if k >= L.MAX_REGS:
            self._refused.add(key)
            return
        try:
            handle = self._export(base)
        except Exception:  # not exportable (e.g. a VMM/expandable segment): stage it
            self._refused.add(key)
            return
        self.mine["handles"][k] = numpy.frombuffer(handle, numpy.uint8, 64)
        self.mine["sizes"][k] = size
        self._sync()
        self.mine["count"] = k + 1  # after the entry: a peer reading the count finds it whole
        self._sync()
        self._own[key] = k

    def close(self) -> None:
        """Unmap every peer buffer this rank mapped."""
        for base in self._mapped:
            try:
                self._close(base)
            except Exception:
                pass
        self._mapped.clear()
