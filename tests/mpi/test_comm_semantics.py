"""What the reductions promise (cudampi.comm.arrays.base.SEMANTICS), the same on every path and
engine: float max/min propagate NaN as NumPy does (MPI's own MAX/MIN drop it), avg divides each
rank's share before the sum (no overflow where the average fits) and is refused for integers by
name. Here on the CPU's paths and the hierarchical engine; tests/gpu/test_comm_gpu.py runs
:func:`check_semantics` on the device engines (ipc, nccl, gpu-ring, staged, native)."""

from __future__ import annotations

import pytest

from tests.mpi.test_comm_collectives import to_lib, to_np
from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi

PATHS = ("auto", "host", "native", "staged", "gpu-ring")
"""On host arrays: MPI's own collective (auto, host, native), the staged pipeline and cudampi's
algorithm."""
BIG = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1.7e308}
"""Per dtype, a value whose sum over the ranks overflows while their average does not."""


def inputs(rank: int, n: int):
    """Rank ``rank``'s input (float64): NaN at element 0 on rank 1 and at element 1 on rank 3,
    infinities of both signs, and distinct small integers elsewhere (exact in every float)."""
    import numpy as np

    x = (np.arange(n, dtype=np.float64) * 3 + rank * 7) % 11 - 5
    x[2] = np.inf if rank == 0 else -np.inf
    if rank == 1:
        x[0] = np.nan
    if rank == 3:
        x[1] = np.nan
    return x


def check_semantics(c, lib: str, paths, dtypes, wrong: list[str]) -> None:
    """Append to ``wrong`` what differs from NumPy's meaning, for ``lib``'s arrays (a library
    of tests/mpi/test_comm_collectives.checks) on each of ``paths``."""
    import numpy as np

    r, size = c.rank, c.size

    def expect(got, want, what):
        got = np.asarray(to_np(got), dtype=np.float64)
        if not np.array_equal(got, np.asarray(want, dtype=np.float64), equal_nan=True):
            wrong.append(f"{what}: got {got[:4]}, want {np.asarray(want)[:4]}")

    for path in paths:
        for dtype in dtypes:
            for n in (5, 1000):  # a few bytes (the check may carry them) and more
                every = np.stack([inputs(q, n) for q in range(size)])
                counts = [n // size] * (size - 1) + [n - n // size * (size - 1)]
                lo = n // size * r
                for op, fn in (("max", np.maximum), ("min", np.minimum)):
                    want = fn.reduce(every, axis=0)
                    what = f"{lib} {path} {dtype} {op} n={n}"
                    x = to_lib(every[r], lib, dtype)
                    expect(c.allreduce(x, op, path=path), want, f"allreduce {what}")
                    got = c.reduce(x, op, root=size - 1, path=path)
                    if r == size - 1:
                        expect(got, want, f"reduce {what}")
                    mine = c.reduce_scatter(x, op, counts=counts, path=path)
                    expect(mine, want[lo : lo + counts[r]], f"reduce_scatter {what}")
            big = to_lib(np.full(size * 3, BIG[dtype]), lib, dtype)
            want = to_np(big)  # the value in the dtype
            what = f"avg {lib} {dtype} {path}"
            expect(c.allreduce(big, "avg", path=path), want, f"allreduce {what}")
            got = c.reduce(big, "avg", root=0, path=path)
            if r == 0:
                expect(got, want, f"reduce {what}")
            expect(c.reduce_scatter(big, "avg", path=path), want[:3], f"reduce_scatter {what}")
    if hasattr(c, "synchronize"):
        c.synchronize()


def rank_semantics(comm):
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.engines.ipc import HierEngine
    from cudampi.config import Config
    from cudampi.errors import CommError

    r, size = comm.rank, comm.size
    wrong: list[str] = []
    cfg = Config.load({"node_ranks": "2"}, env={}, strict_env=False)
    with Communicator(comm, config=cfg) as c:
        check_semantics(c, "numpy", PATHS, ("float16", "float32", "float64"), wrong)
        for path in PATHS:
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
            every = np.stack([inputs(q, 1000) for q in range(size)]).astype(dtype)
            for op, fn in (("max", np.maximum), ("min", np.minimum)):
                out = np.empty_like(every[r])
                h.allreduce(every[r].copy(), out, op, dtype)
                if not np.array_equal(out, fn.reduce(every, axis=0), equal_nan=True):
                    wrong.append(f"hierarchical allreduce {dtype} {op}: {out[:4]}")
            x = np.full(6, BIG[dtype], dtype=dtype)
            h.allreduce(x, x, "avg", dtype)
            if not (x == np.full(6, BIG[dtype], dtype=dtype)).all():
                wrong.append(f"hierarchical allreduce avg {dtype}: {x[:4]}")
    assert not wrong, f"rank {r}: {len(wrong)} wrong:\n" + "\n".join(wrong[:30])
    if r == 0:
        print(f"reductions agree on {len(PATHS)} paths and the hierarchical engine", flush=True)


def test_nan_and_avg_mean_the_same_on_every_path():
    proc = run_mpi(4, __file__, "rank_semantics", timeout=300)
    assert "reductions agree on 5 paths" in proc.stdout
