"""The ipc point-to-point protocol (p2p_kernel) run through its Python model
(tests/unit/ipc_p2p_model.py) in random interleavings of the ranks' blocks: messages through the
inbox and read in place, in one lane and across lanes, groups that send and receive at once,
and the faults (a size mismatch, two ranks that both send past the eager size first)."""

from __future__ import annotations

import numpy
import pytest

from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
from tests.unit import ipc_p2p_model as M

SEEDS = range(6)


class Node:
    """n ranks of the model, a bump allocator in each rank's memory, and the messages' bytes.

    ``capacity`` sets the chunk (1/32 of it, at least 4096: 64 KiB makes 4 KiB chunks and a 16
    KiB eager size), ``blocks`` and ``nt`` the grid (nt threads of 16 bytes a block, so with 32
    threads a chunk spreads over several blocks as 1 MiB chunks do over 512 threads)."""

    def __init__(self, n: int, *, capacity: int = 64 << 10, blocks: int = 3, nt: int = 32):
        self.n, self.nt = n, nt
        self.geo = [plan.Geometry(r, n, capacity, 10**9, 0) for r in range(n)]
        chunk = L.p2p_chunk(capacity)
        self.eager = L.p2p_eager(capacity)
        self.ranks = [M.Rank(r, n, chunk, blocks, 4 << 20) for r in range(n)]
        self.top = [0] * n
        self.groups: list[list[list[plan.Message]]] = [[] for _ in range(n)]
        self.expect: list[tuple[int, int, numpy.ndarray]] = []  # (rank, ptr, bytes)
        self.sends: dict[int, list[tuple[int, int]]] = {r: [] for r in range(n)}
        self.serial = 0

    def alloc(self, r: int, nbytes: int, skew: int = 0) -> int:
        ptr = self.top[r] + skew
        self.top[r] = -(-(ptr + nbytes + 1) // 64) * 64
        assert self.top[r] <= self.ranks[r].mem_bytes
        return ptr

    def message(
        self, src: int, dst: int, nbytes: int, tag: int = 0, *, in_place: bool = False,
        skew: int = 0, recv_tag: int | None = None, recv_bytes: int | None = None,
    ) -> tuple[plan.Message, plan.Message]:  # fmt: skip
        """A send and its receive with fresh bytes (registered and mapped by the receiver
        when ``in_place``: one registry entry per message here)."""
        self.serial += 1
        data = numpy.random.default_rng(self.serial).integers(0, 256, nbytes, numpy.uint8)
        sp = self.alloc(src, nbytes, skew)
        self.ranks[src].mem[sp : sp + nbytes] = data
        rp = self.alloc(dst, recv_bytes if recv_bytes is not None else nbytes, skew)
        reg = offset = 0
        if in_place:
            base = sp - skew - 64  # the allocation holding the buffer starts before it
            reg, offset = self.serial, sp - base
            self.ranks[dst].regs[(src, reg - 1)] = base
        send = plan.Message(True, dst, sp, nbytes, tag, reg, offset)
        recv = plan.Message(
            False, src, rp, recv_bytes or nbytes, tag if recv_tag is None else recv_tag
        )
        self.expect.append((dst, rp, data))
        self.sends[src].append((sp, nbytes))
        return send, recv

    def run(self, seed: int) -> None:
        launches = [
            [lc.params for g in self.groups[r] for lc in plan.p2p(self.geo[r], g)]
            for r in range(self.n)
        ]

        def scribble(r: int, p: numpy.ndarray) -> None:
            # once a launch ends the sender may write its buffers: a receive must not need them
            for o in M.ops_of(p):
                if o.dir == L.P2P_SEND:
                    ptr = o.ptr + (self._base_of(r, o) if o.reg else 0)
                    self.ranks[r].mem[ptr : ptr + o.nbytes] = 0xEE

        M.run(self.ranks, launches, nt=self.nt, seed=seed, on_end=scribble)

    def _base_of(self, r: int, o: M.Op) -> int:
        return self.ranks[o.peer].regs[(r, o.reg - 1)]

    def check(self) -> None:
        assert [rk.error for rk in self.ranks] == [None] * self.n
        for r, ptr, data in self.expect:
            got = self.ranks[r].mem[ptr : ptr + len(data)]
            assert numpy.array_equal(got, data), f"rank {r} at {ptr}: {len(data)} bytes differ"


SIZES = [0, 1, 100, 3 * 4096 + 5, 5 * 4096 + 3]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 3, 4])
def test_sendrecv_around_the_ring_through_the_inbox_and_in_place(n, seed):
    node = Node(n)
    for size in [*SIZES, 5 * 4096 + 3, 40_000]:  # one size twice: a lane goes on in place
        in_place = size > node.eager
        pairs = [node.message(r, (r + 1) % n, size, 7, in_place=in_place) for r in range(n)]
        for r in range(n):
            send, _ = pairs[r]
            _, recv = pairs[(r - 1) % n]
            node.groups[r].append([recv, send])
    node.run(seed)
    node.check()


