"""``cudampi bench fsdp``: training throughput under FSDP2 (``torch.distributed.fsdp.fully_shard``,
torch >= 2.6) per torch.distributed backend, against ``local`` (one rank's model, unsharded and
without communication: the ceiling) and, in the same run, DistributedDataParallel on the same
backends (``ddp-<path>``), so the report states FSDP2/DDP per backend and each backend's FSDP2
against torch-gloo's.

The models, rounds, table and JSON are the shared runner's (:mod:`cudampi.bench.train`); by
default the transformer. Each of the model's blocks (the transformer's encoder layers, ResNet-50's
bottlenecks) is one ``fully_shard`` unit and the root another, on a 1-D DeviceMesh over the
path's group.

The check: every rank also trains the unwrapped model alone on every rank's batch (each loss
divided by the rank count, the gradients accumulated: what data-parallel training computes),
without any communication. A path's parameters must have moved as that reference's did: per
parameter, the float64 sum and the sum of absolute values of (final - initial) must agree within
:data:`RTOL` of the reference's, plus :data:`SPREAD` times how far the reference runs differ
(each rank trains it twice on CUDA, where some kernels' backward adds in no fixed order, so a
training run differs from its own repeat: the spread of every rank's runs together; on the CPU
they agree bitwise); FSDP2's shards are summed over the ranks (through MPI, not the backend under
test), DDP's replicas are compared on every rank. A parameter that does not is one #wrong, and
rank 0 names the one that strayed furthest, and on which rank.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

from cudampi.bench import train
from cudampi.bench.adapters import FSDP_PATHS, FSDP_PEERS, Skip
from cudampi.bench.ddp import DDPMethod
from cudampi.bench.session import Session

RTOL = 1e-4
"""How far (relative to the sum of |update|) a parameter's update may stray from the reference's:
reduction order moves it by ~1e-7; a wrong or unaveraged gradient by ~1."""
SPREAD = 10.0
"""How many times the reference's own run-to-run difference a path's update may stray further."""


class FSDPMethod(train.Method):
    """FSDP2 paths shard the model with ``fully_shard``; ``ddp-<path>`` paths are DDP's."""

    mode = "fsdp"
    diverged = "parameters moved unlike the reference training"

    def __init__(self, ddp_settings: dict[str, Any], check: bool) -> None:
        self.ddp = DDPMethod(ddp_settings)
        self.check = check
        self.reference: dict[str, Any] = {}
        self.spread: dict[str, Any] = {}
        self.start: list[Any] = []

    def prepare(self, s: Session, o: Any, kind: str, device: Any, batch: int) -> None:
        if s.rank == 0 and not o.quiet:
            print(f"# fsdp reference {kind} (every rank's batch, one process)", file=sys.stderr)
        import numpy as np
        from mpi4py import MPI

        runs = [
            reference_update(kind, device, batch, o.image_size, s.size, train.steps_per_pass(o))
            for _ in range(2 if device.type == "cuda" else 1)
        ]
        self.reference[kind] = runs[0]
        # the spread of every rank's runs together (each rank trains its own reference: two
        # runs alone can agree by chance on a parameter whose backward adds in no fixed order)
        hi, lo = np.maximum.reduce(runs), np.minimum.reduce(runs)
        s.comm.Allreduce(MPI.IN_PLACE, hi, op=MPI.MAX)
        s.comm.Allreduce(MPI.IN_PLACE, lo, op=MPI.MIN)
        self.spread[kind] = hi - lo

    def wrap(self, s: Session, path: str, w: train.Workload, device: Any) -> Any:
        self.start = []  # the last pass's copy goes before this one's is made
        if path in FSDP_PEERS:
            net = self.ddp.wrap(s, FSDP_PEERS[path], w, device)
        else:
            net = shard(s, path, w, device)
        self.start = _local_copies(w.model) if self.check else []
        return net

    def settings(self, path: str, net: Any) -> tuple[str, dict[str, Any]] | None:
        if path in FSDP_PEERS:
            return self.ddp.settings(path, net)
        if path == "local":
            return None
        from torch.distributed.fsdp import FSDPModule

        return "fsdp", {"units": sum(isinstance(m, FSDPModule) for m in net.modules())}

    def wrong(self, s: Session, o: Any, path: str, w: train.Workload) -> int:
        import numpy as np
        from mpi4py import MPI

        params = list(w.model.parameters())
        if o.corrupt_rank == s.rank:  # test-only: a real divergence, in this rank's shard
            _local(params[0]).view(-1)[:1].add_(1.0)
        mine = _update_sums(params, self.start)
        sharded = np.array([hasattr(p, "to_local") for p in params])
        summed = np.where(sharded[:, None], mine, 0.0)
        s.comm.Allreduce(MPI.IN_PLACE, summed, op=MPI.SUM)
        mine = np.where(sharded[:, None], summed, mine)
        ref, spread = self.reference[w.name], self.spread[w.name]
        bad = (~same_update(mine, ref, spread=spread)).astype(np.int64)
        s.comm.Allreduce(MPI.IN_PLACE, bad, op=MPI.SUM)
        if bad.any():
            # the furthest of every rank's (DDP compares each rank's replica with its reference)
            worst = s.comm.gather((*worst_update(mine, ref, spread), s.rank), root=0)
            if s.rank == 0:
                names = [n for n, _ in w.model.named_parameters()]
                i, off, allowed, rank = max(worst, key=lambda x: x[1] / x[2])
                print(
                    f"# fsdp {path} {w.name}: {int(np.count_nonzero(bad))} parameter(s) moved "
                    f"unlike the reference; furthest: {names[i]} on rank {rank}, {off:.2e} of its "
                    f"update's size (allowed {allowed:.2e}: {RTOL:.0e} + {SPREAD:.0f} x the "
                    "references' own spread)",
                    file=sys.stderr,
                )
        return int(np.count_nonzero(bad))

    def notes(self, kind: str, rows: list[train.TrainRow]) -> tuple[list[str], dict[str, Any]]:
        found = ratios({r.path: r.samples_per_s for r in rows})
        return ratio_lines(found), found


