"""The nccl engine's MPI bootstrap on real ranks, without a GPU: whatever stops NCCL on any rank
(no NCCL, no GPU, two ranks on one GPU, a failing ncclCommInitRank) raises the same DeviceError
on every rank, none is left waiting, and the Communicator goes on working. The engine's data
paths run on the GPU machine (tests/gpu/test_nccl_gpu.py)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.mpirun import run_mpi

pytestmark = [pytest.mark.mpi]


def rank_nccl_refused(comm, case):
    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.comm.engines import nccl as mod
    from cudampi.errors import DeviceError

    last = comm.rank == comm.size - 1
    own = mod.RankGpu("node", f"0000:{comm.rank + 1:02x}:00.0")
    if case == "no-nccl-on-last":
        mod.available = lambda: "no libnccl on this one" if last else None
        mod.local_gpu = lambda device: own
        want = f"NCCL is not importable on rank {comm.size - 1}: no libnccl on this one"
    elif case == "shared-gpu":
        mod.available = lambda: None
        mod.local_gpu = lambda device: mod.RankGpu("node", "0000:01:00.0") if comm.rank < 2 else own
        want = "ranks 0, 1 share the GPU at PCI 0000:01:00.0 on node"
    elif case == "init-fails":  # CuPy's NCCL is there, the GPU is not: ncclCommInitRank fails
        mod.local_gpu = lambda device: own
        want = "creating the NCCL communicator failed on rank"
    else:  # this machine as it is: no GPU (or no CuPy)
        want = "the nccl engine cannot run here"
    with Communicator(comm) as c:
        with pytest.raises(DeviceError, match="nccl") as info:
            c._engines.get("nccl", "", "cupy", 0)
        assert want in str(info.value), str(info.value)
        x = np.full(3, float(comm.rank))
        c.allreduce(x, out=x)
        assert x.tolist() == [float(sum(range(comm.size)))] * 3
    if comm.rank == 0:
        print(f"refused on every rank: {info.value}", flush=True)


def test_a_rank_that_cannot_run_nccl_makes_every_rank_raise():
    cases = ["as-is", "no-nccl-on-last", "shared-gpu"]
    if importlib.util.find_spec("cupy"):
        from cupy.cuda import nccl

        if nccl.available:
            cases.append("init-fails")
    for case in cases:
        proc = run_mpi(3, __file__, "rank_nccl_refused", case, timeout=120)
        assert "refused on every rank" in proc.stdout, case