@pytest.mark.parametrize("seed", SEEDS)
def test_one_lane_mixes_messages_in_place_and_through_the_inbox_in_order(seed):
    node = Node(2)
    big = node.eager + 4097
    msgs = [
        node.message(0, 1, big, 1, in_place=True, skew=1),  # odd offset
        node.message(0, 1, 10, 2),
        node.message(0, 1, big, 3),  # the same size through the inbox
        node.message(0, 1, big, 4, in_place=True),
        node.message(0, 1, 0, 5),
    ]
    # the sender posts them one group each, the receiver all in one (as irecvs, then a wait)
    node.groups[0] = [[s] for s, _ in msgs]
    node.groups[1] = [[r for _, r in msgs]]
    node.run(seed)
    node.check()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("n", [2, 3])
def test_a_batch_with_every_peer_both_ways_at_once(n, seed):
    node = Node(n)
    sends: list[list[plan.Message]] = [[] for _ in range(n)]
    recvs: list[list[plan.Message]] = [[] for _ in range(n)]
    for src in range(n):
        for dst in range(n):
            for size in (33, node.eager + 100):
                s, r = node.message(src, dst, size, 9, in_place=size > node.eager and src != dst)
                sends[src].append(s)
                recvs[dst].append(r)
    for r in range(n):
        node.groups[r] = [recvs[r] + sends[r]]
    node.run(seed)
    node.check()


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("in_place", [False, True])
def test_blocking_pairs_past_the_eager_size(in_place, seed):
    node = Node(2)
    a_s, a_r = node.message(0, 1, 3 * node.eager, in_place=in_place)
    b_s, b_r = node.message(1, 0, 3 * node.eager, in_place=in_place)
    node.groups[0] = [[a_s], [b_r]]  # rank 0 sends first, rank 1 receives first
    node.groups[1] = [[a_r], [b_s]]
    node.run(seed)
    node.check()


@pytest.mark.parametrize("seed", SEEDS)
def test_a_grid_of_real_size_reads_in_place_with_one_block(seed):
    # 512 threads a block cover 8 KiB: with 4 KiB chunks only block 0 moves data, in place too
    node = Node(2, nt=512, blocks=4)
    s, r = node.message(0, 1, node.eager + 20_000, in_place=True, skew=3)
    t, q = node.message(1, 0, 5000)
    node.groups[0] = [[s, q]]
    node.groups[1] = [[r, t]]
    node.run(seed)
    node.check()


@pytest.mark.parametrize("in_place", [False, True])
def test_both_ranks_sending_past_the_eager_size_first_time_out(in_place):
    node = Node(2)
    a_s, a_r = node.message(0, 1, 2 * node.eager, in_place=in_place)
    b_s, b_r = node.message(1, 0, 2 * node.eager, in_place=in_place)
    node.groups[0] = [[a_s], [b_r]]
    node.groups[1] = [[b_s], [a_r]]
    node.run(0)
    codes = {rk.error[0] for rk in node.ranks if rk.error}
    assert L.ERR_TIMEOUT in codes and codes <= {L.ERR_TIMEOUT, L.ERR_ABORTED}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("in_place", [False, True])
def test_a_receive_of_another_size_fails_on_both_ranks(in_place, seed):
    node = Node(2)
    big = node.eager + 5000
    node.message(0, 1, 10)  # a message before it, matched
    s0, r0 = node.message(0, 1, 10)
    s, r = node.message(0, 1, big, in_place=in_place, recv_bytes=big - 16)
    node.groups[0] = [[s0], [s]]
    node.groups[1] = [[r0], [r]]
    node.run(seed)
    assert node.ranks[1].error == (L.ERR_MESSAGE, 0)
    if in_place:  # the sender waits for the read, and is told to stop
        assert node.ranks[0].error == (L.ERR_ABORTED, 1)


def test_the_model_catches_a_send_whose_sender_ends_before_the_read():
    """The scribble at a launch's end is what checks the rendezvous: a model whose sends read
    in place end at the post (without the acknowledgement) must fail."""
    node = Node(2)
    s, r = node.message(0, 1, node.eager + 5000, in_place=True)
    node.groups[0] = [[s]]
    node.groups[1] = [[r]]
    original = M.block

    def eager_ends(ranks, me, p, blk, nt):
        ops = M.ops_of(p)
        if me == 0 and ops[0].reg:
            # post the chunk as the kernel does, then end without waiting for the ack
            g = int(ranks[0].sent[1][blk])
            if M.block_chunks(ops[0].nbytes, int(p[L.P2P_CHUNK_AT]), blk, nt) > 0:
                ranks[1].posts[0][blk][g % L.P2P_SLOTS] = M.Post(
                    ops[0].tag, ops[0].reg, ops[0].nbytes, ops[0].ptr, g + 1
                )
                ranks[0].sent[1][blk] = g + 1
            return
            yield
        yield from original(ranks, me, p, blk, nt)

    M.block = eager_ends
    try:
        node.run(1)
    finally:
        M.block = original
    with pytest.raises(AssertionError, match="differ"):
        node.check()
