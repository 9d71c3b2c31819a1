"""A Communicator's making, closing and the process's exit end in an error on every rank or a
finished job, never in a wait for ever: a rank that refuses to make its communicator makes the
others raise before any collective; a rank that closes tells the others, who raise within
seconds; a process that gave up waiting for a collective (a handle's or torch Work's
``wait(timeout=)``), or exits with one never waited for, ends the MPI job at exit instead of
sitting in MPI_Finalize for the peer that never comes."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from tests.mpirun import mpi_env, mpiexec_argv, run_launched

pytestmark = pytest.mark.mpi

# Scripts, not tests/_rank_main.py functions: their ranks must leave as programs do (sys.exit,
# atexit handlers, MPI_Finalize), which that harness turns into an abort.
HALF_MADE = """
import sys, time
from mpi4py import MPI
from cudampi.comm import Communicator

comm, how = MPI.COMM_WORLD, sys.argv[1]
t0 = time.monotonic()
if comm.rank == 1 and how == "skips":
    time.sleep(30)  # never makes its communicator
    sys.exit(0)
try:
    c = Communicator(comm, path="nope" if comm.rank == 1 else None)
    print(f"rank {comm.rank} made its Communicator", flush=True)
except Exception as exc:
    took = time.monotonic() - t0
    print(f"rank {comm.rank} raised after {took:.1f} s: {type(exc).__name__}: {exc}", flush=True)
"""


def _run(script: str, tmp_path, *argv: str, env: dict[str, str] | None = None, n: int = 2):
    path = tmp_path / "job.py"
    path.write_text(textwrap.dedent(script))
    t0 = time.monotonic()
    cmd = [*mpiexec_argv(n), sys.executable, str(path), *argv]
    proc = run_launched(cmd, mpi_env(env), 90, f"{argv}")
    return proc, time.monotonic() - t0


def _line(out: str, start: str) -> str:
    return next((ln for ln in out.splitlines() if ln.startswith(start)), "")


def test_a_rank_that_refuses_its_communicator_makes_every_rank_raise(tmp_path):
    proc, _ = _run(HALF_MADE, tmp_path, "refuses", env={"CUDAMPI_TIMEOUT": "60"})
    out = proc.stdout + proc.stderr[-3000:]
    mine = _line(proc.stdout, "rank 1 raised")
    other = _line(proc.stdout, "rank 0 raised")
    assert "ConfigError: path='nope' is not a path" in mine, out
    assert "CommError: making a Communicator: rank 1 refused its arguments" in other, out
    assert "path='nope'" in other and float(other.split()[4]) < 20, other
    assert proc.returncode == 0, out  # nothing is left pending: the job ends as usual


def test_a_rank_that_never_makes_its_communicator_ends_the_job_at_the_deadline(tmp_path):
    proc, took = _run(HALF_MADE, tmp_path, "skips", env={"CUDAMPI_TIMEOUT": "3"})
    out = proc.stdout + proc.stderr[-3000:]
    line = _line(proc.stdout, "rank 0 raised")
    # CUDAMPI_TIMEOUT=3, but making a communicator waits START (10 s) at least: ranks start
    # at different times
    assert "CommTimeoutError: making a Communicator: not every rank of the 2 came within 10 s" in (
        line
    ), out
    assert 10 <= float(line.split()[4]) < 20, line
    # the exchange stays pending in MPI: rank 0 ends the job instead of finalizing
    assert proc.returncode != 0 and took < 30, (took, out)


GIVES_UP = """
import sys, time
from datetime import timedelta
import numpy as np
from mpi4py import MPI

comm, how = MPI.COMM_WORLD, sys.argv[1]
if how == "torch":
    import torch, torch.distributed as dist
    import cudampi.torch
    dist.init_process_group("cudampi", pg_options=cudampi.torch.Options(async_ops=True))
else:
    from cudampi.comm import Communicator
    c = Communicator(comm)
