"""The cudampi torch.distributed backend on real MPI ranks: every collective against gloo's result.

One spawn per rank count runs every check (torch's import is the slow part). Each check runs the
same call on the cudampi default group and on a gloo group of the same processes (gloo's store is
the one the cudampi rendezvous built from MPI: no MASTER_ADDR anywhere), and where gloo has no
such op or dtype, against a result computed locally from every rank's (re-generated) input.
"""

from __future__ import annotations

import os
import time

import pytest

from tests.mpirun import run_mpi, run_mpi_mpich

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

torch = pytest.importorskip("torch")

FLOATS = ("float32", "float64", "bfloat16", "float16")
INTS = ("int64", "int32", "int8", "uint8")


def _tol(dtype):
    import torch

    return {
        torch.bfloat16: {"atol": 6e-2, "rtol": 2e-2},
        torch.float16: {"atol": 1e-2, "rtol": 1e-2},
        torch.float32: {"atol": 1e-5, "rtol": 1e-5},
        torch.float64: {"atol": 1e-12, "rtol": 1e-12},
    }.get(dtype, {"atol": 0, "rtol": 0})


def data(seed, rank, shape, dtype, kind="any"):
    """Rank ``rank``'s input: every rank can re-generate any other rank's input."""
    import torch

    g = torch.Generator().manual_seed(1000 * seed + rank)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if kind == "bits":
        return torch.randint(0, 100, shape, generator=g).to(dtype)
    return torch.randint(1, 4, shape, generator=g).to(dtype)  # small: PRODUCT cannot overflow


def local_reduce(xs, op):
    """What a reduction of the tensors ``xs`` must give, computed in float64 / exactly."""
    import functools

    import torch

    dtype = xs[0].dtype
    if dtype == torch.bool:
        ys = [x.clone() for x in xs]
        fn = {
            "SUM": torch.logical_or,
            "MAX": torch.logical_or,
            "BOR": torch.logical_or,
            "PRODUCT": torch.logical_and,
            "MIN": torch.logical_and,
            "BAND": torch.logical_and,
            "BXOR": torch.logical_xor,
        }[op]
        return functools.reduce(fn, ys)
    wide = [x.double() if dtype.is_floating_point else x.long() for x in xs]
    fn = {
        "SUM": torch.add,
        "AVG": torch.add,
        "PRODUCT": torch.mul,
        "MIN": torch.minimum,
        "MAX": torch.maximum,
        "BAND": torch.bitwise_and,
        "BOR": torch.bitwise_or,
        "BXOR": torch.bitwise_xor,
    }[op]
    out = functools.reduce(fn, wide)
    if op == "AVG":
        out = out / len(xs)
    return out.to(dtype)


class Checks:
    """Counts checks and those made against gloo, so a silently skipped gloo side fails."""

    def __init__(self):
        self.total = 0
        self.vs_gloo = 0

    def close(self, got, want, what, *, gloo=False):
        import torch

        self.total += 1
        self.vs_gloo += int(gloo)
        if got.dtype == torch.bool or not got.dtype.is_floating_point:
            assert torch.equal(got, want), f"{what}: got {got}, want {want}"
        else:
            torch.testing.assert_close(got.float(), want.float(), **_tol(got.dtype), msg=what)


def _try_gloo(fn):
    """Run a gloo call: True if it ran, None where gloo does not implement that op/dtype."""
    try:
        fn()
    except (RuntimeError, ValueError, TypeError, NotImplementedError):
        return None
    return True


