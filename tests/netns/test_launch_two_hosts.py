"""A real two-host launch: a cluster of two nodes (tests/netns/cluster.py: two network
namespaces on one bridge, a real sshd each, key-only, each with its own hostname); ``cudampi
launch`` runs on the first and reaches the second over ssh and TCP. Then the second host is
killed mid-run, and finally it refuses ssh: both must end the job non-zero, naming the host.

Needs root and ``ip netns`` (skipped with the reason otherwise) and sshd (openssh-server).
The namespaces share the filesystem, so the venv's python and MPI are at the same paths there.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.mpirun import bring_up
from tests.netns.cluster import SUBNET, Cluster, why_skip

pytestmark = [pytest.mark.netns, pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[2]
TARGET = str(ROOT / "tests" / "mpi" / "_launch_target.py")


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    yield from bring_up(lambda: Cluster(tmp_path_factory.mktemp("two-hosts"), 2, "cl"), why_skip())


def launch_argv(c: Cluster, *args: str) -> list[str]:
    """``cudampi launch --ssh ... args`` on the first host."""
    return c.in_host(0, sys.executable, "-m", "cudampi", "launch", "--ssh", c.ssh, *args)


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def test_two_hosts_from_an_mpich_style_hostfile(hosts: Cluster, tmp_path: Path):
    hf = tmp_path / "hosts"
    hf.write_text(
        f"# two namespaces\n{hosts.addr[0]}:2\n{hosts.addr[1]}:2\n"
    )  # MPICH format: rewritten
    dry = run(launch_argv(hosts, "--hostfile", str(hf), "--dry-run", TARGET))
    assert f"#   {hosts.addr[1]} slots=2" in dry.stdout, dry.stdout + dry.stderr
    assert f"btl_tcp_if_include {SUBNET}.0/24" in dry.stdout
    p = run(launch_argv(hosts, "--hostfile", str(hf), TARGET, "check", "4", "--flag", "a b"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "OK 4" in p.stdout
    for r, name in (
        (0, hosts.names[0]),
        (1, hosts.names[0]),
        (2, hosts.names[1]),
        (3, hosts.names[1]),
    ):
        # output from both hosts; NCCL/Gloo's interface picked per host from the route
        assert f"rank {r} ok on {name} ifname=cm0" in p.stdout, p.stdout


def test_selftest_across_two_hosts(hosts: Cluster):
    p = run(
        launch_argv(
            hosts, "--hosts", f"{hosts.addr[0]}:1,{hosts.addr[1]}:1", "-m", "cudampi.selftest"
        )
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "2 rank(s) on 2 host(s) via openmpi" in p.stdout
    assert "selftest: PASS" in p.stdout


def test_nccl_settings_reach_the_ranks_on_the_other_host(hosts: Cluster):
    """NCCL reads its settings in every rank; mpirun forwards nothing by itself to a remote
    host, so `cudampi launch` forwards the NCCL_* variables set here."""
    argv = launch_argv(hosts, "--hosts", f"{hosts.addr[0]}:1,{hosts.addr[1]}:1", TARGET, "env")
    argv += ["NCCL_IB_HCA", "NCCL_DEBUG"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    env.update(NCCL_IB_HCA="=mlx5_7:1", NCCL_DEBUG="WARN")
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env, cwd=ROOT)
    assert p.returncode == 0, p.stdout + p.stderr
    for r, name in ((0, hosts.names[0]), (1, hosts.names[1])):
        assert f"rank {r} on {name}: NCCL_IB_HCA==mlx5_7:1 NCCL_DEBUG=WARN" in p.stdout, p.stdout


def test_hierarchical_collectives_with_a_node_per_host(hosts: Cluster):
    """The ipc path's hierarchical collectives, nodes found by MPI's shared-memory split: two
    real hosts of 2 ranks each (MPI inside a node standing in for the kernels, the cross-node
    step over TCP between the hosts), then uneven hosts, refused by every rank."""
    p = run(
        launch_argv(
            hosts, "--hosts", f"{hosts.addr[0]}:2,{hosts.addr[1]}:2", TARGET, "hier", "0", "2"
        )
    )
    assert p.returncode == 0, p.stdout + p.stderr
    want = f"4 ranks, 2 nodes of 2 on {[hosts.names[0]] * 2 + [hosts.names[1]] * 2}"
    assert f"hierarchical ok: {want}" in p.stdout, p.stdout + p.stderr
    p = run(
        launch_argv(
            hosts, "--hosts", f"{hosts.addr[0]}:1,{hosts.addr[1]}:2", TARGET, "hier", "0", "2"
        )
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert p.stdout.count("REFUSED") == 3 and "node sizes here: [1, 2]" in p.stdout, p.stdout


def test_a_host_killed_mid_run_fails_the_job_naming_it(hosts: Cluster, tmp_path: Path):
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        "TARGET_SLEEP": "60",
    }
    job = subprocess.Popen(
        launch_argv(
            hosts,
            "--hosts",
            f"{hosts.addr[0]}:2,{hosts.addr[1]}:2",
            "-x",
            "TARGET_SLEEP",
            TARGET,
            "sleep",
            str(tmp_path),
        ),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 60
        while len(list(tmp_path.glob("*.pid"))) < 4:  # every rank runs, on both hosts
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.1)
        remote = {int((tmp_path / f"{r}.pid").read_text()) for r in (2, 3)}
        assert remote <= set(hosts.pids(1))
        start = time.monotonic()
        hosts.kill_node(1)  # its sshd, its daemon, its ranks
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
    assert time.monotonic() - start < 30
    assert job.returncode != 0
    assert f"host {hosts.addr[1]} was lost during the run" in err, out + err
    local = [int((tmp_path / f"{r}.pid").read_text()) for r in (0, 1)]
    assert [p for p in local if _alive(p)] == []  # no orphans left running on host 1


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for init to reap it is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_host_refusing_ssh_is_named(hosts: Cluster):
    assert hosts.pids(1) == []  # killed by the previous test: nothing listens on port 22
    p = run(
        launch_argv(hosts, "--hosts", f"{hosts.addr[0]}:1,{hosts.addr[1]}:1", TARGET, "check", "2"),
        timeout=60,
    )
    assert p.returncode != 0
    assert f"host {hosts.addr[1]} cannot be reached: Connection refused" in p.stderr, (
        p.stdout + p.stderr
    )
    hosts.start_sshd(1)  # leave it as found
