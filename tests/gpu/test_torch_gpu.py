"""The cudampi torch backend on CUDA tensors: collectives, DDP vs gloo, FSDP; 2 ranks, one GPU.

Run on the GPU machine (2 ranks may share one GPU: MPI and gloo allow it, NCCL does not):

    python -m pytest -m gpu tests/gpu/test_torch_gpu.py                    # staged + ipc
    LD_PRELOAD=<libucx-cu13 libs> OMPI_MCA_pml=ucx CUDAMPI_CUDA_AWARE=yes \\
        python -m pytest -m gpu tests/gpu/test_torch_gpu.py                # + gpu-ring

The gpu-ring case needs device point-to-point that is proven CUDA-aware (the PyPI Open MPI wheel
with the libucx-cu13 wheel preloaded and ``--mca pml ucx``; CUDAMPI_CUDA_AWARE=yes says so).
The ipc cases need CuPy (the ipc engine's kernels): they check the stream-ordered Work (no host
sync in a collective or in ``wait()``) and a DDP step and an FSDP2 step captured in a CUDA graph.
The checks of each rank count run in one job (tests/gpu/jobs.py), each with its own process
group (``init_process_group`` then ``destroy_process_group``) and CUDAMPI_PATH.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

from tests.gpu.jobs import Check, params, time_left
from tests.mpi.test_torch_ddp import (
    assert_same,
    assert_synced,
    init,
    train_ddp,
    train_fsdp1,
    train_fsdp2,
)

pytestmark = [pytest.mark.gpu, pytest.mark.mpi, pytest.mark.torch]

GPU_VARIANTS = "default,small-buckets-views,fp16-hook,builtin-fp16-hook,no-sync-accumulate"


def rank_gpu(comm, path, variants, mode):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    gloo = init(async_ops={"async": True, "sync": False, "auto": None}[mode])
    pg = dist.distributed_c10d._get_default_group()
    chosen = pg.communicator.path_for("allreduce", torch.ones(1 << 20, device=dev))
    assert chosen == path, f"CUDAMPI_PATH={path} but the Communicator picks {chosen}"
    n, rank = comm.size, comm.rank
    if mode == "auto":  # the group's thread for a path that synchronizes the host, else inline
        from cudampi.torch.work import _async_work_class

        work = dist.all_reduce(torch.ones(4, device=dev), async_op=True)
        threaded = isinstance(work, _async_work_class())
        assert threaded == (path != "ipc"), f"auto on {path}: on the thread? {threaded}"
        work.wait()

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
    return f"torch backend on CUDA via {path} ({mode}): collectives, DDP [{variants}], FSDP ok"


def _cuda_aware() -> bool:
    return os.environ.get("CUDAMPI_CUDA_AWARE") == "yes" or os.environ.get("OMPI_MCA_pml") == "ucx"  # noqa: SIM112


NO_CUPY = (
    None
    if importlib.util.find_spec("cupy")
    else "path ipc runs the ipc engine's kernels, which need CuPy"
)
NO_CUDA_AWARE = (
    "gpu-ring needs CUDA-aware point-to-point: preload the libucx-cu13 wheel, set "
    "OMPI_MCA_pml=ucx and CUDAMPI_CUDA_AWARE=yes (see the module docstring)"
)
DDP_FSDP = [
    ("gpu-ring", "sync", 2),
    ("staged", "sync", 2),
    ("gpu-ring", "async", 2),
    ("gpu-ring", "async", 4),
    ("ipc", "sync", 2),
    ("ipc", "sync", 4),
    ("ipc", "async", 2),
    ("gpu-ring", "auto", 2),
    ("staged", "auto", 2),
    ("ipc", "auto", 2),
]
"""(path, mode, ranks) of :func:`rank_gpu`. mode sync: Options(async_ops=False), every call in
the caller's thread; auto: the default, the group's thread where the path synchronizes the host
(gpu-ring, staged), the caller's for ipc; async: Options(async_ops=True), bucket all-reduces
overlap backward. 4 async ranks on one GPU: where DDP's C++ read its allgathered parameter
counts before the side stream had written them (fixed by AsyncWork.wait ordering the caller's
stream). ipc: every call only enqueues kernels on the caller's stream and returns a
stream-ordered Work."""


def _ddp_fsdp_check(path: str, mode: str, ranks: int) -> Check:
    skip = NO_CUDA_AWARE if path == "gpu-ring" and not _cuda_aware() else None
    if path == "ipc":
        skip = NO_CUPY
    variants = GPU_VARIANTS if ranks == 2 else "default,small-buckets-views"
    if mode == "async" or (mode == "auto" and path != "ipc"):
        # built-in C++ hooks need the typed futures of calls run in the caller's thread
        variants = ",".join(v for v in GPU_VARIANTS.split(",") if v != "builtin-fp16-hook")
    name = f"ddp_fsdp_on_cuda_tensors[{path}-{mode}-{ranks}]"
    env = (("CUDAMPI_PATH", path),)
    return Check(name, rank_gpu, (path, variants, mode), ranks, env, skip, timeout=600)


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
        argv, capture_output=True, text=True, timeout=time_left(300), env=mpi_env(), cwd=ROOT
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(next(ln for ln in proc.stdout.splitlines() if ln.startswith("{")))
    assert result["device"].startswith("cuda") and result["replicas_in_sync"] is True


def rank_async_work_wait(comm):
    """Work.wait() of an Options(async_ops=True) op: what the caller queues next on its own
    stream must see the op's results, though the op's kernels ran on the runner's side stream
    and were still running when the runner thread finished queueing them (no process group:
    each rank checks its own runner)."""
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
    return "wait() ordered the caller's stream"


def _sleep_ms(ms: float) -> None:
    """Enqueue a kernel that keeps the current stream busy for about ``ms`` (H200 clocks)."""
    import torch

    torch.cuda._sleep(int(ms * 2_000_000))


def rank_stream_ordered(comm):
    """Path ipc, default mode: a collective and its Work never block the host. A slow kernel
    enqueued before the call keeps the stream busy; the call, async or not, and wait() on the
    same stream return long before it ends; wait() from another stream orders that stream
    after the call; the future's value and .then are right once the stream has run."""
    import time

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    init(async_ops=None)  # the default (auto): ipc calls run in the caller's thread
    n = comm.size
    pg = dist.distributed_c10d._get_default_group()
    x = torch.full((1 << 20,), 1.0, device=dev)
    dist.all_reduce(x)  # warm up: the ipc workspace is made outside the timed part
    assert pg.communicator.path_for("allreduce", x) == "ipc"
    torch.cuda.synchronize()
    dist.barrier()

    x.fill_(float(comm.rank + 1))
    _sleep_ms(500)
    t0 = time.perf_counter()
    work = dist.all_reduce(x, async_op=True)
    # .then runs now (the future is done on the host), enqueueing the clone after the call
    fut = work.get_future().then(lambda f: f.value()[0][:4].clone())
    assert not work.is_completed(), "is_completed() before the stream got to the call"
    work.wait()  # the same stream: nothing to do
    dist.all_reduce(x)  # a blocking call enqueues too
    took = time.perf_counter() - t0
    assert took < 0.25, f"the host waited {took:.3f} s for a stream-ordered collective"
    total = n * (n + 1) / 2
    assert torch.equal(x[:4], torch.full((4,), total * n, device=dev)), "blocking all_reduce"
    torch.cuda.synchronize()
    assert work.is_completed() and work.is_success()
    assert torch.equal(fut.wait(), torch.full((4,), total, device=dev)), "future's value"

    # wait() from another stream: that stream runs after the call, the host does not wait.
    side = torch.cuda.Stream(dev)
    x.fill_(float(comm.rank + 1))
    _sleep_ms(300)
    work = dist.all_reduce(x, async_op=True)
    with torch.cuda.stream(side):
        t0 = time.perf_counter()
        work.wait()
        assert time.perf_counter() - t0 < 0.1, "wait() blocked the host"
        y = x * 2
    side.synchronize()
    assert torch.equal(y[:4], torch.full((4,), 2 * total, device=dev)), "side stream ran early"
    pg.communicator.synchronize()  # where the ipc engine's errors would surface: none
    dist.destroy_process_group()
    return "stream-ordered Work ok"


