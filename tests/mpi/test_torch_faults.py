"""The cudampi torch backend when something goes wrong on one rank only: a check that fails on
one rank, a rank that skips a collective, a Work waited with a
timeout, a rank that exits (with 0 or not) while the others still call collectives, settings
that differ between ranks. Every rank must raise within its deadline, and the job must end.
Under mpiexec (Open MPI) and under torchrun (MPICH through cudampi's PMI server)."""

from __future__ import annotations

import sys
import textwrap
import time

import pytest

from tests.mpirun import mpi_env, mpiexec_argv, only_when_asked, run_launched, run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")


def _init(timeout: float = 60.0):
    from datetime import timedelta

    import torch.distributed as dist

    import cudampi.torch  # noqa: F401

    dist.init_process_group("cudampi", timeout=timedelta(seconds=timeout))
    return dist


def _raises_everywhere(dist, fn, *words):
    """``fn`` raises on every rank (no rank is left waiting), then the group is still in step."""
    import torch

    try:
        fn()
    except Exception as exc:
        for w in words:
            assert w in str(exc), f"rank {dist.get_rank()}: {w!r} not in {exc}"
    else:
        raise AssertionError(f"rank {dist.get_rank()}: no error from {fn}")
    t = torch.ones(2)
    dist.all_reduce(t)
    assert t.tolist() == [float(dist.get_world_size())] * 2, "ranks out of step after the error"


def rank_size_checks(comm):
    """Each of the torch layer's own checks failing on the last rank only."""
    import torch

    dist = _init()
    r, n = dist.get_rank(), dist.get_world_size()
    odd = r == n - 1
    x = torch.ones(4)
    out = torch.empty(n * 4 + (1 if odd else 0))
    _raises_everywhere(dist, lambda: dist.all_gather_into_tensor(out, x), "all_gather")
    outs = [torch.empty(4) for _ in range(n + (1 if odd else 0))]
    _raises_everywhere(dist, lambda: dist.all_gather(outs, x), "all_gather")
    big = torch.ones(n * 4 + (2 if odd else 0))
    _raises_everywhere(
        dist, lambda: dist.reduce_scatter_tensor(torch.empty(4), big), "reduce_scatter"
    )
    splits = [1] * n if not odd else [n] + [0] * (n - 1)
    src = torch.ones(n if not odd else n + 1)
    _raises_everywhere(
        dist,
        lambda: dist.all_to_all_single(torch.empty(n), src, [1] * n, splits),
        "all_to_all",
    )
    root = n - 1
    scatter_list = [torch.ones(4) for _ in range(n - 1)] if r == root else None
    _raises_everywhere(
        dist, lambda: dist.scatter(torch.empty(4), scatter_list, src=root), "scatter"
    )
    gather_list = [torch.empty(4) for _ in range(n + 1)] if r == root else None
    _raises_everywhere(dist, lambda: dist.gather(x, gather_list, dst=root), "gather")
    dist.destroy_process_group()
    if r == 0:
        print(f"every check raised on all {n} ranks", flush=True)


@pytest.mark.parametrize("n", [2, pytest.param(3, marks=only_when_asked())])
def test_a_check_that_fails_on_one_rank_raises_on_every_rank(n, request):
    if n == 2:
        out = request.getfixturevalue("two_rank_runs")
    else:
        out = run_mpi(n, __file__, "rank_size_checks", timeout=120).stdout
    assert f"every check raised on all {n} ranks" in out, out[-3000:]


def rank_anysource_on_ipc(comm):
    """A recv from any source where the Communicator puts the message on the ipc path raises at
    once, naming the fix: ipc sends are kernels that MPI's probe never sees, so waiting would
    only end at the deadline. (The choice is forced here: CPU tensors never take ipc.)"""
    import torch

    from cudampi.comm.paths import PathChoice

    dist = _init(timeout=60)
    pg = dist.distributed_c10d._get_default_group()
    pg.communicator.path_for = lambda op, x, nbytes=None, path=None: PathChoice(
        "ipc", "forced", "ipc", stream_ordered=True
    )
    if comm.rank == 0:
        t0 = time.monotonic()
        try:
            dist.recv(torch.empty(1))
        except Exception as exc:
            assert "name the source" in str(exc), exc
            assert time.monotonic() - t0 < 5, "waited for a message no probe can see"
            print("any source refused at once", flush=True)
        else:
            raise AssertionError("recv from any source on the ipc path returned")
    dist.barrier()
    dist.destroy_process_group()


def test_a_recv_from_any_source_on_the_ipc_path_raises_at_once(two_rank_runs):
    assert "any source refused at once" in two_rank_runs, two_rank_runs[-3000:]


