"""The settings in real jobs: NCCL_DEBUG's level names for CUDAMPI_LOG run the job (they
aborted it), a setting out of bounds is refused on every rank before any call, and a deadline
too short for a call that every rank reached says so (it said "no rank did not arrive")."""

from __future__ import annotations

import sys
import textwrap

import pytest

from tests.mpirun import mpi_env, mpiexec_argv, run_launched, run_mpi

pytestmark = pytest.mark.mpi


LEVELS = {"INFO": "info", "warning": "off", "1": "info", "TRACE": "debug"}


def rank_makes_communicators(comm):
    """A Communicator under each CUDAMPI_LOG value, in turn (each reads the environment)."""
    import os

    import numpy as np

    from cudampi.comm import Communicator

    for value, level in LEVELS.items():
        os.environ["CUDAMPI_LOG"] = value
        with Communicator(comm) as c:
            assert c.config.log == level, (value, c.config.log)
            got = c.allreduce(np.ones(4))
            assert got.tolist() == [comm.size] * 4
        print(f"rank {comm.rank} ran with CUDAMPI_LOG={value}", flush=True)


def test_nccl_debug_level_names_run_the_job():
    proc = run_mpi(2, __file__, "rank_makes_communicators")
    for value in LEVELS:
        assert f"rank 1 ran with CUDAMPI_LOG={value}" in proc.stdout, proc.stderr[-3000:]
    # rank 0 says which path each new call took, as CUDAMPI_LOG=info does
    assert "allreduce 32 B float64: path host" in proc.stderr, proc.stderr[-3000:]


BAD = [
    ("CUDAMPI_NODE_RANKS", "-3", "expected a whole number from 0 to 65536"),
    ("CUDAMPI_IPC_BLOCKS", "-1", "expected a whole number from 0 to 64"),
    ("CUDAMPI_CHUNK_BYTES", "inf", "expected a size from 1 B to 1 GiB"),
    ("CUDAMPI_TIMEOUT", "1e-9", "expected a positive, finite number of seconds from 0.01"),
]


def rank_is_refused(comm):
    import os

    from cudampi.comm import Communicator
    from cudampi.errors import ConfigError

    for var, value, _words in BAD:
        os.environ[var] = value
        try:
            Communicator(comm)
        except ConfigError as exc:
            print(f"rank {comm.rank} refused: {exc}", flush=True)
        else:
            print(f"rank {comm.rank} accepted {var}={value}", flush=True)
        del os.environ[var]


def test_a_setting_out_of_bounds_is_refused_on_every_rank():
    proc = run_mpi(2, __file__, "rank_is_refused")
    for var, value, words in BAD:
        for rank in (0, 1):
            assert f"rank {rank} refused: {var}={value!r}: {words}" in proc.stdout, (
                proc.stdout + proc.stderr[-3000:]
            )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]


LATE = """
import time
import numpy as np
from mpi4py import MPI
from cudampi.comm import Communicator
from cudampi.errors import CommTimeoutError

comm = MPI.COMM_WORLD
c = Communicator(comm)
comm.Barrier()
if comm.rank == 1:
    time.sleep(0.5)  # comes after rank 0's deadline, but while rank 0 calls the roll
try:
    c.allreduce(np.ones(4))
except CommTimeoutError as exc:
    print(f"rank {comm.rank} raised: {exc}", flush=True)
"""


@pytest.mark.alone  # the late rank answers within the roll call's 1 s (measured: not under -n 3)
def test_a_rank_that_came_after_the_deadline_is_not_called_missing(tmp_path):
    script = tmp_path / "late.py"
    script.write_text(textwrap.dedent(LATE))
    argv = [*mpiexec_argv(2), sys.executable, str(script)]
    proc = run_launched(argv, mpi_env({"CUDAMPI_TIMEOUT": "0.05"}), 120, "a late rank")
    line = next((ln for ln in proc.stdout.splitlines() if "rank 0 raised: " in ln), "")
    assert line, proc.stdout + proc.stderr[-3000:]
    assert "no rank did not arrive" not in line, line
    assert "every rank reached it, but not all within 0.05 s; rank 1 waits here too" in line
    assert "A rank came late" in line and "raise the deadline" in line, line
