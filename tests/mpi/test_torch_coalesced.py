"""Coalesced collectives of the cudampi backend: one Communicator call per dtype, not per tensor.

``allreduce_coalesced``, ``allgather_into_tensor_coalesced`` and ``reduce_scatter_tensor_coalesced``
(what torch's ``_coalescing_manager`` and the functional ``*_coalesced`` collectives issue)
flatten every tensor of one device and dtype into one buffer, run ONE Communicator collective
and copy the pieces back. Checked on real ranks (2 and 3) against gloo (tests/mpi/
test_torch_backend.py's helpers): mixed shapes and dtypes (several dtypes in one call), an empty
tensor, non-contiguous outputs, ``async_ops``, the functional forms; then DDP with a comm hook
that all-reduces a bucket's gradients through ``_coalescing_manager``, and FSDP2 with custom
all-gather / reduce-scatter comms that split each call in pieces and coalesce them, both
reaching gloo's parameters. A counter on the Communicator proves the call counts (calls per
step, not time).
"""

from __future__ import annotations

import pytest

from cudampi.names import COLLECTIVES
from tests.mpi.test_torch_backend import Checks, _init, _try_gloo, data, local_reduce
from tests.mpi.test_torch_ddp import assert_same, batch, make_model
from tests.mpirun import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

COUNTED = tuple(c for c in COLLECTIVES if c != "split")  # the calls torch makes

# (shape, dtype): several dtypes interleaved, an empty tensor among them
MIXED = [
    ((2, 3), "float32"),
    ((4,), "int64"),
    ((0,), "float32"),
    ((5,), "bfloat16"),
    ((1, 2, 2), "float32"),
    ((3,), "float64"),
    ((2, 2), "int64"),
]


class CallCounter:
    """Counts the collectives a Communicator runs (its methods wrapped on the instance)."""

    def __init__(self, comm):
        self.counts = {}
        for name in COUNTED:
            setattr(comm, name, self._wrap(name, getattr(comm, name)))

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] = self.counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    def take(self):
        out, self.counts = self.counts, {}
        return out


def _groups(specs):
    return len({dtype for _, dtype in specs})


def check_allreduce_coalesced(ck, dist, gloo, counter, rank, n):
    import torch
    from torch.distributed.distributed_c10d import _coalescing_manager

    R = dist.ReduceOp
    for seed, op in enumerate(("SUM", "MAX", "AVG")):
        specs = [(s, d) for s, d in MIXED if op != "AVG" or d != "int64"]  # (avg: floats only)
        for async_ops in (False, True):
            ts = [data(300 + 10 * seed + k, rank, s, d) for k, (s, d) in enumerate(specs)]
            ours = [t.clone() for t in ts]
            counter.take()
            with _coalescing_manager(async_ops=async_ops) as cm:
                for t in ours:
                    dist.all_reduce(t, op=getattr(R, op))
            if async_ops:
                cm.wait()
            assert counter.take() == {"allreduce": _groups(specs)}, f"allreduce_coalesced {op}"
            for k, (s, d) in enumerate(specs):
                want = local_reduce([data(300 + 10 * seed + k, r, s, d) for r in range(n)], op)
                ck.close(ours[k], want, f"allreduce_coalesced {op} {d} {s}")
                theirs = ts[k].clone()
                if op != "AVG" and _try_gloo(
                    lambda t=theirs, op=op: dist.all_reduce(t, op=getattr(R, op), group=gloo)
                ):
                    ck.close(ours[k], theirs, f"allreduce_coalesced {op} {d} vs gloo", gloo=True)
    # PREMUL_SUM (FSDP's divide folded in), and a non-contiguous tensor.
    ts = [data(350, rank, (3, 4), "float32").t(), data(351, rank, (5,), "float32")]
    with _coalescing_manager():
        for t in ts:
            dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    for k, (x, shape) in enumerate(zip(ts, ((3, 4), (5,)))):
        full = [data(350 + k, r, shape, "float32") for r in range(n)]
        want = local_reduce(full, "SUM") * 0.5
        ck.close(x, want.t() if k == 0 else want, f"allreduce_coalesced PREMUL_SUM {k}")
    # The deprecated front end calls the same method.
    ts = [torch.full((3,), float(rank)), torch.full((2, 2), 1.0)]
    counter.take()
    dist.all_reduce_coalesced(ts)
    assert counter.take() == {"allreduce": 1}
    ck.close(ts[0], torch.full((3,), float(sum(range(n)))), "all_reduce_coalesced")
    ck.close(ts[1], torch.full((2, 2), float(n)), "all_reduce_coalesced")