if comm.rank == 1:
    time.sleep(60)  # stuck: never makes the call
    sys.exit(0)
t0 = time.monotonic()
if how == "torch":
    work = dist.all_reduce(torch.ones(4), async_op=True)
    wait = lambda: work.wait(timeout=timedelta(seconds=1))
else:
    h = c.allreduce(np.ones(4), async_op=True)
    wait = lambda: h.wait(timeout=1.0)
if how != "never-waited":
    try:
        wait()
    except Exception as exc:
        took = time.monotonic() - t0
        print(f"rank 0 gave up after {took:.1f} s: {type(exc).__name__}: {exc}", flush=True)
        try:
            dist.all_reduce(torch.ones(4)) if how == "torch" else c.barrier()
        except Exception as again:
            print(f"then at once: {again}", flush=True)
print("rank 0 exits", flush=True)
"""


@pytest.mark.parametrize("how", ["handle", "torch", "never-waited"])
def test_a_process_that_gave_up_on_a_collective_ends_the_job_at_exit(tmp_path, how):
    if how == "torch":
        pytest.importorskip("torch")
    proc, took = _run(GIVES_UP, tmp_path, how, env={"CUDAMPI_TIMEOUT": "4"})
    out = proc.stdout + proc.stderr[-3000:]
    assert "rank 0 exits" in proc.stdout, out
    if how != "never-waited":
        line = _line(proc.stdout, "rank 0 gave up")
        assert "within Work.wait(timeout=1 s)" in line or "within 1 s" in line, out
        assert "cannot be used again" in line, line
        assert "then at once:" in proc.stdout and "failed earlier" in proc.stdout, out
    # the call stays pending in MPI: the job ends (non-zero) instead of waiting for rank 1
    assert proc.returncode != 0, out
    assert "aborting the MPI job at exit" in proc.stderr, out
    assert took < 40, (took, out)


CLOSES = """
import sys, time
import numpy as np
from mpi4py import MPI
from cudampi.comm import Communicator

comm = MPI.COMM_WORLD
c = Communicator(comm)
c.barrier()
if comm.rank == 1:
    c.close()
    print("rank 1 closed", flush=True)
    if sys.argv[1] == "stays":
        time.sleep(20)  # alive: the goodbye came from close(), not from the exit
    sys.exit(0)
t0 = time.monotonic()
try:
    c.allreduce(np.ones(4))
except Exception as exc:
    print(f"rank 0 raised after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
"""


@pytest.mark.parametrize("then", ["exits", "stays"])
def test_a_rank_that_closes_tells_the_others(tmp_path, then):
    proc, _ = _run(CLOSES, tmp_path, then, env={"CUDAMPI_TIMEOUT": "15"})
    out = proc.stdout + proc.stderr[-3000:]
    line = _line(proc.stdout, "rank 0 raised")
    assert "allreduce (call #2 on this communicator): rank 1 left the job" in line, out
    assert "or closed this communicator" in line and float(line.split()[4]) < 10, line


STUCK_ABORT = """
import time
from mpi4py import MPI
import cudampi.abort
from cudampi.abort import abort_job

cudampi.abort.ABORT_GRACE = 2.0

class StuckAbort:  # an MPI_Abort that never returns nor ends the process
    def Abort(self, code):
        time.sleep(600)

print("aborting", flush=True)
abort_job(7, "cudampi: planted abort\\n", StuckAbort())
"""


def test_a_rank_whose_mpi_abort_never_returns_still_ends(tmp_path):
    """Open MPI's MPI_Abort waits for the launcher's answer; where none comes the rank ends
    itself after the grace, with the abort's code, so the job ends rather than waits."""
    proc, took = _run(STUCK_ABORT, tmp_path, n=1)
    assert "aborting" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "cudampi: planted abort" in proc.stderr.splitlines(), proc.stderr[-2000:]
    assert proc.returncode != 0 and took < 30, (proc.returncode, took)
