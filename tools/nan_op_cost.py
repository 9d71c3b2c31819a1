"""What the NaN-aware MPI op costs a host allreduce (docs/reliability.md has the figures).

    mpiexec -n 2 python tools/nan_op_cost.py

Per size: mpi4py's Allreduce with MPI.MAX and with cudampi's NaN-aware user op alone, then the
Communicator's allreduce with op sum and max (in place); the best of 40 batches of 100 calls (10
for 1 MiB), in microseconds, printed by rank 0.
"""

import time

import numpy as np
from mpi4py import MPI

from cudampi.comm import Communicator
from cudampi.comm.engines.mpi import nan_op

comm = MPI.COMM_WORLD


def best(fns, reps, batches=40):
    """Per function, the best time per call over ``batches`` batches of ``reps`` calls."""
    out = [float("inf")] * len(fns)
    for f in fns:
        for _ in range(20):
            f()
    for _ in range(batches):
        for i, f in enumerate(fns):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(reps):
                f()
            out[i] = min(out[i], (time.perf_counter() - t) / reps * 1e6)
    return out


with Communicator(comm) as c:
    rows = []
    for n in (4, 32, 1024, 131072):
        x = np.random.default_rng(comm.rank).random(n)
        out = np.empty_like(x)
        fns = [
            lambda x=x, out=out: comm.Allreduce(x, out, MPI.MAX),
            lambda x=x, out=out: comm.Allreduce(x, out, nan_op("max")),
            lambda x=x, out=out: c.allreduce(x, "sum", out=out),
            lambda x=x, out=out: c.allreduce(x, "max", out=out),
        ]
        times = best(fns, 100 if n < 10000 else 10)
        rows.append(f"{n * 8:>8} B  " + "  ".join(f"{v:8.1f}" for v in times))
if comm.rank == 0:
    print("   bytes   MPI.MAX    nan_op  comm-sum  comm-max  (us per call)")
    print("\n".join(rows))
