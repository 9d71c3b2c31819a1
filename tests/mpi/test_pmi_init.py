"""Ranks of cudampi's PMI server in MPI_Init, with real MPICH (the PyPI wheel's libmpi): a rank
left waiting there when a peer dies is ended (mpi4py holds the GIL in MPI_Init, so no watch
thread can), nothing is left behind, and MPICH's shared-memory segment is named as
:mod:`cudampi.shm` says and removed after a failed job."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudampi.pmi.client import single_node_mapping
from cudampi.pmi.server import PmiServer
from cudampi.shm import SHM_DIR, mpich_segments, mpich_world_id, unique_kvsname
from tests.mpirun import MPICH_SKIP, ROOT, mpi_env, mpich_venv

SECRET = "0123456789abcdef0123456789abcdef"

# One rank of a PMI job, as cudampi.pmi.join.join_world runs it (no torch store here).
RANK = """
import os, sys
from cudampi.pmi.client import InitGuard, client_env, connect
address, rank, size, secret = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
fd = connect(address, rank, secret).detach()
guard = InitGuard(address, rank, size, secret)
os.environ.update(client_env(fd, rank, size))
print("in MPI_Init", flush=True)
with guard:
    from mpi4py import MPI
MPI.COMM_WORLD.Barrier()
with open("/proc/self/maps") as f:
    maps = sorted({line.split()[-1] for line in f if "/dev/shm/mpich_" in line})
print("up", MPI.COMM_WORLD.rank, MPI.COMM_WORLD.size, *maps, flush=True)
MPI.COMM_WORLD.Barrier()
"""


def _mpich_env() -> dict[str, str]:
    venv = mpich_venv()
    if venv is None:
        pytest.skip(MPICH_SKIP)
    return mpi_env({"MPI4PY_LIBMPI": str(venv / "lib" / "libmpi.so.12")})


def _ranks(srv: PmiServer, n: int) -> list[subprocess.Popen[str]]:
    address = f"127.0.0.1:{srv.port}"
    return [
        subprocess.Popen(
            [sys.executable, "-c", RANK, address, str(r), str(n), SECRET],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=_mpich_env(),
            cwd=ROOT,
        )
        for r in range(n)
    ]


def _guards(address: str) -> list[int]:
    """Pids of the guard processes of the job at ``address`` still alive."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"cudampi.pmi.guard" in argv and address.encode() in argv:
            pids.append(int(entry.name))
    return pids


def test_ranks_come_up_through_the_guard_and_it_leaves():
    """Also the fact cudampi.shm rests on, on real MPICH: the segment both ranks map is
    ``mpich_shm_<FNV-1a of the job's key-value space name>_0``, and a clean end removes it."""
    srv = PmiServer(2, process_mapping=single_node_mapping(2), secret=SECRET).start()
    ranks = _ranks(srv, 2)
    try:
        outs = [p.communicate(timeout=60) for p in ranks]
    finally:
        for p in ranks:
            p.kill()
    segment = f"{SHM_DIR}/mpich_shm_{mpich_world_id(srv.state.kvsname):x}_0"
    for r, (p, (out, err)) in enumerate(zip(ranks, outs)):
        assert p.returncode == 0 and f"up {r} 2 {segment}\n" in out, (out, err)
    assert not os.path.exists(segment)
    assert _guards(f"127.0.0.1:{srv.port}") == []
    assert srv.done.wait(10) and srv.aborted is None
    srv.close()


def test_a_rank_left_in_mpi_init_is_ended_when_a_peer_dies():
    """Both ranks wait in MPI_Init outside any PMI call (here for the ready flag of a segment
    that has the job's name but no creator: what a killed earlier job left when names repeated),
    then rank 0 is killed: rank 1 is ended within seconds with the reason, not left for ever
    (before the guard it waited until killed by hand), its guard and rank 0's are gone, and the
    job's segment is removed."""
    srv = PmiServer(2, process_mapping=single_node_mapping(2), secret=SECRET)
    srv.state.kvsname = unique_kvsname()
    stale = Path(SHM_DIR) / f"mpich_shm_{mpich_world_id(srv.state.kvsname):x}_0"
    with open(stale, "wb") as f:
        f.truncate(4 << 20)  # sparse: no memory until written
    srv.start()
    address = f"127.0.0.1:{srv.port}"
    ranks = _ranks(srv, 2)
    try:
        for p in ranks:
            assert p.stdout is not None and p.stdout.readline() == "in MPI_Init\n"
        time.sleep(2.0)  # well inside MPI_Init (the PMI exchange takes milliseconds)
        assert [p.poll() for p in ranks] == [None, None]
        assert len(_guards(address)) == 2
        ranks[0].send_signal(signal.SIGKILL)
        start = time.monotonic()
        _, err = ranks[1].communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        for p in ranks:
            p.kill()
            p.wait()
        stale.unlink(missing_ok=True)
    assert ranks[1].returncode == -signal.SIGKILL, err
    assert took < 10, took
    assert "rank 0 ended without MPI_Finalize" in err, err
    assert "ending rank 1 of 2 on" in err and "(still in MPI_Init)" in err, err
    assert mpich_segments(srv.state.kvsname) == []
    deadline = time.monotonic() + 10
    while _guards(address) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _guards(address) == []
    srv.close()
