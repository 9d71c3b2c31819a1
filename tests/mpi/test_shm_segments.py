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
