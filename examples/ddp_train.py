"""DistributedDataParallel training on synthetic data, on the cudampi torch.distributed backend.

    cudampi launch -n 2 examples/ddp_train.py                 # CPU or one GPU per rank
    cudampi launch -n 2 examples/ddp_train.py --backend gloo  # the same run on gloo
    mpirun -n 2 python examples/ddp_train.py --json           # any MPI launcher works too

The first half is the pattern most training scripts start with: ``init_distributed()`` (who am
I, which device, ``init_process_group``) and one ``dist.all_reduce`` to prove every rank is
there. The second half is a real DDP loop (MLP, SGD, MSE on per-rank synthetic batches) that
reports samples/s; ``--json`` gives the same as one JSON object. Only rank 0 prints.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: str
    backend: str
    async_ops: bool | None = None


@dataclass(frozen=True)
class TrainResult:
    backend: str
    async_ops: bool | None
    device: str
    world_size: int
    steps: int
    batch_per_rank: int
    params: int
    seconds: float
    samples_per_s: float
    first_loss: float
    last_loss: float
    checksum: float
    """Sum of all parameters after training: equal on every rank, equal across backends."""


def init_distributed(
    backend: str = "cudampi", device: str = "auto", *, async_ops: bool | None = None
) -> DistInfo:
    """Join the job: rank/size from the launcher, the rank's GPU, the process group, a check.

    ``async_ops`` (cudampi only, :class:`cudampi.torch.Options`): True runs every collective on
    a per-group thread, overlapping backward; None (default) only those whose path blocks
    the host; False none.
    """
    import torch
    import torch.distributed as dist

    import cudampi

    info = cudampi.init()  # rank, local rank, MASTER_ADDR/PORT where missing, the rank's GPU
    options = None
    if backend == "cudampi":
        import cudampi.torch  # (registers the backend)

        options = cudampi.torch.Options(async_ops=async_ops)
    use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
    dev = torch.device("cuda", torch.cuda.current_device()) if use_cuda else torch.device("cpu")
    dist.init_process_group(backend, pg_options=options)
    t = torch.ones(1, device=dev)
    dist.all_reduce(t)
    if int(t.item()) != dist.get_world_size():
        raise RuntimeError(
            f"all_reduce of ones gave {t.item()} on rank {dist.get_rank()}, expected "
            f"{dist.get_world_size()}: the process group is broken"
        )
    return DistInfo(
        dist.get_rank(), dist.get_world_size(), info.local_rank, str(dev), backend, async_ops
    )


def build_model(width: int, depth: int) -> object:
    from torch import nn

    layers: list[nn.Module] = [nn.Linear(64, width), nn.ReLU()]
    for _ in range(depth - 1):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 10))
    return nn.Sequential(*layers)


def train(
    di: DistInfo, *, steps: int, batch: int, width: int, depth: int, warmup: int
) -> TrainResult:
    """DDP on synthetic data (a fixed random linear teacher); timed after ``warmup`` steps."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    device = torch.device(di.device)
    torch.manual_seed(0)  # the same init everywhere (DDP would broadcast rank 0's anyway)
    model = build_model(width, depth).to(device)  # type: ignore[attr-defined]
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(1234)
    teacher = (torch.randn(64, 10, generator=gen) / 8).to(device)
    gen.manual_seed(1000 + di.rank)  # each rank its own shard of the data
    losses: list[float] = []
    t0 = 0.0
    for step in range(warmup + steps):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize()
            dist.barrier()
            t0 = time.perf_counter()
        x = torch.randn(batch, 64, generator=gen).to(device)
        y = x @ teacher
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    if device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    return TrainResult(
        backend=di.backend,
        async_ops=di.async_ops,
        device=di.device,
        world_size=di.world_size,
        steps=steps,
        batch_per_rank=batch,
        params=sum(p.numel() for p in model.parameters()),
        seconds=seconds,
        samples_per_s=steps * batch * di.world_size / seconds if seconds > 0 else 0.0,
        first_loss=losses[0],
        last_loss=losses[-1],
        checksum=checksum,
    )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cudampi", help="cudampi (default), gloo or nccl")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch", type=int, default=64, help="samples per rank per step")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=3)
    p.add_argument(
        "--async-ops",
        action="store_true",
        default=None,
        help="cudampi: run every collective on a per-group thread (default: only those whose "
        "path blocks the host)",
    )
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = p.parse_args(argv)

    import torch.distributed as dist

    di = init_distributed(args.backend, args.device, async_ops=args.async_ops)
    result = train(
        di,
        steps=args.steps,
        batch=args.batch,
        width=args.width,
        depth=args.depth,
        warmup=args.warmup,
    )
    # Every rank must end with the same parameters; say so instead of assuming it.
    import torch

    sums = torch.tensor([result.checksum], dtype=torch.float64, device=torch.device(di.device))
    lo, hi = sums.clone(), sums.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    in_sync = bool(lo.item() == hi.item())
    dist.destroy_process_group()
    if di.rank == 0:
        if args.json:
            print(json.dumps({**asdict(result), "replicas_in_sync": in_sync}))
        else:
            print(
                f"DDP on {result.backend} ({result.world_size} ranks, {result.device}): "
                f"{result.samples_per_s:,.0f} samples/s over {result.steps} steps; loss "
                f"{result.first_loss:.4f} -> {result.last_loss:.4f}; replicas "
                f"{'in sync' if in_sync else 'DIFFER'}"
            )
    return 0 if in_sync else 1


if __name__ == "__main__":
    sys.exit(main())
