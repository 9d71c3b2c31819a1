"""Where a small ``dist.all_reduce`` on the cudampi backend spends its time, against the
Communicator it forwards to, on the same tensor (2+ ranks, any device):

    cudampi launch -n 2 tools/torch-call-cost.py --device cuda --numel 1024 --iters 2000

Per call, on rank 0 (the slowest rank's mean, the better of two rounds; every layer in the same
run, calls pipelined, one synchronisation at the end): the Communicator's ``allreduce``; the backend's method called
as c10d's dispatcher calls it (``ProcessGroup.allreduce`` with its options); ``dist.all_reduce``;
``dist.all_reduce`` on a group that runs every call in the caller's thread (the default group
runs a call whose path synchronises the host on its own thread); ``dist.all_reduce`` on a Python
group that moves nothing (torch's own Python and a Python process group's call: the floor of any
backend written in Python).
Then each of the adapter's own steps alone (decoding the options, the thread-or-not decision, the
finished Work and its ``wait()``, the path lookup; on CUDA the capture and current-stream queries).
Then rank 0 runs ``dist.all_reduce`` under cProfile (the others run it unprofiled) and prints
the functions with the most own time, and those with the most time under them.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from typing import Any

from mpi4py import MPI
from timing import per_call

from cudampi.bench.session import open_session


def _null_backend() -> str:
    """A torch.distributed backend whose allreduce moves nothing and returns a finished Work:
    what torch's own Python and any Python process group cost a call, the floor under the
    cudampi backend's figure (registered as ``cudampi-null-floor``)."""
    import torch.distributed as dist

    from cudampi.torch.work import finished_work

    class NullGroup(dist.ProcessGroup):  # type: ignore[misc]
        def getBackendName(self) -> str:
            return "cudampi-null-floor"

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            return finished_work(tensors)

    name = "cudampi-null-floor"
    if name.upper() not in dist.Backend.__dict__:
        dist.Backend.register_backend(
            name, lambda store, rank, size, timeout: NullGroup(rank, size), devices=["cpu", "cuda"]
        )
    return name


def _best_of_two(world: Any, layers: dict[str, Any], iters: int, sync: Any) -> dict[str, float]:
    """us per call of each layer: two rounds, the better of each (a run's first calls pay
    extra)."""
    took: dict[str, float] = {}
    for _ in range(2):
        for name, fn in layers.items():
            us = 1e6 * per_call(world, fn, iters, sync, 50)
            took[name] = min(took.get(name, float("inf")), us)
    return took


def _steps(world: Any, pg: Any, comm: Any, x: Any, opts: Any, device: str, iters: int) -> None:
    """The adapter's own steps, each alone (no communication: every rank times its own)."""
    import torch

    from cudampi.torch.dispatch import threaded
    from cudampi.torch.methods import decode
    from cudampi.torch.work import finished_work

    steps = {
        "decode(AllreduceOptions)": lambda: decode(opts),
        "threaded (the path's stream order)": lambda: threaded(pg, "allreduce", ([x],)),
        "finished_work([x])": lambda: finished_work([x]),
        "finished_work([x]).wait()": lambda: finished_work([x]).wait(),
        "comm.path_for": lambda: comm.path_for("allreduce", x),
    }
    if device == "cuda":
        steps["is_current_stream_capturing"] = torch.cuda.is_current_stream_capturing
        steps["torch.cuda.current_stream()"] = torch.cuda.current_stream
    if world.rank == 0:
        print("# the adapter's steps alone, us per call (rank 0)")
    for name, fn in steps.items():
        us = 1e6 * per_call(MPI.COMM_SELF, fn, iters, lambda: None, 50)
        if world.rank == 0:
            print(f"{name:50s} {us:9.2f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--numel", type=int, default=1024)
    ap.add_argument("--iters", type=int, default=2000)
    ap.add_argument("--top", type=int, default=25)
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    world = MPI.COMM_WORLD
    s = open_session(world, a.device)
    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if a.device == "cuda":
        torch.cuda.set_device(dev)
    s.torch_default = "cudampi"
    s._start_dist("cudampi")
    pg = dist.distributed_c10d._get_default_group()
    comm = pg.communicator
    x = torch.zeros(a.numel, device=dev)  # (ones would double to inf, call after call)
    path = comm.path_for("allreduce", x)

    # The c10d layer's last Work: where the group's thread runs the calls (a path that
    # synchronises the host) a call returns at hand-over, so the timing waits for the thread
    # too (it runs the calls in order: the last Work is the last call).
    last: list[Any] = []

    def c10d() -> None:
        last[:] = [pg.allreduce([x], opts)]

    def sync() -> None:
        while last:
            last.pop().wait()
        if a.device == "cuda":
            torch.cuda.synchronize()
        comm.synchronize()

    from cudampi.torch import Options

    inline = dist.new_group(
        list(range(world.size)), backend="cudampi", pg_options=Options(async_ops=False)
    )
    null = dist.new_group(list(range(world.size)), backend=_null_backend())
    opts = dist.AllreduceOptions()
    layers = {
        "Communicator.allreduce (in place)": lambda: comm.allreduce(x, out=x),
        "ProcessGroup.allreduce (c10d -> backend)": c10d,
        "dist.all_reduce": lambda: dist.all_reduce(x),
        "dist.all_reduce, Options(async_ops=False) group": lambda: dist.all_reduce(x, group=inline),
        "dist.all_reduce, a Python group that moves nothing": lambda: dist.all_reduce(
            x, group=null
        ),
    }
    took = _best_of_two(world, layers, a.iters, sync)
    if world.rank == 0:
        print(f"# {world.size} ranks, {a.device}, {a.numel} float32, path {path}, torch "
              f"{torch.__version__}; us per call, pipelined, slowest rank")  # fmt: skip
        base = took["Communicator.allreduce (in place)"]
        for name, us in took.items():
            print(f"{name:50s} {us:9.2f} us  {us / base:5.2f}x")

    _steps(world, pg, comm, x, opts, a.device, a.iters)

    world.Barrier()
    prof = cProfile.Profile() if world.rank == 0 else None
    if prof is not None:
        prof.enable()
    for _ in range(a.iters):
        dist.all_reduce(x)
    sync()
    if prof is not None:
        prof.disable()
        for key in ("tottime", "cumulative"):
            out = io.StringIO()
            pstats.Stats(prof, stream=out).sort_stats(key).print_stats(a.top)
            print(f"# cProfile of {a.iters} dist.all_reduce calls on rank 0, by {key}")
            print(out.getvalue())
    world.Barrier()
    s.close()


if __name__ == "__main__":
    main()
