"""Which call breaks a CUDA graph capture on the cudampi backend (path ipc)? Run under
`cudampi launch -n 2 tools/graph-debug.py VARIANT [MODE]`: VARIANT `allreduce` (dist.all_reduce
captured alone), `ddp` (the DDP step of tests/gpu/test_torch_gpu.py), `ddp0` (DDP wrapped on the
default stream, which CUDA cannot capture) or `fsdp`; MODE is
torch.cuda.graph's capture_error_mode (global, thread_local, relaxed). Every backend
collective, Work event, future and ipc launch is logged with its thread, the current torch and
CuPy streams and whether a capture is under way, so the last line before the error names it."""

from __future__ import annotations

import functools
import os
import sys
import threading
import traceback

import torch
import torch.distributed as dist
from mpi4py import MPI
from torch import nn

import cudampi.torch  # noqa: F401
from cudampi.comm.ipc import workspace as wsmod
from cudampi.torch import backend as bmod
from cudampi.torch import work as wmod

variant = sys.argv[1] if len(sys.argv) > 1 else "ddp"
mode = sys.argv[2] if len(sys.argv) > 2 else "global"
w = MPI.COMM_WORLD
torch.cuda.set_device(0)
dev = torch.device("cuda", 0)


def state() -> str:
    import cupy

    s = torch.cuda.current_stream()
    return (
        f"[r{w.rank} {threading.current_thread().name}] torch stream {s.cuda_stream:#x} "
        f"capturing {torch.cuda.is_current_stream_capturing()} cupy stream "
        f"{cupy.cuda.get_current_stream().ptr:#x}"
    )


def logged(owner, name):
    real = getattr(owner, name)

    @functools.wraps(real)
    def wrap(*a, **k):
        extra = f" stream_ptr {a[-1]:#x}" if name == "launch" else ""
        print(f"{state()} -> {name}{extra}", file=sys.stderr, flush=True)
        try:
            return real(*a, **k)
        except BaseException as exc:
            print(f"{state()} !! {name}: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            traceback.print_stack(file=sys.stderr)
            raise

    setattr(owner, name, wrap)


for owner, name in (
    (wmod, "record_done"),
    (wmod, "completed_future"),
    (wmod, "order_after"),
    (wsmod.Workspace, "launch"),
):
    logged(owner, name)
for name in (
    "allreduce",
    "allreduce_coalesced",
    "allgather",
    "allgather_coalesced",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_single_coalesced",
):
    if hasattr(bmod.CudampiProcessGroup, name):
        logged(bmod.CudampiProcessGroup, name)

os.environ.setdefault("CUDAMPI_PATH", "ipc")
dist.init_process_group("cudampi")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 8)).to(dev)


def capture(step, warm):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    print(f"r{w.rank}: warm-up done, capturing ({mode})", file=sys.stderr, flush=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, capture_error_mode=mode):
        step()
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()


x = torch.randn(32, 64, device=dev)
y = torch.randn(32, 8, device=dev)
try:
    if variant == "allreduce":
        t = torch.ones(1000, device=dev)
        capture(lambda: dist.all_reduce(t), 2)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = mlp()
        if variant == "ddp":  # wrapped on a side stream, as torch's CUDA graph notes say
            setup = torch.cuda.Stream()
            with torch.cuda.stream(setup):
                net = DDP(model, device_ids=[0], bucket_cap_mb=0.25)
            torch.cuda.current_stream().wait_stream(setup)
        elif variant == "ddp0":  # wrapped on the default stream: CUDA refuses its capture
            net = DDP(model, device_ids=[0], bucket_cap_mb=0.25)
        else:
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            mesh = init_device_mesh("cuda", (w.size,))
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)
            net = fully_shard(model, mesh=mesh)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            nn.functional.mse_loss(net(x), y).backward()
            opt.step()

        capture(step, 3 if variant == "fsdp" else 11)
    print(f"r{w.rank}: {variant} ({mode}) captured and replayed OK", flush=True)
except Exception:
    print(f"r{w.rank}: {variant} ({mode}) FAILED", flush=True)
    traceback.print_exc()
    sys.stdout.flush()
    os._exit(1)
dist.destroy_process_group()
