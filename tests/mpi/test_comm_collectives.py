"""cudampi.comm on real MPI ranks: every collective, path, dtype, op and size against NumPy.

One spawn per rank count runs the whole matrix (importing torch costs seconds per rank), so the
rank functions collect every wrong value and fail once at the end with all of them listed. The
helpers here are reused by tests/gpu/test_comm_gpu.py with device array libraries.
"""

from __future__ import annotations

import functools

import pytest

from cudampi.comm.arrays import DTYPES as ALL_DTYPES
from tests.mpirun import only_when_asked, run_mpi

pytestmark = pytest.mark.mpi

HOST_PATHS = ("host", "native", "gpu-ring", "staged")
SIZES = (0, 1, 7, 1000)
SOME_DTYPES = ("float32", "float16", "bfloat16", "int32", "uint8", "bool", "complex64")


# ----------------------------------------------------------------------------- array helpers


@functools.cache
def checks(lib: str):
    """The array registry's checks for a test library: ``numpy``, ``torch``, ``jax`` (host),
    ``cupy`` or ``torch-cuda`` (the current CUDA device)."""
    from cudampi.comm.arrays import checks_for

    name, _, device = lib.partition("-")
    return checks_for(name, device or ("cuda" if name == "cupy" else "cpu"))


def lib_dtypes(lib: str, dtypes=ALL_DTYPES) -> list[str]:
    return checks(lib).dtypes(tuple(dtypes))


def to_lib(a, lib: str, dtype: str):
    """NumPy reference values ``a`` as an array of ``lib`` (see :func:`checks`)."""
    return checks(lib).from_numpy(a, dtype)


def empty_lib(shape, lib: str, dtype: str):
    import numpy as np

    return to_lib(np.zeros(shape, dtype=np.float64 if dtype == "bfloat16" else dtype), lib, dtype)


def to_np(x):
    """Any registered library's array as NumPy (bfloat16 as float64)."""
    from cudampi.comm.arrays import adapt

    b = adapt(x)
    return checks(
        b.impl.name + ("-cuda" if b.on_device and b.impl.name != "cupy" else "")
    ).to_numpy(x)


def gen(rank: int, n: int, dtype: str, op: str = "sum"):
    """Deterministic input of ``rank``: small integers, so every reduction is exact in every
    dtype (float16/bfloat16 included) whatever the order of the reduction."""
    import numpy as np

    i = np.arange(n, dtype=np.int64)
    if dtype == "bool":
        return (i * 3 + rank) % 4 == 0
    if op == "prod":
        v = 1 + (i + rank) % 3
    elif op in ("band", "bor", "bxor"):
        v = (i * 7 + rank * 13) % 64
    else:
        v = (i * 5 + rank * 3) % 11
        if not dtype.startswith("uint"):
            v = v - 5
    if dtype.startswith("complex"):
        im = (i + 2 * rank) % 2 if op == "prod" else (i + 2 * rank) % 5
        return v.astype(np.float64) + 1j * im
    return v.astype(np.float64) if dtype in ("float16", "bfloat16", "float32", "float64") else v


def reference(size: int, n: int, dtype: str, op: str):
    """NumPy's reduction over every rank's :func:`gen` input (float64 for bfloat16)."""
    import numpy as np

    from tests import oracle

    ref_dt = np.float64 if dtype == "bfloat16" else np.dtype(dtype)
    return oracle.reduce([gen(r, n, dtype, op).astype(ref_dt) for r in range(size)], op)


def ops_for(dtype: str) -> list[str]:
    from cudampi.comm.arrays import ops_allowed

    return list(ops_allowed(dtype))


def same(got, want, dtype: str, op: str = "sum") -> bool:
    import numpy as np

    g = to_np(got)
    w = np.asarray(want)
    if g.shape != w.shape:
        return False
    if op == "avg" and dtype[0] not in "iu":
        tol = {"float16": 2e-3, "bfloat16": 1e-2}.get(dtype, 1e-6)
        return bool(
            np.allclose(g.astype(np.complex128), w.astype(np.complex128), rtol=tol, atol=tol)
        )
    if dtype == "bfloat16":
        return bool(np.array_equal(g.astype(np.float64), w.astype(np.float64)))
    return bool(np.array_equal(g, w.astype(g.dtype)))


