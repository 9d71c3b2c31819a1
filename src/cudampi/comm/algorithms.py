"""Collective algorithms built from point-to-point, generic over array ops and a transport.

Every function works on flat arrays through an :class:`~cudampi.comm.arrays.ArrayOps` (so the same
code reduces on the host or on a GPU) and a :class:`~cudampi.comm.transport.DirectTransport`.
Large messages use bandwidth-optimal reduce-scatter + allgather, either as rings (2(n-1) steps
to neighbours: right for any topology) or direct (every rank exchanges with every other at once:
2 steps, best where all ranks share one node's NVLink/NVSwitch); small ones use latency-optimal
recursive doubling / binomial trees. Any rank count works (non-powers of two fold the extra
ranks into partners). Transfers are chunked: while chunk k is reduced, chunks k+1 and
k+2 are already being received into rotating scratch slots. All ranks must call the same
function with the same sizes (the communicator checks that first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cudampi.comm.arrays import ArrayOps
from cudampi.comm.transport import DirectTransport

MAX_CHUNKS = 8
"""A segment is sent in at most this many chunks: past that, per-message overhead (MPI
rendezvous, Python, events) costs more than the overlap of transfer and reduction gains."""

SLOTS = 3


@dataclass(frozen=True)
class Ctx:
    """One collective call's setting: who we are, how to reduce, how to move, how to chunk."""

    rank: int
    size: int
    ops: ArrayOps
    tx: DirectTransport
    itemsize: int
    chunk_bytes: int
    small_bytes: int
    direct: bool = False
    """Large reduce-scatter/allgather exchange with all ranks at once instead of a ring."""


