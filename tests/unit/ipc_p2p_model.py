"""A model of ``p2p_kernel`` (kernels.cu) in Python, for the point-to-point protocol on the CPU.

Every block of every rank's launch is a generator that runs the kernel's steps (thread 0's scan
of the ops, the block's copies, thread 0's posts and acknowledgements) and yields where the
kernel would spin or where another rank's blocks could run between two steps; a scheduler runs
them in a random interleaving. A rank's launches run in stream order (the next starts once every
block of the last finished). Memory is one byte array per rank (a pointer is an offset in it);
the header's counters, posts and inboxes are arrays of the same shapes as the kernel's. It reads
the parameter blocks that cudampi.comm.ipc.plan.p2p makes, so the encoding is checked too.
The GPU tests (tests/gpu/test_ipc_gpu.py) check the CUDA code itself.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache

import numpy

from cudampi.comm.ipc import layout as L

NEW, OPEN = -2, -1
SPIN_LIMIT = 20000
"""Spins of one block before the model's timeout (the kernel's CUDAMPI_TIMEOUT)."""


@dataclass
class Post:
    tag: int = 0
    reg: int = 0
    nbytes: int = 0
    off: int = 0
    seq: int = 0


@dataclass
class Rank:
    """One rank's device memory and workspace header, as its kernels see them."""

    rank: int
    nranks: int
    chunk: int
    blocks: int
    mem_bytes: int
    mem: numpy.ndarray = field(init=False)
    regs: dict[tuple[int, int], int] = field(default_factory=dict)
    """(peer, entry) -> the peer's registered allocation base (in the peer's memory)."""
    error: tuple[int, int] | None = None
    """(ERR_* code, peer) of the first failure, as the error record."""
    abort: bool = False

    def __post_init__(self) -> None:
        m, b = L.MAX_RANKS, self.blocks
        self.mem = numpy.zeros(self.mem_bytes, numpy.uint8)
        self.sent = numpy.zeros((m, b), numpy.int64)
        self.taken = numpy.zeros((m, b), numpy.int64)
        self.acked = numpy.zeros((m, b), numpy.int64)  # written by the receiver
        self.posts = [[[Post() for _ in range(L.P2P_SLOTS)] for _ in range(b)] for _ in range(m)]
        self.inbox = numpy.zeros((self.nranks, L.P2P_SLOTS, self.chunk), numpy.uint8)


@dataclass(frozen=True)
class Op:
    peer: int
    dir: int
    reg: int
    tag: int
    ptr: int
    nbytes: int

    @property
    def lane(self) -> int:
        return self.peer * 2 + (self.dir == L.P2P_SEND)


def ops_of(p: numpy.ndarray) -> list[Op]:
    """Decode a parameter block the way op_at does."""
    words = p[L.P2P_OPS_AT :].view(numpy.uint64)
    out = []
    for i in range(int(p[L.P2P_NOPS_AT])):
        w = int(words[3 * i])
        tag = w >> 32
        tag = tag - (1 << 32) if tag >= 1 << 31 else tag
        args = (int(p[L.P2P_OPS_AT + 3 * i + 1]), int(p[L.P2P_OPS_AT + 3 * i + 2]))
        out.append(Op(w & 0xFF, (w >> 8) & 0xFF, (w >> 16) & 0xFFFF, tag, *args))
    return out