class Failures:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.items: list[str] = []
        self.checked = 0

    def check(self, ok: bool, what: str) -> None:
        self.checked += 1
        if not ok:
            self.items.append(what)

    def finish(self) -> None:
        assert not self.items, (
            f"rank {self.rank}: {len(self.items)} of {self.checked} checks wrong:\n"
            + "\n".join(self.items[:40])
        )


# ----------------------------------------------------------------------------- the matrix


def run_matrix(c, libs, paths, f: Failures, sizes=SIZES, dtypes=ALL_DTYPES, some=SOME_DTYPES):
    """Every collective on ``c`` for ``libs`` x ``paths`` x dtypes x ops x sizes."""
    size, rank = c.size, c.rank
    flip = 0
    for lib in libs:
        for path in paths:
            for dtype in lib_dtypes(lib, dtypes):
                for op in ops_for(dtype):
                    for n in sizes:
                        x = to_lib(gen(rank, n, dtype, op), lib, dtype)
                        want = reference(size, n, dtype, op)
                        flip ^= 1
                        tag = f"allreduce {lib} {path} {dtype} {op} n={n}"
                        if flip:
                            got = c.allreduce(x, op, path=path)
                            f.check(same(got, want, dtype, op), tag)
                            f.check(same(x, gen(rank, n, dtype, op), dtype), tag + " input kept")
                        else:
                            got = c.allreduce(x, op, out=x, path=path)
                            f.check(got is x and same(x, want, dtype, op), tag + " in place")
            for dtype in lib_dtypes(lib, some):
                for n in sizes:
                    _others(c, lib, path, dtype, n, f)


