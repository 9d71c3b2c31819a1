"""The staged path: device data goes through pinned host buffers and MPI works on host memory.

Element-wise collectives (allreduce, reduce, broadcast) are pipelined piece by piece: the
device->host copy of piece k+1 and the host->device copy of piece k-1 run on the copy stream
while MPI (or cudampi's host algorithm, for dtypes MPI cannot reduce) works on piece k. The other
collectives stage their whole input in, run on the host, and stage their output back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

PIECES_MAX = 64
SLOTS = 3


def piece_bounds(count: int, itemsize: int, chunk_bytes: int) -> list[tuple[int, int]]:
    step = max(1, chunk_bytes // max(1, itemsize), -(-count // PIECES_MAX))
    return [(lo, min(count, lo + step)) for lo in range(0, count, step)]


def piecewise(
    stager: Any,
    src: Any | None,
    dst: Any | None,
    like: Any,
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


def stage_in(stager: Any, a: Any, like: Any, count: int, itemsize: int) -> Any:
    """A host copy of the flat ``a`` (``count`` elements), as host elements."""
    host = stager.pinned(max(1, count * itemsize))
    if count:
        stager.wait(stager.d2h(host, a, 0, count * itemsize))
    return stager.host_view(host, like, count)


def stage_buffer(stager: Any, like: Any, count: int, itemsize: int) -> Any:
    """An uninitialised host buffer of ``count`` elements."""
    return stager.host_view(stager.pinned(max(1, count * itemsize)), like, count)


def stage_out(stager: Any, dst: Any, host_view: Any, nbytes: int) -> None:
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
