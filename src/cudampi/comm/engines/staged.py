"""The ``staged`` engine: device data goes through pinned host buffers; an inner engine (``mpi``,
or ``alg`` for dtypes MPI cannot reduce) runs the collective on host memory.

Element-wise collectives (allreduce, reduce, broadcast) are pipelined piece by piece: the
device->host copy of piece k+1 and the host->device copy of piece k-1 run on the copy stream
while the inner engine works on piece k. The other collectives stage their whole input in, run
on the host, and stage their output back. User point-to-point goes through
:class:`~cudampi.comm.transport.StagedTransport`. One stager (copy stream, pinned buffers) per
(lib, device) of a communicator serves every staged engine there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cudampi.comm.arrays import ArrayOps, Flat, Stager, stager_for
from cudampi.comm.choice import Ask, DeviceSupport, Facts, PathChoice, Verdict
from cudampi.comm.engines.base import Engine, Engines, Setting
from cudampi.comm.engines.p2p import irecv_handle, request_handle
from cudampi.comm.handle import Handle
from cudampi.comm.transport import StagedTransport, mem

PIECES_MAX = 64
SLOTS = 3


def piece_bounds(count: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    step = max(1, chunk_bytes // max(1, itemsize), -(-count // PIECES_MAX))
    return [(lo, min(count, lo + step)) for lo in range(0, count, step)]


def piecewise(
    stager: Stager,
    src: Any | None,
    dst: Any | None,
    like: Flat,
    count: int,
    itemsize: int,
    chunk_bytes: int,
    fn: Callable[[Any], None],
) -> None:
    """For each piece: copy ``src``'s piece to a host slot (unless ``src`` is None), run ``fn`` on
    the slot viewed as host elements, copy the slot into ``dst``'s piece (unless None)."""
    pieces = piece_bounds(count, itemsize, chunk_bytes)
    if not pieces:
        return
    step = pieces[0][1] - pieces[0][0]
    slots = [stager.pinned(step * itemsize) for _ in range(min(SLOTS, len(pieces)))]
    ns = len(slots)
    d2h: dict[int, Any] = {}
    h2d: dict[int, Any] = {}

    def start_in(k: int) -> None:
        if k - ns in h2d:  # the slot's previous piece must be on the device before reuse
            stager.wait(h2d.pop(k - ns))
        if src is not None:
            lo, hi = pieces[k]
            d2h[k] = stager.d2h(slots[k % ns], src, lo * itemsize, hi * itemsize)

    start_in(0)
    for k, (lo, hi) in enumerate(pieces):
        if k + 1 < len(pieces):
            start_in(k + 1)
        stager.wait(d2h.pop(k, None))
        fn(stager.host_view(slots[k % ns], like, hi - lo))
        if dst is not None:
            h2d[k] = stager.h2d(dst, slots[k % ns], lo * itemsize, hi * itemsize)
    for ev in h2d.values():
        stager.wait(ev)


def stage_in(stager: Stager, a: Flat, like: Flat, count: int, itemsize: int) -> Any:
    """A host copy of the flat ``a`` (``count`` elements), as host elements."""
    host = stager.pinned(max(1, count * itemsize))
    if count:
        stager.wait(stager.d2h(host, a, 0, count * itemsize))
    return stager.host_view(host, like, count)


def stage_buffer(stager: Stager, like: Flat, count: int, itemsize: int) -> Any:
    """An uninitialised host buffer of ``count`` elements."""
    return stager.host_view(stager.pinned(max(1, count * itemsize)), like, count)


def stage_out(stager: Stager, dst: Any, host_view: Any, nbytes: int) -> None:
    """Copy a host view made by :func:`stage_in` / :func:`stage_buffer` into the flat ``dst``."""
    if nbytes:
        stager.wait(stager.h2d(dst, _raw(host_view), 0, nbytes))


def _raw(v: Any) -> Any:
    """The uint8 view under a host element view (what the stagers copy from)."""
    import numpy

    if isinstance(v, numpy.ndarray):
        return v.view(numpy.uint8)
    import torch

    return v.view(torch.uint8)


