"""Logs, profiler ranges and the timeline on real ranks: CUDAMPI_LOG=info|debug through the
Communicator's dispatch (every engine), torch.profiler showing each collective of the torch
backend, and `cudampi trace` writing one Chrome-trace timeline of a 2-rank job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.mpirun import ROOT, mpi_env, run_mpi

pytestmark = pytest.mark.mpi
CLI = (sys.executable, "-m", "cudampi")


def rank_calls(comm):
    import numpy as np

    from cudampi.comm import Communicator

    with Communicator(comm) as c:
        for _ in range(3):
            c.allreduce(np.ones(8, dtype=np.float32))
        c.allreduce(np.ones(1024, dtype=np.float32))
        c.broadcast(np.zeros(4, dtype=np.int64), root=0)
        c.barrier()


def test_info_logs_each_new_call_once_on_rank_0():
    p = run_mpi(2, __file__, "rank_calls", env={"CUDAMPI_LOG": "info"})
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("[cudampi ")]
    assert all(" rank 0/2] INFO " in ln for ln in lines), lines
    text = "\n".join(lines)
    assert text.count("allreduce 32 B float32: path ") == 1  # three calls, one line
    assert text.count("allreduce 4 KiB float32: path ") == 1
    assert "broadcast 32 B int64: path " in text and "barrier 0 B none: path mpi" in text
    assert "host memory" in text  # the why


def test_debug_logs_every_call_on_every_rank():
    p = run_mpi(2, __file__, "rank_calls", env={"CUDAMPI_LOG": "debug", "CUDAMPI_LOG_RANKS": "all"})
    for rank in (0, 1):
        mine = [ln for ln in p.stderr.splitlines() if f" rank {rank}/2] DEBUG allreduce" in ln]
        assert len(mine) == 4 and all(ln.endswith(" us") for ln in mine), p.stderr


def rank_torch_profiler(comm):
    import torch
    import torch.distributed as dist

    import cudampi.torch  # noqa: F401  (registers the backend)

    dist.init_process_group("cudampi")
    t = torch.ones(16)
    with torch.profiler.profile() as prof:
        dist.all_reduce(t)
        dist.broadcast(t, src=0)
    names = {e.name for e in prof.events()}
    assert any(n.startswith("cudampi.allreduce 64 B float32") for n in names), names
    assert any(n.startswith("cudampi.broadcast 64 B float32") for n in names), names
    dist.destroy_process_group()


@pytest.mark.torch
def test_torch_profiler_shows_each_collective_of_the_backend():
    pytest.importorskip("torch")
    run_mpi(2, __file__, "rank_torch_profiler")


SCRIPT = """
import numpy as np
from mpi4py import MPI
from cudampi.comm import Communicator
with Communicator(MPI.COMM_WORLD) as c:
    for n in (8, 8, 4096):
        c.allreduce(np.ones(n, dtype=np.float32))
    c.allgather(np.ones(4, dtype=np.float64))
print("done", MPI.COMM_WORLD.rank, flush=True)
"""


def test_cudampi_trace_writes_one_timeline_of_every_rank(tmp_path: Path):
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    timeline = tmp_path / "timeline.json"
    p = subprocess.run(
        [*CLI, "trace", "--timeline", str(timeline), "-n", "2", str(script)],
        capture_output=True,
        text=True,
        timeout=180,
        env=mpi_env(),
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "calls from 2 rank(s)" in p.stderr
    doc = json.loads(timeline.read_text())
    calls = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert {e["pid"] for e in calls} == {0, 1}
    per_rank = [e["name"] for e in calls if e["pid"] == 1]
    assert per_rank.count("cudampi.allreduce 32 B float32 host") == 2, per_rank
    assert "cudampi.allgather 32 B float64 host" in per_rank
    assert all(e["dur"] >= 0 and e["args"]["why"] for e in calls)
    merged = subprocess.run(
        [*CLI, "trace", "--merge", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=60,
        env=mpi_env(),
        cwd=tmp_path,
    )
    assert merged.returncode == 1 and "0 calls from 0 rank(s)" in merged.stdout
