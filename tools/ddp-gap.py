"""Where DDP's throughput goes on the cudampi backend: the same model trained as variants that
add one cost at a time, interleaved over several rounds so the GPU's drift hits them alike.

  local    no DDP, no communication (what `cudampi bench ddp` calls local)
  nocomm   DDP with a comm hook that returns the bucket untouched: DDP's own work, no sync
  sync     DDP with a hook that all-reduces one element per bucket: the ranks meet at every
           bucket (on the GPU, through the backend) but move no gradient data
  default  DDP on the cudampi backend as it ships (the bucket all-reduced on the caller's stream)
  side     DDP with a hook that all-reduces the bucket on a side stream ordered after the
           caller's (NCCL's way): backward goes on while the collective waits for the peers

Run: cudampi launch -n 2 tools/ddp-gap.py [--model resnet50] [--steps 20] [--rounds 3]
Rank 0 prints per-rank samples/s per variant and round, and the median ratio to local.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import cudampi.torch  # noqa: F401  (registers the backend)
from cudampi.bench.train import build

p = argparse.ArgumentParser()
p.add_argument("--model", default="resnet50")
p.add_argument("--batch", type=int, default=0)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--warmup", type=int, default=3)
p.add_argument("--rounds", type=int, default=3)
p.add_argument("--variants", default="local,nocomm,sync,default,side")
o = p.parse_args()
cuda = torch.cuda.is_available()  # the host runs it too (a check of the script, not a figure)
if not cuda and "side" in o.variants.split(","):  # a side stream is a CUDA stream
    o.variants = ",".join(v for v in o.variants.split(",") if v != "side")
    print("ddp-gap: no GPU here, so no side-stream variant", flush=True)

dist.init_process_group("cudampi")
rank, size = dist.get_rank(), dist.get_world_size()
if cuda:
    torch.cuda.set_device(rank % torch.cuda.device_count())
dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
batch = o.batch or (64 if o.model == "resnet50" else 16 if cuda else 8)
token = torch.zeros(1, device=dev)
side = torch.cuda.Stream(dev) if cuda else None
devices = [dev] if cuda else []


def nocomm_hook(state, bucket):
    fut = torch.futures.Future(devices=devices)
    fut.set_result(bucket.buffer())
    return fut


def sync_hook(state, bucket):
    dist.all_reduce(token)
    fut = torch.futures.Future(devices=devices)
    fut.set_result(bucket.buffer())
    return fut


def side_hook(state, bucket):
    buf = bucket.buffer()
    side.wait_stream(torch.cuda.current_stream(dev))
    with torch.cuda.stream(side):
        dist.all_reduce(buf)
        buf.div_(size)
        buf.record_stream(side)
        fut = torch.futures.Future(devices=devices)
        fut.set_result(buf)  # the future's event is recorded on the side stream
    return fut


def sync() -> None:
    if cuda:
        torch.cuda.synchronize()


HOOKS = {"nocomm": nocomm_hook, "sync": sync_hook, "side": side_hook}


def rate(variant: str) -> float:
    w = build(o.model, dev, batch, None, rank)
    net = w.model
    if variant != "local":
        net = DDP(w.model, device_ids=[dev.index] if cuda else None)
        if variant in HOOKS:
            net.register_comm_hook(None, HOOKS[variant])
    opt = torch.optim.SGD(net.parameters(), lr=1e-3, momentum=0.9)

    def steps(n: int) -> None:
        for _ in range(n):
            x, y = w.make_batch()
            opt.zero_grad(set_to_none=True)
            w.loss(net(x), y).backward()
            opt.step()

    steps(o.warmup)
    sync()
    dist.barrier()
    t0 = time.perf_counter()
    steps(o.steps)
    sync()
    step = (time.perf_counter() - t0) / o.steps
    slowest = torch.tensor([step], dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # the job's rate is its slowest rank's
    if cuda:
        torch.cuda.empty_cache()
    return batch / float(slowest)


variants = o.variants.split(",")
rates: dict[str, list[float]] = {v: [] for v in variants}
for r in range(o.rounds):
    for v in variants:
        rates[v].append(rate(v))
    if rank == 0:
        print(f"round {r}: " + ", ".join(f"{v} {rates[v][-1]:.0f}" for v in variants), flush=True)
if rank == 0:
    print(
        f"{o.model} batch {batch}, {size} ranks, {o.steps} steps x {o.rounds} rounds "
        "(per-rank samples/s, slowest rank; ratio: median over rounds of variant/local)"
    )
    for v in variants:
        ratio = ""
        if "local" in rates and v != "local":
            ratio = f"  {statistics.median(a / b for a, b in zip(rates[v], rates['local'])):.3f}x"
        print(
            f"{v:8s} median {statistics.median(rates[v]):7.1f}  "
            + " ".join(f"{x:.0f}" for x in rates[v])
            + ratio
        )
dist.destroy_process_group()