def _init(mode="sync"):
    import warnings

    # torch 2.13 renames all_gather_into_tensor/reduce_scatter_tensor: the old names still work.
    warnings.filterwarnings("ignore", category=FutureWarning)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch.distributed as dist

    import cudampi.torch  # registers the backend

    # Plain init under mpiexec: no MASTER_ADDR/MASTER_PORT/RANK/WORLD_SIZE in the environment
    # (under torchrun, tests/mpi/test_torch_torchrun.py, torchrun sets them: stock env://).
    if "TORCHELASTIC_RUN_ID" not in os.environ:
        for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE"):
            assert var not in os.environ, var
    if mode == "async":
        dist.init_process_group("cudampi", pg_options=cudampi.torch.Options(async_ops=True))
    elif mode == "sync":
        dist.init_process_group("cudampi", pg_options=cudampi.torch.Options(async_ops=False))
    else:
        if mode == "auto-mixed":
            # The default (auto) sends CUDA calls of host-synchronizing paths to the group's
            # thread. Host tensors never go there, so here a call whose first tensor has an odd
            # element count is taken for one: threaded and inline calls interleave through the
            # whole suite, and call order must hold (no inline call overtakes the thread).
            from cudampi.torch import dispatch

            dispatch.first_cuda = odd_first
        dist.init_process_group("cudampi")
    return dist.new_group(backend="gloo")


def odd_first(args):
    """A call's first tensor if its element count is odd, else None: what auto-mixed tests
    hand the backend as its "first CUDA tensor" (``dispatch.first_cuda``)."""
    import torch

    stack = [args]
    while stack:
        item = stack.pop(0)
        if isinstance(item, (list, tuple)):
            stack[:0] = list(item)
        elif isinstance(item, torch.Tensor):
            return item if item.numel() % 2 else None
    return None


def check_allreduce(ck, dist, gloo, rank, n):
    import torch

    R = dist.ReduceOp
    ops_f = ("SUM", "PRODUCT", "MIN", "MAX", "AVG")
    ops_i = ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR")
    cases = [(d, ops_f) for d in FLOATS] + [(d, ops_i) for d in INTS] + [("bool", ops_i)]
    for seed, (dtype, ops) in enumerate(cases):
        for op in ops:
            kind = "bits" if op.startswith("B") else "any"
            x = data(seed, rank, (7, 3), dtype, kind)
            y = x.clone()
            dist.all_reduce(x, op=getattr(R, op))
            want = local_reduce([data(seed, r, (7, 3), dtype, kind) for r in range(n)], op)
            ck.close(x, want, f"all_reduce {op} {dtype}")
            if (
                op != "AVG"
                and _try_gloo(lambda y=y, op=op: dist.all_reduce(y, op=getattr(R, op), group=gloo))
                is not None
            ):
                ck.close(x, y, f"all_reduce {op} {dtype} vs gloo", gloo=True)
    # PREMUL_SUM (what FSDP2 uses to fold the gradient divide into the reduce-scatter).
    for factor in (0.5, torch.tensor([0.25])):
        x = data(99, rank, (5,), "float32")
        dist.all_reduce(x, op=dist._make_nccl_premul_sum(factor))
        f = float(factor) if not isinstance(factor, torch.Tensor) else float(factor.item())
        want = local_reduce([data(99, r, (5,), "float32") for r in range(n)], "SUM") * f
        ck.close(x, want, f"all_reduce PREMUL_SUM({f})")
    # Non-contiguous input, and an empty tensor.
    x = data(7, rank, (6, 4), "float32").t()
    dist.all_reduce(x)
    ck.close(
        x,
        local_reduce([data(7, r, (6, 4), "float32").t() for r in range(n)], "SUM"),
        "non-contiguous",
    )
    e = torch.empty(0)
    dist.all_reduce(e)
    assert e.numel() == 0
    # Large enough for the pipelined/ring paths (1M floats).
    x = torch.full((1 << 20,), float(rank + 1))
    y = x.clone()
    dist.all_reduce(x)
    dist.all_reduce(y, group=gloo)
    ck.close(x, y, "all_reduce 4 MB vs gloo", gloo=True)


