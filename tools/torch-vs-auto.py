"""Where ``dist.all_reduce`` on the cudampi backend and the Communicator's auto part at large
sizes: each path of the Communicator, in place and out of place, beside ``dist.all_reduce`` on
the same tensors, and what each chose and why (2+ ranks, CUDA; ``--device cpu``: host tensors):

    cudampi launch -n 2 tools/torch-vs-auto.py --sizes 2M,16M,128M --iters 10

us per call on the slowest rank, every call synchronised (the bench's way); a path that cannot
run says why instead of a figure.
"""

from __future__ import annotations

import argparse
from mpi4py import MPI
from timing import per_call

from cudampi.bench.session import open_session
from cudampi.comm import Communicator
from cudampi.config import parse_size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="2M,16M,128M")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--paths", default="auto,gpu-ring,native,staged")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    a = ap.parse_args()

    import torch
    import torch.distributed as dist

    world = MPI.COMM_WORLD
    s = open_session(world, a.device)
    dev = torch.device("cuda", torch.cuda.current_device()) if a.device == "cuda" else None
    s.torch_default = "cudampi"
    s._start_dist("cudampi")
    pg = dist.distributed_c10d._get_default_group()
    comm = Communicator(world)

    def sync() -> None:
        if a.device == "cuda":
            torch.cuda.synchronize()

    for size in a.sizes.split(","):
        n = parse_size(size) // 4
        x = torch.zeros(n, device=dev)
        y = torch.zeros(n, device=dev)
        rows: list[tuple[str, str]] = []
        for path in a.paths.split(","):
            for inplace in (True, False):
                name = f"{path}, {'in place' if inplace else 'out of place'}"
                p = None if path == "auto" else path
                try:
                    choice = comm.path_for("allreduce", x, path=p)
                    us = 1e6 * per_call(
                        world,
                        lambda x=x, p=p, o=(x if inplace else y): comm.allreduce(x, out=o, path=p),
                        a.iters,
                        sync,
                        2,
                        each=True,
                    )
                    rows.append((name, f"{us:10.1f} us  runs {choice} ({choice.reason})"))
                except Exception as exc:  # a path that cannot run here: say why
                    rows.append((name, f"   skipped  {type(exc).__name__}: {exc}"[:200]))
        tchoice = pg.communicator.path_for("allreduce", x)
        us = 1e6 * per_call(world, lambda x=x: dist.all_reduce(x), a.iters, sync, 2, each=True)
        rows.append(("dist.all_reduce", f"{us:10.1f} us  runs {tchoice} ({tchoice.reason})"))
        if world.rank == 0:
            print(f"# allreduce float32 {size} ({n * 4} B), {world.size} ranks, us per call")
            for name, text in rows:
                print(f"{name:28s} {text}")
        world.Barrier()
    comm.close()
    s.close()


if __name__ == "__main__":
    main()