SHARED_GPU_STAGED_BELOW = 4 << 20
"""Ranks time-slicing one GPU (no MPS daemon): below this size staging through host memory
beat gpu-ring on the reference GPU, and gpu-ring won above it (docs/benchmarks.md)."""


def staged_below(shared_gpu: bool | None, mps: bool) -> int:
    """The size under which ``auto`` stages device collectives rather than run gpu-ring: where
    the ranks share a GPU without MPS, each device-to-device MPI message waits for the other
    context's time slice, and a copy to host and back costs less up to a few MiB."""
    return SHARED_GPU_STAGED_BELOW if shared_gpu and not mps else 0


def _inner(ask: Ask) -> str:
    """The engine that runs the call on the host buffers: MPI's, or cudampi's algorithm for a
    reduction MPI has no type for."""
    return "alg" if ask.no_mpi else "mpi"


class StagedEngine(Engine):
    """Stages through host buffers around ``inner``, an engine over the host buffers' ops."""

    name = "staged"
    paths = ("staged",)
    agreed = True
    last_resort = True

    @classmethod
    def verdict(cls, facts: Facts) -> Verdict:
        """Small device collectives where the ranks time-slice one GPU (no MPS daemon)."""
        caps = facts.caps
        hi = staged_below(caps.ipc_shared_gpu if caps is not None else None, facts.mps)
        if not hi:
            return Verdict(False, "auto stages device collectives only where nothing else runs")
        return Verdict(
            True,
            f"device memory under {hi >> 20} MiB on ranks time-slicing one GPU (no MPS daemon): "
            "staged through pinned host buffers beats gpu-ring there (measured)",
            (0, hi),
        )

    @classmethod
    def route(cls, ask: Ask, support: DeviceSupport) -> PathChoice | None:
        if not ask.on_device:
            return None
        if ask.call.p2p:
            return None if support.p2p else cls.fallback(ask, support)
        small = support.verdict(cls.name)
        if support.p2p and small.takes(ask.nbytes):
            return PathChoice("staged", small.why, "staged", _inner(ask))
        return None

    @classmethod
    def fallback(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        why = f"device memory, {support.p2p_why}: staged through pinned host buffers"
        return PathChoice("staged", why, "staged", "" if ask.call.p2p else _inner(ask))

    @classmethod
    def forced(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        inner = "" if ask.call.p2p else _inner(ask)
        if not ask.on_device:
            return PathChoice(
                "staged", "requested; host memory staged through host buffers", "staged", inner
            )
        if ask.call.p2p:
            return cls.fallback(ask, support)
        return PathChoice(
            "staged", "requested: staged through pinned host buffers", "staged", inner
        )

    def __init__(self, setting: Setting, ops: ArrayOps, inner: Engine, stager: Stager) -> None:
        super().__init__(setting, ops)
        self.inner = inner
        self.stager = stager

    @classmethod
    def make(cls, engines: Engines, ops: ArrayOps, inner: str) -> Engine:
        stager = engines.keep(
            ("staged", ops.lib, ops.device), lambda: stager_for(ops.lib, ops.device)
        )
        host = engines.get(inner or "mpi", "", stager.host_lib(), None)
        return cls(engines.setting, ops, host, stager)

    # ------------------------------------------------------------------ helpers

    def _pieces(
        self, src: Any | None, dst: Any | None, like: Flat, fn: Callable[[Any], None]
    ) -> None:
        n, isz = int(like.shape[0]), self.ops.itemsize(like)
        piecewise(self.stager, src, dst, like, n, isz, self.setting.config.chunk_bytes, fn)

    def _in(self, a: Flat) -> Any:
        return stage_in(self.stager, a, a, int(a.shape[0]), self.ops.itemsize(a))

    def _buffer(self, like: Flat, count: int) -> Any:
        return stage_buffer(self.stager, like, count, self.ops.itemsize(like))

    def _out(self, dst: Any, host: Any, count: int) -> None:
        stage_out(self.stager, dst, host, count * self.ops.itemsize(dst))

    # ------------------------------------------------------------------ collectives

    # The host engine reduces the staged copies with the call's own op (it divides avg's
    # shares there, before the sum).

    def allreduce(self, xf: Flat, of: Flat, op: str, dtype: str) -> None:
        inner = self.inner
        self._pieces(xf, of, xf, lambda h: inner.allreduce(h, h, op, dtype))

    def reduce(
        self, xf: Flat, of: Flat, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        inner = self.inner
        is_root = self.setting.rank == root
        self._pieces(
            xf,
            of if is_root else None,
            xf,
            lambda h: inner.reduce(h, h, op, dtype, root, scratch=True),
        )

    def broadcast(self, xf: Flat, root: int) -> None:
        inner = self.inner
        is_root = self.setting.rank == root
        self._pieces(
            xf if is_root else None, None if is_root else xf, xf, lambda h: inner.broadcast(h, root)
        )

    def allgatherv(self, xf: Flat, of: Flat, counts: list[int]) -> None:
        hx, ho = self._in(xf), self._buffer(xf, sum(counts))
        self.inner.allgatherv(hx, ho, counts)
        self._out(of, ho, sum(counts))

    def gatherv(self, xf: Flat, of: Flat | None, counts: list[int], root: int) -> None:
        hx = self._in(xf)
        ho = self._buffer(xf, sum(counts)) if of is not None else None
        self.inner.gatherv(hx, ho, counts, root)
        if of is not None:
            self._out(of, ho, sum(counts))

    def scatterv(self, xf: Flat | None, of: Flat, counts: list[int], root: int) -> None:
        isz, mine = self.ops.itemsize(of), counts[self.setting.rank]
        hx = stage_in(self.stager, xf, of, sum(counts), isz) if xf is not None else None
        ho = self._buffer(of, mine)
        self.inner.scatterv(hx, ho, counts, root)
        self._out(of, ho, mine)

    def reduce_scatterv(
        self, xf: Flat, of: Flat, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        mine = counts[self.setting.rank]
        hx, ho = self._in(xf), self._buffer(of, mine)
        self.inner.reduce_scatterv(hx, ho, counts, op, dtype, scratch=True)
        self._out(of, ho, mine)

    def alltoallv(self, xf: Flat, send_counts: list[int], of: Flat, recv_counts: list[int]) -> None:
        hx, ho = self._in(xf), self._buffer(xf, sum(recv_counts))
        self.inner.alltoallv(hx, send_counts, ho, recv_counts)
        self._out(of, ho, sum(recv_counts))

    # ------------------------------------------------------------------ point-to-point

    def _transport(self) -> StagedTransport:
        c = self.setting.config
        return StagedTransport(self.setting.p2p, self.stager, c.chunk_bytes, c.timeout)

    def send(self, f: Flat, dest: int, tag: int) -> None:
        with self.ops.device_ctx():
            self._transport().send(f, dest, tag)

    def recv(self, f: Flat, source: int, tag: int) -> None:
        with self.ops.device_ctx():
            self._transport().recv(f, source, tag)

    def isend(self, f: Flat, dest: int, tag: int) -> Handle:
        st, n = self.stager, self.ops.nbytes(f)
        keep = st.pinned(max(1, n))
        with self.ops.device_ctx():
            st.wait(st.d2h(keep, f, 0, n))
        req = self.setting.p2p.Isend(mem(st.host_ptr(keep), n), dest, tag)
        what = f"isend to rank {dest} (tag {tag})"
        return request_handle(what, req, keep, self.setting.config.timeout)

    def irecv(self, f: Flat, source: int, tag: int) -> Handle:
        st, n = self.stager, self.ops.nbytes(f)
        host = st.pinned(max(1, n))

        def land(got: int) -> None:
            with self.ops.device_ctx():
                st.wait(st.h2d(f, host, 0, got))

        s, ptr = self.setting, st.host_ptr(host)
        return irecv_handle(
            s.p2p,
            mem(ptr, n),
            n,
            lambda: ptr,
            source,
            tag,
            s.config.chunk_bytes,
            land,
            s.config.timeout,
        )