def rank_settings_differ_under_torch(comm):
    """Settings that differ between ranks, through torch: init_process_group raises on every
    rank."""
    import os

    from cudampi.errors import MismatchError

    os.environ["CUDAMPI_CHUNK_BYTES"] = "64K" if comm.rank == 0 else "4M"
    try:
        _init()
    except MismatchError as exc:
        assert "chunk_bytes" in str(exc) and "CUDAMPI_CHUNK_BYTES" in str(exc), exc
        comm.Barrier()
        if comm.rank == 0:
            print("refused on every rank", flush=True)
    else:
        raise AssertionError("CUDAMPI_CHUNK_BYTES differs between ranks and nothing said so")


def test_settings_that_differ_refuse_the_group_on_every_rank(two_rank_runs):
    assert "refused on every rank" in two_rank_runs, two_rank_runs[-3000:]


def rank_two_rank_runs(comm):
    """The 2-rank runs above one after another in one job (each makes its process group and
    destroys it; the settings that differ last: they leave no group)."""
    rank_size_checks(comm)
    rank_anysource_on_ipc(comm)
    rank_settings_differ_under_torch(comm)


@pytest.fixture(scope="module")
def two_rank_runs():
    """:func:`rank_two_rank_runs` as one 2-rank job (the three tests that read it run on one
    xdist worker: tests/conftest.py's TOGETHER); what rank 0 printed."""
    return run_mpi(2, __file__, "rank_two_rank_runs", timeout=240).stdout


# A script, not a tests/_rank_main.py function: a rank must skip, wait and leave as a program
# does (sys.exit runs atexit handlers and MPI_Finalize; that harness turns it into an abort).
FAULTS = """
import os, sys, time
from datetime import timedelta
import torch, torch.distributed as dist
import cudampi.torch

fault = sys.argv[1]
dist.init_process_group("cudampi", timeout=timedelta(seconds=4),
                        pg_options=cudampi.torch.Options(async_ops=fault == "wait"))
rank = dist.get_rank()
t = torch.ones(4)
t0 = time.monotonic()
for i in range(50):
    if rank == 1 and i == 3:
        if fault == "exit0":
            sys.exit(0)
        if fault == "exit3":
            sys.exit(3)
        if fault in ("skip", "wait"):
            time.sleep(20)
            sys.exit(0)
    if fault == "wait":
        work = dist.all_reduce(t, async_op=True)
        try:
            work.wait(timeout=timedelta(seconds=1))
        except dist.DistBackendError as exc:
            print(f"rank {rank} wait raised after {time.monotonic() - t0:.1f} s: {exc}",
                  flush=True)
            raise
    else:
        dist.all_reduce(t)
    t0 = time.monotonic()
"""


def run_faults(tmp_path, fault: str, launcher: str):
    script = tmp_path / "faults.py"
    script.write_text(textwrap.dedent(FAULTS))
    if launcher == "mpiexec":
        argv = [*mpiexec_argv(2), sys.executable, str(script), fault]
        env = mpi_env()
    else:
        from tests.mpi.test_torch_torchrun import torchrun_env

        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", "2", str(script), fault]
        env = torchrun_env("mpich")
    t0 = time.monotonic()
    proc = run_launched(argv, env, 150, f"{fault} under {launcher}")
    return proc, time.monotonic() - t0


SKIP = "allreduce (call #4 on this communicator): rank 1 did not arrive within 4 s"
LEFT = "allreduce (call #4 on this communicator): rank 1 left the job"
WAIT = "did not complete within Work.wait(timeout=1 s)"
LONG = only_when_asked()  # the same mechanisms as the cells CI runs, under the other launcher


@pytest.mark.parametrize(
    ("fault", "words", "launcher"),
    [
        ("skip", SKIP, "mpiexec"),
        pytest.param("skip", SKIP, "torchrun", marks=LONG),
        pytest.param("exit0", LEFT, "mpiexec", marks=LONG),
        ("exit0", LEFT, "torchrun"),
        ("exit3", LEFT, "mpiexec"),
        pytest.param("exit3", LEFT, "torchrun", marks=LONG),
        ("wait", WAIT, "mpiexec"),
        pytest.param("wait", WAIT, "torchrun", marks=LONG),
    ],
)
def test_a_fault_on_one_rank_raises_on_the_others_and_ends_the_job(
    tmp_path, fault, words, launcher
):
    """The timeout given to init_process_group reaches the backend,
    Work.wait(timeout=) is honoured, and a rank that exits (with 0 in the middle of the loop,
    or with 3) makes the other raise DistBackendError; the job ends non-zero, soon."""
    proc, took = run_faults(tmp_path, fault, launcher)
    err = proc.stderr + proc.stdout
    assert proc.returncode != 0, err[-4000:]
    assert words in err and "DistTimeoutError" in err, err[-4000:]
    assert took < 60, f"{took:.0f} s"
