"""Entry point of one MPI rank for tests/mpirun.py: import a test file, call one function."""

from __future__ import annotations

import importlib.util
import sys
import traceback
from typing import Any


def main() -> int:
    file, func, *args = sys.argv[1:]
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    spec = importlib.util.spec_from_file_location(f"_rank_test_{comm.rank}", file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        getattr(module, func)(comm, *args)
    except BaseException:
        return abort_job(comm, f"in {func}")
    return 0


def abort_job(comm: Any, where: str) -> int:
    """The exception being handled, with the rank that raised it, on stderr; then the whole
    job ends (no rank left waiting for this one), as cudampi ends a job (cudampi.abort)."""
    from cudampi.abort import abort_job as end_the_job

    end_the_job(
        1, f"--- rank {comm.rank} of {comm.size} failed {where}:\n{traceback.format_exc()}", comm
    )
    return 1


if __name__ == "__main__":
    sys.exit(main())
