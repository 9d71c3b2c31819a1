"""DDP and FSDP training on the cudampi backend reach gloo's parameters (real ranks, CPU).

Every run trains the same model on the same per-rank synthetic batches twice in one job, once on
the cudampi default group and once on a gloo group of the same processes, and compares every
parameter and buffer. Each rank starts from a *different* random init, so DDP's initial broadcast
is checked too. The training helpers are shared with tests/gpu/test_torch_gpu.py (CUDA tensors).
"""

from __future__ import annotations

import os

import pytest

from tests.mpirun import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

VARIANTS = {
    # name: (DDP keyword arguments, comm hook name or None, micro-batches per step)
    "default": ({}, None, 1),
    "small-buckets-views": ({"bucket_cap_mb": 0.002, "gradient_as_bucket_view": True}, None, 1),
    "allreduce-hook": ({}, "allreduce", 1),
    "fp16-hook": ({}, "fp16", 1),
    "bf16-hook": ({}, "bf16", 1),
    "builtin-fp16-hook": ({}, "builtin-fp16", 1),
    "unused-params": ({"find_unused_parameters": True}, None, 1),
    "no-sync-accumulate": ({}, None, 2),
}


def init(async_ops=False):
    """init_process_group('cudampi') from MPI, plus a gloo group of the same processes."""
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", category=UserWarning)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    import cudampi.torch

    dist.init_process_group("cudampi", pg_options=cudampi.torch.Options(async_ops=async_ops))
    return dist.new_group(backend="gloo")


def make_model(seed, *, unused=False):
    import torch
    from torch import nn

    torch.manual_seed(seed)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(
                nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU()
            )
            self.head = nn.Linear(32, 4)
            self.spare = nn.Linear(32, 4) if unused else None  # never used in forward

        def forward(self, x):
            return self.head(self.body(x))

    return Net()


def batch(step, rank, device, micro=0):
    import torch

    g = torch.Generator().manual_seed(10_000 * step + 100 * rank + micro)
    x = torch.randn(8, 16, generator=g)
    y = torch.randn(8, 4, generator=g)
    return x.to(device), y.to(device)


def bf16_allreduce_hook(state, bucket):
    """A user comm hook: average the bucket in bfloat16 through an async all_reduce future."""
    import torch
    import torch.distributed as dist

    buf = bucket.buffer()
    small = buf.to(torch.bfloat16).div_(dist.get_world_size())
    fut = dist.all_reduce(small, async_op=True).get_future()

    def decompress(f):
        buf.copy_(f.value()[0])
        return buf

    return fut.then(decompress)


def _hook(ddp, name):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks as hooks

    if name == "allreduce":
        ddp.register_comm_hook(None, hooks.allreduce_hook)
    elif name == "fp16":
        ddp.register_comm_hook(None, hooks.fp16_compress_hook)
    elif name == "bf16":
        # torch's bf16_compress_hook insists on NCCL; this one does the same casts.
        ddp.register_comm_hook(None, bf16_allreduce_hook)
    elif name == "builtin-fp16":
        import torch.distributed as dist

        ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.FP16_COMPRESS)


def train_ddp(group, device, variant, *, steps=4):
    """Train DDP on ``group``; the final parameters and buffers (on the CPU), in order."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs, hook, micro = VARIANTS[variant]
    rank = dist.get_rank()
    model = make_model(seed=rank, unused=variant == "unused-params").to(device)
    ids = [device.index] if device.type == "cuda" else None
    ddp = DDP(model, process_group=group, device_ids=ids, **kwargs)
    if hook:
        _hook(ddp, hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step, rank, device, m)
            if m < micro - 1:
                with ddp.no_sync():
                    nn.functional.mse_loss(ddp(x), y).backward()
            else:
                nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
    return [t.detach().cpu().clone() for t in (*model.parameters(), *model.buffers())]


def train_fsdp2(mesh, device, *, steps=1):
    """One (or more) fully_shard training steps; the full parameters (on the CPU)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    model = make_model(seed=0).to(device)
    for layer in (*model.body, model.head):
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step, dist.get_rank(), device)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.full_tensor().detach().cpu().clone() for p in model.parameters()]


