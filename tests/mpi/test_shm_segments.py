"""cudampi.shm on real MPI: which shared-memory files count as stale."""

from __future__ import annotations

import os
import subprocess
import sys

from cudampi.shm import remove, stale_segments
from tests.mpirun import mpi_env


def test_an_open_mpi_singletons_segment_is_stale_only_once_it_has_exited(tmp_path):
    """Real Open MPI: a singleton maps its own sm_segment (not stale while it runs); Open MPI
    5.0 leaves it behind at a clean exit, and then it is."""
    before = set(stale_segments())
    code = "import sys; from mpi4py import MPI; print(MPI.COMM_WORLD.size, flush=True); sys.stdin.read()"
    proc = subprocess.Popen(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=mpi_env(),
    )
    assert proc.stdout is not None and proc.stdin is not None
    assert proc.stdout.readline() == "1\n"
    with open(f"/proc/{proc.pid}/maps") as f:
        mine = {ln.split()[-1] for ln in f if "/dev/shm/sm_segment." in ln}
    assert len(mine) == 1, mine
    assert not mine & set(stale_segments())  # mapped: not stale
    proc.stdin.close()
    assert proc.wait(60) == 0
    left = mine & set(stale_segments())
    assert left == {p for p in mine if os.path.exists(p)}  # whatever it left is stale now
    remove(sorted(left - before))


_SINGLETON = """
import os, sys
from mpi4py import MPI
import numpy as np
from cudampi.comm import Communicator
from cudampi.shm import _SINGLETON_EXIT, _remove_if_mine

c = Communicator(MPI.COMM_WORLD)
assert list(c.allreduce(np.ones(3))) == [1.0, 1.0, 1.0]
c.close()
_remove_if_mine(os.getpid() + 1, list(_SINGLETON_EXIT))  # a forked child's exit handler
assert all(os.path.exists(p) for p in _SINGLETON_EXIT)  # left the parent's segment alone
print(" ".join(_SINGLETON_EXIT), flush=True)
"""


def test_an_open_mpi_singleton_with_a_communicator_leaves_no_segment():
    """Open MPI 5.0 leaves a singleton's sm_segment at every exit (the test above); a singleton
    that made a cudampi Communicator removes its own at exit, and only its own."""
    proc = subprocess.run(
        [sys.executable, "-c", _SINGLETON],
        capture_output=True,
        text=True,
        env=mpi_env(),
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    mine = proc.stdout.split()
    assert len(mine) == 1 and os.path.basename(mine[0]).startswith("sm_segment."), mine
    assert not os.path.exists(mine[0])