def _others(c, lib, path, dtype, n, f: Failures) -> None:
    import numpy as np

    size, rank = c.size, c.rank
    where = f"{lib} {path} {dtype} n={n}"
    mine = gen(rank, n, dtype)
    ops = ops_for(dtype)
    # reduce (to the last rank), out of place and in place
    root = size - 1
    for op in ("sum", ops[-1]):
        x = to_lib(gen(rank, n, dtype, op), lib, dtype)
        got = c.reduce(x, op, root=root, path=path)
        if rank == root:
            f.check(same(got, reference(size, n, dtype, op), dtype, op), f"reduce {op} {where}")
        y = to_lib(gen(rank, n, dtype, op), lib, dtype)
        c.reduce(y, op, root=root, out=y, path=path)
        if rank == root:
            f.check(same(y, reference(size, n, dtype, op), dtype, op), f"reduce in place {where}")
    # broadcast from rank 1 % size
    b = to_lib(mine, lib, dtype)
    bsrc = 1 % size
    c.broadcast(b, root=bsrc, path=path)
    f.check(same(b, gen(bsrc, n, dtype), dtype), f"broadcast {where}")
    # allgather / gather
    x = to_lib(mine, lib, dtype)
    want = np.stack([gen(r, n, dtype) for r in range(size)])
    f.check(same(c.allgather(x, path=path), want, dtype), f"allgather {where}")
    out = empty_lib((size, n), lib, dtype)
    c.allgather(x, out=out, path=path)
    f.check(same(out, want, dtype), f"allgather out= {where}")
    g = c.gather(x, root=0, path=path)
    if rank == 0:
        f.check(same(g, want, dtype), f"gather {where}")
    else:
        f.check(g is None, f"gather non-root returns None {where}")
    # allgatherv: rank r contributes n + r elements
    counts = [n + r for r in range(size)]
    xv = to_lib(gen(rank, n + rank, dtype), lib, dtype)
    wantv = np.concatenate([gen(r, n + r, dtype) for r in range(size)])
    f.check(same(c.allgatherv(xv, counts, path=path), wantv, dtype), f"allgatherv {where}")
    # scatter from the last rank: block i of root's (size, n) goes to rank i
    full = np.stack([gen(10 + i, n, dtype) for i in range(size)])
    if rank == root:
        got = c.scatter(to_lib(full, lib, dtype), root=root, path=path)
    else:
        got = c.scatter(None, root=root, out=empty_lib((n,), lib, dtype), path=path)
    f.check(same(got, full[rank], dtype), f"scatter {where}")
    # reduce_scatter: equal blocks of n, and counts n+i
    op = "sum"
    xr = to_lib(gen(rank, size * n, dtype, op), lib, dtype)
    want = reference(size, size * n, dtype, op)
    got = c.reduce_scatter(xr, op, path=path)
    f.check(same(got, want[rank * n : (rank + 1) * n], dtype), f"reduce_scatter {where}")
    rc = [n + (i % 2) for i in range(size)]
    tot = sum(rc)
    xr = to_lib(gen(rank, tot, dtype, op), lib, dtype)
    want = reference(size, tot, dtype, op)
    lo = sum(rc[:rank])
    got = c.reduce_scatter(xr, op, counts=rc, path=path)
    f.check(same(got, want[lo : lo + rc[rank]], dtype), f"reduce_scatter counts {where}")
    # alltoall: block j of rank r is gen(100*r + j)
    blocks = [gen(100 * rank + j, n, dtype) for j in range(size)]
    xa = to_lib(np.concatenate(blocks) if n else np.zeros(0, dtype=blocks[0].dtype), lib, dtype)
    want = np.concatenate([gen(100 * j + rank, n, dtype) for j in range(size)])
    f.check(same(c.alltoall(xa, path=path), want, dtype), f"alltoall {where}")
    # alltoallv: rank r sends (r + j) % 3 + n elements to rank j
    sc = [(rank + j) % 3 + n for j in range(size)]
    rcv = [(j + rank) % 3 + n for j in range(size)]
    parts = [gen(1000 * rank + j, sc[j], dtype) for j in range(size)]
    xv = to_lib(np.concatenate(parts), lib, dtype)
    want = np.concatenate([gen(1000 * j + rank, rcv[j], dtype) for j in range(size)])
    f.check(
        same(c.alltoall(xv, send_counts=sc, recv_counts=rcv, path=path), want, dtype),
        f"alltoallv {where}",
    )
    f.check(
        same(c.alltoall(xv, send_counts=sc, path=path), want, dtype),
        f"alltoallv exchanged counts {where}",
    )


def run_async(c, lib, paths, f: Failures) -> None:
    """Non-blocking collectives interleaved with blocking ones, waited out of order."""
    size, rank = c.size, c.rank
    for path in paths:
        hs = []
        for k, n in enumerate((1, 7, 1000, 0, 33)):
            x = to_lib(gen(rank + k, n, "float32"), lib, "float32")
            hs.append((c.allreduce(x, "sum", path=path, async_op=True), n, k))
            if k == 2:  # a blocking call between queued ones keeps its place in the order
                b = to_lib(gen(rank, 5, "int32"), lib, "int32")
                c.broadcast(b, root=0, path=path)
                f.check(same(b, gen(0, 5, "int32"), "int32"), f"async-interleaved bcast {path}")
        hb = c.broadcast(
            to_lib(gen(rank, 9, "int64"), lib, "int64"), root=size - 1, path=path, async_op=True
        )
        hg = c.allgather(to_lib(gen(rank, 3, "float16"), lib, "float16"), path=path, async_op=True)
        hbar = c.barrier(async_op=True)
        for h, n, k in reversed(hs):
            import numpy as np

            want = np.add.reduce(
                np.stack([gen(r + k, n, "float32").astype(np.float32) for r in range(size)]), axis=0
            )
            got = h.wait(timeout=120)
            f.check(
                h.done and h.test() and same(got, want, "float32"), f"async allreduce {path} n={n}"
            )
        import numpy as np

        f.check(
            same(hb.wait(timeout=120), gen(size - 1, 9, "int64"), "int64"), f"async bcast {path}"
        )
        f.check(
            same(
                hg.wait(timeout=120),
                np.stack([gen(r, 3, "float16") for r in range(size)]),
                "float16",
            ),
            f"async allgather {path}",
        )
        f.check(hbar.wait(timeout=120) is None, f"async barrier {path}")


