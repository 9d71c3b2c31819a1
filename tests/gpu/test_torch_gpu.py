"""The cudampi torch backend on CUDA tensors: collectives, DDP vs gloo, FSDP; 2 ranks, one GPU.

Run on the GPU machine (2 ranks may share one GPU: MPI and gloo allow it, NCCL does not):

    python -m pytest -m gpu tests/gpu/test_torch_gpu.py                    # staged path
    LD_PRELOAD=<libucx-cu13 libs> OMPI_MCA_pml=ucx CUDAMPI_CUDA_AWARE=yes \\
        python -m pytest -m gpu tests/gpu/test_torch_gpu.py                # + gpu-ring

The gpu-ring case needs device point-to-point that is proven CUDA-aware (the PyPI Open MPI wheel
with the libucx-cu13 wheel preloaded and ``--mca pml ucx``; CUDAMPI_CUDA_AWARE=yes says so).
"""

from __future__ import annotations

import os

import pytest

from tests.mpi.test_torch_ddp import (
    assert_same,
    assert_synced,
    init,
    train_ddp,
    train_fsdp1,
    train_fsdp2,
)
from tests.mpirun import run_mpi

pytestmark = [pytest.mark.gpu, pytest.mark.mpi, pytest.mark.torch]

GPU_VARIANTS = "default,small-buckets-views,fp16-hook,builtin-fp16-hook,no-sync-accumulate"


def rank_gpu(comm, path, variants, mode):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    gloo = init(async_ops=mode == "async")
    pg = dist.distributed_c10d._get_default_group()
    chosen = pg.communicator.path_for("allreduce", torch.ones(1 << 20, device=dev))
    assert chosen == path, f"CUDAMPI_PATH={path} but the Communicator picks {chosen}"
    n, rank = comm.size, comm.rank

    # Collectives on CUDA tensors (results stay on the GPU), small and pipelined sizes.
    for numel in (7, 3 << 20):
        x = torch.full((numel,), float(rank + 1), device=dev)
        dist.all_reduce(x)
        assert x.is_cuda and bool((x == n * (n + 1) / 2).all()), "all_reduce"
        out = torch.empty(n * numel, device=dev)
        dist.all_gather_into_tensor(out, torch.full((numel,), float(rank), device=dev))
        want = torch.arange(n, device=dev, dtype=torch.float32).repeat_interleave(numel)
        assert torch.equal(out, want), "all_gather_into_tensor"
        rs = torch.empty(numel, device=dev)
        dist.reduce_scatter_tensor(rs, torch.ones(n * numel, device=dev))
        assert bool((rs == n).all()), "reduce_scatter_tensor"
        b = torch.full((numel,), float(rank), device=dev, dtype=torch.bfloat16)
        dist.broadcast(b, src=n - 1)
        assert bool((b == n - 1).all()), "broadcast bf16"
    a2a = torch.arange(2 * n, device=dev, dtype=torch.float32) + 100 * rank
    got = torch.empty_like(a2a)
    dist.all_to_all_single(got, a2a)
    want = torch.cat([torch.arange(2 * rank, 2 * rank + 2, device=dev) + 100 * j for j in range(n)])
    assert torch.equal(got, want.float()), "all_to_all_single"
    recv = torch.empty(5, device=dev)
    r = dist.irecv(recv, src=(rank - 1) % n)
    dist.isend(torch.full((5,), float(rank), device=dev), dst=(rank + 1) % n).wait()
    r.wait()
    assert bool((recv == (rank - 1) % n).all()), "isend/irecv"
    work = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
    assert torch.equal(work.get_future().wait()[0], torch.full((4,), float(n), device=dev))

    # DDP on CUDA: cudampi vs gloo (both on CUDA tensors), every variant.
    for variant in variants.split(","):
        ours = train_ddp(None, dev, variant)
        theirs = train_ddp(gloo, dev, variant)
        assert_same(
            ours,
            theirs,
            f"CUDA DDP {variant} ({path}) vs gloo",
            atol=2e-3 if "16" in variant else 1e-5,
        )
        assert_synced(ours[:8], f"CUDA DDP {variant}")
    # FSDP2 and FSDP1 one step on CUDA: the same update as FSDP2 on the CPU (checked vs gloo).
    cuda2 = train_fsdp2(init_device_mesh("cuda", (n,)), dev)
    cpu2 = train_fsdp2(init_device_mesh("cpu", (n,)), torch.device("cpu"))
    assert_same(cuda2, cpu2, f"FSDP2 CUDA ({path}) vs CPU", atol=1e-5)
    one = train_fsdp1(None, dev)
    assert_same(one, cpu2, f"FSDP1 CUDA ({path}) vs FSDP2 CPU", atol=1e-5)
    dist.destroy_process_group()
    if rank == 0:
        print(
            f"torch backend on CUDA via {path} ({mode}): collectives, DDP [{variants}], FSDP ok",
            flush=True,
        )