def even_counts(count: int, parts: int) -> list[int]:
    """``count`` split in ``parts`` near-equal pieces, the larger ones first."""
    q, r = divmod(count, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def offsets(counts: list[int]) -> list[int]:
    out, acc = [], 0
    for c in counts:
        out.append(acc)
        acc += c
    return out


def chunk_elems(ctx: Ctx, seg: int) -> int:
    base = max(1, ctx.chunk_bytes // max(1, ctx.itemsize))
    return max(base, -(-seg // MAX_CHUNKS))


def chunks(ctx: Ctx, lo: int, hi: int) -> list[tuple[int, int]]:
    step = chunk_elems(ctx, hi - lo)
    return [(a, min(hi, a + step)) for a in range(lo, hi, step)]


# ---------------------------------------------------------------------------- building blocks


def exchange_reduce(
    ctx: Ctx,
    data: Any,
    send: tuple[int, int],
    dest: int,
    recv: tuple[int, int],
    src: int,
    op: str,
    dtype: str,
    slots: list[Any],
    sdata: Any = None,
    first: Any = None,
) -> None:
    """Send ``data[send]`` (``sdata[send]`` where given) to ``dest`` while receiving ``src``'s
    copy of ``data[recv]`` and reducing it into ``data[recv]`` (``data[recv] = first[recv] op
    it`` where ``first`` is given), chunk by chunk, pipelined over the scratch ``slots``."""
    tx, ops = ctx.tx, ctx.ops
    out = data if sdata is None else sdata
    sreqs = [tx.isend(out[a:b], dest) for a, b in chunks(ctx, *send)]
    rch = chunks(ctx, *recv)
    ns = len(slots)
    rreqs: dict[int, Any] = {}
    events: dict[int, Any] = {}

    def post(j: int) -> None:
        a, b = rch[j]
        rreqs[j] = tx.irecv(slots[j % ns][: b - a], src)

    for j in range(min(ns - 1, len(rch))):
        post(j)
    for j, (a, b) in enumerate(rch):
        tx.wait(rreqs.pop(j))
        ops.reduce(
            data[a:b], slots[j % ns][: b - a], op, dtype, None if first is None else first[a:b]
        )
        events[j] = ops.record()
        nxt = j + ns - 1
        if nxt < len(rch):
            if j - 1 in events:  # slot of nxt was last read by the reduction of chunk j-1
                ops.wait_event(events.pop(j - 1))
            post(nxt)
    tx.waitall(sreqs)


def exchange(
    ctx: Ctx,
    sdata: Any,
    send: tuple[int, int],
    dest: int,
    rdata: Any,
    recv: tuple[int, int],
    src: int,
) -> None:
    """Send ``sdata[send]`` to ``dest`` and receive ``rdata[recv]`` from ``src``, chunked."""
    tx = ctx.tx
    reqs = [tx.irecv(rdata[a:b], src) for a, b in chunks(ctx, *recv)]
    reqs += [tx.isend(sdata[a:b], dest) for a, b in chunks(ctx, *send)]
    tx.waitall(reqs)


def _slots(ctx: Ctx, like: Any, seg: int) -> list[Any]:
    n = min(seg, chunk_elems(ctx, seg))
    buf = ctx.ops.empty(max(1, n) * SLOTS, like)
    return [buf[i * n : (i + 1) * n] for i in range(SLOTS)]


# ---------------------------------------------------------------------------- rings


def ring_reduce_scatter(
    ctx: Ctx, data: Any, counts: list[int], op: str, dtype: str, src: Any = None
) -> None:
    """In place: afterwards block ``rank`` of ``data`` (blocks sized by ``counts``) holds the
    reduction over all ranks; other blocks hold partial sums. With ``src`` (the input, apart
    from ``data``), ``data`` starts empty: the first step sends from ``src``, and each block is
    reduced from ``src`` into ``data`` (a rank reduces every block but the one it sends first
    exactly once), so the input is never copied; block ``rank - 1`` of ``data`` stays unset."""
    n, r = ctx.size, ctx.rank
    if n == 1:
        return
    offs = offsets(counts)
    bounds = [(offs[i], offs[i] + counts[i]) for i in range(n)]
    slots = _slots(ctx, data, max(counts))
    right, left = (r + 1) % n, (r - 1) % n
    for s in range(n - 1):
        ctx.ops.fence()  # the block we send was reduced in the previous step
        exchange_reduce(
            ctx,
            data,
            bounds[(r - s - 1) % n],
            right,
            bounds[(r - s - 2) % n],
            left,
            op,
            dtype,
            slots,
            src if s == 0 else None,
            src,
        )
    ctx.ops.fence()


def ring_allgather(ctx: Ctx, data: Any, counts: list[int]) -> None:
    """In place: block ``rank`` of ``data`` is ours; afterwards every block is filled."""
    n, r = ctx.size, ctx.rank
    if n == 1:
        return
    offs = offsets(counts)
    bounds = [(offs[i], offs[i] + counts[i]) for i in range(n)]
    right, left = (r + 1) % n, (r - 1) % n
    ctx.ops.fence()
    for s in range(n - 1):
        exchange(ctx, data, bounds[(r - s) % n], right, data, bounds[(r - s - 1) % n], left)


def direct_reduce_scatter(
    ctx: Ctx, data: Any, counts: list[int], op: str, dtype: str, src: Any = None
) -> None:
    """Like :func:`ring_reduce_scatter`, but block i goes straight to rank i from every rank
    (one message per peer, all in flight at once); blocks are reduced in a fixed peer order as
    they arrive, so results do not depend on timing. With ``src``: sent from ``src``, block
    ``rank`` reduced from it into ``data`` (the other blocks of ``data`` stay unset)."""
    n, r = ctx.size, ctx.rank
    if n == 1:
        return
    tx, ops = ctx.tx, ctx.ops
    offs = offsets(counts)
    c = counts[r]
    mine = data[offs[r] : offs[r] + c]
    sdata = data if src is None else src
    first = None if src is None else src[offs[r] : offs[r] + c]
    peers = [(r + i) % n for i in range(1, n)]
    scratch = ops.empty(max(1, c * (n - 1)), data)
    ops.fence()
    rreqs = [tx.irecv(scratch[i * c : (i + 1) * c], p) for i, p in enumerate(peers)]
    sreqs = [tx.isend(sdata[offs[p] : offs[p] + counts[p]], p) for p in reversed(peers)]
    for i in range(n - 1):
        tx.wait(rreqs[i])
        ops.reduce(mine, scratch[i * c : (i + 1) * c], op, dtype, first if i == 0 else None)
    tx.waitall(sreqs)
    ops.fence()


def direct_allgather(ctx: Ctx, data: Any, counts: list[int]) -> None:
    """Like :func:`ring_allgather`, with every block sent straight to every rank."""
    n, r = ctx.size, ctx.rank
    if n == 1:
        return
    tx = ctx.tx
    offs = offsets(counts)
    peers = [(r + i) % n for i in range(1, n)]
    ctx.ops.fence()
    reqs = [tx.irecv(data[offs[p] : offs[p] + counts[p]], p) for p in peers]
    own = data[offs[r] : offs[r] + counts[r]]
    reqs += [tx.isend(own, p) for p in reversed(peers)]
    tx.waitall(reqs)


def reduce_scatter_blocks(
    ctx: Ctx, data: Any, counts: list[int], op: str, dtype: str, src: Any = None
) -> None:
    """In place (or from ``src`` into ``data``): block ``rank`` of ``data`` ends up reduced over
    all ranks (ring or direct)."""
    if src is not None and ctx.size == 1:
        ctx.ops.copy(data, src)
        ctx.ops.fence()
    elif ctx.direct:
        direct_reduce_scatter(ctx, data, counts, op, dtype, src)
    else:
        ring_reduce_scatter(ctx, data, counts, op, dtype, src)


def allgather_blocks(ctx: Ctx, data: Any, counts: list[int]) -> None:
    """In place: every rank's block ``rank`` reaches every rank (ring or direct)."""
    if ctx.direct:
        direct_allgather(ctx, data, counts)
    else:
        ring_allgather(ctx, data, counts)


def ring_allreduce(ctx: Ctx, data: Any, op: str, dtype: str, src: Any = None) -> None:
    """Reduce-scatter + allgather (ring or direct, see :class:`Ctx`); from ``src`` into
    ``data`` where given (no copy of the input: see :func:`ring_reduce_scatter`)."""
    counts = even_counts(int(data.shape[0]), ctx.size)
    reduce_scatter_blocks(ctx, data, counts, op, dtype, src)
    allgather_blocks(ctx, data, counts)


# ---------------------------------------------------------------------------- recursive doubling


def rd_allreduce(ctx: Ctx, data: Any, op: str, dtype: str) -> None:
    """Recursive doubling; the ``size - 2**k`` extra ranks first hand their data to a partner."""
    n, r = ctx.size, ctx.rank
    if n == 1:
        return
    count = int(data.shape[0])
    ops = ctx.ops
    tmp = ops.scratch(count, data)
    p2 = 1 << (n.bit_length() - 1)
    rem = n - p2
    whole = (0, count)
    ops.fence()
    if r < 2 * rem:
        if r % 2 == 0:
            exchange(ctx, data, whole, r + 1, data, (0, 0), r + 1)
            newrank = -1
        else:
            exchange(ctx, data, (0, 0), r - 1, tmp, whole, r - 1)
            ops.reduce(data, tmp, op, dtype)
            newrank = r // 2
    else:
        newrank = r - rem
    if newrank >= 0:
        mask = 1
        while mask < p2:
            peer_new = newrank ^ mask
            peer = peer_new * 2 + 1 if peer_new < rem else peer_new + rem
            ops.fence()
            exchange(ctx, data, whole, peer, tmp, whole, peer)
            ops.reduce(data, tmp, op, dtype)
            mask <<= 1
    ops.fence()
    if r < 2 * rem:
        if r % 2 == 0:
            exchange(ctx, data, (0, 0), r + 1, data, whole, r + 1)
        else:
            exchange(ctx, data, whole, r - 1, data, (0, 0), r - 1)


def allreduce(ctx: Ctx, data: Any, op: str, dtype: str, src: Any = None) -> None:
    """Allreduce of the flat ``data`` in place, or of ``src`` into ``data`` (apart from it):
    ring for large messages, which reads ``src`` where it lies, recursive doubling for small
    ones, after a copy (``avg`` is divided by the caller, before)."""
    count = int(data.shape[0])
    alone = ctx.size == 1 or count == 0
    small = count * ctx.itemsize <= ctx.small_bytes or count < ctx.size
    if src is not None and (alone or small):  # those paths work in place
        ctx.ops.copy(data, src)
        src = None
        if alone:
            ctx.ops.fence()
    if alone:
        return
    if small:
        rd_allreduce(ctx, data, op, dtype)
    else:
        ring_allreduce(ctx, data, op, dtype, src)


# ---------------------------------------------------------------------------- rooted


def reduce(ctx: Ctx, work: Any, op: str, dtype: str, root: int) -> None:
    """In place in ``work`` (a copy of the input on every rank): the reduction lands on ``root``."""
    n, r = ctx.size, ctx.rank
    count = int(work.shape[0])
    if n == 1 or count == 0:
        return
    ops = ctx.ops
    if count * ctx.itemsize > ctx.small_bytes and count >= n:
        counts = even_counts(count, n)
        reduce_scatter_blocks(ctx, work, counts, op, dtype)
        offs = offsets(counts)
        tx = ctx.tx
        if r == root:
            reqs = [tx.irecv(work[offs[b] : offs[b] + counts[b]], b) for b in range(n) if b != root]
            tx.waitall(reqs)
        else:
            tx.waitall([tx.isend(work[offs[r] : offs[r] + counts[r]], root)])
        return
    tmp = ops.scratch(count, work)
    whole = (0, count)
    vr = (r - root) % n
    mask = 1
    while mask < n:
        if vr & mask:
            ops.fence()
            exchange(ctx, work, whole, (vr - mask + root) % n, work, (0, 0), 0)
            break
        if vr + mask < n:
            ops.fence()  # the previous reduction still reads tmp
            exchange(ctx, work, (0, 0), 0, tmp, whole, (vr + mask + root) % n)
            ops.reduce(work, tmp, op, dtype)
        mask <<= 1
    ops.fence()


def broadcast(ctx: Ctx, data: Any, root: int) -> None:
    """In place: ``root``'s ``data`` reaches every rank (binomial tree when small, a pipelined
    chain of chunks when large)."""
    n, r = ctx.size, ctx.rank
    count = int(data.shape[0])
    if n == 1 or count == 0:
        return
    tx = ctx.tx
    ctx.ops.fence()
    vr = (r - root) % n
    if count * ctx.itemsize > ctx.small_bytes and n > 2:
        prev, nxt = (vr - 1 + root) % n, (vr + 1 + root) % n
        parts = chunks(ctx, 0, count)
        sends: list[Any] = []
        if vr == 0:
            sends = [tx.isend(data[a:b], nxt) for a, b in parts]
        else:
            recvs = [tx.irecv(data[a:b], prev) for a, b in parts]
            for (a, b), req in zip(parts, recvs):
                tx.wait(req)
                if vr < n - 1:
                    sends.append(tx.isend(data[a:b], nxt))
        tx.waitall(sends)
        return
    mask = 1
    while mask < n:
        if vr & mask:
            tx.waitall([tx.irecv(data, (vr - mask + root) % n)])
            break
        mask <<= 1
    mask >>= 1
    reqs = []
    while mask > 0:
        if vr + mask < n:
            reqs.append(tx.isend(data, (vr + mask + root) % n))
        mask >>= 1
    tx.waitall(reqs)


def gatherv(ctx: Ctx, send: Any, out: Any, counts: list[int], root: int) -> None:
    """Rank i's ``send`` (``counts[i]`` elements) lands in block i of ``out`` on ``root``."""
    tx, r = ctx.tx, ctx.rank
    ctx.ops.fence()
    if r == root:
        offs = offsets(counts)
        reqs = [
            tx.irecv(out[offs[i] : offs[i] + counts[i]], i) for i in range(ctx.size) if i != root
        ]
        ctx.ops.copy(out[offs[r] : offs[r] + counts[r]], send)
        ctx.ops.fence()
        tx.waitall(reqs)
    else:
        tx.waitall([tx.isend(send, root)])


def scatterv(ctx: Ctx, send: Any, out: Any, counts: list[int], root: int) -> None:
    """Block i of ``root``'s ``send`` (``counts[i]`` elements) lands in rank i's ``out``."""
    tx, r = ctx.tx, ctx.rank
    ctx.ops.fence()
    if r == root:
        offs = offsets(counts)
        reqs = [
            tx.isend(send[offs[i] : offs[i] + counts[i]], i) for i in range(ctx.size) if i != root
        ]
        ctx.ops.copy(out, send[offs[r] : offs[r] + counts[r]])
        ctx.ops.fence()
        tx.waitall(reqs)
    else:
        tx.waitall([tx.irecv(out, root)])


def allgatherv(ctx: Ctx, send: Any, out: Any, counts: list[int]) -> None:
    """Every rank's ``send`` (``counts[i]`` elements from rank i) lands in block i of ``out``."""
    offs = offsets(counts)
    r = ctx.rank
    ctx.ops.copy(out[offs[r] : offs[r] + counts[r]], send)
    allgather_blocks(ctx, out, counts)
    ctx.ops.fence()


def reduce_scatterv(
    ctx: Ctx, work: Any, out: Any, counts: list[int], op: str, dtype: str, src: Any = None
) -> None:
    """``work`` (a scratch copy of the input, clobbered; or, with ``src``, a scratch buffer of
    its size and ``src`` the input, read where it lies) is reduced over ranks; block ``rank``
    (``counts[rank]`` elements) lands in ``out``."""
    reduce_scatter_blocks(ctx, work, counts, op, dtype, src)
    offs = offsets(counts)
    r = ctx.rank
    ctx.ops.copy(out, work[offs[r] : offs[r] + counts[r]])
    ctx.ops.fence()


def alltoallv(ctx: Ctx, send: Any, scounts: list[int], out: Any, rcounts: list[int]) -> None:
    """Block j of ``send`` (``scounts[j]`` elements) goes to rank j; block i of ``out``
    (``rcounts[i]`` elements) comes from rank i. All transfers are posted at once."""
    tx, r, n = ctx.tx, ctx.rank, ctx.size
    so, ro = offsets(scounts), offsets(rcounts)
    ctx.ops.fence()
    reqs = []
    for s in range(1, n):
        src = (r - s) % n
        reqs += [tx.irecv(out[a:b], src) for a, b in chunks(ctx, ro[src], ro[src] + rcounts[src])]
    for s in range(1, n):
        dst = (r + s) % n
        reqs += [tx.isend(send[a:b], dst) for a, b in chunks(ctx, so[dst], so[dst] + scounts[dst])]
    ctx.ops.copy(out[ro[r] : ro[r] + rcounts[r]], send[so[r] : so[r] + scounts[r]])
    tx.waitall(reqs)
    ctx.ops.fence()