def shard(s: Session, path: str, w: train.Workload, device: Any) -> Any:
    """``w.model`` under FSDP2 on ``path``'s backend: one ``fully_shard`` per block, then the
    root (:class:`Skip` where this torch has no FSDP2 or the backend cannot run here)."""
    import torch

    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        raise Skip(
            "FSDP2 needs torch >= 2.6 (torch.distributed.fsdp.fully_shard); "
            f"this is torch {torch.__version__}"
        ) from None
    from torch.distributed.device_mesh import DeviceMesh

    backend = FSDP_PATHS[path]
    why = s.nccl_refusal(s.device) if backend == "nccl" else None
    if why is not None:
        raise Skip(why)
    # The root returns nn.Linear's output, a view; FSDP2 warns that an in-place op on it would
    # skip a hook. The loss only reads it: the warning, once per rank, says nothing here.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    mesh = DeviceMesh.from_group(s.torch_group(backend), device.type)
    for block in w.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(w.model, mesh=mesh)


def reference_update(
    kind: str, device: Any, batch: int, image_size: int | None, ranks: int, steps: int
) -> Any:
    """What data-parallel training on ``ranks`` ranks does to the parameters over ``steps``
    steps, computed in this process without communication: per parameter, the sum and the sum
    of absolute values of (final - initial), float64, shape (parameters, 2)."""
    w = train.build(kind, device, batch, image_size, 0)
    data = [train.inputs(kind, device, batch, image_size, r) for r in range(ranks)]
    start = _local_copies(w.model)
    opt = train.make_optimizer(w.model.parameters())
    for _ in range(steps):
        opt.zero_grad(set_to_none=True)
        for x, y in data:
            (w.loss(w.model(x), y) / ranks).backward()
        opt.step()
    return _update_sums(list(w.model.parameters()), start)


