"""The nccl engine on the GPU: every method of the engine contract through CuPy's NCCL binding,
bootstrapped over MPI (no MASTER_ADDR), on torch tensors and CuPy arrays; stream order (a call
returns before a slow kernel enqueued ahead of it ends); a CUDA graph capture; refusals.

World size 1 runs on any GPU machine; 2 ranks need two GPUs (NCCL refuses ranks that share one):

    python -m pytest -m gpu tests/gpu/test_nccl_gpu.py

Needs CuPy and a libnccl CuPy loads (pip install nvidia-nccl-cu13, which torch's CUDA wheels
bring along). The engine is taken from the Communicator's engine set directly: auto does not
choose it yet (docs/torch.md, "the nccl engine"). The checks of each rank count run in one job
(tests/gpu/jobs.py).
"""

from __future__ import annotations

import importlib.util
import subprocess

import pytest

from tests.gpu.jobs import Check, Skip, params

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def _gpus() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def _skip_without_nccl() -> None:
    if not importlib.util.find_spec("cupy"):
        raise Skip("the nccl engine uses CuPy's NCCL binding: pip install cupy-cuda13x")
    from cupy.cuda import nccl

    if not nccl.available:
        raise Skip("CuPy finds no libnccl: pip install nvidia-nccl-cu13")


def _arrays(lib):
    """(full(n, value, dtype), to_numpy) in ``lib`` on the current device."""
    import numpy as np

    if lib == "torch":
        import torch

        def full(n, v, dtype):
            wide = "float32" if dtype == "bfloat16" else dtype
            return torch.from_numpy(np.full(n, v, dtype=wide)).to("cuda", getattr(torch, dtype))

        def host(t):
            return (t.float() if t.dtype == torch.bfloat16 else t).cpu().numpy()

        return full, host
    import cupy

    return (lambda n, v, dtype: cupy.full(n, v, dtype=dtype)), cupy.asnumpy


def rank_nccl(comm, lib):
    import time

    import numpy as np

    from cudampi.comm import Communicator
    from cudampi.errors import CommError

    _skip_without_nccl()
    dev = comm.rank % _device_count()
    _use(lib, dev)
    size, me = comm.size, comm.rank
    full, host = _arrays(lib)
    checked = 0
    with Communicator(comm) as c:
        e = c._engines.get("nccl", "", lib, dev)
        assert e.stream_ordered and e.nc.version > 0
        dtypes = ["float32", "float16", "float64", "int32", "int64", "uint8", "bool"]
        if lib == "torch":
            dtypes.append("bfloat16")
        for dtype in dtypes:
            ops = ("sum", "max", "min") if dtype == "bool" else ("sum", "prod", "max", "min")
            if dtype.startswith("float") or dtype == "bfloat16":
                ops = (*ops, "avg")
            for op in ops:
                for n in (1, 1000, 1 << 20):
                    x = full(n, 1 if dtype == "bool" else me + 1, dtype)
                    e.allreduce(x, x, op, dtype)
                    vals = [1 if dtype == "bool" else r + 1 for r in range(size)]
                    want = {
                        "sum": sum(vals),
                        "prod": np.prod(vals),
                        "max": max(vals),
                        "min": min(vals),
                        "avg": sum(vals) / size,
                    }[op]
                    if dtype == "bool":
                        want = True
                    got = host(x)
                    assert np.allclose(got.astype("float64"), float(want)), (dtype, op, n, got[:4])
                    checked += 1
        # every other method, float32, sizes that cannot be split evenly too
        k = 1001
        x = full(k, me + 1, "float32")
        out = full(k, -1, "float32")
        e.reduce(x, out, "sum", "float32", size - 1)
        if me == size - 1:
            assert np.allclose(host(out), size * (size + 1) / 2), "reduce"
        b = full(k, me, "float32")
        e.broadcast(b, 0)
        assert np.allclose(host(b), 0), "broadcast"
        for counts in ([k] * size, [k + r for r in range(size)]):
            g = full(sum(counts), -1, "float32")
            e.allgatherv(full(counts[me], me, "float32"), g, counts)
            want = np.concatenate([np.full(cn, r) for r, cn in enumerate(counts)])
            assert np.array_equal(host(g), want), ("allgatherv", counts)
            g = full(sum(counts), -1, "float32")
            e.gatherv(full(counts[me], me, "float32"), g if me == 0 else None, counts, 0)
            if me == 0:
                assert np.array_equal(host(g), want), ("gatherv", counts)
            s = full(counts[me], -1, "float32")
            src = full(sum(counts), 0, "float32") if me == 0 else None
            if src is not None:
                _fill_blocks(src, counts)
            e.scatterv(src, s, counts, 0)
            assert np.array_equal(host(s), np.full(counts[me], me)), ("scatterv", counts)
            rs_in = full(sum(counts), me + 1, "float32")
            rs = full(counts[me], -1, "float32")
            e.reduce_scatterv(rs_in, rs, counts, "avg", "float32")
            assert np.allclose(host(rs), (size + 1) / 2), ("reduce_scatterv avg", counts)
            checked += 4
        sc = [r + 1 for r in range(size)]  # rank me sends r+1 to rank r
        rc = [me + 1] * size
        a_in = full(sum(sc), me, "float32")
        a_out = full(sum(rc), -1, "float32")
        e.alltoallv(a_in, sc, a_out, rc)
        want = np.concatenate([np.full(me + 1, r) for r in range(size)])
        assert np.array_equal(host(a_out), want), "alltoallv"
        with pytest.raises(CommError, match="no int16 datatype"):
            e.allreduce(full(4, 1, "int16"), full(4, 1, "int16"), "sum", "int16")
        if lib == "torch":
            # stream order: the call returns at once though a slow kernel runs ahead of it
            import torch

            x = full(1 << 20, me + 1, "float32")
            torch.cuda._sleep(800_000_000)  # ~0.4 s at H200 clocks
            t0 = time.perf_counter()
            e.allreduce(x, x, "sum", "float32")
            took = time.perf_counter() - t0
            assert took < 0.2, f"allreduce blocked the host for {took:.3f} s"
            e.synchronize()
            assert np.allclose(host(x)[:8], size * (size + 1) / 2)
            _graph(e, size, me)
        c.synchronize()
    return f"nccl engine ({lib}, {size} ranks): {checked} results ok"


