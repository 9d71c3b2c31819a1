"""Where a cudampi collective's time goes, per call, next to raw mpi4py on the same buffers.

Run under an MPI launcher (every rank runs it, rank 0 prints):

    cudampi launch -n 2 tools/profile-comm.py --device cuda --sizes 4K,1M,64M --iters 30

For each size it times, on the same arrays: raw mpi4py Sendrecv with the ring neighbours (the
floor any point-to-point algorithm stands on), cudampi's pieces alone (the signature check, the
caller-stream capture + wait, one DirectTransport exchange, the reduction kernel + fence) and the
whole ``Communicator.allreduce`` on each requested path. Then rank 0 runs ``--profile-size``
under cProfile and prints the functions with the most own time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
from typing import Any

from timing import per_call

from cudampi.config import parse_size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    p.add_argument("--sizes", default="4K,1M,64M")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--paths", default="gpu-ring,staged")
    p.add_argument("--profile-size", default="1M")
    p.add_argument("--profile-path", default="gpu-ring")
    a = p.parse_args()

    import torch
    from mpi4py import MPI

    import cudampi
    from cudampi.comm import Communicator
    from cudampi.comm.transport import DirectTransport, mem
    from cudampi.comm.validate import Signature, check

    info = cudampi.init()
    world = MPI.COMM_WORLD
    rank, size = world.rank, world.size
    dev = torch.device(f"cuda:{info.device}") if a.device == "cuda" else torch.device("cpu")
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    comm = Communicator(world)
    raw = world.Dup()
    right, left = (rank + 1) % size, (rank - 1) % size
    out = print if rank == 0 else (lambda *x, **k: None)
    out(f"# {size} ranks, {dev}, {torch.cuda.get_device_name() if a.device == 'cuda' else 'cpu'}")
    out(f"# MPI: {MPI.Get_library_version().splitlines()[0]}")
    for path in a.paths.split(","):
        x = torch.ones(1 << 20, device=dev)
        out(f"# path_for({path!r}, 4 MiB): {comm._choose('allreduce', _adapt(x), path).reason}")
    header = ["size", "raw sendrecv", "check()", "capture+begin", "exchange", "reduce+fence"]
    header += [f"allreduce {p}" for p in a.paths.split(",")]
    out("| " + " | ".join(header) + " |  (us per call, slowest rank)")
    out("|" + "---:|" * len(header))
    for s in a.sizes.split(","):
        nbytes = parse_size(s)
        n = max(1, nbytes // 4)
        x = torch.full((n,), float(rank + 1), device=dev)
        y = torch.empty_like(x)
        xb = _adapt(x)
        ops = comm._engines.ops(xb.lib, xb.device)
        tx = DirectTransport(comm._coll, ops)
        row = [s]

        def raw_sr(x: Any = x, y: Any = y, nb: int = n * 4) -> None:
            raw.Sendrecv(mem(x.data_ptr(), nb), right, 7, mem(y.data_ptr(), nb), left, 7)

        row.append(per_call(world, raw_sr, a.iters, sync))
        sig = Signature("allreduce", "sum", "float32", count=n, path="gpu-ring", algo=2)
        row.append(
            per_call(
                world, lambda sig=sig: check(comm._coll, sig, None, debug=False), a.iters, sync
            )
        )

        def cap() -> None:
            ops.begin(ops.capture())

        row.append(per_call(world, cap, a.iters, sync))
        row.append(per_call(world, lambda x=x, y=y: tx.sendrecv(x, right, y, left), a.iters, sync))

        def red(x: Any = x, y: Any = y) -> None:
            ops.reduce(y, x, "sum", "float32")
            ops.fence()

        row.append(per_call(world, red, a.iters, sync))
        for path in a.paths.split(","):
            row.append(
                per_call(
                    world, lambda x=x, path=path: comm.allreduce(x, out=x, path=path), a.iters, sync
                )
            )
        out("| " + " | ".join([row[0]] + [f"{v * 1e6:.1f}" for v in row[1:]]) + " |")
        sys.stdout.flush()

    n = max(1, parse_size(a.profile_size) // 4)
    x = torch.ones(n, device=dev)
    for _ in range(3):
        comm.allreduce(x, out=x, path=a.profile_path)
    sync()
    world.Barrier()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(a.iters):
        comm.allreduce(x, out=x, path=a.profile_path)
    sync()
    prof.disable()
    if rank == 0:
        buf = io.StringIO()
        st = pstats.Stats(prof, stream=buf)
        st.sort_stats("tottime").print_stats(25)
        print(f"# cProfile, rank 0, {a.iters} x allreduce {a.profile_size} on {a.profile_path}")
        print(buf.getvalue())
    comm.close()
    return 0


def _adapt(x: Any) -> Any:
    from cudampi.comm.arrays import adapt

    return adapt(x)


if __name__ == "__main__":
    sys.exit(main())
