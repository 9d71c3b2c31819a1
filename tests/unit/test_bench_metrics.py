"""algbw/busbw and buffer layouts against nccl-tests' formulas (doc/PERFORMANCE.md, src/*.cu)."""

from __future__ import annotations

import pytest

from cudampi.bench.metrics import algbw, busbw, busbw_factor, collective_layout
from cudampi.bench.registry import COLLECTIVES


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8, 16])
def test_factors_are_nccl_tests(n):
    assert busbw_factor("allreduce", n) == pytest.approx(2 * (n - 1) / n)
    for op in ("reduce_scatter", "allgather", "alltoall"):
        assert busbw_factor(op, n) == pytest.approx((n - 1) / n)
    for op in ("broadcast", "reduce", "sendrecv"):
        assert busbw_factor(op, n) == 1.0


def test_unknown_op_and_bad_ranks_are_rejected():
    with pytest.raises(ValueError, match="unknown collective 'allreduc'"):
        busbw_factor("allreduc", 2)
    with pytest.raises(ValueError, match="nranks"):
        busbw_factor("allreduce", 0)


def test_bandwidths_in_decimal_gigabytes():
    # 1 GB in 10 ms: algbw 100 GB/s; allreduce on 4 ranks: busbw 150 GB/s
    assert algbw(10**9, 0.01) == pytest.approx(100.0)
    assert busbw("allreduce", 10**9, 0.01, 4) == pytest.approx(150.0)
    assert busbw("allgather", 10**9, 0.01, 4) == pytest.approx(75.0)
    assert busbw("broadcast", 10**9, 0.01, 4) == pytest.approx(100.0)
    assert algbw(0, 0.0) == 0.0


def test_allreduce_layout_is_the_whole_buffer():
    L = collective_layout("allreduce", 1 << 20, 4, 4)
    assert (L.count, L.send_count, L.recv_count, L.size) == (1 << 18, 1 << 18, 1 << 18, 1 << 20)


@pytest.mark.parametrize(
    ("op", "nbytes", "itemsize", "n", "count", "size"),
    [
        # nccl-tests: base = (count/nranks) & ~(16/eltSize - 1); size = base*n*eltSize
        ("allgather", 8, 4, 2, 0, 0),
        ("allgather", 1024, 4, 2, 128, 1024),
        ("allgather", 1000, 4, 3, 80, 960),
        ("reduce_scatter", 1000, 4, 3, 80, 960),
        ("alltoall", 1000, 4, 3, 80, 960),
        ("allgather", 100, 1, 3, 32, 96),
        ("allgather", 1000, 8, 3, 40, 960),
    ],
)
def test_blocked_layouts_round_like_nccl_tests(op, nbytes, itemsize, n, count, size):
    L = collective_layout(op, nbytes, itemsize, n)
    assert L.count == count
    assert L.size == size


def test_blocked_send_and_receive_counts():
    ag = collective_layout("allgather", 4096, 4, 4)
    assert (ag.send_count, ag.recv_count) == (256, 1024)
    rs = collective_layout("reduce_scatter", 4096, 4, 4)
    assert (rs.send_count, rs.recv_count) == (1024, 256)
    a2a = collective_layout("alltoall", 4096, 4, 4)
    assert (a2a.send_count, a2a.recv_count) == (1024, 1024)


def test_every_collective_has_a_factor_and_layout():
    for op in COLLECTIVES:
        assert busbw_factor(op, 2) > 0
        assert collective_layout(op, 64, 4, 2).size > 0
