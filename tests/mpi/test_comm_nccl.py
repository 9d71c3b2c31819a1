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


def rank_auto_nccl(comm, case, cache):
    """A host whose probe proved the nccl engine (a cache entry as the doctor saves it) and
    ranks that can or cannot all use it: auto keeps nccl only where every rank can."""
    import os
    import socket

    from mpi4py import MPI

    from cudampi.comm import Communicator
    from cudampi.comm.engines import ipc as ipc_mod
    from cudampi.comm.engines import nccl as mod
    from cudampi.comm.paths import NO_LIMIT, choose
    from cudampi.probe import capabilities as capmod

    os.environ["CUDAMPI_CACHE_DIR"] = cache
    if case == "across-nodes":
        os.environ["CUDAMPI_NODE_RANKS"] = "1"
    lib = MPI.Get_library_version()
    if comm.rank == 0:
        ok = capmod.ProbeOutcome
        capmod.save(
            cache,
            capmod.Capabilities(
                key=capmod.stack_key(lib, os.environ),
                mpi_library=lib,
                device_ipc=ok("ok", "correct", gbps=300.0),
                ipc_latency_us=20.0,
                device_nccl=ok("ok", "correct", gbps=600.0),
                nccl_latency_us=30.0,
                host=socket.gethostname(),
                env=capmod.stack_env(os.environ),
            ),
        )
    comm.Barrier()
    mod.available = lambda: None  # CuPy's NCCL, as on a GPU host
    ipc_mod.available = lambda: None  # and CuPy for the ipc engine (nccl's span is against ipc)
    mod.current_device = lambda: 0
    gpu = (
        "0000:01:00.0"
        if case == "shared-gpu" and comm.rank < 2
        else f"0000:{comm.rank + 2:02x}:00.0"
    )
    mod.local_gpu = lambda device: mod.RankGpu("node", gpu)
    with Communicator(comm) as c:
        s = c.device_support
        if case == "usable":
            assert s.nccl and s.nccl_span == (6_000_000, NO_LIMIT), s
            assert "faster than ipc from 6000000 bytes up" in s.nccl_why
            pick = lambda n, call="allreduce", dtype="float32": choose(  # noqa: E731
                call, "auto", True, dtype, n, s, mpi_reduces=True
            )
            assert pick(64 << 20) == "nccl" and pick(64 << 20).engine == "nccl"
            assert pick(1 << 20) != "nccl"  # below the crossing: ipc's (or the ring's)
            assert pick(64 << 20, dtype="int32") != "nccl"  # NCCL lacks its bitwise ops
            assert pick(64 << 20, call="allgather") != "nccl"  # uneven per rank: never per size
            assert (
                choose("allreduce", "ipc", True, "float32", 64 << 20, s, mpi_reduces=True) == "ipc"
            )
        else:
            want = {
                "shared-gpu": "ranks 0, 1 share the GPU at PCI 0000:01:00.0",
                "across-nodes": "across nodes auto keeps ipc inside each node",
            }[case]
            assert not s.nccl and want in s.nccl_why and s.nccl_span == (0, 0), s
    # the rule itself: one rank whose probe does not prove NCCL turns it off for all
    why = mod.ranks_can_use(comm, proven=comm.rank != 1)
    assert why == "not every rank's probe result proves the nccl engine", why
    if comm.rank == 0:
        print(f"auto nccl {case}: {s.nccl_why}", flush=True)


@pytest.mark.parametrize("case", ["usable", "shared-gpu", "across-nodes"])
def test_auto_takes_nccl_only_where_the_probe_proved_it_and_every_rank_can(case, tmp_path):
    proc = run_mpi(3, __file__, "rank_auto_nccl", case, str(tmp_path), timeout=120)
    assert f"auto nccl {case}:" in proc.stdout