def check_allgather_coalesced(ck, dist, gloo, counter, rank, n):
    import torch
    from torch.distributed.distributed_c10d import _coalescing_manager

    for async_ops in (False, True):
        ins = [data(400 + k, rank, s, d) for k, (s, d) in enumerate(MIXED)]
        outs = [torch.empty((n * s[0], *s[1:]), dtype=t.dtype) for t, (s, _) in zip(ins, MIXED)]
        outs[0] = torch.empty((3, 2 * n)).t()  # a non-contiguous output: (2n, 3) strided
        counter.take()
        with _coalescing_manager(async_ops=async_ops) as cm:
            for out, t in zip(outs, ins):
                dist.all_gather_into_tensor(out, t)
        if async_ops:
            cm.wait()
        assert counter.take() == {"allgather": _groups(MIXED)}, "allgather_into_tensor_coalesced"
        for k, (s, d) in enumerate(MIXED):
            want = torch.cat([data(400 + k, r, s, d) for r in range(n)])
            ck.close(outs[k], want, f"allgather_into_tensor_coalesced {d} {s}")
            theirs = torch.empty_like(want)
            if _try_gloo(lambda o=theirs, t=ins[k]: dist.all_gather_into_tensor(o, t, group=gloo)):
                ck.close(outs[k], theirs, f"allgather coalesced {d} vs gloo", gloo=True)
    # The functional form (DTensor, torch.compile's bucketing) reaches the same method from C++.
    import torch.distributed._functional_collectives as funcol

    pg = dist.distributed_c10d._get_default_group()
    ins = [torch.full((2,), float(rank)), torch.full((3, 2), float(rank) + 0.5)]
    counter.take()
    got = funcol.all_gather_into_tensor_coalesced(ins, pg)
    got = [funcol.wait_tensor(g) for g in got]
    assert counter.take() == {"allgather": 1}, "functional all_gather_into_tensor_coalesced"
    ck.close(got[0], torch.arange(n, dtype=torch.float32).repeat_interleave(2), "funcol agc 0")
    ck.close(
        got[1].view(n, 3, 2)[:, 0, 0], torch.arange(n, dtype=torch.float32) + 0.5, "funcol agc 1"
    )


