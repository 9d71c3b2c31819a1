"""The MPI test harness itself: real mpiexec at 1, 2 and 4 ranks, and a failing rank fails fast."""

from __future__ import annotations

import pytest

from tests.mpirun import run_mpi

pytestmark = pytest.mark.mpi


def rank_sum(comm, expected_size):
    import numpy as np

    assert comm.size == int(expected_size)
    x = np.full(3, comm.rank, dtype=np.int64)
    out = np.empty_like(x)
    comm.Allreduce(x, out)
    assert out.tolist() == [sum(range(comm.size))] * 3


def rank_one_fails(comm):
    if comm.rank == comm.size - 1:
        raise ValueError("planted failure")
    comm.Barrier()


@pytest.mark.parametrize("n", [1, 2, 4])
def test_ranks_run_and_agree(n):
    run_mpi(n, __file__, "rank_sum", str(n))


def test_one_failing_rank_fails_the_job_without_hanging():
    proc = run_mpi(2, __file__, "rank_one_fails", check=False, timeout=60)
    assert proc.returncode != 0
    assert "planted failure" in proc.stderr
    assert "rank 1 of 2 failed" in proc.stderr


def test_two_host_tests_skip_with_the_reason_without_openssh(monkeypatch):
    """README command 2 on a fresh machine without sshd: the two-host tests skip and say how to
    install it (they used to error in setup)."""
    import os

    import tests.netns.cluster as cluster

    if os.geteuid() != 0 or cluster.shutil.which("ip") is None:
        pytest.skip("the reason given first here is root or iproute2, not OpenSSH")
    monkeypatch.setattr(cluster, "SSHD", "/nonexistent/sshd")
    why = cluster.why_skip()
    assert why is not None and "OpenSSH is not installed (sshd missing)" in why
    assert "apt-get install openssh-server openssh-client" in why
    without = cluster.why_skip(ssh=False)  # torchrun's hosts: no sshd needed
    assert without is None or "OpenSSH" not in without
