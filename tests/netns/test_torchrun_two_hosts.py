"""torchrun across two real hosts with the cudampi backend: a cluster of two nodes
(tests/netns/cluster.py, without sshd), each with its own hostname (UTS namespace) and its own
/dev/shm, as separate machines have. Each host runs
``torchrun --nnodes 2 --nproc-per-node 2 --node-rank K`` (static rendezvous at host 1); the
workers' ``init_process_group("cudampi")`` must make the four processes one MPICH job through
cudampi's PMI-1 server (cudampi.pmi.join), served on host 1's veth address, and its
collectives must cross the veth and agree with gloo's. Then a worker on host 2 raises after
init: both torchruns must end non-zero, soon.

Needs root and ``ip netns`` (skipped with the reason otherwise), torch, and the PyPI mpich
wheel's venv (CUDAMPI_TEST_MPICH_PYTHON, else ./.venv-mpich): mpi4py (this venv's, beside
torch) loads its libmpi through MPI4PY_LIBMPI.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from tests.mpirun import MPICH_SKIP, bring_up, mpich_venv
from tests.netns.cluster import Cluster, why_skip

pytestmark = [pytest.mark.netns, pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
BIG = 1 << 21  # float32 elements of the all_reduce that must cross the veth: 8 MiB
SECRET = "netns-test-secret-0123456789abcdef"


def mpich_lib() -> Path:
    """libmpi.so.12 of the PyPI mpich wheel's venv, its path not resolved (a venv's python is a
    link to the base interpreter's)."""
    venv = mpich_venv()
    if venv is None:
        pytest.skip(MPICH_SKIP)
    lib = venv / "lib" / "libmpi.so.12"
    return lib


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory):
    """Two nodes without sshd (torchrun starts each host's side itself), each process started
    there with its own /dev/shm, as separate machines have: MPICH's segments there are named
    after the job and the node only, so a shared one could meet another job's (a run beside
    this test's), and the segments of the jobs this module kills go away with their host's
    tmpfs."""
    yield from bring_up(
        lambda: Cluster(
            tmp_path_factory.mktemp("torchrun-hosts"), 2, "ct", sshd=False, own_shm=True
        ),
        why_skip(ssh=False),
    )


_WORKER = """
import os
import socket
import sys
import time

import torch
import torch.distributed as dist

import cudampi.torch  # noqa: F401  (registers the backend)
import cudampi.pmi.join as join

dialled = []  # the PMI server's address this rank is pointed at (cudampi.pmi.join)
connect = join.connect
join.connect = lambda address, *args: dialled.append(address) or connect(address, *args)

dist.init_process_group("cudampi")
from mpi4py import MPI  # started by init_process_group, through cudampi's PMI server

rank, size = dist.get_rank(), dist.get_world_size()
world = MPI.COMM_WORLD
assert (world.rank, world.size) == (rank, size) == (int(os.environ["RANK"]), 4), (
    world.rank, world.size, rank, size)
(pmi,) = dialled
host = socket.gethostname()
names = world.allgather(host)


def say(line):  # one write: lines of the host's two workers must not interleave
    os.write(1, f"{line}\\n".encode())


fail = os.environ.get("FAIL_RANK")
if fail is not None:
    t = torch.ones(3)
    dist.all_reduce(t)
    if rank == int(fail):
        say(f"rank {rank} raises on {host}")
        raise RuntimeError(f"planted failure on rank {rank}")
    dist.all_reduce(t)  # the others wait here for the rank that raised
    time.sleep(300)
    sys.exit(0)

def collectives(group=None):
    s = torch.arange(4, dtype=torch.float32) + rank
    dist.all_reduce(s, group=group)
    got = [torch.zeros(2, dtype=torch.int64) for _ in range(size)]
    dist.all_gather(got, torch.tensor([rank, 10 * rank]), group=group)
    b = torch.full((3,), 7.0 * rank)
    dist.broadcast(b, src=3, group=group)  # from host 2
    return s, torch.stack(got), b

s, got, b = collectives()
assert s.tolist() == [6.0, 10.0, 14.0, 18.0], s
assert got.tolist() == [[r, 10 * r] for r in range(4)], got
assert b.tolist() == [21.0] * 3, b

big = torch.full((BIG,), rank + 1.0)
dist.all_reduce(big)  # 8 MiB: its bytes must cross the veth
assert bool((big == 10.0).all()), big[:4]

gloo = dist.new_group(backend="gloo")
for mine, theirs in zip((s, got, b), collectives(gloo)):
    assert torch.equal(mine, theirs), (mine, theirs)

dist.barrier()
say(f"rank {rank} ok on {host} pmi={pmi} hosts={','.join(names)} end")
dist.destroy_process_group()
# The gloo group's last reference goes now, while the interpreter is whole: its destructor lets
# its worker threads drop their finished works. Left to interpreter exit, a worker thread that
# drops one then (its tensors need the GIL) is ended inside a C++ destructor: std::terminate,
# "terminate called without an active exception" (torch's gloo, seen on CI under load).
del gloo
if os.environ.get("DIE_AT_END") == str(rank):  # the others are in MPI_Finalize by now
    import signal
    time.sleep(1)
    os.kill(os.getpid(), signal.SIGKILL)
""".replace("BIG", str(BIG))


