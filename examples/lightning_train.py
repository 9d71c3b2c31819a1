"""PyTorch Lightning on the cudampi backend: ``DDPStrategy(process_group_backend="cudampi")``.

    cudampi launch -n 2 examples/lightning_train.py            # or: mpirun -n 2 python ...
    cudampi launch -n 2 examples/lightning_train.py --backend gloo   # the same run on gloo
    python examples/lightning_train.py --devices 2 --lightning-env   # Lightning's own launcher

Under an MPI launcher Lightning picks its ``MPIEnvironment`` (ranks from MPI) and cudampi's
group runs on the launcher's MPI job. Under Lightning's own launcher (``python train.py`` with
``devices=2``) Lightning starts the processes itself; its MPIEnvironment detection starts MPI in
each of them first (a one-process job), so cudampi cannot join them into one MPI job. Pass
``plugins=[LightningEnvironment()]`` (``--lightning-env`` here) so that MPI starts only when
the cudampi group is made: cudampi then joins the processes as under torchrun, which needs an
MPICH-family MPI (see docs/torch.md); with the Open MPI wheel use an MPI launcher.

The script fits a small regression model, saves a checkpoint, resumes from it for two more
steps and prints (rank 0, ``--json``) the final parameters' checksum, which must equal gloo's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping, Sequence


def build(seed: int = 0):  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl
    import torch
    from torch import nn

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(seed)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    return Regression()


def loader():  # type: ignore[no-untyped-def]
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    y = x.sum(dim=1, keepdim=True) + 0.1 * torch.randn(256, 1, generator=g)
    # Lightning adds a DistributedSampler: each rank gets its own shard of the batches.
    return DataLoader(TensorDataset(x, y), batch_size=16)


def trainer(args: argparse.Namespace, steps: int):  # type: ignore[no-untyped-def]
    import lightning.pytorch as pl
    from lightning.pytorch.strategies import DDPStrategy

    plugins = []
    if args.lightning_env:
        from lightning.pytorch.plugins.environments import LightningEnvironment

        plugins.append(LightningEnvironment())
    return pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        strategy=DDPStrategy(process_group_backend=args.backend),
        plugins=plugins,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.out,
    )


def launcher_sizes(env: Mapping[str, str]) -> tuple[int, int]:
    """(ranks in the job, ranks on this node) from the MPI launcher's variables, else (1, 1):
    Lightning wants devices per node and num_nodes, and checks them against MPI's world size."""

    def first(*names: str) -> int:
        for name in names:
            if env.get(name, "").isdigit():
                return int(env[name])
        return 0

    world = first("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "SLURM_NTASKS")
    local = first("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")
    return world or 1, local or world or 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cudampi")
    p.add_argument("--devices", type=int, help="ranks per node (default: the MPI launcher's)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--lightning-env", action="store_true", help="plugins=[LightningEnvironment()]")
    p.add_argument("--out", default="lightning-out", help="checkpoint folder")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    world, local = launcher_sizes(os.environ)
    args.devices = args.devices or local
    args.num_nodes = world // local if world % local == 0 else 1

    import torch
    import torch.distributed as dist

    if args.backend == "cudampi":
        import cudampi.torch  # noqa: F401  (registers the backend)

    model = build()
    t = trainer(args, args.steps)
    t.fit(model, loader())
    ckpt = os.path.join(args.out, "last.ckpt")
    t.save_checkpoint(ckpt)  # every rank takes part; rank 0 writes
    # Resume from the checkpoint for two more steps (optimizer state and step count restored).
    resumed = build(seed=123)  # different init: the checkpoint must overwrite it
    t2 = trainer(args, args.steps + 2)
    t2.fit(resumed, loader(), ckpt_path=ckpt)
    flat = torch.cat([q.detach().reshape(-1) for q in resumed.parameters()])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    result = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "global_step": t2.global_step,
        "replicas_in_sync": bool(torch.equal(lo, hi)),
        "params": [round(float(v), 6) for v in flat],
    }
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(
                f"Lightning on {result['backend']}: {result['world_size']} ranks, step "
                f"{result['global_step']}, replicas in sync: {result['replicas_in_sync']}, "
                f"checksum {sum(result['params']):.6f}"
            )
    dist.destroy_process_group()  # Lightning leaves the group up
    if args.backend == "gloo":  # torch's gloo threads vs a finalizing interpreter (docs/torch.md)
        time.sleep(1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
