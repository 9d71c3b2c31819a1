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
    from cudampi.comm.engines import KINDS, Engine
    from cudampi.comm.ops import NumpyOps

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