@cache
def pack_ranges(n: int, nb: int, nt: int, blk: int) -> list[tuple[int, int]]:
    """The byte ranges of [0, n) that block ``blk`` of ``nb`` blocks of ``nt`` threads copies
    (16-byte pack k belongs to thread k mod nb * nt: FOR_PACKS and copy_spread)."""
    stride, out = nb * nt, []
    for k in range(-(-n // L.PACK)):
        if (k % stride) // nt == blk:
            out.append((k * L.PACK, min(n, (k + 1) * L.PACK)))
    return out


def block_chunks(nbytes: int, chunk: int, blk: int, nt: int) -> int:
    n = -(-nbytes // chunk) if nbytes > 0 else 1
    if blk == 0:
        return n
    first = blk * nt * L.PACK
    if first >= chunk:
        return 0
    return n if nbytes - (n - 1) * chunk > first else n - 1


def inplace_blocks(chunk: int, blocks: int, nt: int) -> int:
    per = nt * L.PACK
    return min(blocks, -(-chunk // per))


def record_error(ranks: list[Rank], me: int, code: int, peer: int) -> None:
    if ranks[me].error is None:
        ranks[me].error = (code, peer)
    for r in ranks:
        r.abort = True


def block(ranks: list[Rank], me: int, p: numpy.ndarray, blk: int, nt: int) -> Iterator[None]:
    """One block of one p2p_kernel launch of rank ``me`` (the steps of kernels.cu in order)."""
    R = ranks[me]
    G, chunk = R.blocks, int(p[L.P2P_CHUNK_AT])
    ops = ops_of(p)
    nops = len(ops)
    nxt = [int((R.sent if k & 1 else R.taken)[k >> 1][blk]) for k in range(2 * L.MAX_RANKS)]
    base, done, total = [0] * nops, [0] * nops, [NEW] * nops
    fin, inplace = [False] * nops, [False] * nops
    first, spins = 0, 0
    while True:
        state, go = 0, []  # go: (op, chunks, source of a read in place)
        while True:
            seen, waiting, moved = 0, -1, False
            while first < nops and fin[first]:
                first += 1
            for i in range(first, nops):
                if fin[i]:
                    continue
                o = ops[i]
                if seen & (1 << o.lane):
                    continue
                if total[i] == NEW:
                    bc = block_chunks(o.nbytes, chunk, blk, nt)
                    base[i] = nxt[o.lane]
                    if o.dir == L.P2P_SEND:
                        total[i] = int(bc > 0) if o.reg else bc
                    else:
                        total[i] = OPEN if bc > 0 else 0
                    if total[i] >= 0:
                        nxt[o.lane] += total[i]
                    if total[i] == 0:
                        fin[i] = True
                        continue
                seen |= 1 << o.lane
                if waiting < 0:
                    waiting = i
                g = base[i] + done[i]
                if o.dir == L.P2P_SEND:
                    acked = int(R.acked[o.peer][blk])  # written by the receiver
                    if done[i] >= total[i]:
                        if acked >= g:
                            fin[i], moved = True, True
                            seen &= ~(1 << o.lane)
                            if waiting == i:
                                waiting = -1
                        continue
                    room = acked + L.P2P_SLOTS - g
                    if room > 0:
                        go.append((i, min(room, L.P2P_SLOTS, total[i] - done[i]), None))
                    continue
                post = R.posts[o.peer][blk][g % L.P2P_SLOTS]
                if post.seq != g + 1:
                    continue
                if done[i] == 0:
                    if post.nbytes != o.nbytes or (o.tag >= 0 and post.tag != o.tag):
                        record_error(ranks, me, L.ERR_MESSAGE, o.peer)
                        state = 2
                        break
                    if total[i] == OPEN:
                        inplace[i] = post.reg > 0
                        total[i] = 1 if inplace[i] else block_chunks(o.nbytes, chunk, blk, nt)
                        nxt[o.lane] += total[i]
                n = 1
                src = None
                if inplace[i]:
                    src = (R.regs[(o.peer, post.reg - 1)], post.off)
                else:
                    most = min(L.P2P_SLOTS, total[i] - done[i])
                    while n < most and R.posts[o.peer][blk][(g + n) % L.P2P_SLOTS].seq == g + n + 1:
                        n += 1
                go.append((i, n, src))
            if state or go:
                break
            if moved:
                continue
            if waiting < 0:
                state = 1
                break
            if R.abort:
                record_error(ranks, me, L.ERR_ABORTED, ops[waiting].peer)
                state = 2
                break
            spins += 1
            if spins > SPIN_LIMIT:
                record_error(ranks, me, L.ERR_TIMEOUT, ops[waiting].peer)
                state = 2
                break
            yield  # spinning
        if state:
            break
        for i, cnt, src in go:  # the block's copies
            o = ops[i]
            if o.dir == L.P2P_SEND and o.reg:
                continue
            if o.dir == L.P2P_RECV and inplace[i]:
                peer_base, off = src
                nb = inplace_blocks(chunk, G, nt)
                if blk < nb:
                    for a, b in pack_ranges(o.nbytes, nb, nt, blk):
                        R.mem[o.ptr + a : o.ptr + b] = ranks[o.peer].mem[
                            peer_base + off + a : peer_base + off + b
                        ]
                continue
            for j in range(cnt):
                lo = (done[i] + j) * chunk
                cb = max(0, min(chunk, o.nbytes - lo))
                slot = (base[i] + done[i] + j) % L.P2P_SLOTS
                for a, b in pack_ranges(cb, G, nt, blk):
                    if o.dir == L.P2P_SEND:
                        box = ranks[o.peer].inbox[me][slot]
                        box[a:b] = R.mem[o.ptr + lo + a : o.ptr + lo + b]
                    else:
                        R.mem[o.ptr + lo + a : o.ptr + lo + b] = R.inbox[o.peer][slot][a:b]
        yield  # other ranks run between the copies and the posts
        for i, cnt, _ in go:  # thread 0's posts and acknowledgements
            o = ops[i]
            g = base[i] + done[i]
            if o.dir == L.P2P_SEND:
                for j in range(cnt):
                    slot = (g + j) % L.P2P_SLOTS
                    ranks[o.peer].posts[me][blk][slot] = Post(
                        o.tag, o.reg, o.nbytes, o.ptr if o.reg else 0, g + j + 1
                    )
            else:
                ranks[o.peer].acked[me][blk] = g + cnt
            done[i] += cnt
            if done[i] >= total[i] and not (o.dir == L.P2P_SEND and o.reg):
                fin[i] = True
    if state == 1:
        for lane in range(2 * L.MAX_RANKS):
            (R.sent if lane & 1 else R.taken)[lane >> 1][blk] = nxt[lane]


def run(
    ranks: list[Rank],
    launches: list[list[numpy.ndarray]],
    *,
    nt: int,
    seed: int,
    on_end: Callable[[int, numpy.ndarray], None] = lambda r, p: None,
) -> None:
    """Run every rank's launches (parameter blocks, in stream order) with the blocks of the
    ranks' current launches interleaved at random; ``on_end(rank, params)`` runs as a launch
    ends (before the rank's next one starts)."""
    rng = random.Random(seed)
    queue = [list(ls) for ls in launches]
    live: dict[int, list[Iterator[None]]] = {}

    def start(r: int) -> None:
        if queue[r]:
            p = queue[r][0]
            live[r] = [block(ranks, r, p, b, nt) for b in range(ranks[r].blocks)]

    for r in range(len(ranks)):
        start(r)
    while live:
        r = rng.choice(sorted(live))
        blocks = live[r]
        gen = rng.choice(blocks)
        try:
            next(gen)
        except StopIteration:
            blocks.remove(gen)
            if not blocks:
                on_end(r, queue[r].pop(0))
                del live[r]
                if ranks[r].error is None:  # after an error the host launches nothing more
                    start(r)
