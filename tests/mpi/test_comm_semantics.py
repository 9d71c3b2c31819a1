"""What the reductions promise (cudampi.comm.arrays.base.SEMANTICS), the same on every path and
engine the CPU runs: float max/min propagate NaN as NumPy does (MPI's own MAX/MIN drop it),
avg divides each rank's share before the sum (no overflow where the average fits) and is
refused for integers by name. tests/gpu/test_comm_gpu.py holds the device engines to the same."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi

PATHS = ("auto", "host", "native", "staged", "gpu-ring")
"""On host arrays: MPI's own collective (auto, host, native), the staged pipeline and cudampi's
algorithm; the hierarchical engine (node and cross engines) is asked directly."""


def inputs(rank: int, n: int, dtype: str):
    """Rank ``rank``'s input: NaN at element 0 on rank 1 and at element 1 on the last rank,
    infinities of both signs, and distinct finite values elsewhere."""
    import numpy as np

    x = (np.arange(n, dtype=np.float64) * 3 + rank * 7) % 11 - 5
    x[2] = np.inf if rank == 0 else -np.inf
    if rank == 1:
        x[0] = np.nan
    if rank == 3:
        x[1] = np.nan
    return x.astype(dtype)


def rank_semantics(comm):
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.engines.ipc import HierEngine
    from cudampi.config import Config
    from cudampi.errors import CommError

    r, size = comm.rank, comm.size
    wrong: list[str] = []

    def expect(got, want, what):
        got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
        if not np.array_equal(got, want, equal_nan=True):
            wrong.append(f"{what}: got {got[:4]}, want {want[:4]}")

    cfg = Config.load({"node_ranks": "2"}, env={}, strict_env=False)
    with Communicator(comm, config=cfg) as c:
        for path in PATHS:
            for dtype in ("float16", "float32", "float64"):
                for n in (5, 1000):  # a few bytes (the check may carry them) and more
                    x = inputs(r, n, dtype)
                    every = np.stack([inputs(q, n, dtype) for q in range(size)])
                    for op, fn in (("max", np.maximum), ("min", np.minimum)):
                        want = fn.reduce(every, axis=0)
                        what = f"{path} {dtype} {op} n={n}"
                        expect(c.allreduce(x, op, path=path), want, f"allreduce {what}")
                        got = c.reduce(x, op, root=size - 1, path=path)
                        if r == size - 1:
                            expect(got, want, f"reduce {what}")
                        mine = c.reduce_scatter(x, op, counts=[n // size] * (size - 1)
                                                + [n - n // size * (size - 1)], path=path)  # fmt: skip
                        lo = n // size * r
                        expect(mine, want[lo : lo + mine.shape[0]], f"reduce_scatter {what}")
            big = {"float16": 6e4, "float32": 3e38, "float64": 1.7e308}
            for dtype, v in big.items():  # the sum overflows, the average does not
                x = np.full(7, v, dtype=dtype)
                expect(c.allreduce(x, "avg", path=path), x, f"allreduce avg {dtype} {path}")
                got = c.reduce(x, "avg", root=0, path=path)
                if r == 0:
                    expect(got, x, f"reduce avg {dtype} {path}")
                rs = c.reduce_scatter(np.full(size * 3, v, dtype=dtype), "avg", path=path)
                expect(rs, x[:3], f"reduce_scatter avg {dtype} {path}")
            for dtype in ("int8", "uint16", "int64"):
                try:
                    c.allreduce(np.full(4, 100, dtype=dtype), "avg", path=path)
                    wrong.append(f"avg on {dtype} ({path}) was taken")
                except CommError as exc:
                    if f"op='avg' is not defined for {dtype}" not in str(exc):
                        wrong.append(f"avg on {dtype} ({path}): {exc}")
        # the ipc path's hierarchical engine (nodes of 2 ranks), as the CPU runs it
        h = HierEngine.make(c._engines, c._engines.ops("numpy", None), "")
        for dtype in ("float32", "float64"):
            x = inputs(r, 1000, dtype)
            every = np.stack([inputs(q, 1000, dtype) for q in range(size)])
            for op, fn in (("max", np.maximum), ("min", np.minimum)):
                out = np.empty_like(x)
                h.allreduce(x, out, op, dtype)
                expect(out, fn.reduce(every, axis=0), f"hier allreduce {dtype} {op}")
            x = np.full(6, big[dtype], dtype=dtype)
            h.allreduce(x, x, "avg", dtype)
            expect(x, np.full(6, big[dtype], dtype=dtype), f"hier allreduce avg {dtype}")
    assert not wrong, f"rank {r}: {len(wrong)} wrong:\n" + "\n".join(wrong[:30])
    if r == 0:
        print(f"reductions agree on {len(PATHS)} paths and the hierarchical engine", flush=True)


def test_nan_and_avg_mean_the_same_on_every_path():
    proc = run_mpi(4, __file__, "rank_semantics", timeout=300)
    assert "reductions agree on 5 paths" in proc.stdout