def _cuda_aware() -> bool:
    return os.environ.get("CUDAMPI_CUDA_AWARE") == "yes" or os.environ.get("OMPI_MCA_pml") == "ucx"  # noqa: SIM112


@pytest.mark.parametrize(
    ("path", "mode", "ranks"),
    [
        ("gpu-ring", "sync", 2),
        ("staged", "sync", 2),
        ("gpu-ring", "async", 2),
        ("gpu-ring", "async", 4),
    ],
)
def test_ddp_fsdp_on_cuda_tensors(path, mode, ranks):
    """mode async: Options(async_ops=True), bucket all-reduces overlap backward. 4 async ranks
    on one GPU: where DDP's C++ read its allgathered parameter counts before the side stream
    had written them (fixed by AsyncWork.wait ordering the caller's stream)."""
    if path == "gpu-ring" and not _cuda_aware():
        pytest.skip(
            "gpu-ring needs CUDA-aware point-to-point: preload the libucx-cu13 wheel, set "
            "OMPI_MCA_pml=ucx and CUDAMPI_CUDA_AWARE=yes (see the module docstring)"
        )
    variants = GPU_VARIANTS if ranks == 2 else "default,small-buckets-views"
    if mode == "async":  # built-in C++ hooks need the typed futures of the default mode
        variants = ",".join(v for v in GPU_VARIANTS.split(",") if v != "builtin-fp16-hook")
    proc = run_mpi(
        ranks, __file__, "rank_gpu", path, variants, mode, timeout=600, env={"CUDAMPI_PATH": path}
    )
    assert f"via {path} ({mode})" in proc.stdout


def test_ddp_example_on_cuda():
    import json
    import subprocess
    import sys

    from tests.mpirun import ROOT, mpi_env

    argv = [
        sys.executable,
        "-m",
        "cudampi",
        "launch",
        "-n",
        "2",
        "examples/ddp_train.py",
        "--device",
        "cuda",
        "--steps",
        "20",
        "--json",
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=300, env=mpi_env(), cwd=ROOT
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    assert result["device"].startswith("cuda") and result["replicas_in_sync"] is True


def test_async_work_wait_orders_the_callers_stream():
    """Work.wait() of an Options(async_ops=True) op: what the caller queues next on its own
    stream must see the op's results, though the op's kernels ran on the runner's side stream
    and were still running when the runner thread finished queueing them."""
    import torch

    from cudampi.torch.work import AsyncRunner

    dev = torch.device("cuda", 0)
    out = torch.zeros(1 << 20, device=dev)
    runner = AsyncRunner("test-async-stream")

    def op():  # a slow kernel, then the result: both queued on the side stream, not waited for
        torch.cuda._sleep(200_000_000)  # ~0.1 s at H200 clocks
        out.fill_(7.0)
        return [out]

    try:
        work = runner.submit(op, [out])
        work.wait()
        assert out.sum().item() == 7.0 * out.numel(), "wait() returned before the op's kernels"
    finally:
        runner.close()