def check_rooted(ck, dist, gloo, rank, n):
    import torch

    for root in range(n):
        x = data(20 + root, rank, (4, 5), "float32")
        y = x.clone()
        dist.broadcast(x, src=root)
        dist.broadcast(y, src=root, group=gloo)
        ck.close(x, y, f"broadcast root {root} vs gloo", gloo=True)
        ck.close(x, data(20 + root, root, (4, 5), "float32"), f"broadcast root {root}")

        x = data(30 + root, rank, (9,), "int64")
        mine = x.clone()
        y = x.clone()
        dist.reduce(x, dst=root, op=dist.ReduceOp.MAX)
        dist.reduce(y, dst=root, op=dist.ReduceOp.MAX, group=gloo)
        if rank == root:
            ck.close(x, y, f"reduce MAX root {root} vs gloo", gloo=True)
        else:
            ck.close(x, mine, "reduce leaves non-root input unchanged")

        x = data(40 + root, rank, (3, 2), "float64")
        outs = [torch.empty(3, 2, dtype=torch.float64) for _ in range(n)] if rank == root else None
        gouts = [torch.empty(3, 2, dtype=torch.float64) for _ in range(n)] if rank == root else None
        dist.gather(x, gather_list=outs, dst=root)
        dist.gather(x, gather_list=gouts, dst=root, group=gloo)
        if rank == root:
            for i in range(n):
                ck.close(outs[i], gouts[i], f"gather root {root} from {i} vs gloo", gloo=True)

        ins = [data(50 + root, i, (2, 3), "float32") for i in range(n)] if rank == root else None
        out = torch.empty(2, 3)
        gout = torch.empty(2, 3)
        dist.scatter(out, scatter_list=ins, src=root)
        dist.scatter(gout, scatter_list=ins, src=root, group=gloo)
        ck.close(out, gout, f"scatter root {root} vs gloo", gloo=True)
        ck.close(out, data(50 + root, rank, (2, 3), "float32"), f"scatter root {root}")


def check_gathers(ck, dist, gloo, rank, n):
    import torch

    for dtype in ("float32", "bfloat16", "int64", "bool"):
        x = data(60, rank, (3, 2), dtype)
        outs = [torch.empty_like(x) for _ in range(n)]
        gouts = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(outs, x)
        got_gloo = _try_gloo(lambda gouts=gouts, x=x: dist.all_gather(gouts, x, group=gloo))
        for i in range(n):
            ck.close(outs[i], data(60, i, (3, 2), dtype), f"all_gather {dtype} from {i}")
            if got_gloo is not None:
                ck.close(outs[i], gouts[i], f"all_gather {dtype} vs gloo", gloo=True)
        out = torch.empty((n * 3, 2), dtype=x.dtype)
        gout = torch.empty_like(out)
        dist.all_gather_into_tensor(out, x)
        if (
            _try_gloo(lambda gout=gout, x=x: dist.all_gather_into_tensor(gout, x, group=gloo))
            is not None
        ):
            ck.close(out, gout, f"all_gather_into_tensor {dtype} vs gloo", gloo=True)
        ck.close(
            out, torch.cat([data(60, i, (3, 2), dtype) for i in range(n)]), "all_gather_into_tensor"
        )
    # Uneven all_gather (rank i contributes i+1 elements): gloo cannot, NCCL can.
    x = torch.arange(rank + 1, dtype=torch.float32) + 10 * rank
    outs = [torch.empty(i + 1) for i in range(n)]
    dist.all_gather(outs, x)
    for i in range(n):
        ck.close(outs[i], torch.arange(i + 1, dtype=torch.float32) + 10 * i, "uneven all_gather")


