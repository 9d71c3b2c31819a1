"""The per-call timing loop of the profiling tools (tools/profile-comm.py, tools/torch-call-cost.py,
tools/ipc-profile.py),
imported from beside them (a script's own folder is first on ``sys.path``, under ``cudampi launch``
too)."""

from __future__ import annotations

import time
from typing import Any


def per_call(
    comm: Any, fn: Any, iters: int, sync: Any, warmup: int = 3, *, each: bool = False
) -> float:
    """Seconds per call of ``fn`` over ``iters`` pipelined calls after ``warmup`` more (one
    ``sync()`` before and after, the ranks starting together; with ``each``, also after every
    call), the slowest rank's."""
    from mpi4py import MPI

    for _ in range(warmup):
        fn()
    sync()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
        if each:
            sync()
    sync()
    return float(comm.allreduce((time.perf_counter() - t0) / iters, op=MPI.MAX))