def check_reduce_scatter_coalesced(ck, dist, gloo, counter, rank, n):
    import torch
    from torch.distributed.distributed_c10d import _coalescing_manager

    R = dist.ReduceOp
    specs = [(s, d) for s, d in MIXED if d != "bfloat16"]  # gloo has no bfloat16 reduce_scatter
    specs.append(((5,), "bfloat16"))
    every = specs
    for seed, (op, async_ops) in enumerate((("SUM", False), ("MAX", True), ("AVG", False))):
        specs = [(s, d) for s, d in every if op != "AVG" or d != "int64"]  # (avg: floats only)
        ins = [
            data(500 + 10 * seed + k, rank, (n * s[0], *s[1:]), d) for k, (s, d) in enumerate(specs)
        ]
        outs = [torch.empty(s, dtype=t.dtype) for t, (s, _) in zip(ins, specs)]
        counter.take()
        with _coalescing_manager(async_ops=async_ops) as cm:
            for out, t in zip(outs, ins):
                dist.reduce_scatter_tensor(out, t.clone(), op=getattr(R, op))
        if async_ops:
            cm.wait()
        assert counter.take() == {"reduce_scatter": _groups(specs)}, f"rs coalesced {op}"
        for k, (s, d) in enumerate(specs):
            full = local_reduce(
                [data(500 + 10 * seed + k, r, (n * s[0], *s[1:]), d) for r in range(n)], op
            )
            ck.close(outs[k], full[rank * s[0] : (rank + 1) * s[0]], f"rs coalesced {op} {d} {s}")
            theirs = torch.empty_like(outs[k])
            if op != "AVG" and _try_gloo(
                lambda o=theirs, t=ins[k], op=op: dist.reduce_scatter_tensor(
                    o, t.clone(), op=getattr(R, op), group=gloo
                )
            ):
                ck.close(outs[k], theirs, f"rs coalesced {op} {d} vs gloo", gloo=True)
    # PREMUL_SUM, as FSDP2 issues it.
    ins = [data(560, rank, (n * 3,), "float32"), data(561, rank, (n * 2, 2), "float32")]
    outs = [torch.empty(3), torch.empty(2, 2)]
    with _coalescing_manager():
        for out, t in zip(outs, ins):
            dist.reduce_scatter_tensor(out, t, op=dist._make_nccl_premul_sum(1.0 / n))
    for k, shape in enumerate(((3,), (2, 2))):
        full = local_reduce(
            [data(560 + k, r, (n * shape[0], *shape[1:]), "float32") for r in range(n)], "SUM"
        )
        ck.close(outs[k], full[rank * shape[0] : (rank + 1) * shape[0]] / n, f"rs PREMUL_SUM {k}")