def check_scatters(ck, dist, gloo, rank, n):
    import torch

    R = dist.ReduceOp
    for dtype, op in (
        ("float32", "SUM"),
        ("float32", "AVG"),
        ("int64", "MAX"),
        ("bfloat16", "SUM"),
    ):
        ins = [data(70 + i, rank, (4,), dtype) for i in range(n)]
        out = torch.empty(4, dtype=ins[0].dtype)
        dist.reduce_scatter(out, [t.clone() for t in ins], op=getattr(R, op))
        want = local_reduce([data(70 + rank, r, (4,), dtype) for r in range(n)], op)
        ck.close(out, want, f"reduce_scatter {op} {dtype}")
        if op != "AVG":
            gout = torch.empty_like(out)
            if (
                _try_gloo(
                    lambda gout=gout, ins=ins, op=op: dist.reduce_scatter(
                        gout, [t.clone() for t in ins], op=getattr(R, op), group=gloo
                    )
                )
                is not None
            ):
                ck.close(out, gout, f"reduce_scatter {op} {dtype} vs gloo", gloo=True)
        flat = torch.cat(ins)
        out = torch.empty(4, dtype=flat.dtype)
        dist.reduce_scatter_tensor(out, flat.clone(), op=getattr(R, op))
        ck.close(out, want, f"reduce_scatter_tensor {op} {dtype}")
        if op != "AVG":
            gout = torch.empty_like(out)
            if (
                _try_gloo(
                    lambda gout=gout, flat=flat, op=op: dist.reduce_scatter_tensor(
                        gout, flat.clone(), op=getattr(R, op), group=gloo
                    )
                )
                is not None
            ):
                ck.close(out, gout, f"reduce_scatter_tensor {op} {dtype} vs gloo", gloo=True)
    # PREMUL_SUM reduce-scatter, as FSDP2 issues it.
    flat = data(80, rank, (n * 3,), "float32")
    out = torch.empty(3)
    dist.reduce_scatter_tensor(out, flat, op=dist._make_nccl_premul_sum(1.0 / n))
    want = (
        local_reduce([data(80, r, (n * 3,), "float32") for r in range(n)], "SUM")[
            3 * rank : 3 * rank + 3
        ]
        / n
    )
    ck.close(out, want, "reduce_scatter_tensor PREMUL_SUM")
    # Uneven reduce_scatter list (block i has i+1 elements).
    ins = [torch.full((i + 1,), float(rank + 1)) for i in range(n)]
    out = torch.empty(rank + 1)
    dist.reduce_scatter(out, ins)
    ck.close(out, torch.full((rank + 1,), float(sum(range(1, n + 1)))), "uneven reduce_scatter")

    # all_to_all_single: equal and uneven splits, and the list form.
    x = data(90, rank, (n * 2, 3), "float32")
    out = torch.empty_like(x)
    gout = torch.empty_like(x)
    dist.all_to_all_single(out, x)
    dist.all_to_all_single(gout, x, group=gloo)
    ck.close(out, gout, "all_to_all_single vs gloo", gloo=True)
    send = [rank + j + 1 for j in range(n)]  # rank r sends r+j+1 rows to rank j
    recv = [j + rank + 1 for j in range(n)]
    x = torch.arange(sum(send) * 2, dtype=torch.float64).reshape(-1, 2) + 1000 * rank
    out = torch.empty(sum(recv), 2, dtype=torch.float64)
    gout = torch.empty_like(out)
    dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send)
    dist.all_to_all_single(gout, x, output_split_sizes=recv, input_split_sizes=send, group=gloo)
    ck.close(out, gout, "uneven all_to_all_single vs gloo", gloo=True)
    ins = [data(95 + j, rank, (3, 2), "float32") for j in range(n)]
    outs = [torch.empty(3, 2) for _ in range(n)]
    gouts = [torch.empty(3, 2) for _ in range(n)]
    dist.all_to_all(outs, ins)
    dist.all_to_all(gouts, ins, group=gloo)
    for j in range(n):
        ck.close(outs[j], gouts[j], "all_to_all vs gloo", gloo=True)
    # Uneven list form (rank r sends j+1 rows to rank j): gloo cannot, NCCL can.
    ins = [torch.full((j + 1, 2), float(10 * rank + j)) for j in range(n)]
    outs = [torch.empty(rank + 1, 2) for _ in range(n)]
    dist.all_to_all(outs, ins)
    for j in range(n):
        ck.close(outs[j], torch.full((rank + 1, 2), float(10 * j + rank)), "uneven all_to_all")