def _mlp(seed, dev):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8)
    ).to(dev)


def _batches(steps, rank, dev):
    import torch

    g = torch.Generator().manual_seed(99 + rank)
    return [(torch.randn(32, 64, generator=g).to(dev), torch.randn(32, 8, generator=g).to(dev))
            for _ in range(steps)]  # fmt: skip


def _train_captured(model, batches, warmup, *, eager):
    """Train on ``batches``: the first ``warmup`` steps eagerly on a side stream (what capture
    needs: DDP's first iterations rebuild buckets and sample timings, FSDP2 and the optimizer
    make their state), then, unless ``eager``, one step captured in a CUDA graph and replayed
    for every remaining batch (copied into the static inputs)."""
    import torch
    from torch import nn

    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    static_x = batches[0][0].clone()
    static_y = batches[0][1].clone()

    def step():
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(model(static_x), static_y).backward()
        opt.step()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for x, y in batches[: warmup if not eager else len(batches)]:
            static_x.copy_(x)
            static_y.copy_(y)
            step()
    torch.cuda.current_stream().wait_stream(side)
    if eager:
        torch.cuda.synchronize()  # (a stack that stops here: the eager run)
        return model
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        nn.functional.mse_loss(model(static_x), static_y).backward()
        opt.step()
    for x, y in batches[warmup:]:
        static_x.copy_(x)
        static_y.copy_(y)
        graph.replay()
    torch.cuda.synchronize()  # (here: the replays)
    return model


