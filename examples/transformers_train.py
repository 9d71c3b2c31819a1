"""Hugging Face transformers ``Trainer`` on the cudampi backend: create the group first.

    cudampi launch -n 2 examples/transformers_train.py              # or: mpirun -n 2 python ...
    cudampi launch -n 2 examples/transformers_train.py --backend gloo   # the same run on gloo

``TrainingArguments(ddp_backend="cudampi")`` is refused: the Trainer hands the name to
accelerate, whose CPU path picks ``mpi`` or ``gloo`` itself ("Your assigned backend cudampi is
not available"), and ``ddp_backend`` lists its choices (nccl, gloo, mpi, xccl, hccl, ...). So the
script makes the group first, ``dist.init_process_group("cudampi")``, and leaves ``ddp_backend``
unset: the Trainer finds the group and wraps the model in DDP on it.

It trains a small model (no download: a plain ``nn.Module`` returning ``{"loss": ...}``) for
``--steps`` steps with checkpoints every ``--steps // 2``, then a second Trainer resumes from the
middle checkpoint and must reach the same parameters. Rank 0 prints them (``--json``): equal to
gloo's.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="cudampi")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="trainer-out", help="Trainer output_dir")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    import torch
    import torch.distributed as dist
    from torch import nn

    if args.backend == "cudampi":
        import cudampi.torch  # noqa: F401  (registers the backend)

    # 1. The group first: rank and size from the MPI launcher, no MASTER_ADDR needed.
    dist.init_process_group(args.backend)
    from transformers import Trainer, TrainingArguments

    class Regression(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))

        def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
            out = self.net(x)
            loss = nn.functional.mse_loss(out, labels) if labels is not None else None
            return {"loss": loss, "logits": out}

    g = torch.Generator().manual_seed(1)
    xs = torch.randn(256, 8, generator=g)
    data = [{"x": x, "labels": x.sum().reshape(1)} for x in xs]

    def arguments(output_dir: str) -> TrainingArguments:
        # 2. ddp_backend left unset: the Trainer takes the group made above.
        return TrainingArguments(
            output_dir=output_dir,
            use_cpu=not torch.cuda.is_available(),
            per_device_train_batch_size=8,
            max_steps=args.steps,
            learning_rate=0.05,
            optim="sgd",
            lr_scheduler_type="constant",
            save_strategy="steps",
            save_steps=max(1, args.steps // 2),
            logging_strategy="no",
            report_to=[],
            seed=0,
            disable_tqdm=True,
        )

    first = Trainer(model=Regression(), args=arguments(args.out), train_dataset=data)
    first.train()
    if (
        first.args.parallel_mode.name != "DISTRIBUTED"
        or first.args.world_size != dist.get_world_size()
    ):
        raise RuntimeError(
            f"the Trainer did not take the process group: {first.args.parallel_mode}"
        )
    final = torch.cat([q.detach().reshape(-1) for q in first.model.parameters()])
    middle = os.path.join(args.out, f"checkpoint-{max(1, args.steps // 2)}")
    second = Trainer(model=Regression(), args=arguments(args.out + "-resumed"), train_dataset=data)
    second.train(resume_from_checkpoint=middle)
    resumed = torch.cat([q.detach().reshape(-1) for q in second.model.parameters()])
    lo, hi = resumed.clone(), resumed.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    result = {
        "backend": dist.get_backend(),
        "world_size": dist.get_world_size(),
        "resume_repeats": bool(torch.allclose(final, resumed, atol=1e-6)),
        "replicas_in_sync": bool(torch.equal(lo, hi)),
        "params": [round(float(v), 6) for v in final],
    }
    if dist.get_rank() == 0:
        if args.json:
            print(json.dumps(result), flush=True)
        else:
            print(
                f"Trainer on {result['backend']}: {result['world_size']} ranks, resumed run "
                f"repeats: {result['resume_repeats']}, replicas in sync: "
                f"{result['replicas_in_sync']}, checksum {sum(result['params']):.6f}"
            )
    if dist.is_initialized():
        dist.destroy_process_group()
    if args.backend == "gloo":  # torch's gloo threads vs a finalizing interpreter (docs/torch.md)
        time.sleep(1)
    return 0 if result["resume_repeats"] and result["replicas_in_sync"] else 1


if __name__ == "__main__":
    sys.exit(main())