def check_p2p(ck, dist, rank, n):
    import torch

    right, left = (rank + 1) % n, (rank - 1) % n
    # Non-blocking ring: receive posted first, no deadlock.
    got = torch.empty(5)
    r = dist.irecv(got, src=left, tag=3)
    s = dist.isend(torch.full((5,), float(rank)), dst=right, tag=3)
    s.wait()
    r.wait()
    ck.close(got, torch.full((5,), float(left)), "isend/irecv ring")
    # A receive into a non-contiguous tensor polled with is_completed() and no wait(): done
    # means the data is in the tensor (as with gloo), the copy out of the staging buffer too.
    got = torch.zeros(3, 2).t()
    r = dist.irecv(got, src=left, tag=4)
    dist.isend(torch.full((2, 3), float(rank)), dst=right, tag=4).wait()
    deadline = time.monotonic() + 60
    while not r.is_completed():
        assert time.monotonic() < deadline, "the polled irecv never completed"
    ck.close(got, torch.full((2, 3), float(left)), "irecv polled, non-contiguous")
    r.wait()
    # batch_isend_irecv (the pipeline-parallel pattern).
    got = torch.empty(3, dtype=torch.int64)
    ops = [
        dist.P2POp(dist.isend, torch.full((3,), rank, dtype=torch.int64), right),
        dist.P2POp(dist.irecv, got, left),
    ]
    for w in dist.batch_isend_irecv(ops):
        w.wait()
    ck.close(got, torch.full((3,), left, dtype=torch.int64), "batch_isend_irecv")
    # Blocking send/recv, even ranks first; a non-contiguous receive buffer.
    if n % 2 == 0:
        buf = torch.empty(4, 2).t()
        peer = rank ^ 1
        if rank % 2 == 0:
            dist.send(torch.arange(8.0).reshape(2, 4) + rank, dst=peer)
            dist.recv(buf, src=peer)
        else:
            dist.recv(buf, src=peer)
            dist.send(torch.arange(8.0).reshape(2, 4) + rank, dst=peer)
        ck.close(buf, torch.arange(8.0).reshape(2, 4) + peer, "send/recv non-contiguous")
    # recv from any source: rank 0 hears from everyone, in whatever order.
    if rank == 0:
        seen = set()
        for _ in range(n - 1):
            t = torch.empty(1, dtype=torch.int64)
            src = dist.recv(t)
            assert int(t) == src, (int(t), src)
            seen.add(src)
        assert seen == set(range(1, n)), seen
    else:
        dist.send(torch.tensor([rank]), dst=0)
    dist.barrier()


