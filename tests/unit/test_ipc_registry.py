"""The ipc buffer registry's rules, with NumPy standing in for shared memory and the CUDA calls
(the GPU tests run it with real IPC handles)."""

from __future__ import annotations

import numpy
import pytest

from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc.registry import SEGMENT, Registry

MAPPED = 1 << 44


class Node:
    """n ranks' registries over one set of mailbox segments; allocations by (base, id)."""

    def __init__(self, n: int) -> None:
        self.segs = [numpy.zeros(1, SEGMENT)[0] for _ in range(n)]
        self.allocs: dict[int, tuple[int, int, int]] = {}  # pointer block -> (base, size, id)
        self.tables = [dict() for _ in range(n)]
        self.refuse: set[int] = set()
        self.regs = [self._registry(r) for r in range(n)]

    def alloc(self, base: int, size: int, buffer_id: int) -> None:
        self.allocs[base] = (base, size, buffer_id)

    def _registry(self, r: int) -> Registry:
        def query(ptr: int):
            for base, info in self.allocs.items():
                if base <= ptr < base + info[1]:
                    return info
            return None

        def export(base: int) -> bytes:
            if base in self.refuse:
                raise RuntimeError("not exportable")
            return base.to_bytes(8, "little") + bytes(56)

        def open_(handle: bytes) -> int:
            return int.from_bytes(handle[:8], "little") + MAPPED

        def write(peer: int, k: int, base: int) -> None:
            self.tables[r][(peer, k)] = base

        return Registry(r, self.segs, query=query, export=export, open_=open_,
                        close=lambda b: None, write_table=write)  # fmt: skip


def test_used_only_once_every_peer_maps_it_by_that_launch():
    node = Node(3)
    node.alloc(0x1000_0000, 1 << 20, 7)
    r0, r1, r2 = node.regs
    assert r0.lookup(0x1000_0100, 5) == (0, 0)  # published now, nobody mapped it yet
    assert int(node.segs[0]["count"]) == 1
    r1.step(6)  # rank 1's kernels see it from its launch 6 on
    assert node.tables[1][(0, 0)] == 0x1000_0000 + MAPPED
    assert r0.lookup(0x1000_0100, 6) == (0, 0)  # rank 2 has not mapped it
    r2.step(9)
    assert r0.lookup(0x1000_0100, 8) == (0, 0)  # rank 2's kernels see it from launch 9 only
    assert r0.lookup(0x1000_0100, 9) == (1, 0x100)
    assert r0.lookup(0x1000_0200, 20) == (1, 0x200)  # another block of the same segment
    assert int(node.segs[0]["count"]) == 1


def test_a_segment_made_again_at_the_same_address_is_a_new_registration():
    node = Node(2)
    node.alloc(0x2000_0000, 4096, 1)
    r0, r1 = node.regs
    r0.lookup(0x2000_0000, 0)
    r1.step(1)
    assert r0.lookup(0x2000_0000, 1) == (1, 0)
    node.alloc(0x2000_0000, 4096, 2)  # freed and allocated again: a new buffer id
    assert r0.lookup(0x2000_0000, 2) == (0, 0)
    r1.step(3)
    assert r0.lookup(0x2000_0000, 3) == (2, 0)


def test_bounded_unexportable_and_capture_stage():
    node = Node(2)
    r0, r1 = node.regs
    for i in range(L.MAX_REGS + 3):
        node.alloc((i + 1) << 32, 4096, i)
        r0.lookup((i + 1) << 32, 0)
    assert int(node.segs[0]["count"]) == L.MAX_REGS
    r1.step(1)
    assert r0.lookup((L.MAX_REGS + 2) << 32, 1) == (0, 0)
    assert r0.lookup(1 << 32, 1) == (1, 0)
    node2 = Node(2)
    node2.alloc(0x5000, 4096, 1)
    node2.refuse.add(0x5000)
    assert node2.regs[0].lookup(0x5000, 0) == (0, 0)
    assert int(node2.segs[0]["count"]) == 0
    node2.alloc(0x9000, 4096, 2)
    assert node2.regs[0].lookup(0x9000, 0, publish=False) == (0, 0)  # capturing: no publishing
    assert int(node2.segs[0]["count"]) == 0
    assert node2.regs[0].lookup(0x1, 0) == (0, 0)  # not a device allocation


def test_a_send_is_read_in_place_once_its_receiver_alone_mapped_it():
    node = Node(3)
    node.alloc(0x3000_0000, 8 << 20, 4)
    r0, r1, _ = node.regs
    assert r0.lookup_peer(0x3000_0040, 1) == (0, 0)  # published now
    assert int(node.segs[0]["count"]) == 1
    r1.step(0)  # no collective launch yet: rank 1's receives read it from now on
    assert r0.lookup_peer(0x3000_0040, 1) == (1, 0x40)
    assert r0.lookup_peer(0x3000_0040, 2) == (0, 0)  # rank 2 has not mapped it
    assert r0.lookup(0x3000_0040, 5) == (0, 0)  # so no collective reads it in place yet
    assert r0.lookup_peer(0x3000_0040, 0) == (0, 0)  # never to itself
    node.alloc(0x3000_0000, 8 << 20, 5)  # given back and made again
    assert r0.lookup_peer(0x3000_0040, 1) == (0, 0)
    assert r0.lookup_peer(0x3000_0040, 1, publish=False) == (0, 0)
    r1.step(0)
    assert r0.lookup_peer(0x3000_0040, 1) == (2, 0x40)


@pytest.mark.parametrize("pattern", ["all", "none", "mixed"])
def test_registered_two_shot_plans_through_the_model(pattern):
    from cudampi.comm.ipc import plan
    from tests.unit.ipc_model import OUT_BASE, X_BASE, Rank, run

    n, count = 3, 5000
    g = numpy.random.default_rng(4)
    xs = [g.integers(-9, 9, count).astype("float32") for _ in range(n)]
    want = sum(x.astype(numpy.float64) for x in xs)
    outs = [numpy.zeros(count, "float32") for _ in range(n)]
    plans = []
    for r in range(n):
        on = pattern == "all" or (pattern == "mixed" and r != 1)
        reg = (1, 0, 2, 0) if on else (0, 0, 0, 0)
        geo = plan.Geometry(r, n, 4096, 10**9, 1024)
        plans.append(plan.reduction(geo, "allreduce", count, 4, X_BASE, OUT_BASE, (1, 1),
                                    registered=reg))  # fmt: skip
        assert int(plans[-1][0].params[L.P_REGIN]) == reg[0]
    run([Rank(xs[r], outs[r], 4096) for r in range(n)], plans, numpy.dtype("float32"), "sum")
    for r in range(n):
        numpy.testing.assert_array_equal(outs[r], want.astype("float32"))
