"""The hierarchical collectives of the ipc path on the CPU: MPI's own collectives stand in for
the ipc kernels inside each "node" (4 ranks cut into 2 nodes of 2 by CUDAMPI_NODE_RANKS, or 3
nodes of 1), the cross-node step is the real one. The GPU test runs the same with the kernels;
tests/netns/test_launch_two_hosts.py runs ``rank_hier`` on two real hosts (node_ranks 0)."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def rank_hier(comm, node_ranks, per=None):
    """The hierarchical collectives against NumPy; ``per``: the ranks a node must have (default
    ``node_ranks``, which 0 leaves to MPI's shared-memory split: the real hosts)."""
    import socket

    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.engines.ipc import HierEngine
    from cudampi.config import Config
    from cudampi.errors import DeviceError

    cfg = Config.load({"node_ranks": node_ranks}, env={}, strict_env=False)
    n, r = comm.size, comm.rank
    with Communicator(comm, config=cfg) as c:
        engines = c._engines
        try:
            h = HierEngine.make(engines, engines.ops("numpy", None), "")
        except DeviceError as exc:
            print(f"rank {r}: REFUSED {exc}")
            return
        assert h.nodes * h.per_node == n and h.per_node == int(per or node_ranks)
        hosts = comm.allgather(socket.gethostname())
        first = r - h.local
        assert len(set(hosts[first : first + h.per_node])) == 1, hosts  # a node is on one host
        for count in (0, 1, 7, 1001):
            x = np.arange(count, dtype=np.float64) * (r + 1) - r
            want = sum(np.arange(count, dtype=np.float64) * (q + 1) - q for q in range(n))
            of = np.full(count, -1.0)
            h.allreduce(x, of, "sum", "float64")
            np.testing.assert_array_equal(of, want)
            h.allreduce(x, x, "avg", "float64")  # in place
            np.testing.assert_allclose(x, want / n)
            xi = (np.arange(count) % 13 + r).astype(np.int32)
            oi = np.empty_like(xi)
            h.allreduce(xi, oi, "max", "int32")
            np.testing.assert_array_equal(oi, np.arange(count) % 13 + n - 1)
            counts = [count + (q % 3) for q in range(n)]
            xs = np.arange(sum(counts), dtype=np.float32) + r
            mine = np.empty(counts[r], np.float32)
            h.reduce_scatterv(xs, mine, counts, "sum", "float32")
            lo = sum(counts[:r])
            full = sum(np.arange(sum(counts), dtype=np.float32) + q for q in range(n))
            np.testing.assert_array_equal(mine, full[lo : lo + counts[r]])
            xg = np.full(counts[r], r, np.int64)
            og = np.empty(sum(counts), np.int64)
            h.allgatherv(xg, og, counts)
            np.testing.assert_array_equal(og, np.repeat(np.arange(n), counts))
    if r == 0:
        print(f"hierarchical ok: {n} ranks, {h.nodes} nodes of {h.per_node} on {hosts}")


@pytest.mark.parametrize("n, per", [(4, "2"), (3, "1"), (4, "4")])
def test_hierarchical_collectives_match_numpy(n, per):
    proc = run_mpi(n, __file__, "rank_hier", per, timeout=180)
    assert "hierarchical ok" in proc.stdout


def test_uneven_nodes_are_refused_on_every_rank():
    proc = run_mpi(3, __file__, "rank_hier", "2", timeout=180)
    assert proc.stdout.count("REFUSED") == 3 and "same number of ranks" in proc.stdout