def check_ring_p2p(c, lib, f: Failures, n, dtype, spath, rpath, tag, where):
    """Each rank sends to its right and receives from its left: blocking send/recv on ``tag``
    (even ranks send first), then isend/irecv on ``tag + 1``; returns the array sent."""
    rank, size = c.rank, c.size
    right, left = (rank + 1) % size, (rank - 1) % size
    x = to_lib(gen(rank, n, dtype), lib, dtype)
    y = empty_lib((n,), lib, dtype)
    if rank % 2 == 0:
        c.send(x, right, tag=tag, path=spath)
        c.recv(y, left, tag=tag, path=rpath)
    else:
        c.recv(y, left, tag=tag, path=rpath)
        c.send(x, right, tag=tag, path=spath)
    f.check(same(y, gen(left, n, dtype), dtype), where)
    y2 = empty_lib((n,), lib, dtype)
    hr = c.irecv(y2, left, tag=tag + 1, path=rpath)
    c.isend(x, right, tag=tag + 1, path=spath).wait(timeout=60)
    f.check(hr.wait(timeout=60) is y2 and same(y2, gen(left, n, dtype), dtype), "i" + where)
    return x


def run_p2p(c, lib, f: Failures) -> None:
    """send/recv, isend/irecv, sendrecv around a ring, direct and staged, mixed framing."""
    size, rank = c.size, c.rank
    if size < 2:
        return
    right, left = (rank + 1) % size, (rank - 1) % size
    for n in (0, 1, 1000):
        for spath, rpath in (
            ("host", "host"),
            ("staged", "staged"),
            ("staged", "host"),
            ("host", "staged"),
        ):
            where = f"p2p {lib} n={n} send {spath} recv {rpath}"
            x = check_ring_p2p(c, lib, f, n, "float64", spath, rpath, 3, where)
            y3 = empty_lib((n,), lib, "float64")
            c.sendrecv(x, right, y3, left, tag=5, path=spath)
            f.check(same(y3, gen(left, n, "float64"), "float64"), "sendrecv " + where)
    # as in MPI, a message shorter than the receive buffer fills its front (direct and staged)
    for rpath in ("host", "staged"):
        x = to_lib(gen(rank, 5, "int32"), lib, "int32")
        y = to_lib(gen(99, 9, "int32"), lib, "int32")
        if rank % 2 == 0:
            c.send(x, right, tag=6)
            c.recv(y, left, tag=6, path=rpath)
        else:
            c.recv(y, left, tag=6, path=rpath)
            c.send(x, right, tag=6)
        import numpy as np

        want = np.concatenate([gen(left, 5, "int32"), gen(99, 9, "int32")[5:]])
        f.check(same(y, want, "int32"), f"short message into a longer {rpath} buffer")


