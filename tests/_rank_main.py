"""Entry point of one MPI rank for tests/mpirun.py: import a test file, call one function."""

from __future__ import annotations

import importlib.util
import sys
import traceback


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
        sys.stderr.write(f"--- rank {comm.rank} of {comm.size} failed in {func}:\n")
        sys.stderr.write(traceback.format_exc())
        sys.stderr.flush()
        comm.Abort(1)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