def check_objects_async(ck, dist, rank, n):
    import torch

    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank, "name": f"r{rank}" * (rank + 1)})
    assert objs == [{"rank": i, "name": f"r{i}" * (i + 1)} for i in range(n)], objs
    lst = [f"from {rank}", rank] if rank == n - 1 else [None, None]
    dist.broadcast_object_list(lst, src=n - 1)
    assert lst == [f"from {n - 1}", n - 1], lst
    got = [None] * n if rank == 0 else None
    dist.gather_object(("g", rank), got, dst=0)
    if rank == 0:
        assert got == [("g", i) for i in range(n)], got
    out = [None]
    dist.scatter_object_list(out, [{"to": i} for i in range(n)] if rank == 0 else None, src=0)
    assert out == [{"to": rank}], out
    if rank == 0:
        dist.send_object_list([{"hello": 1}, "x"], dst=n - 1)
    elif rank == n - 1:
        recv = [None, None]
        dist.recv_object_list(recv, src=0)
        assert recv == [{"hello": 1}, "x"], recv
    # async_op=True: Work.wait, and futures chained with then (how comm hooks use them).
    x = torch.full((4,), float(rank))
    work = dist.all_reduce(x, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    work.wait()
    assert work.is_completed()
    ck.close(fut.wait(), torch.full((4,), 2.0 * sum(range(n))), "async all_reduce future")
    out = torch.empty(n)
    w = dist.all_gather_into_tensor(out, torch.tensor([float(rank)]), async_op=True)
    w.wait()
    ck.close(out, torch.arange(n, dtype=torch.float32), "async all_gather_into_tensor")
    w = dist.barrier(async_op=True)
    w.wait()
    # Coalescing manager (fast path: allreduce_coalesced).
    from torch.distributed.distributed_c10d import _coalescing_manager

    ts = [torch.full((i + 2,), float(rank)) for i in range(3)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    for t in ts:
        ck.close(t, torch.full_like(t, float(sum(range(n)))), "coalesced all_reduce")


def check_groups(ck, dist, rank, n):
    import torch

    pairs = [[0, n - 1]] + ([[1, 2]] if n >= 4 else [])
    for ranks in pairs:
        sub = dist.new_group(ranks)
        gsub = dist.new_group(ranks, backend="gloo")
        if rank in ranks:
            assert dist.get_backend(sub) == "cudampi"
            assert dist.get_rank(sub) == ranks.index(rank)
            x = data(120, rank, (6,), "float32")
            y = x.clone()
            dist.all_reduce(x, group=sub)
            dist.all_reduce(y, group=gsub)
            ck.close(x, y, f"subgroup {ranks} all_reduce vs gloo", gloo=True)
            z = torch.full((2,), float(rank))
            dist.broadcast(z, src=ranks[-1], group=sub)
            ck.close(z, torch.full((2,), float(ranks[-1])), f"subgroup {ranks} broadcast")
            objs = [None] * len(ranks)
            dist.all_gather_object(objs, rank, group=sub)
            assert objs == ranks, objs
        else:
            assert sub == dist.GroupMember.NON_GROUP_MEMBER
    if n >= 4:
        mine, _ = dist.new_subgroups(group_size=2)
        x = torch.tensor([float(rank)])
        dist.all_reduce(x, group=mine)
        base = rank - rank % 2
        ck.close(x, torch.tensor([float(2 * base + 1)]), "new_subgroups all_reduce")
    # DeviceMesh names its groups; DTensor and functional collectives look them up by name.
    from torch.distributed.device_mesh import init_device_mesh

    shape = (2, n // 2) if n >= 4 else (n,)
    names = ("dp", "tp") if n >= 4 else ("dp",)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    for name in names:
        g = mesh.get_group(name)
        assert isinstance(g.group_name, str) and g.group_name, g.group_name
        x = torch.ones(3)
        dist.all_reduce(x, group=g)
        ck.close(x, torch.full((3,), float(mesh.size(names.index(name)))), f"mesh dim {name}")
    import torch.distributed._functional_collectives as funcol

    y = funcol.all_reduce(torch.full((2,), float(rank)), "sum", mesh.get_group(names[0]))
    dp = mesh.get_group(names[0])
    members = dist.get_process_group_ranks(dp)
    ck.close(y, torch.full((2,), float(sum(members))), "functional all_reduce")
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(4.0 * n).reshape(2 * n, 2)
    dt = distribute_tensor(full, mesh, [Shard(0)] * len(names))
    ck.close(dt.full_tensor(), full, "DTensor full_tensor (all_gather)")


def check_errors(dist, rank, n):
    import torch

    from cudampi.errors import CommError, MismatchError

    with pytest.raises(CommError, match="bitwise"):
        dist.all_reduce(torch.ones(2), op=dist.ReduceOp.BAND)
    # Ranks disagree on the element count: every rank raises, none hangs; the group survives.
    with pytest.raises(MismatchError):
        dist.all_reduce(torch.ones(3 + (rank == n - 1)))
    x = torch.ones(2)
    dist.all_reduce(x)
    assert x.tolist() == [float(n)] * 2


def rank_collectives(comm, expected_size, mode="sync"):
    import torch.distributed as dist

    n = int(expected_size)
    gloo = _init(mode)
    rank = dist.get_rank()
    assert (rank, dist.get_world_size()) == (comm.rank, comm.size) and comm.size == n
    assert dist.get_backend() == "cudampi"
    if mode == "auto-mixed":
        import torch

        from cudampi.torch.work import _async_work_class

        odd, even = torch.ones(3), torch.ones(2)
        threaded = _async_work_class()
        work = dist.all_reduce(odd, async_op=True)
        assert isinstance(work, threaded)
        dist.all_reduce(even)  # behind the threaded call: on the thread or after it, in order
        work.wait()
        runner = dist.distributed_c10d._get_default_group()._runner
        while runner.busy():  # the thread marks an op done just after completing its Work
            time.sleep(0.001)
        assert not isinstance(dist.all_reduce(even, async_op=True), threaded)
        assert torch.equal(odd, torch.full((3,), float(n)))
        assert torch.equal(even, torch.full((2,), float(n * n)))
    ck = Checks()
    check_allreduce(ck, dist, gloo, rank, n)
    check_rooted(ck, dist, gloo, rank, n)
    check_gathers(ck, dist, gloo, rank, n)
    check_scatters(ck, dist, gloo, rank, n)
    check_p2p(ck, dist, rank, n)
    check_objects_async(ck, dist, rank, n)
    check_groups(ck, dist, rank, n)
    check_errors(dist, rank, n)
    assert ck.vs_gloo >= 80, ck.vs_gloo
    dist.destroy_process_group()
    if rank == 0:
        print(f"torch backend checks: {ck.total} passed, {ck.vs_gloo} against gloo", flush=True)


TWO_RANK_MODES = ("sync", "async", "auto-mixed")
"""The modes of the 2-rank runs: all in one job (:func:`rank_collectives_modes`)."""


def rank_collectives_modes(comm, modes):
    """:func:`rank_collectives` in each of ``modes``, one after the other in this job (a
    process group each, made and destroyed): the job's start, torch's imports and their first
    use once, not per mode. auto-mixed's dispatch is put back after it; rank 0 says which mode
    passed."""
    from cudampi.torch import dispatch

    for mode in modes.split(","):
        first = dispatch.first_cuda
        try:
            rank_collectives(comm, str(comm.size), mode)
        finally:
            dispatch.first_cuda = first
        if comm.rank == 0:
            print(f"mode {mode}: every collective matched gloo", flush=True)


@pytest.fixture(scope="module")
def two_rank_modes():
    """Every mode of :data:`TWO_RANK_MODES` in one 2-rank job (this file's tests run on one
    xdist worker: tests/conftest.py's TOGETHER); what rank 0 printed."""
    modes = ",".join(TWO_RANK_MODES)
    return run_mpi(2, __file__, "rank_collectives_modes", modes, timeout=600).stdout


@pytest.mark.parametrize(("n", "mode"), [(2, "sync"), (4, "sync"), (2, "async"), (2, "auto-mixed")])
def test_every_collective_matches_gloo(n, mode, request):
    """mode sync: Options(async_ops=False); async: Options(async_ops=True), collectives on the
    group's own thread; auto-mixed: the default, with calls of odd-sized tensors standing in
    for CUDA calls of a host-synchronizing path (on the thread), the others in the caller's."""
    if n == 2:
        out = request.getfixturevalue("two_rank_modes")
        assert f"mode {mode}: every collective matched gloo" in out, out[-3000:]
    else:
        out = run_mpi(n, __file__, "rank_collectives", str(n), mode, timeout=300).stdout
    assert "against gloo" in out


def test_every_collective_matches_gloo_under_mpich():
    """The same suite under MPICH (its Hydra mpiexec and libmpi), threaded and inline calls
    mixed: the group's thread needs MPI_THREAD_MULTIPLE from MPICH too."""
    proc = run_mpi_mpich(2, __file__, "rank_collectives", "2", "auto-mixed", timeout=300)
    assert "against gloo" in proc.stdout