def rank_matrix(comm, libs_csv):
    from cudampi.comm import Communicator
    from cudampi.config import Config

    libs = libs_csv.split(",")
    f = Failures(comm.rank)
    # tiny chunks and a tiny small-message limit: rings, chunk pipelines, non-divisible segments
    tiny = Config.load({"chunk_bytes": "64", "small_bytes": "256"}, env={})
    with Communicator(comm, config=tiny) as c:
        assert (c.rank, c.size) == (comm.rank, comm.size)
        run_matrix(c, libs, HOST_PATHS, f)
        for lib in libs:
            run_async(c, lib, HOST_PATHS, f)
            run_p2p(c, lib, f)
    # default chunking: recursive doubling / binomial trees for everything small
    with Communicator(comm, config=Config.load({}, env={})) as c:
        run_matrix(
            c,
            libs[:1],
            ("gpu-ring", "staged"),
            f,
            sizes=(1, 7, 1000),
            dtypes=("float32", "bfloat16", "int64"),
            some=("float16",),
        )
    # direct (all-pairs) reduce-scatter / allgather instead of rings, on every large message
    direct = Config.load({"algorithm": "direct", "chunk_bytes": "64", "small_bytes": "256"}, env={})
    with Communicator(comm, config=direct) as c:
        run_matrix(
            c,
            libs[:1],
            ("gpu-ring", "staged"),
            f,
            sizes=(7, 1000, 1001),
            dtypes=("float32", "float16", "int64", "bool"),
            some=("float32", "float16"),
        )
        run_matrix(
            c, ["torch"], ("gpu-ring",), f, sizes=(1000,), dtypes=("bfloat16",), some=("bfloat16",)
        )
    with Communicator(comm, config=Config.load({}, env={})) as c:
        # sub-communicators: even and odd ranks
        sub = c.split(comm.rank % 2, key=-comm.rank)
        assert sub is not None
        import numpy as np

        got = sub.allreduce(np.array([comm.rank], dtype=np.int64))
        f.check(
            int(got[0]) == sum(r for r in range(comm.size) if r % 2 == comm.rank % 2),
            "split allreduce",
        )
        f.check(
            sub.rank
            == sorted((r for r in range(comm.size) if r % 2 == comm.rank % 2), reverse=True).index(
                comm.rank
            ),
            "split key order",
        )
        sub.close()
    f.finish()
    if comm.rank == 0:
        print(f"checked {f.checked} results on {comm.size} ranks")


@pytest.mark.parametrize("n", [1, 2, 3, 4])
def test_every_collective_path_dtype_and_size_matches_numpy(n):
    proc = run_mpi(n, __file__, "rank_matrix", "numpy,torch", timeout=420)
    assert f"on {n} ranks" in proc.stdout


def rank_over_the_count_limit(comm):
    """At a small stand-in for the C-int limit: every collective of the mpi
    engine (host, and inside staged) on messages over it runs in pieces or through cudampi's
    chunked algorithms, with right results."""
    from cudampi.comm import Communicator, transport
    from cudampi.config import Config

    transport.COUNT_LIMIT, transport.PIECE = 1000, 300  # bytes for broadcast, else elements
    f = Failures(comm.rank)
    with Communicator(comm, config=Config.load({}, env={})) as c:
        run_matrix(
            c,
            ["numpy"],
            ("host", "staged"),
            f,
            sizes=(999, 1001, 2500),
            dtypes=("float32", "int64"),
            some=("float32", "uint8"),
        )
    f.finish()
    if comm.rank == 0:
        print(f"checked {f.checked} results on {comm.size} ranks")


@pytest.mark.parametrize("n", [2, 3])
def test_messages_over_the_count_limit_run_in_pieces(n):
    proc = run_mpi(n, __file__, "rank_over_the_count_limit", timeout=300)
    assert f"on {n} ranks" in proc.stdout


def rank_p2p_over_the_count_limit(comm):
    """At a stand-in for the C-int limit (1000 bytes): user messages over it on every host path
    (blocking, non-blocking, sendrecv) and cudampi's broadcast
    (gpu-ring, whose binomial tree sends whole arrays) arrive whole."""
    import numpy as np

    from cudampi.comm import Communicator, transport
    from cudampi.config import Config

    transport.COUNT_LIMIT, transport.PIECE = 1000, 300
    r, peer = comm.rank, 1 - comm.rank
    config = Config.load({"chunk_bytes": "256", "timeout": "20"}, env={})
    with Communicator(comm, config=config) as c:
        for path in ("host", "staged"):
            for n in (999, 1001, 4000):  # bytes (uint8), around and over the limit
                x = (np.arange(n) * (r + 3) % 251).astype(np.uint8)
                want = (np.arange(n) * (peer + 3) % 251).astype(np.uint8)
                y = np.zeros(n, np.uint8)
                if r == 0:
                    c.send(x, 1, 1, path=path)
                    c.recv(y, 1, 2, path=path)
                else:
                    c.recv(y, 0, 1, path=path)
                    c.send(x, 0, 2, path=path)
                assert (y == want).all(), (path, n, "send/recv")
                y[:] = 0
                h = c.irecv(y, peer, 3, path=path)
                c.isend(x, peer, 3, path=path).wait()
                h.wait()
                assert (y == want).all(), (path, n, "isend/irecv")
                y[:] = 0
                c.sendrecv(x, peer, y, peer, 4, path=path)
                assert (y == want).all(), (path, n, "sendrecv")
        for n in (999, 1001, 4000):
            x = np.full(n, 7 if r == 0 else 0, np.uint8)
            x[-1] = 9 if r == 0 else 0
            c.broadcast(x, root=0, path="gpu-ring")
            assert (x[:-1] == 7).all() and x[-1] == 9, (n, "gpu-ring broadcast")
    if r == 0:
        print("messages over the limit arrive whole", flush=True)


