"""Deadlines: a Communicator call never waits for ever. A rank that
skips a collective, never sends, or leaves the job makes the ranks that wait raise a
CommTimeoutError naming the call, its number and the rank, within the deadline (CUDAMPI_TIMEOUT)
or, for a rank that left, within seconds; the job then ends (non-zero) instead of hanging."""

from __future__ import annotations

import os
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.mpirun import mpi_env, mpiexec_argv, only_when_asked, run_launched, run_mpi

pytestmark = pytest.mark.mpi

TIMEOUT = "3"


# A script, not a tests/_rank_main.py function: its rank 1 must leave as a program does
# (sys.exit, atexit handlers, MPI_Finalize), which that harness turns into an abort.
SKIPS = """
import sys, time
import numpy as np
from mpi4py import MPI
from cudampi.comm import Communicator
from cudampi.errors import CommTimeoutError

comm, how = MPI.COMM_WORLD, sys.argv[1]
c = Communicator(comm)
x = np.ones(4)
for i in range(1, 5):
    if comm.rank == 1 and i == 3:  # rank 1 skips allreduce #3
        if how == "exit":
            sys.exit(0)  # leaves in the middle of the loop, its communicator open
        time.sleep(20)
        sys.exit(0)
    t0 = time.monotonic()
    try:
        c.allreduce(x, out=x)
    except CommTimeoutError as exc:
        print(f"rank {comm.rank} raised after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
        try:
            c.barrier()
        except CommTimeoutError as again:
            print(f"then at once: {again}", flush=True)
        sys.exit(0)
"""


@pytest.mark.parametrize("how", ["sleep", "exit"])
def test_a_rank_that_skips_a_collective_makes_the_others_raise(tmp_path, how):
    script = tmp_path / "skips.py"
    script.write_text(textwrap.dedent(SKIPS))
    t0 = time.monotonic()
    argv = [*mpiexec_argv(2), sys.executable, str(script), how]
    proc = run_launched(argv, mpi_env({"CUDAMPI_TIMEOUT": TIMEOUT}), 120, how)
    out = proc.stdout
    assert "rank 0 raised after" in out, out + proc.stderr[-3000:]
    line = next(ln for ln in out.splitlines() if ln.startswith("rank 0 raised after"))
    took = float(line.split()[4])
    assert "allreduce (call #3 on this communicator)" in line
    if how == "sleep":
        assert "rank 1 did not arrive within 3 s" in line and 3 <= took < 10, line
    else:
        assert "rank 1 left the job" in line and took < 8, line
    assert "then at once: barrier: this Communicator failed earlier" in out
    # the failed communicator ends the job at exit (MPI_Finalize could wait for the pending call)
    assert proc.returncode != 0
    assert time.monotonic() - t0 < 60


def rank_recv_without_sender(comm, call):
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.errors import CommTimeoutError

    with Communicator(comm) as c:
        buf = np.zeros(8)
        if comm.rank == 0:
            t0 = time.monotonic()
            try:
                if call == "recv":
                    c.recv(buf, source=1, tag=5)
                elif call == "irecv":
                    c.irecv(buf, source=1, tag=5).wait()
                else:
                    c.send(np.ones(1 << 20), dest=1, tag=5)  # rendezvous: needs a receiver
            except CommTimeoutError as exc:
                print(f"{call} raised after {time.monotonic() - t0:.1f} s: {exc}", flush=True)
        comm.Barrier()


@pytest.mark.parametrize(
    "call",
    [
        "irecv",
        pytest.param("recv", marks=only_when_asked()),
        pytest.param("send", marks=only_when_asked()),
    ],
)
def test_point_to_point_waits_have_the_deadline(call):
    proc = run_mpi(
        2,
        __file__,
        "rank_recv_without_sender",
        call,
        env={"CUDAMPI_TIMEOUT": TIMEOUT},
        timeout=120,
        check=False,
    )
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(call)), "")
    assert "rank 1 (tag 5)" in line and "within 3 s" in line, proc.stdout + proc.stderr[-2000:]
    assert 3 <= float(line.split()[3]) < 10, line


def rank_three_wait_for_one(comm):
    """Ranks 0 and 1 wait in a barrier that rank 2 never reaches: both name rank 2 alone."""
    from cudampi.comm import Communicator
    from cudampi.errors import CommTimeoutError

    c = Communicator(comm)
    if comm.rank == 2:
        time.sleep(25)
        return
    try:
        c.barrier()
    except CommTimeoutError as exc:
        print(f"rank {comm.rank}: {exc}", flush=True)
    # The failed communicator aborts the job at exit: stay until the other waiting rank has
    # reached its own deadline (on a loaded machine it may enter the barrier seconds later),
    # told by a file each (the communicator cannot carry it).
    meet = Path(os.environ["MEET_DIR"])
    (meet / str(comm.rank)).touch()
    t0 = time.monotonic()
    while not (meet / str(1 - comm.rank)).exists() and time.monotonic() - t0 < 15:
        time.sleep(0.05)


def test_the_ranks_that_wait_name_the_one_that_did_not_come(tmp_path):
    proc = run_mpi(
        3,
        __file__,
        "rank_three_wait_for_one",
        env={"CUDAMPI_TIMEOUT": TIMEOUT, "MEET_DIR": str(tmp_path)},
        timeout=120,
        check=False,
    )
    for r, other in ((0, 1), (1, 0)):
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith(f"rank {r}:")), "")
        assert line, proc.stdout + proc.stderr[-3000:]
        assert "barrier (call #1 on this communicator): rank 2 did not arrive" in line, line
        assert f"rank {other} waits here too" in line, line


def rank_leave_with_a_communicator_open(comm):
    """Every rank leaves with a Communicator open (no close(), as most scripts end): each tells
    its peers goodbye at exit and takes in theirs, so none is left unreceived at MPI_Finalize
    (under Open MPI's pml ucx each one made UCX warn "unexpected tag-receive descriptor ... was
    not matched" on every rank)."""
    import atexit

    from mpi4py import MPI

    from cudampi.comm import Communicator
    from cudampi.comm.deadline import GOODBYE_TAG

    watched = []

    def after_cudampi():  # registered first, so it runs after cudampi's exit hook
        time.sleep(0.5)  # every peer's goodbye has arrived by now, taken in or not
        left = watched[0]._watch.comm.Iprobe(MPI.ANY_SOURCE, GOODBYE_TAG)
        print(f"rank {comm.rank}: a peer's goodbye left unreceived: {left}", flush=True)

    atexit.register(after_cudampi)
    c = Communicator(comm)
    watched.append(c)  # alive at exit, as a script's module-level communicator is
    c.barrier()


def test_ranks_leaving_with_a_communicator_open_take_in_each_others_goodbyes():
    proc = run_mpi(3, __file__, "rank_leave_with_a_communicator_open", timeout=120)
    said = sorted(ln for ln in proc.stdout.splitlines() if "goodbye left unreceived" in ln)
    assert said == [f"rank {r}: a peer's goodbye left unreceived: False" for r in range(3)], (
        proc.stdout + proc.stderr[-2000:]
    )