def train_fsdp1(group, device, *, steps=1):
    """FullyShardedDataParallel (FSDP1: torch requires an accelerator); full parameters."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    model = FSDP(make_model(seed=0), process_group=group, device_id=device, use_orig_params=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = batch(step, dist.get_rank(), device)
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    with FSDP.summon_full_params(model):
        return [p.detach().cpu().clone() for p in model.parameters()]


def assert_same(ours, theirs, what, atol=1e-6):
    import torch

    assert len(ours) == len(theirs), what
    for i, (a, b) in enumerate(zip(ours, theirs)):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5, msg=f"{what}: tensor {i}")


def assert_synced(params, what):
    """Every rank holds the same parameters (DDP keeps replicas identical)."""
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.reshape(-1).double() for p in params])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    assert torch.equal(lo, hi), f"{what}: replicas differ across ranks"


def rank_ddp_fsdp(comm, variants, mode="sync"):
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    if mode == "auto-mixed":  # see tests/mpi/test_torch_backend.py: odd sizes take the thread
        from cudampi.torch import dispatch
        from tests.mpi.test_torch_backend import odd_first

        dispatch.first_cuda = odd_first
    gloo = init(async_ops={"async": True, "sync": False}.get(mode))
    cpu = torch.device("cpu")
    for variant in variants.split(","):
        ours = train_ddp(None, cpu, variant)
        theirs = train_ddp(gloo, cpu, variant)
        atol = 2e-3 if "16" in variant else 1e-6
        assert_same(ours, theirs, f"DDP {variant}: cudampi vs gloo", atol=atol)
        start = make_model(seed=dist.get_rank(), unused=variant == "unused-params")
        params = ours[: len(list(start.parameters()))]
        # Parameters are identical on every rank; BatchNorm's running stats are per rank (the
        # last forward updates them locally after DDP's buffer broadcast).
        assert_synced(params, f"DDP {variant}")
        moved = max(float((a - b).abs().max()) for a, b in zip(params, start.parameters()))
        assert moved > 1e-3, f"DDP {variant}: training did not change the parameters"
    ours = train_fsdp2(init_device_mesh("cpu", (comm.size,)), cpu)
    theirs = train_fsdp2(DeviceMesh.from_group(gloo, "cpu"), cpu)
    assert_same(ours, theirs, "FSDP2 fully_shard step: cudampi vs gloo")
    dist.destroy_process_group()
    if comm.rank == 0:
        print(f"DDP variants {variants} and FSDP2 match gloo ({mode})", flush=True)


NO_BUILTIN = ",".join(v for v in VARIANTS if v != "builtin-fp16-hook")  # needs typed futures
TWO_RANK_RUNS = {
    # name: (rank function, variants, mode)
    "sync": ("rank_ddp_fsdp", ",".join(VARIANTS), "sync"),
    "async": ("rank_ddp_fsdp", NO_BUILTIN, "async"),
    "stream-work": ("rank_ddp_stream_work", "default,fp16-hook,builtin-fp16-hook", "sync"),
    "auto-mixed": ("rank_ddp_fsdp", NO_BUILTIN, "auto-mixed"),
}
"""The 2-rank runs of the tests below, all in one job (:func:`rank_ddp_fsdp_runs`)."""


def rank_ddp_fsdp_runs(comm, names):
    """The runs ``names`` of :data:`TWO_RANK_RUNS`, one after the other in this job, each with
    process groups of its own (made, trained on, destroyed): the job's start, torch's imports and
    their first use once, not per run (here a job of one run took ~10 s of CPU, of all four
    about the same). What a run patches (the stream-ordered Work, the auto-mixed dispatch) is
    put back after it."""
    from cudampi.torch import dispatch

    for name in names.split(","):
        func, variants, mode = TWO_RANK_RUNS[name]
        work, first = dispatch.finished_work, dispatch.first_cuda
        try:
            if func == "rank_ddp_stream_work":
                rank_ddp_stream_work(comm, variants)
            else:
                rank_ddp_fsdp(comm, variants, mode)
        finally:
            dispatch.finished_work, dispatch.first_cuda = work, first


@pytest.fixture(scope="module")
def two_rank_runs():
    """Every run of :data:`TWO_RANK_RUNS` in one 2-rank job (this file's tests run on one
    xdist worker: tests/conftest.py's TOGETHER); what rank 0 printed."""
    return run_mpi(2, __file__, "rank_ddp_fsdp_runs", ",".join(TWO_RANK_RUNS), timeout=600).stdout


def matched(name):
    """The line rank 0 prints when run ``name`` of :data:`TWO_RANK_RUNS` matched gloo."""
    _, variants, mode = TWO_RANK_RUNS[name]
    return f"DDP variants {variants} and FSDP2 match gloo ({mode})"


def test_ddp_and_fsdp_match_gloo_2_ranks(two_rank_runs):
    assert matched("sync") in two_rank_runs


def test_ddp_and_fsdp_match_gloo_with_async_ops(two_rank_runs):
    """Options(async_ops=True): bucket all-reduces overlap backward; same parameters as gloo."""
    assert matched("async") in two_rank_runs


def test_ddp_and_fsdp_match_gloo_with_threaded_and_inline_calls_mixed(two_rank_runs):
    """The default (auto) where some calls take the group's thread (standing in for CUDA calls
    of a host-synchronizing path: odd-sized buckets) and the others the caller's thread."""
    assert matched("auto-mixed") in two_rank_runs


def test_ddp_and_fsdp_match_gloo_4_ranks():
    proc = run_mpi(
        4, __file__, "rank_ddp_fsdp", "default,small-buckets-views,fp16-hook", timeout=300
    )
    assert "match gloo" in proc.stdout


def rank_ddp_stream_work(comm, variants):
    """The default mode's Work for CUDA tensors (a Python Work subclass over an event, see
    cudampi.torch.work.finished_work) given to DDP's C++ reducer on the CPU, where there is no
    event: its typed future must serve the built-in C++ hooks as the completed Work does."""
    from cudampi.torch import dispatch, work

    def stream_work(result):
        return work._stream_work_class()([], work.completed_future(result), result, None)

    # where the backend's calls look it up (cudampi.torch.backend, patched before, no longer
    # reads it: the patch went unused and the run checked the completed Work only)
    dispatch.finished_work = stream_work
    rank_ddp_fsdp(comm, variants)


def test_ddp_and_fsdp_through_the_stream_ordered_work(two_rank_runs):
    assert matched("stream-work") in two_rank_runs