def coalesced_hook(state, bucket):
    """A DDP comm hook: the bucket's gradients (views into its buffer) averaged by one
    coalesced all_reduce over ``state`` (the group)."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager

    group = state
    grads = bucket.gradients()
    with _coalescing_manager(group=group, async_ops=True) as cm:
        for g in grads:
            dist.all_reduce(g, group=group)
    cm.wait()
    buf = bucket.buffer()
    buf.div_(dist.get_world_size(group))
    fut = torch.futures.Future()
    fut.set_result(buf)
    return fut


def train_ddp_coalesced(group, steps, counter=None):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = make_model(seed=rank)
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.002, broadcast_buffers=False)
    ddp.register_comm_hook(group, coalesced_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    per_step = []
    for step in range(steps):
        if counter is not None:
            counter.take()
        opt.zero_grad()
        x, y = batch(step, rank, torch.device("cpu"))
        nn.functional.mse_loss(ddp(x), y).backward()
        opt.step()
        if counter is not None:
            per_step.append(counter.take())
    params = [p.detach().clone() for p in model.parameters()]
    return params, per_step, len(ddp.reducer._get_zeros_like_grad_buckets())


def _fsdp_comms(pieces):
    """FSDP2 all-gather / reduce-scatter comms that cut each call in ``pieces`` and issue them
    coalesced (what a bucketing compiler pass does), rearranging to FSDP2's layout."""
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _coalescing_manager
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter

    def cuts(k):
        step = -(-k // pieces)
        return [(lo, min(lo + step, k)) for lo in range(0, k, step)] or [(0, 0)]

    class Alloc:
        def allocate(self, size, *, dtype, device):
            return torch.empty(*size, dtype=dtype, device=device)

    class PiecewiseAllGather(Alloc, AllGather):
        def __call__(self, output_tensor, input_tensor, group, async_op=False):
            n, k = group.size(), input_tensor.numel()
            parts = [(lo, hi, input_tensor.new_empty(n * (hi - lo))) for lo, hi in cuts(k)]
            with _coalescing_manager(group=group):
                for lo, hi, out in parts:
                    dist.all_gather_into_tensor(out, input_tensor[lo:hi], group=group)
            rows = output_tensor.view(n, k)
            for lo, hi, out in parts:
                rows[:, lo:hi].copy_(out.view(n, hi - lo))

    class PiecewiseReduceScatter(Alloc, ReduceScatter):
        def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
            n, k = group.size(), output_tensor.numel()
            rows = input_tensor.view(n, k)
            parts = [(lo, hi, output_tensor.new_empty(hi - lo)) for lo, hi in cuts(k)]
            with _coalescing_manager(group=group):
                for lo, hi, out in parts:
                    chunk = rows[:, lo:hi].contiguous().view(-1)
                    dist.reduce_scatter_tensor(out, chunk, op=op, group=group)
            for lo, hi, out in parts:
                output_tensor[lo:hi].copy_(out)

    return PiecewiseAllGather(), PiecewiseReduceScatter()


def train_fsdp2_coalesced(mesh, *, pieces=3, steps=2, counter=None):
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = make_model(seed=0)
    for layer in (*model.body, model.head):
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if pieces:
        ag, rs = _fsdp_comms(pieces)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_custom_all_gather(ag)
                m.set_custom_reduce_scatter(rs)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    per_step = []
    for step in range(steps):
        if counter is not None:
            counter.take()
        x, y = batch(step, dist.get_rank(), torch.device("cpu"))
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        if counter is not None:
            per_step.append(counter.take())
    return [p.full_tensor().detach().clone() for p in model.parameters()], per_step


def rank_coalesced(comm, expected_size):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    n = int(expected_size)
    gloo = _init()
    rank = dist.get_rank()
    assert comm.size == n
    pg = dist.distributed_c10d._get_default_group()
    counter = CallCounter(pg.communicator)
    ck = Checks()
    check_allreduce_coalesced(ck, dist, gloo, counter, rank, n)
    check_allgather_coalesced(ck, dist, gloo, counter, rank, n)
    check_reduce_scatter_coalesced(ck, dist, gloo, counter, rank, n)
    assert ck.vs_gloo >= 40, ck.vs_gloo

    # DDP: every bucket is one coalesced all_reduce of its gradients, one Communicator call.
    ours, per_step, buckets = train_ddp_coalesced(None, 3, counter)
    theirs, _, _ = train_ddp_coalesced(gloo, 3)
    assert_same(ours, theirs, "DDP with a coalescing comm hook: cudampi vs gloo")
    assert buckets > 1, buckets
    # (DDP rebuilds its buckets after step 1, broadcasting the new order in step 2's forward)
    assert per_step[-1] == {"allreduce": buckets}, (per_step, buckets)

    # FSDP2, each all-gather / reduce-scatter cut in 3 pieces and coalesced: as many
    # Communicator calls per step as plain FSDP2 (one per call), not 3 times as many.
    ours, fsdp_counts = train_fsdp2_coalesced(init_device_mesh("cpu", (n,)), counter=counter)
    theirs, _ = train_fsdp2_coalesced(DeviceMesh.from_group(gloo, "cpu"), pieces=0)
    assert_same(ours, theirs, "FSDP2 with coalesced comms: cudampi vs gloo")
    mesh = init_device_mesh("cpu", (n,))
    plain, plain_counts = train_fsdp2_coalesced(mesh, pieces=0, counter=counter)
    assert_same(ours, plain, "FSDP2 coalesced vs plain on cudampi")
    assert fsdp_counts == plain_counts and fsdp_counts[-1].get("allgather"), fsdp_counts
    dist.destroy_process_group()
    if rank == 0:
        print(
            f"coalesced: {ck.total} checks, {ck.vs_gloo} against gloo; DDP {buckets} buckets = "
            f"{per_step[-1]} per step; FSDP2 calls per step, coalesced {fsdp_counts[-1]} plain "
            f"{plain_counts[-1]}",
            flush=True,
        )


@pytest.mark.parametrize("n", [2, 3])
def test_coalesced_calls_match_gloo_in_one_call_per_dtype(n):
    proc = run_mpi(n, __file__, "rank_coalesced", str(n), timeout=300)
    assert "against gloo" in proc.stdout
