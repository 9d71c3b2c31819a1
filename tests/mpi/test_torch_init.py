"""Starting the cudampi backend: every init method, wrong ranks, torchrun singletons, fail-fast.

- under mpiexec: ``init_method="cudampi://"``, the plain default (env:// with no variables),
  env:// with torchrun-style variables, ``pg_options=Options(path=...)``, a cudampi subgroup
  under a gloo default group, and RANK values that contradict MPI (a clear ConfigError on every
  rank, no hang);
- a process started without an MPI launcher (as torchrun starts them) asking for 2 ranks: the
  singleton error that names the fix;
- a rank that raises makes every rank exit at once with a message naming the rank.
- a script whose last line is a gloo collective (beside a cudampi world, or with a gloo world)
  exits cleanly.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tests.mpirun import ROOT, mpi_env, mpiexec_argv, run_launched, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

_TORCH_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def _sum_check(dist, torch, n):
    x = torch.ones(3)
    dist.all_reduce(x)
    assert x.tolist() == [float(n)] * 3


def rank_init_methods(comm):

    import torch
    import torch.distributed as dist

    import cudampi.torch
    from cudampi.errors import ConfigError

    n = comm.size
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    for var in _TORCH_VARS:
        os.environ.pop(var, None)

    # 1. The explicit MPI rendezvous.
    dist.init_process_group("cudampi", init_method=cudampi.torch.INIT_METHOD)
    assert (dist.get_rank(), dist.get_world_size()) == (comm.rank, n)
    _sum_check(dist, torch, n)
    dist.destroy_process_group()

    # 2. torchrun-style variables present: stock env:// runs; the backend checks them vs MPI.
    from cudampi.net import free_port

    port = comm.bcast(free_port("127.0.0.1") if comm.rank == 0 else 0, root=0)
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(comm.rank), WORLD_SIZE=str(n)
    )
    dist.init_process_group("cudampi")
    _sum_check(dist, torch, n)
    dist.destroy_process_group()
    for var in _TORCH_VARS:
        os.environ.pop(var, None)

    # 3. pg_options: the Communicator gets the path.
    dist.init_process_group("cudampi", pg_options=cudampi.torch.Options(path="host"))
    pg = dist.distributed_c10d._get_default_group()
    assert isinstance(pg, cudampi.torch.CudampiProcessGroup), type(pg)
    assert pg.communicator.path_for("allreduce", torch.ones(4)) == "host"
    _sum_check(dist, torch, n)
    sub = dist.new_group(list(range(n)))
    assert sub.communicator.path_for("allreduce", torch.ones(4)) == "host"  # inherited
    dist.destroy_process_group()

    # 4. Another default backend (gloo, through the cudampi:// rendezvous) plus a cudampi group.
    dist.init_process_group("gloo", init_method=cudampi.torch.INIT_METHOD)
    sub = dist.new_group(backend="cudampi")
    assert isinstance(sub, cudampi.torch.CudampiProcessGroup), type(sub)
    x = torch.full((2,), float(comm.rank))
    dist.all_reduce(x, group=sub)
    assert x.tolist() == [float(sum(range(n)))] * 2
    dist.destroy_process_group()

    # 5. RANK contradicting MPI (ranks reversed): every rank raises, none waits.
    os.environ["RANK"] = str(n - 1 - comm.rank)
    with pytest.raises(ConfigError, match="MPI says"):
        dist.init_process_group("cudampi")
    os.environ.pop("RANK")
    comm.Barrier()
    if comm.rank == 0:
        print("init methods ok", flush=True)


def test_init_methods_under_mpiexec():
    proc = run_mpi(2, __file__, "rank_init_methods", timeout=240)
    assert "init methods ok" in proc.stdout


_SINGLETON = """
import os
import torch.distributed as dist
import cudampi.torch
from cudampi.errors import ConfigError

os.environ.update(RANK="0", WORLD_SIZE="2")
for name, kwargs in (
    ("rendezvous", dict(init_method="cudampi://")),
    ("creator", dict(store=dist.HashStore(), rank=0, world_size=2)),
):
    try:
        dist.init_process_group("cudampi", **kwargs)
    except ConfigError as exc:
        print(name, "->", exc, flush=True)
