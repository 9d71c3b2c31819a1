"""The Communicator's dispatch to engines: the registry picks the engine by PathChoice.engine, and
a stream-ordered engine runs in the caller's thread after the queued calls, with no host-side
check and no stream capture/fence. The engine here is a stand-in that reduces with plain MPI on
NumPy arrays (no stream-ordered engine exists yet); the data it returns is checked."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def rank_stream_ordered_dispatch(comm):
    import threading
    import time

    import numpy as np

    import cudampi.comm.communicator as cm
    from cudampi.comm import Communicator, PathChoice
    from cudampi.comm.arrays.numpy import NumpyOps
    from cudampi.comm.engines import KINDS, Engine

    counts = {"check": 0, "capture": 0, "begin": 0, "fence": 0}
    real_check = cm.check

    def counting_check(*a, **k):
        counts["check"] += 1
        return real_check(*a, **k)

    class CountingOps(NumpyOps):
        device = 0  # stands for device ops: host ops skip the stream protocol (no-ops there)

        def capture(self):
            counts["capture"] += 1

        def begin(self, token):
            counts["begin"] += 1

        def fence(self):
            counts["fence"] += 1

    seen = {}

    class Ordered(Engine):
        name = "ordered"
        stream_ordered = True

        def allreduce(self, xf, of, op, dtype):
            seen["thread"] = threading.current_thread()
            seen["queued_done"] = queued.test()
            self.setting.coll.Allreduce(xf, of)

        def send(self, f, dest, tag):
            self.setting.p2p.Send(f, dest, tag)

        def recv(self, f, source, tag):
            self.setting.p2p.Recv(f, source, tag)

    KINDS["ordered"] = Ordered
    cm.check = counting_check
    try:
        c = Communicator(comm)
        c._engines._ops[("numpy", None)] = CountingOps()
        r, n = c.rank, c.size
        if r == 1:
            time.sleep(0.5)  # rank 0's queued allreduce waits for this rank
        before = dict(counts)
        queued = c.allreduce(np.full(4, 1.0), async_op=True)
        c._choose = lambda *a, **k: PathChoice("host", "test", "ordered")
        got = c.allreduce(np.full(3, float(r + 1)))
        assert got.tolist() == [n * (n + 1) / 2] * 3, got
        assert seen["thread"] is threading.current_thread(), seen
        assert seen["queued_done"], "ran before the queued allreduce finished"
        assert queued.wait().tolist() == [float(n)] * 4
        h = c.allreduce(np.full(2, 1.0), async_op=True)
        assert h.test(), "an async stream-ordered call returns a finished handle"
        assert h.wait().tolist() == [float(n)] * 2
        if r == 0:
            c.send(np.arange(3.0), 1, tag=5)
        elif r == 1:
            box = np.zeros(3)
            assert c.recv(box, 0, tag=5) is box and box.tolist() == [0.0, 1.0, 2.0]
        # the queued allreduce alone was checked, captured, begun and fenced
        assert counts == {k: v + 1 for k, v in before.items()}, (before, counts)
        del c._choose  # back to the real path choice
        assert c.allreduce(np.full(2, 1.0)).tolist() == [float(n)] * 2
        assert counts == {k: v + 2 for k, v in before.items()}, (before, counts)
        c.close()
    finally:
        cm.check = real_check
        del KINDS["ordered"]


def test_stream_ordered_engine_runs_inline_unchecked_after_queued_calls():
    run_mpi(2, __file__, "rank_stream_ordered_dispatch", timeout=120)


def _count_full_paths(c):
    """A one-item list counting the calls of Communicator ``c`` that take the full path."""
    full = [0]
    real = c._run

    def counting(*args, **kwargs):
        full[0] += 1
        return real(*args, **kwargs)

    c._run = counting
    return full


def rank_repeats(comm):
    """An allreduce repeated on the same torch tensors goes straight to a stream-ordered engine
    (cudampi.comm.repeat); anything that could change what the full path decided takes the full
    path again, and the results are right either way."""
    import gc

    import torch
    from mpi4py import MPI

    from cudampi.comm import Communicator, PathChoice
    from cudampi.comm.engines import KINDS, Engine
    from cudampi.errors import CommError

    class Ordered(Engine):
        name = "ordered"
        stream_ordered = True

        def allreduce(self, xf, of, op, dtype):
            mpi_op = {"sum": MPI.SUM, "max": MPI.MAX}[op]
            if xf.data_ptr() == of.data_ptr():
                self.setting.coll.Allreduce(MPI.IN_PLACE, of.numpy(), mpi_op)
            else:
                self.setting.coll.Allreduce(xf.numpy(), of.numpy(), mpi_op)

    KINDS["ordered"] = Ordered
    try:
        c = Communicator(comm)
        c._choose = lambda *a, **k: PathChoice("host", "test", "ordered")
        full = _count_full_paths(c)
        r, n = c.rank, c.size
        total = float(n * (n + 1) // 2)

        def call(t, expect_full, op="sum", out=None, **kw):
            before = full[0]
            t.fill_(r + 1) if not t.requires_grad else t.detach().fill_(r + 1)
            got = c.allreduce(t, op, out=t if out is None else out, **kw)
            if kw.get("async_op"):
                got = got.wait()
            want = total if op == "sum" else float(n)
            assert torch.equal(got.detach(), torch.full_like(got.detach(), want)), (got, want)
            assert full[0] - before == expect_full, (full[0] - before, expect_full)

        x = torch.empty(4, 3)
        call(x, 1)  # the full path, remembered
        assert len(c._repeats) == 1
        call(x, 0)  # straight to the engine
        call(x, 0)
        y = torch.empty(4, 3)
        x.fill_(r + 1)
        assert c.allreduce(x, out=y) is y and torch.equal(y, torch.full_like(y, total))
        x.fill_(r + 1)
        assert c.allreduce(x, out=y) is y and torch.equal(y, torch.full_like(y, total))
        assert torch.equal(x, torch.full_like(x, r + 1.0)), "out of place wrote its input"
        assert len(c._repeats) == 2
        call(x, 1, op="max")  # another op: its own entry
        call(x, 0, op="max")
        call(x, 1, path="host")  # another path asked for
        call(x, 1, async_op=True)  # async calls always take the full path
        x.data = torch.empty(4, 3)  # new storage under the same tensor object
        call(x, 1)
        call(x, 0)
        x.resize_(12)  # same storage, another shape
        call(x, 1)
        c._observer.logs = True  # something observes calls: the full path logs them
        call(x, 1)
        c._observer.logs = False
        call(x, 0)
        try:  # a bad op after remembered calls: the full path's error, on every rank
            c.allreduce(x, ["sum"], out=x)
        except CommError as exc:
            assert "sum" in str(exc), exc
        else:
            raise AssertionError("allreduce took op=['sum']")
        w = torch.empty(6, requires_grad=True)  # a leaf that needs grad: written detached
        call(w, 1)
        call(w, 0)
        before = len(c._repeats)
        z = torch.empty(5)
        call(z, 1)
        assert len(c._repeats) == before + 1
        del z
        gc.collect()
        assert len(c._repeats) == before, "a dead tensor's entry stays"
        c.close()
        try:
            c.allreduce(x, out=x)
        except CommError as exc:
            assert "closed" in str(exc), exc
        else:
            raise AssertionError("a closed Communicator ran an allreduce")
    finally:
        del KINDS["ordered"]
    if comm.rank == 0:
        print("repeats ok", flush=True)


def test_repeated_allreduce_skips_the_front_end_only_when_nothing_changed():
    run_mpi(2, __file__, "rank_repeats", timeout=120)


def rank_host_repeats(comm, lib):
    """An allreduce repeated on the same host arrays (MPI's engine) skips the front end but not
    the cross-rank check: fresh data every call, and a call that differs on one rank (count, op,
    an array changed under the same object, one rank's arguments refused) still makes every rank
    raise, whether that rank repeats or takes the full path."""
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.errors import CommError, MismatchError

    c = Communicator(comm)
    full = _count_full_paths(c)
    r, n = c.rank, c.size

    def make(count):
        a = np.zeros(count, dtype=np.float32)
        if lib == "numpy":
            return a
        import torch

        return torch.from_numpy(a)

    def values(a):
        return np.asarray(a) if lib == "numpy" else a.numpy()

    def reduce(x, op="sum", out=None, expect_full=0):
        before = full[0]
        got = c.allreduce(x, op, out=x if out is None else out)
        assert expect_full is None or full[0] - before == expect_full, full[0] - before
        return values(got)

    def refused(x, kind, words, op="sum"):
        before = full[0]
        try:
            c.allreduce(x, op, out=x)
        except kind as exc:
            assert all(w in str(exc) for w in words), exc
        else:
            raise AssertionError(f"rank {r}: no {kind.__name__}")
        return full[0] - before

    x = make(12)
    for i in range(4):
        values(x)[...] = r + i
        got = reduce(x, expect_full=int(i == 0))  # the full path once, then straight to MPI
        assert (got == sum(q + i for q in range(n))).all(), got
    assert len(c._repeats) == 1
    y = make(12)
    for i in range(2):
        values(x)[...] = r + 10 * i
        got = reduce(x, out=y, expect_full=int(i == 0))
        assert (got == sum(q + 10 * i for q in range(n))).all() and (values(x) == r + 10 * i).all()
    # rank 0 repeats on x, rank 1 calls on a longer array: both raise, nothing moves
    z = make(13)
    took = refused(x if r == 0 else z, MismatchError, ["count"])
    assert took == (0 if r == 0 else 1), took
    # both remembered a max; rank 1 repeats it while rank 0 repeats a sum
    values(x)[...] = r
    assert (reduce(x, "max", expect_full=1) == n - 1).all()
    assert refused(x, MismatchError, ["op"], op="sum" if r == 0 else "max") == 0
    # the array changed under the same object on rank 1 only: its full path, a count mismatch
    if lib == "numpy":
        if r == 1:
            x.flags.writeable = False  # refused on rank 1; rank 0 repeats and learns of it
        took = refused(x, CommError, ["read-only"] if r == 1 else ["rank 1", "rejected"])
        x.flags.writeable = True
    else:
        if r == 1:
            x.data = make(15)  # new storage and shape under the same tensor object
        took = refused(x, MismatchError, ["count"])
        if r == 1:
            x.data = make(12)
    assert took == (0 if r == 0 else 1), took
    values(x)[...] = r + 1  # the communicator still works (rank 1's new tensor may have the
    # old one's address: then nothing the full path checks has changed, and it repeats)
    assert (reduce(x, expect_full=None) == n * (n + 1) // 2).all()
    values(x)[...] = r + 1
    assert (reduce(x, expect_full=0) == n * (n + 1) // 2).all()
    c.close()
    if comm.rank == 0:
        print("host repeats ok", flush=True)


@pytest.mark.parametrize("lib", ["numpy", "torch"])
def test_repeated_host_allreduce_keeps_the_cross_rank_check(lib):
    run_mpi(2, __file__, "rank_host_repeats", lib, timeout=120)


def rank_host_job_without_cupy(comm):
    import sys

    import numpy as np

    from cudampi.comm import Communicator

    c = Communicator(comm)
    x = c.allreduce(np.ones(4))
    assert (x == comm.size).all(), x
    try:
        import torch
    except ImportError:
        pass
    else:
        t = c.allreduce(torch.ones(4))
        assert t.tolist() == [comm.size] * 4, t
    c.close()
    # the ipc engine's availability is asked by every Communicator: importing CuPy to answer
    # costs each rank ~0.6 s of CPU where no array of it is used
    assert "cupy" not in sys.modules, "a host-only job imported CuPy"
    if comm.rank == 0:
        print("no cupy ok", flush=True)


def test_a_host_only_job_never_imports_cupy():
    proc = run_mpi(2, __file__, "rank_host_job_without_cupy", timeout=120)
    assert "no cupy ok" in proc.stdout


def rank_out_of_place_ring_reads_the_input(comm, algorithm):
    """An out-of-place allreduce on the alg engine (gpu-ring's algorithm; float16 on the host,
    which MPI cannot reduce) reads the input where it lies: no copy of it into the output
    first (where ranks time-slice one GPU that copy cost 230-425 us of a 16-128 MiB call), and
    every bit as the in-place call gives, the input untouched."""
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.arrays.numpy import NumpyOps
    from cudampi.config import Config

    copied: list[int] = []

    class CountingOps(NumpyOps):
        def copy(self, dst, src):
            copied.append(int(src.size))
            super().copy(dst, src)

    config = Config.load({"algorithm": algorithm}, env={})
    with Communicator(comm, config=config) as c:
        c._engines._ops[("numpy", None)] = CountingOps()
        r, n = c.rank, c.size
        rng = np.random.default_rng(7 + r)
        for count in (300_001, 131_072 + n - 1):  # ring sizes (past small_bytes), odd splits
            x = rng.standard_normal(count).astype(np.float16)
            x[r::5] = np.nan if r == 1 else x[r::5]  # max/min: what NaN does is the same
            for op in ("sum", "max", "min", "prod"):
                keep = x.copy()
                assert c.path_for("allreduce", x).engine == "alg"
                copied.clear()
                out = c.allreduce(x, op, out=np.empty_like(x))
                big = [k for k in copied if k >= count // n]
                assert not big, f"{op} {count}: the input was copied first ({big} elements)"
                assert np.array_equal(x.view(np.uint16), keep.view(np.uint16)), "input changed"
                inplace = x.copy()
                c.allreduce(inplace, op, out=inplace)
                assert np.array_equal(out.view(np.uint16), inplace.view(np.uint16)), op
                every = comm.allgather(out.view(np.uint16).tobytes())
                assert len(set(every)) == 1, f"{op}: ranks disagree"
        # a rank alone, and avg (each share divided first), still right out of place
        y = np.full(300_001, 2.0, dtype=np.float16)
        assert np.all(c.allreduce(y, "avg", out=np.empty_like(y)) == 2.0)
        # reduce_scatter reads its input where it lies too (a scratch buffer, not a copy), even
        # and by counts (an empty block included), each rank's block as the allreduce's (bitwise
        # where the blocks are the allreduce's own; by counts they are not, so the order differs)
        m = 100_003
        x = rng.standard_normal(n * m + 8 * n * n).astype(np.float16)
        counts = [m + 7 * r_ for r_ in range(n)]
        counts[-1] = 0 if n > 2 else counts[-1]
        for op, cs in (("sum", None), ("max", None), ("sum", counts)):
            total = n * m if cs is None else sum(cs)
            xs = x[:total].copy()
            copied.clear()
            got = c.reduce_scatter(xs, op, counts=cs)
            assert total not in copied, f"{op}: the input was copied first ({copied})"
            whole = c.allreduce(xs, op, out=np.empty_like(xs))
            lo = r * m if cs is None else sum(cs[:r])
            mine = whole[lo : lo + (m if cs is None else cs[r])]
            if cs is None:
                assert np.array_equal(got.reshape(-1).view(np.uint16), mine.view(np.uint16)), op
            else:
                assert np.allclose(got, mine, rtol=1e-2, atol=1e-2), op


@pytest.mark.parametrize(("n", "algorithm"), [(2, "ring"), (3, "ring"), (3, "direct")])
def test_out_of_place_ring_allreduce_reads_the_input_without_copying_it(n, algorithm):
    run_mpi(n, __file__, "rank_out_of_place_ring_reads_the_input", algorithm, timeout=180)