def rank_graphs(comm):
    """A DDP step and an FSDP2 step captured in a CUDA graph on the cudampi backend (path ipc)
    and replayed for new batches reach the parameters of the same training run eagerly, on
    every rank; the capture itself proves no host sync, no MPI call and no blocking
    allocation on the path (capture raises on them)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.cuda.set_device(comm.rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
    init(async_ops=None)  # the default (auto): ipc calls run in the caller's thread
    rank = comm.rank
    batches = _batches(16, rank, dev)

    warm = 11  # torch's CUDA graph notes: DDP needs 11 eager iterations before capture
    ddp = {}
    for eager in (True, False):
        model = _mlp(rank, dev)  # different inits: DDP's broadcast makes them equal
        # torch's CUDA graph notes: wrap DDP on a side stream (its gradient hooks run on the
        # stream current at construction; the legacy default stream cannot join a capture)
        setup = torch.cuda.Stream()
        setup.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(setup):
            net = DDP(model, device_ids=[dev.index], bucket_cap_mb=0.25)
        torch.cuda.current_stream().wait_stream(setup)
        _train_captured(net, batches, warm, eager=eager)
        ddp[eager] = [p.detach().clone() for p in model.parameters()]
    assert_same(ddp[False], ddp[True], "DDP: graph replay vs eager", atol=1e-5)
    assert_synced(ddp[False], "DDP graph replay")

    fsdp = {}
    for eager in (True, False):
        mesh = init_device_mesh("cuda", (comm.size,))
        model = _mlp(0, dev)
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        _train_captured(model, batches, 3, eager=eager)
        fsdp[eager] = [p.full_tensor().detach().clone() for p in model.parameters()]
    assert_same(fsdp[False], fsdp[True], "FSDP2: graph replay vs eager", atol=1e-5)
    dist.distributed_c10d._get_default_group().communicator.synchronize()
    dist.destroy_process_group()
    return "DDP and FSDP2 steps captured and replayed ok"


def checks() -> list[Check]:
    """Every check of this file, in the order its jobs run them (one job per rank count):
    the async runner, DDP/FSDP per path and mode, the graph captures, the stream-ordered Work
    last (a few seconds where it works; past its 90 s it ends the job with each rank's stack)."""
    ipc = (("CUDAMPI_PATH", "ipc"),)
    out = [Check("async_work_wait_orders_the_callers_stream", rank_async_work_wait)]
    out += [_ddp_fsdp_check(*case) for case in DDP_FSDP]
    for n in (2, 4):
        name = f"ddp_and_fsdp2_steps_captured_in_a_cuda_graph[{n}]"
        # (1-5 s on one H100, MPS on or off; 120 s leaves the rest of the job its time if it hangs)
        out.append(Check(name, rank_graphs, ranks=n, env=ipc, skip=NO_CUPY, timeout=120))
    name = "stream_ordered_work_never_blocks_the_host"
    out.append(Check(name, rank_stream_ordered, env=ipc, skip=NO_CUPY, timeout=90))
    return out


@pytest.mark.parametrize("check", params(checks()))
def test_check(check, gpu_jobs):
    gpu_jobs.verify(check)
