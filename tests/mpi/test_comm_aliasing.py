"""Collectives whose input lives inside their output (or overlaps it), as FSDP2 does when it
all-gathers a shard that is a slice of the gathered buffer. MPI forbids aliased send and
receive buffers (MPICH checks and fails the call: "Buffers must not be aliased"; Open MPI reads
them as they are), so the MPI engine must pass MPI_IN_PLACE or a copy. Run under Open MPI and
under MPICH's Hydra, on host arrays through MPI's own collectives."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi, run_mpi_mpich

pytestmark = pytest.mark.mpi


def rank_aliased(comm, path="host", rounds="1"):
    for _ in range(int(rounds)):
        _aliased(comm, path)


def _aliased(comm, path):
    import numpy as np

    from cudampi.comm import Communicator

    n, r = comm.size, comm.rank
    c = Communicator(comm, path=path)
    k = 5
    want = np.repeat(np.arange(n, dtype=np.float32), k).reshape(n, k) + 1

    # allgather: x is this rank's own block of out (MPI_IN_PLACE)
    out = np.zeros((n, k), np.float32)
    out[r] = r + 1
    c.allgather(out[r], out=out)
    assert np.array_equal(out, want), out

    # allgather: x overlaps out elsewhere (the first k elements of out, on every rank)
    out = np.zeros((n, k), np.float32)
    out.reshape(-1)[:k] = r + 1
    c.allgather(out.reshape(-1)[:k], out=out)
    assert np.array_equal(out, want), out

    # gather at the root with x inside out
    out = np.zeros((n, k), np.float32)
    out[r] = r + 1
    got = c.gather(out[r], root=0, out=out if r == 0 else None)
    if r == 0:
        assert np.array_equal(got, want), got

    # reduce_scatter: out overlaps x (x's second block; out=x itself is refused as documented)
    x = np.arange(n * k, dtype=np.float32) * (r + 1)
    full = np.arange(n * k, dtype=np.float32) * sum(range(1, n + 1))
    out = x[k : 2 * k]
    c.reduce_scatter(x, out=out)
    assert np.array_equal(out, full[r * k : (r + 1) * k]), out

    # alltoall: out overlaps x, one block further on (out=x itself is refused as documented)
    buf = np.zeros((n + 1) * k, np.float32)
    x = buf[: n * k]
    x[:] = np.arange(n * k, dtype=np.float32) + 100 * r
    out = buf[k:]
    expect = np.concatenate(
        [np.arange(r * k, (r + 1) * k, dtype=np.float32) + 100 * s for s in range(n)]
    )
    c.alltoall(x, out=out)
    assert np.array_equal(out, expect), out

    # alltoall: out overlaps x by part of a block, either way (gpu-ring once received into
    # blocks it had not sent yet)
    for shift in (k // 2, -(k // 2), (n - 1) * k + 1):
        buf = np.zeros((2 * n + 2) * k, np.float32)
        at = n * k if shift < 0 else 0
        x = buf[at : at + n * k]
        x[:] = np.arange(n * k, dtype=np.float32) + 100 * r
        out = buf[at + shift : at + shift + n * k]
        c.alltoall(x, out=out)
        assert np.array_equal(out, expect), (shift, out)
    c.close()
    if r == 0:
        print("aliased buffers ok", flush=True)


@pytest.mark.parametrize("n", [2, 3])
def test_aliased_buffers_open_mpi(n):
    assert "aliased buffers ok" in run_mpi(n, __file__, "rank_aliased").stdout


@pytest.mark.parametrize("n", [3, 4])
def test_aliased_buffers_on_gpu_ring(n):
    """The same cases through cudampi's own algorithms (the gpu-ring path runs them on host
    arrays too), repeated: a wrong block there depended on timing."""
    proc = run_mpi(n, __file__, "rank_aliased", "gpu-ring", "8", timeout=240)
    assert "aliased buffers ok" in proc.stdout


def test_aliased_buffers_mpich():
    assert "aliased buffers ok" in run_mpi_mpich(2, __file__, "rank_aliased").stdout