def test_user_messages_over_the_count_limit_arrive_whole():
    proc = run_mpi(2, __file__, "rank_p2p_over_the_count_limit", timeout=300)
    assert "messages over the limit arrive whole" in proc.stdout


def rank_two_gib(comm):
    """2 GiB and more on the default host path, for real (no stand-in for the limit)."""
    import numpy as np

    from cudampi.comm import Communicator

    n = (2 << 30) + 8
    with Communicator(comm) as c:
        x = np.zeros(n, dtype=np.uint8)
        if comm.rank == 0:
            x[::4096] = 7
            x[-1] = 9
        c.broadcast(x)
        assert x[-1] == 9 and x[4096] == 7 and x[1] == 0 and c.path_for("broadcast", x) == "host"
        x[:] = 1
        c.allreduce(x, out=x)  # in place: no second 2 GiB buffer
        assert x[0] == x[-1] == comm.size and x[1 << 31] == comm.size
        del x
        half = np.full(n // 2, comm.rank + 1, dtype=np.uint8)
        out = c.allgather(half)
        assert out.shape == (comm.size, n // 2) and out[-1, -1] == comm.size and out[0, 0] == 1
    if comm.rank == 0:
        print("2 GiB ok", flush=True)


@pytest.mark.parametrize("asked", [pytest.param("", marks=only_when_asked())])
def test_two_gib_messages_on_the_host_path(asked):
    """Messages over the C-int limit for real (~6 GiB of memory for 2 ranks, a minute or two)."""
    proc = run_mpi(2, __file__, "rank_two_gib", timeout=900)
    assert "2 GiB ok" in proc.stdout


def rank_two_gib_messages(comm, path):
    """A user message of 2 GiB and more (send/recv) and cudampi's broadcast (gpu-ring) of one,
    for real: MPI's large-count calls refuse them in the Open MPI 5.0 wheel (MPI_ERR_ARG)."""
    import numpy as np

    from cudampi.comm import Communicator

    n = (2 << 30) + 4096
    x = np.zeros(n, dtype=np.uint8)
    with Communicator(comm) as c:
        if comm.rank == 0:
            x[::4096] = 7
            x[-1] = 9
            c.send(x, 1, 1, path=path)
        else:
            c.recv(x, 0, 1, path=path)
            assert x[-1] == 9 and x[4096] == 7 and x[1] == 0 and x[1 << 31] == 7, "send/recv"
            x[:] = 0
        c.broadcast(x, root=0, path="gpu-ring")
        assert x[-1] == 9 and x[4096] == 7 and x[1] == 0 and x[1 << 31] == 7, "broadcast"
    if comm.rank == 0:
        print("2 GiB messages ok", flush=True)


@pytest.mark.parametrize(
    "path", [pytest.param(p, marks=only_when_asked()) for p in ("host", "staged")]
)
def test_two_gib_user_messages(path):
    """~2.2 GiB a rank, ~5 GiB in all, a minute or two."""
    proc = run_mpi(2, __file__, "rank_two_gib_messages", path, timeout=900)
    assert "2 GiB messages ok" in proc.stdout
