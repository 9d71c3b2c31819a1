"""The ipc engine's launch planning, run through a NumPy model of the kernels (no GPU).

Small workspaces force many launches, so chunking, slicing, rounds and directories are all
exercised; the GPU tests (tests/gpu/test_ipc_gpu.py) run the same calls through the kernels.
"""

from __future__ import annotations

import numpy
import pytest

from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
from tests.unit.ipc_model import OUT_BASE, X_BASE, Rank, run

CAP = 4096


def geo(r: int, n: int, cap: int = CAP, oneshot: int = 1024) -> plan.Geometry:
    return plan.Geometry(r, n, cap, 10**9, oneshot)


def rng_data(n: int, count: int, dtype: str, seed: int = 0) -> list[numpy.ndarray]:
    g = numpy.random.default_rng(seed)
    if numpy.dtype(dtype).kind == "f":
        return [g.standard_normal(count).astype(dtype) for _ in range(n)]
    return [g.integers(-50, 50, count).astype(dtype) for _ in range(n)]


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("count", [0, 1, 7, 100, 1000, 5001])
@pytest.mark.parametrize("dtype", ["float32", "int64", "float16", "int8"])
def test_allreduce_plans_reduce_in_rank_order(n: int, count: int, dtype: str) -> None:
    xs = rng_data(n, count, dtype)
    outs = [numpy.zeros(count, dtype) for _ in range(n)]
    es = numpy.dtype(dtype).itemsize
    plans = [
        plan.reduction(geo(r, n), "allreduce", count, es, X_BASE, OUT_BASE, (1, 1))
        for r in range(n)
    ]
    run([Rank(xs[r], outs[r], CAP) for r in range(n)], plans, numpy.dtype(dtype), "sum")
    acc = xs[0].astype(numpy.float32 if dtype == "float16" else dtype)
    for x in xs[1:]:
        acc = acc + x
    for r in range(n):
        numpy.testing.assert_array_equal(outs[r], acc.astype(dtype))
    modes = {int(lc.params[L.P_MODE]) for lc in plans[0]}
    assert modes == ({L.MODE_ONESHOT} if count * es <= 1024 else {L.MODE_TWOSHOT})
    two_shot = count * es > 1024
    assert len(plans[0]) == (1 if two_shot else max(1, -(-count * es // CAP)))


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("registered", ["none", "all", "some inputs", "some outputs", "mixed"])
def test_two_shot_is_one_launch_in_rounds_whoever_registered(
    n: int, in_place: bool, registered: str
) -> None:
    """A two-shot allreduce larger than the data buffers is one launch: the kernel goes in
    rounds of one buffer, or in one where every rank registered both buffers; the result is
    the same, bitwise on every rank, whichever ranks registered what."""
    count = 3 * CAP // 4 + 77  # 3+ rounds of float32
    xs = rng_data(n, count, "float32", 2)
    want = xs[0].copy()
    for x in xs[1:]:
        want = want + x
    reg = {
        "none": lambda r: (0, 0),
        "all": lambda r: (1, 1),
        "some inputs": lambda r: (r % 2, 1),
        "some outputs": lambda r: (1, r % 2),
        "mixed": lambda r: ((r + 1) % 2, r % 2),
    }[registered]
    plans = []
    for r in range(n):
        rin, rout = reg(r)
        words = (rin, 0, rout, 0)
        out = X_BASE if in_place else OUT_BASE
        plans.append(
            plan.reduction(geo(r, n), "allreduce", count, 4, X_BASE, out, (1, 1), registered=words)
        )
    assert all(len(p) == 1 and p[0].kernel == "twoshot" for p in plans)
    outs = [xs[r] if in_place else numpy.zeros(count, "float32") for r in range(n)]
    run([Rank(xs[r], outs[r], CAP) for r in range(n)], plans, numpy.dtype("float32"), "sum")
    for r in range(n):
        numpy.testing.assert_array_equal(outs[r], want)


@pytest.mark.parametrize("n", [2, 3, 4])
def test_allreduce_in_place_two_shot(n: int) -> None:
    count = 3001
    xs = rng_data(n, count, "float32", 1)
    want = sum(x.astype(numpy.float64) for x in xs)
    plans = [
        plan.reduction(geo(r, n), "allreduce", count, 4, X_BASE, X_BASE, (1, 1)) for r in range(n)
    ]
    ranks = [Rank(xs[r], xs[r], CAP) for r in range(n)]
    run(ranks, plans, numpy.dtype("float32"), "sum")
    for r in range(n):
        numpy.testing.assert_allclose(xs[r], want, rtol=1e-5, atol=1e-5)
        numpy.testing.assert_array_equal(xs[r], xs[0])  # bitwise the same on every rank


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("root", [0, -1])
def test_reduce_to_root(n: int, root: int) -> None:
    root = root % n
    count = 2500
    xs = rng_data(n, count, "int32", 2)
    outs = [numpy.zeros(count, "int32") for _ in range(n)]
    plans = [
        plan.reduction(geo(r, n), "reduce", count, 4, X_BASE, OUT_BASE, (1, 4), root=root)
        for r in range(n)
    ]
    run([Rank(xs[r], outs[r], CAP) for r in range(n)], plans, numpy.dtype("int32"), "max")
    numpy.testing.assert_array_equal(outs[root], numpy.maximum.reduce(xs))
    for r in range(n):
        if r != root:
            assert not outs[r].any()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("counts", ["even", "uneven", "zeros"])
def test_reduce_scatter(n: int, counts: str) -> None:
    cs = {"even": [700] * n, "uneven": [(i * 977) % 1500 + 1 for i in range(n)], "zeros": [0] * n}[
        counts
    ]
    total = sum(cs)
    xs = rng_data(n, total, "float32", 3)
    full = sum(x.astype(numpy.float64) for x in xs)
    offs = numpy.cumsum([0, *cs])
    outs = [numpy.zeros(cs[r], "float32") for r in range(n)]
    plans = [plan.reduce_scatter(geo(r, n), cs, 4, X_BASE, OUT_BASE, (1, 1)) for r in range(n)]
    run([Rank(xs[r], outs[r], CAP) for r in range(n)], plans, numpy.dtype("float32"), "sum")
    for r in range(n):
        numpy.testing.assert_allclose(outs[r], full[offs[r] : offs[r + 1]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("call", ["allgather", "allgatherv", "gather", "gatherv"])
def test_gathers(n: int, call: str) -> None:
    cs = [1500 + 333 * i for i in range(n)] if call.endswith("v") else [1700] * n
    root = -1 if call.startswith("all") else n - 1
    xs = [numpy.arange(cs[r], dtype="int16") + 1000 * r for r in range(n)]
    outs = [numpy.zeros(sum(cs), "int16") for _ in range(n)]
    planned = "gather" if call == "gatherv" else call  # the engine's gather takes any counts
    plans = [
        plan.gather_like(geo(r, n), planned, cs, 2, X_BASE, OUT_BASE, 5, root=root)
        for r in range(n)
    ]
    run([Rank(xs[r], outs[r], CAP) for r in range(n)], plans, numpy.dtype("int16"))
    want = numpy.concatenate(xs)
    for r in range(n):
        if root < 0 or r == root:
            numpy.testing.assert_array_equal(outs[r], want)
        else:
            assert not outs[r].any()


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("count", [0, 5, 4099])
def test_broadcast(n: int, count: int) -> None:
    root = n // 2
    xs = [numpy.full(count, r, "uint8") for r in range(n)]
    xs[root] = numpy.arange(count).astype("uint8")
    want = xs[root].copy()
    plans = [
        plan.gather_like(geo(r, n), "broadcast", [count] * n, 1, X_BASE, X_BASE, 6, root=root)
        for r in range(n)
    ]
    run([Rank(xs[r], xs[r], CAP) for r in range(n)], plans, numpy.dtype("uint8"))
    for r in range(n):
        numpy.testing.assert_array_equal(xs[r], want)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5])
def test_alltoallv_and_scatter(n: int) -> None:
    sc = [[(3 * s + 7 * d) % 11 * 97 for d in range(n)] for s in range(n)]
    rc = [[sc[s][d] for s in range(n)] for d in range(n)]
    max_pair = max(max(row) for row in sc)
    xs = [numpy.arange(sum(sc[s]), dtype="float64") + 10000 * s for s in range(n)]
    outs = [numpy.zeros(sum(rc[d]), "float64") for d in range(n)]
    plans = [
        plan.all_to_all(
            geo(r, n), "alltoall", sc[r], rc[r], 8, X_BASE, OUT_BASE, 12, max_pair=max_pair
        )
        for r in range(n)
    ]
    run([Rank(xs[r], outs[r], CAP) for r in range(n)], plans, numpy.dtype("float64"))
    for d in range(n):
        parts = []
        for s in range(n):
            o = sum(sc[s][:d])
            parts.append(xs[s][o : o + sc[s][d]])
        numpy.testing.assert_array_equal(outs[d], numpy.concatenate(parts))
    # scatter: only the root sends
    root, k = n - 1, 600
    x = numpy.arange(n * k, dtype="int32")
    outs = [numpy.zeros(k, "int32") for _ in range(n)]
    plans = [
        plan.all_to_all(
            geo(r, n),
            "scatter",
            [k] * n,
            [k if s == root else 0 for s in range(n)],
            4,
            X_BASE,
            OUT_BASE,
            7,
            max_pair=k,
            root=root,
        )
        for r in range(n)
    ]
    run(
        [Rank(x if r == root else numpy.zeros(0, "int32"), outs[r], CAP) for r in range(n)],
        plans,
        numpy.dtype("int32"),
    )
    for d in range(n):
        numpy.testing.assert_array_equal(outs[d], x[d * k : (d + 1) * k])


def test_disagreeing_counts_change_the_signature() -> None:
    a = plan.reduction(geo(0, 2), "allreduce", 1000, 4, X_BASE, OUT_BASE, (1, 1))
    b = plan.reduction(geo(1, 2), "allreduce", 999, 4, X_BASE, OUT_BASE, (1, 1))
    with pytest.raises(AssertionError, match="signature"):
        run(
            [
                Rank(numpy.zeros(1000, "f4"), numpy.zeros(1000, "f4"), CAP),
                Rank(numpy.zeros(999, "f4"), numpy.zeros(999, "f4"), CAP),
            ],
            [a, b],
            numpy.dtype("float32"),
            "sum",
        )
    words = [int(w) for w in a[0].params[L.P_SIG : L.P_SIG + 4].view(numpy.uint64)]
    assert plan.describe(words) == "allreduce, bool, sum, 1000 elements, launch 0 of 1"


def test_alltoallv_count_disagreement_is_caught_by_the_directory() -> None:
    a = plan.all_to_all(geo(0, 2), "alltoall", [5, 5], [5, 6], 4, X_BASE, OUT_BASE, 7, max_pair=6)
    b = plan.all_to_all(geo(1, 2), "alltoall", [5, 5], [5, 5], 4, X_BASE, OUT_BASE, 7, max_pair=6)
    with pytest.raises(AssertionError, match="expects"):
        run(
            [
                Rank(numpy.zeros(10, "f4"), numpy.zeros(11, "f4"), CAP),
                Rank(numpy.zeros(10, "f4"), numpy.zeros(10, "f4"), CAP),
            ],
            [a, b],
            numpy.dtype("float32"),
        )


def test_slices_are_pack_aligned_and_cover() -> None:
    for n in range(1, 9):
        for count in (0, 1, 3, 17, 1000):
            for pe in (1, 2, 4, 8, 16):
                sl = plan._slices(count, n, pe)
                assert len(sl) == n and sl[0][0] == 0
                assert all(a % pe == 0 for a, _ in sl)
                covered = [i for a, b in sl for i in range(a, b)]
                assert covered == list(range(count))


def test_the_oneshot_switch_follows_the_measurement_and_a_setting_wins() -> None:
    from cudampi.config import Config

    # ranks sharing one GPU: one-shot up to 8 MiB / ranks (measured, docs/ipc.md)
    assert plan.oneshot_auto(2, True) == 4 << 20 and plan.oneshot_auto(4, True) == 2 << 20
    # a GPU each: small messages only until several GPUs measure it
    assert plan.oneshot_auto(2, False) == plan.oneshot_auto(8, False) == 512 << 10
    assert Config.load({}, env={}).ipc_oneshot_bytes == -1
    assert Config.load({}, env={"CUDAMPI_IPC_ONESHOT_BYTES": "auto"}).ipc_oneshot_bytes == -1
    assert Config.load({}, env={"CUDAMPI_IPC_ONESHOT_BYTES": "0"}).ipc_oneshot_bytes == 0
    assert Config.load({}, env={"CUDAMPI_IPC_ONESHOT_BYTES": "1M"}).ipc_oneshot_bytes == 1 << 20
    with pytest.raises(ValueError):
        Config.load({}, env={"CUDAMPI_IPC_ONESHOT_BYTES": "-2"})


def test_a_launch_hands_the_driver_a_pointer_to_its_own_parameter_block() -> None:
    launches = plan.reduction(geo(0, 2), "allreduce", 1000, 4, X_BASE, OUT_BASE, (12, 1))
    for lc in launches:
        assert lc.argv is lc.argv and lc.argv_ptr == lc.argv.ctypes.data  # made once, kept
        assert int(lc.argv[0]) == lc.params.ctypes.data  # kernelParams[0] -> struct Params
        assert lc.params.nbytes == plan.PARAM_DTYPE.itemsize == 8 * L.NPARAM


def test_a_p2p_group_packs_each_message_in_three_words() -> None:
    g = geo(1, 3)
    group = [
        plan.Message(True, 2, X_BASE, 5000, 7),
        plan.Message(False, 0, OUT_BASE, 5000, -1),  # any tag
        plan.Message(False, 1, OUT_BASE + 64, 0, (1 << 31) - 1),  # from itself, empty
        plan.Message(True, 0, X_BASE + 96, (4 << 20) + 1, 3, reg=L.MAX_REGS, offset=96),
    ]
    (lc,) = plan.p2p(g, group)
    p = lc.params
    assert lc.kernel == "p2p" and p.nbytes == 8 * L.P2P_NPARAM < 4096  # any driver takes it
    assert (p[L.P_WS], p[L.P_ERR], p[L.P_RANK], p[L.P_TIMEOUT]) == (g.workspace, g.error, 1, 10**9)
    assert p[L.P2P_NOPS_AT] == 4 and p[L.P2P_CHUNK_AT] == L.p2p_chunk(g.capacity)
    assert p[L.P2P_INBOX_AT] == L.DATA_OFFSET + 2 * g.capacity
    words = p[L.P2P_OPS_AT :].view(numpy.uint64)
    for i, m in enumerate(group):
        w = int(words[3 * i])  # decoded as the kernel's op_at does
        assert w & 0xFF == m.peer
        assert (w >> 8) & 0xFF == (L.P2P_SEND if m.send else L.P2P_RECV)
        assert (w >> 16) & 0xFFFF == m.reg
        assert numpy.int64(numpy.uint32(w >> 32).astype(numpy.int32)) == m.tag
        where = m.offset if m.reg else m.ptr  # a send read in place names its offset
        assert (p[L.P2P_OPS_AT + 3 * i + 1], p[L.P2P_OPS_AT + 3 * i + 2]) == (where, m.nbytes)


def test_a_large_p2p_group_runs_in_parts_in_order_and_bad_messages_are_refused() -> None:
    g = geo(0, 2)
    group = [plan.Message(k % 2 == 0, 1, X_BASE + k, k, k) for k in range(L.P2P_MAX_OPS + 5)]
    a, b = plan.p2p(g, group)
    assert (a.params[L.P2P_NOPS_AT], b.params[L.P2P_NOPS_AT]) == (L.P2P_MAX_OPS, 5)
    assert b.params[L.P2P_OPS_AT + 2] == L.P2P_MAX_OPS  # the 129th message opens the second
    with pytest.raises(ValueError, match="peer 2"):
        plan.p2p(g, [plan.Message(True, 2, X_BASE, 8, 0)])
    with pytest.raises(ValueError, match="32 bits"):
        plan.p2p(g, [plan.Message(True, 1, X_BASE, 8, 1 << 31)])
    # read in place only a send of more than the eager size (the receiver's blocks take part
    # in it as in a message of several chunks), and only a real registry entry
    eager = L.p2p_eager(g.capacity)
    for bad in [
        plan.Message(True, 1, X_BASE, eager, 0, reg=1),
        plan.Message(False, 1, X_BASE, eager + 1, 0, reg=1),
        plan.Message(True, 1, X_BASE, eager + 1, 0, reg=L.MAX_REGS + 1),
    ]:
        with pytest.raises(ValueError, match="in place"):
            plan.p2p(g, [bad])


def test_p2p_sizes_and_how_errors_name_a_message() -> None:
    assert L.p2p_chunk(32 << 20) == 1 << 20 and L.p2p_chunk(64 << 10) == 4096
    assert L.p2p_eager(32 << 20) == 4 << 20  # sent before the receive arrives
    assert L.p2p_bytes(32 << 20, 4) == 4 * L.P2P_SLOTS * (1 << 20)
    send = [(L.CALL_SEND << 56) | 3, 4096, 7, 0]
    recv = [(L.CALL_RECV << 56) | 1, 100, (1 << 64) - 1, 0]
    assert plan.describe(send) == "send to rank 2, 4096 bytes, tag 7"
    assert plan.describe(recv) == "recv from rank 0, 100 bytes, tag any"
