"""``cudampi bench ddp``: training throughput of a real model under DistributedDataParallel,
per torch.distributed backend, against a no-communication baseline (``local``).

The models, rounds, table and JSON are the shared runner's (:mod:`cudampi.bench.train`). On
CUDA the default runs both models, one after the other, each against its own ``local``; on the
CPU the transformer. The check is DDP's own invariant: after the timed steps every rank holds
the same parameters (per-parameter float64 sums compared across ranks; a differing parameter is
one #wrong). Whether the CUDA MPS daemon was serving the run is reported with it
(``meta.mps``): ranks sharing a GPU time-slice it without MPS.

``ddp-nocomm`` is DDP whose comm hook hands every bucket back untouched: DDP's own cost (bucket
copies, hooks, the buffer broadcast) without gradient communication, the ceiling for every
backend; its replicas differ by design, so it is not checked.
"""

from __future__ import annotations

from typing import Any

from cudampi.bench import train
from cudampi.bench.adapters import DDP_PATHS, Skip
from cudampi.bench.options import DDP_OPTIONS
from cudampi.bench.session import Session

UNCHECKED = ("local", "ddp-nocomm")
"""Paths whose replicas legitimately differ (no gradient is averaged): no #wrong check."""


class DDPMethod(train.Method):
    """Every path but ``local`` trains under DistributedDataParallel on its backend's group."""

    mode = "ddp"
    unchecked = UNCHECKED

    def __init__(self, settings: dict[str, Any]) -> None:
        self.ddp_settings = settings

    def wrap(self, s: Session, path: str, w: train.Workload, device: Any) -> Any:
        return wrap_ddp(s, path, w.model, device, self.ddp_settings)

    def settings(self, path: str, net: Any) -> tuple[str, dict[str, Any]] | None:
        return None if path == "local" else ("ddp", settings_of(net))

    def wrong(self, s: Session, o: Any, path: str, w: train.Workload) -> int:
        return _count_wrong(s, o, w.model)


def wrap_ddp(s: Session, path: str, model: Any, device: Any, settings: dict[str, Any]) -> Any:
    """``model`` in DistributedDataParallel on ``path``'s backend (:class:`Skip` where that
    backend cannot train here) with ``settings`` (--ddp-option); ``ddp-nocomm`` on the run's
    default group, with a comm hook that communicates nothing."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    backend = DDP_PATHS[path]
    why = s.nccl_refusal(s.device) if backend == "nccl" else None
    if why is not None:
        raise Skip(why)
    group = _default_group(s) if backend is None else s.torch_group(backend)
    ids = [device.index] if device.type == "cuda" else None
    net = DDP(model, device_ids=ids, process_group=group, **settings)
    if backend is None:
        net.register_comm_hook(None, _nocomm_hook(device))
    return net


def settings_of(net: Any) -> dict[str, Any]:
    """The settings DistributedDataParallel runs with (DDP's defaults or --ddp-option's), as it
    reports them, for the JSON."""
    out = {name: getattr(net, name, None) for name in DDP_OPTIONS if name != "bucket_cap_mb"}
    cap = getattr(net, "bucket_bytes_cap", None)
    out["bucket_cap_mb"] = None if cap is None else cap / 2**20
    return out


def _default_group(s: Session) -> Any:
    """torch's default group in this run: the one the torch paths' DDP would meet (cudampi's
    when a torch-cudampi path is asked, else gloo's). DDP still broadcasts the initial weights
    and, every forward, the buffers (BatchNorm's statistics) on it."""
    backend = s.torch_default
    try:
        return s.torch_group(backend)
    except Exception:
        if s.torch_default == backend:
            raise
        return s.torch_group(s.torch_default)  # cudampi's world group failed: gloo's is it


def _nocomm_hook(device: Any) -> Any:
    """A DDP comm hook that hands the bucket back untouched: no communication, no averaging."""
    import torch

    # No annotations: DDP refuses a hook whose annotations are not dist.GradBucket and
    # Future[Tensor] (and under `from __future__ import annotations` every one is a string).
    def hook(state, bucket):  # type: ignore[no-untyped-def]
        cuda = device.type == "cuda"
        fut: Any = torch.futures.Future(devices=[device]) if cuda else torch.futures.Future()
        fut.set_result(bucket.buffer())
        return fut

    return hook


def _param_sums(model: Any) -> list[float]:
    import torch

    with torch.no_grad():
        return [float(p.detach().double().sum().item()) for p in model.parameters()]


def _count_wrong(s: Session, o: Any, model: Any) -> int:
    """Parameters that differ from rank 0's after training (DDP keeps the replicas equal)."""
    import torch

    if o.corrupt_rank == s.rank:
        # test-only: this rank's first parameter really diverges before the check
        with torch.no_grad():
            next(model.parameters()).view(-1)[0] += 1.0
    every = s.comm.allgather(_param_sums(model))
    ref = every[0]
    return sum(1 for r in every[1:] for a, b in zip(r, ref) if abs(a - b) > 1e-6 * max(1.0, abs(b)))


def main(session: Session, o: Any, meta: dict[str, Any]) -> int:
    return train.main(session, o, meta, DDPMethod(dict(o.ddp_options)))