def torchrun_env(extra: dict[str, str | None]) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        # this pytest may itself run under a launcher: the workers must not take its job for
        # theirs
        if not k.startswith(("OMPI_", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC", "MPI4PY_"))
        and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    env.update(
        PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        MPI4PY_LIBMPI=str(mpich_lib()),
        # The one thing MPICH needs here, and only because the hosts are namespaces of one
        # kernel: UCX (the wheel's default network module) sees one boot_id on both, takes the
        # other host for this one ("intra-node") and moves MPI's bytes between the hosts through
        # shared memory (sysv, cma): nothing crossed the veth. TCP (and self) is what separate
        # hosts would have; UCX finds cm0 itself (no UCX_NET_DEVICES, no libfabric setting).
        UCX_TLS="tcp,self",
        # gloo (the comparison) binds to the address of the hostname, which resolves nowhere
        # here (it falls back to loopback): name its interface.
        GLOO_SOCKET_IFNAME="cm0",
        # The job's PMI secret, the same on both hosts (a batch script would make it).
        CUDAMPI_PMI_SECRET=SECRET,
    )
    env.update(extra)
    return {k: v for k, v in env.items() if v is not None}


class JobHung(AssertionError):
    """The torchruns did not both end in time."""


def run_job(
    hosts: Cluster,
    script: Path,
    extra: dict[str, str | None],
    timeout: float,
    after: str = "",
    grace: float = 0.0,
) -> list[tuple[int, str]]:
    """Both hosts' torchruns; (exit code, output) of each. Raises JobHung (after killing every
    process on both hosts) if they are not both done within ``timeout`` seconds, or within
    ``grace`` seconds of ``after`` appearing in host 2's output."""
    port = hosts.free_port()
    env = torchrun_env(extra)
    marker = after
    logs = [hosts.tmp / f"{script.stem}-host{i + 1}.log" for i in (0, 1)]
    procs = []
    try:
        for i in (0, 1):
            argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
            argv += ["--nproc-per-node", "2", "--node-rank", str(i), "--rdzv-backend", "static"]
            argv += ["--master-addr", hosts.addr[0], "--master-port", str(port), str(script)]
            with logs[i].open("w") as out:
                procs.append(
                    subprocess.Popen(
                        hosts.in_host(i, *argv),
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                        cwd=ROOT,
                    )
                )
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs):
            if after and after in logs[1].read_text():
                deadline = min(deadline, time.monotonic() + grace)
                after = ""
            if time.monotonic() > deadline:
                done = [p.poll() for p in procs]
                raise JobHung(
                    f"torchrun exit codes {done} (None: still running) after {timeout:.0f} s or "
                    f"{grace:.0f} s after {marker!r}:\n" + _tails(logs)
                )
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for i in (0, 1):
            hosts.kill_node(i)  # workers, PMI server: whatever torchrun left behind
        for p in procs:
            p.wait()
    return [(p.returncode, log.read_text()) for p, log in zip(procs, logs)]


def _tails(logs: list[Path]) -> str:
    return "\n".join(f"--- {log.name}:\n{log.read_text()[-4000:]}" for log in logs)


def run_worker(
    hosts: Cluster, tmp_path: Path, name: str, extra: dict[str, str | None], **kw: Any
) -> tuple[int, str, int, str, str]:
    """_WORKER (as ``tmp_path/name.py``) on both hosts through :func:`run_job`: each host's exit
    code and output, then both outputs' tails for an assertion's message."""
    script = tmp_path / f"{name}.py"
    script.write_text(textwrap.dedent(_WORKER))
    (rc1, out1), (rc2, out2) = run_job(hosts, script, extra, **kw)
    return rc1, out1, rc2, out2, f"--- host 1:\n{out1[-4000:]}\n--- host 2:\n{out2[-4000:]}"


def test_torchrun_on_two_hosts_is_one_mpi_job(hosts: Cluster, tmp_path: Path):
    before = hosts.rx_bytes(0)
    rc1, out1, rc2, out2, both = run_worker(hosts, tmp_path, "worker", {}, timeout=90)
    assert (rc1, rc2) == (0, 0), both
    seen = dict(re.findall(r"rank (\d) ok on (.*? end)", out1 + out2))
    assert sorted(seen) == ["0", "1", "2", "3"], both
    for r, line in seen.items():
        host, pmi, names = re.fullmatch(r"(\S+) pmi=(\S+) hosts=(\S+) end", line).groups()
        assert host == hosts.names[int(r) // 2], line  # ranks 0, 1 on host 1; 2, 3 on host 2
        assert names == f"{hosts.names[0]},{hosts.names[0]},{hosts.names[1]},{hosts.names[1]}", (
            line
        )  # as MPI sees
        # rank 0 (host 1) serves PMI on the veth, not loopback: host 2's ranks reached it
        assert re.fullmatch(rf"{re.escape(hosts.addr[0])}:\d+", pmi), line
    crossed = hosts.rx_bytes(0) - before
    assert crossed > BIG * 4, f"the 8 MiB all_reduce did not cross the veth: {crossed} bytes did"


def test_a_rank_raising_on_host_2_ends_both_torchruns(hosts: Cluster, tmp_path: Path):
    rc1, out1, rc2, out2, both = run_worker(
        hosts, tmp_path, "raises", {"FAIL_RANK": "2"}, timeout=60, after="rank 2 raises", grace=20
    )
    assert rc1 != 0 and rc2 != 0, both
    assert "RuntimeError: planted failure on rank 2" in out2, both
    # host 1's torchrun never heard of host 2's failure: its ranks ended on the PMI watch
    assert "cudampi: rank 2 called MPI_Abort (exit code 1); ending rank" in out1, both


def test_ranks_in_mpi_finalize_end_when_a_rank_dies_at_exit(hosts: Cluster, tmp_path: Path):
    """Host 1's ranks finish and enter MPI_Finalize (mpi4py calls it at interpreter exit, when no
    Python thread runs, so their PMI watchers cannot act); rank 2 on host 2 is then killed, and
    host 1's torchrun never hears of it. Host 1's ranks waited in the PMI barrier for ever
    (seen on CI, where a crash at exit did the killing); the PMI server now fails their
    PMI barrier, so MPI_Finalize fails and MPI ends them."""
    rc1, out1, rc2, _, both = run_worker(
        hosts, tmp_path, "dies", {"DIE_AT_END": "2"}, timeout=90, after="rank 2 ok", grace=30
    )
    assert rc1 != 0 and rc2 != 0, both
    assert "rank 2 closed its PMI connection without MPI_Finalize" in out1, both
    assert "PMI_Barrier returned -1" in out1, both  # MPICH's error stack, from both ranks


def test_a_job_across_hosts_without_a_pmi_secret_is_refused_on_every_rank(
    hosts: Cluster, tmp_path: Path
):
    """Across hosts the PMI server listens on the network, so the job must
    share a secret (torch's store is readable by anyone who reaches it): every rank refuses, and
    each host's output names the fix (torchrun ends a host's other ranks as soon as one fails,
    so a rank that raises a moment later may be ended before it prints)."""
    rc1, out1, rc2, out2, both = run_worker(
        hosts, tmp_path, "worker", {"CUDAMPI_PMI_SECRET": None}, timeout=60
    )
    assert rc1 != 0 and rc2 != 0, both
    assert "export CUDAMPI_PMI_SECRET=" in out1 and "export CUDAMPI_PMI_SECRET=" in out2, both