def _local(p: Any) -> Any:
    """This rank's part of a parameter: an FSDP2 DTensor's shard, else the tensor itself."""
    return (p.to_local() if hasattr(p, "to_local") else p).detach()


def _local_copies(model: Any) -> list[Any]:
    return [_local(p).clone() for p in model.parameters()]


def _update_sums(params: list[Any], start: list[Any]) -> Any:
    import numpy as np
    import torch

    out = np.zeros((len(params), 2))
    with torch.no_grad():
        for i, (p, p0) in enumerate(zip(params, start)):
            d = _local(p).double() - p0.double()
            out[i] = (float(d.sum().item()), float(d.abs().sum().item()))
    return out


def _slack(ref: Any, spread: Any, rtol: float) -> Any:
    """Per parameter and sum, how far an update may stray from the reference's (pure)."""
    import numpy as np

    ref = np.asarray(ref, dtype=float)
    return (rtol * ref[:, 1] + 1e-12)[:, None] + SPREAD * np.asarray(spread, dtype=float)


def same_update(mine: Any, ref: Any, rtol: float = RTOL, spread: Any = 0.0) -> Any:
    """Per parameter, whether the (sum, sum of |.|) of its update agrees with the reference's
    within ``rtol`` of the reference's sum of |update|, plus :data:`SPREAD` times ``spread``
    (the reference's own run-to-run difference, per parameter and sum) (pure)."""
    import numpy as np

    mine, ref = np.asarray(mine, dtype=float), np.asarray(ref, dtype=float)
    return np.all(np.abs(mine - ref) <= _slack(ref, spread, rtol), axis=1)


def worst_update(mine: Any, ref: Any, spread: Any = 0.0) -> tuple[int, float, float]:
    """(parameter index, how far its update strayed, how far it might), both relative to the
    reference's sum of |update|: the parameter that strayed furthest beyond its slack (pure)."""
    import numpy as np

    mine, ref = np.asarray(mine, dtype=float), np.asarray(ref, dtype=float)
    size = ref[:, 1] + 1e-30
    off = (np.abs(mine - ref) / size[:, None]).max(axis=1)
    allowed = (_slack(ref, spread, RTOL) / size[:, None]).min(axis=1)
    i = int(np.argmax(off / allowed))
    return i, float(off[i]), float(allowed[i])


def ratios(rate: dict[str, float]) -> dict[str, dict[str, float]]:
    """From each path's throughput: FSDP2 over DDP on the same backend (``fsdp_vs_ddp``), and
    each backend's FSDP2 over torch-gloo's (``fsdp_vs_gloo``), where both ran (pure)."""
    vs_ddp = {
        p: rate[p] / rate[peer] for peer, p in FSDP_PEERS.items() if p in rate and peer in rate
    }
    gloo = rate.get("torch-gloo")
    vs_gloo = {p: rate[p] / gloo for p in FSDP_PATHS if gloo and p != "torch-gloo" and p in rate}
    return {k: v for k, v in (("fsdp_vs_ddp", vs_ddp), ("fsdp_vs_gloo", vs_gloo)) if v}


def ratio_lines(found: dict[str, dict[str, float]]) -> list[str]:
    """The ratios as lines under a model's table."""
    words = {
        "fsdp_vs_ddp": "FSDP2 / DDP on the same backend",
        "fsdp_vs_gloo": "FSDP2 / torch-gloo's FSDP2",
    }
    return [
        f"{words[key]}: " + ", ".join(f"{p} {v:.2f}x" for p, v in found[key].items())
        for key in words
        if key in found
    ]


def main(session: Session, o: Any, meta: dict[str, Any]) -> int:
    return train.main(session, o, meta, FSDPMethod(dict(o.ddp_options), o.check))
