"""Hugging Face accelerate on the cudampi backend: create the group first, then the Accelerator.

    cudampi launch -n 2 examples/accelerate_train.py              # or: mpirun -n 2 python ...
    cudampi launch -n 2 examples/accelerate_train.py --backend gloo   # the same run on gloo

``Accelerator(kwargs_handlers=[InitProcessGroupKwargs(backend="cudampi")])`` is refused on a
CPU machine ("Your assigned backend cudampi is not available, please use gloo"): accelerate's
CPU path picks the backend itself (``mpi`` if torch was built with it, else ``gloo``) and
accelerate has no way to register another name. So the script makes the group first,
``dist.init_process_group("cudampi")``; accelerate then finds it initialized and uses it (its
``state.backend`` still *says* gloo on the CPU path: a label, every collective runs on cudampi).
On a GPU machine under ``cudampi launch`` (which sets LOCAL_RANK) accelerate passes
``InitProcessGroupKwargs(backend="cudampi")`` through as well; creating the group first works in
both cases.

It trains a small regression model, saves the state (``save_state``), trains two more steps,
loads the state back (``load_state``) and trains the same two steps again: the parameters must
repeat exactly. Rank 0 prints the final parameters (``--json``): equal to gloo's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cudampi")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="accelerate-out", help="save_state folder")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    if args.backend == "cudampi":
        import cudampi.torch  # noqa: F401  (registers the backend)

    # 1. The group first: rank and size from the MPI launcher, no MASTER_ADDR needed.
    dist.init_process_group(args.backend)
    from accelerate import Accelerator

    # 2. The Accelerator finds the group. cpu=True on a machine without GPUs: accelerate's
    # GPU path would otherwise see no accelerator and run as a single process.
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    if accelerator.num_processes != dist.get_world_size():
        raise RuntimeError(
            f"accelerate sees {accelerator.num_processes} processes, torch "
            f"{dist.get_world_size()}: it did not take the existing process group"
        )

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    data = DataLoader(TensorDataset(x, y), batch_size=16)
    model, opt, data = accelerator.prepare(model, opt, data)

    batches = iter(data)

    def train(steps: int) -> None:
        for _ in range(steps):
            xb, yb = next(batches)
            opt.zero_grad()
            accelerator.backward(nn.functional.mse_loss(model(xb), yb))
            opt.step()

    def params() -> torch.Tensor:
        return torch.cat([q.detach().reshape(-1).clone() for q in model.parameters()])

    train(args.steps)
    accelerator.save_state(args.out)
    train(2)
    after = params()
    accelerator.load_state(args.out)
    batches = iter(data)
    for _ in range(args.steps):  # the same batches as after the save
        next(batches)
    train(2)
    repeat = params()
    everyone = accelerator.gather(repeat.unsqueeze(0))
    result = {
        "backend": dist.get_backend(),
        "accelerate_backend_label": accelerator.state.backend,
        "world_size": accelerator.num_processes,
        "load_state_repeats": bool(torch.equal(after, repeat)),
        "replicas_in_sync": bool((everyone == everyone[0]).all()),
        "params": [round(float(v), 6) for v in repeat],
    }
    if accelerator.is_main_process:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(
                f"accelerate on {result['backend']}: {result['world_size']} ranks, state "
                f"reloaded exactly: {result['load_state_repeats']}, replicas in sync: "
                f"{result['replicas_in_sync']}, checksum {sum(result['params']):.6f}"
            )
    accelerator.end_training()  # destroys the process group too
    if args.backend == "gloo":  # torch's gloo threads vs a finalizing interpreter (docs/torch.md)
        time.sleep(1)
    return 0 if result["load_state_repeats"] and result["replicas_in_sync"] else 1


if __name__ == "__main__":
    sys.exit(main())