def _fill_blocks(src, counts):
    lo = 0
    for r, cn in enumerate(counts):
        src[lo : lo + cn] = r
        lo += cn


def _graph(e, size, me):
    """An allreduce captured in a CUDA graph and replayed with new data (NCCL >= 2.9.6)."""
    import torch

    static = torch.zeros(1 << 16, device="cuda")
    e.allreduce(static, static, "sum", "float32")  # warm up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        e.allreduce(static, static, "sum", "float32")
    for k in range(1, 4):
        static.fill_(k * (me + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert (static == k * size * (size + 1) / 2).all().item(), ("graph", k)


def _device_count():
    import cupy

    return cupy.cuda.runtime.getDeviceCount()


def _use(lib, dev):
    import cupy

    cupy.cuda.Device(dev).use()
    if lib == "torch":
        import torch

        torch.cuda.set_device(dev)


def _libs():
    return [lib for lib in ("torch", "cupy") if importlib.util.find_spec(lib)]


def rank_probe_job(comm):
    """The doctor's device_nccl job (cudampi.probe.worker.run_test) as the probe ranks run it,
    here on one rank: correct data, a 4 KiB latency and a bandwidth for the cache."""
    from cudampi.probe.worker import run_test

    _skip_without_nccl()
    got = run_test(comm, "device_nccl", 16 << 20, "cupy", 3)
    assert got["ok"] is True and got["gbps"] > 0 and got["latency_us"] > 0, got
    return f"probe job ok: {got['latency_us']:.1f} us at 4 KiB, {got['gbps']:.1f} GB/s"


def checks() -> list[Check]:
    """Every check of this file, in the order its jobs run them: world size 1 (any GPU
    machine), then 2 ranks (two GPUs: NCCL refuses ranks that share one)."""
    two = (
        None if _gpus() >= 2 else "NCCL needs one GPU per rank: this machine has fewer than 2 GPUs"
    )
    out = [
        Check(f"nccl_engine_at_world_size_1[{lib}]", rank_nccl, (lib,), ranks=1, timeout=600)
        for lib in _libs()
    ]
    out.append(
        Check("the_doctor_probe_job_of_the_nccl_engine_at_world_size_1", rank_probe_job, ranks=1)
    )
    out += [
        Check(f"nccl_engine_on_two_gpus[{lib}]", rank_nccl, (lib,), ranks=2, skip=two, timeout=600)
        for lib in _libs()
    ]
    return out


@pytest.mark.parametrize("check", params(checks()))
def test_check(check, gpu_jobs):
    gpu_jobs.verify(check)
