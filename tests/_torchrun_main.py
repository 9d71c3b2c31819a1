"""Entry point of one torchrun worker for tests/mpi/test_torch_torchrun.py: call one function of
a test file, as tests/_rank_main.py does under mpiexec.

The function gets a stand-in for ``MPI.COMM_WORLD`` that imports mpi4py only when first used:
under torchrun MPI must not start before ``init_process_group("cudampi")``, which makes the
processes one MPI job (cudampi.pmi.join). A function that raises exits the worker non-zero,
and torchrun then stops the others.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import traceback
from typing import Any


class LazyWorld:
    """``MPI.COMM_WORLD``, looked up on first attribute access."""

    def __getattr__(self, name: str) -> Any:
        from mpi4py import MPI

        return getattr(MPI.COMM_WORLD, name)


def main() -> int:
    file, func, *args = sys.argv[1:]
    rank = os.environ.get("RANK", "?")
    spec = importlib.util.spec_from_file_location(f"_torchrun_test_{rank}", file)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        getattr(module, func)(LazyWorld(), *args)
    except BaseException:
        sys.stderr.write(f"--- torchrun rank {rank} failed in {func}:\n{traceback.format_exc()}")
        sys.stderr.flush()
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