"""


def test_torchrun_singletons_get_the_fix_not_a_hang():
    env = mpi_env()
    for var in ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK"):
        env.pop(var, None)
    proc = subprocess.run(
        [sys.executable, "-c", _SINGLETON],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        cwd=ROOT,
    )
    out = proc.stdout
    assert proc.returncode == 0, proc.stderr[-3000:]
    for name in ("rendezvous", "creator"):
        line = next((ln for ln in out.splitlines() if ln.startswith(name)), "")
        assert "MPI singleton" in line and "cudampi launch -n 2" in line, out


_RAISES = """
import time
import torch, torch.distributed as dist
import cudampi.torch

dist.init_process_group("cudampi")
if dist.get_rank() == dist.get_world_size() - 1:
    raise ValueError("planted failure")
t = torch.ones(3)
dist.all_reduce(t)  # the other ranks wait here for the rank that raised
time.sleep(300)
"""


def test_a_raising_rank_fails_every_rank_fast(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(_RAISES))
    t0 = time.monotonic()
    proc = run_launched([*mpiexec_argv(2), sys.executable, str(script)], mpi_env(), 150, "script")
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "ValueError: planted failure" in proc.stderr, proc.stderr[-3000:]
    assert "cudampi: rank 1 of 2" in proc.stderr and "aborting the MPI job" in proc.stderr
    assert elapsed < 120, f"took {elapsed:.0f} s"


_GLOO_LAST = """
import sys

import torch
import torch.distributed as dist

import cudampi.torch  # noqa: F401

dist.init_process_group(sys.argv[1])  # under mpiexec, env:// without variables: MPI's ranks
groups = [dist.new_group(backend="gloo") for _ in range(2)]
x = torch.ones(16)
for _ in range(50):
    for g in groups:
        dist.all_reduce(x, group=g)
print(f"rank {dist.get_rank()} done", flush=True)
"""


@pytest.mark.parametrize("world", ["cudampi", "gloo"])
def test_a_script_ending_right_after_gloo_collectives_exits_cleanly(tmp_path, world):
    """The script's last line is a collective on a gloo group (beside a cudampi world, or with
    torch's own gloo world): gloo's worker threads must not be left waiting for the GIL when
    Python finalizes (that aborted the process after the last line, SIGABRT, in 5 of 10 runs
    here: pytorch/pytorch#190489). Four runs per world, eight in all: before the fix all four
    of one world passed about once in 16, all eight about once in 256 (a launch is ~7 s of the
    suite's time, so not more)."""
    script = tmp_path / "gloo_last.py"
    script.write_text(_GLOO_LAST)
    for run in range(4):
        argv = [*mpiexec_argv(2), sys.executable, str(script), world]
        proc = run_launched(argv, mpi_env(), 120, "script")
        assert proc.returncode == 0, f"run {run}: exit {proc.returncode}\n{proc.stderr[-3000:]}"
        assert proc.stdout.count("done") == 2, proc.stdout


AGAIN = """
import os, sys, time
import torch
import torch.distributed as dist
import cudampi.torch

os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
rounds = int(sys.argv[1])
for i in range(rounds):
    backend = "gloo" if i % 2 else "cudampi"
    dist.init_process_group(backend)
    t = torch.ones(4)
    dist.all_reduce(t)
    assert t.tolist() == [2.0] * 4, (i, t)
    if dist.get_rank() == 0:
        time.sleep(0.5)  # rank 1 comes back to init_process_group first
    dist.destroy_process_group()
print(f"{rounds} rounds ok", flush=True)
"""


def test_destroy_then_init_again_under_cudampi_launch(tmp_path):
    """Each init under ``cudampi launch`` starts env://'s TCPStore on the same MASTER_PORT: a
    rank that came back first reached rank 0's previous store, closed under it when rank 0
    destroyed its group (DistNetworkError, or a wait for ever, before)."""
    script = tmp_path / "again.py"
    script.write_text(textwrap.dedent(AGAIN))
    argv = [sys.executable, "-m", "cudampi", "launch", "-n", "2", str(script), "6"]
    proc = run_launched(argv, mpi_env(), 120, "6 rounds of init and destroy")
    assert proc.returncode == 0 and "6 rounds ok" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-4000:]
    )
