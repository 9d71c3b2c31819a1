"""What a cudampi point-to-point message costs over raw mpi4py, per message, on host buffers.

Run on two ranks (rank 0 prints):

    mpirun -n 2 python tools/p2p-overhead.py [--iters 2000] [--rounds 7] [--profile send]

For NumPy arrays and torch CPU tensors of 8 B and 1 KiB, it times raw mpi4py and
``cudampi.comm.Communicator`` on the same arrays, in alternating rounds (the machine may be
shared: compare the ratio column, which is taken within one run): a blocking ping-pong
(send/recv), a non-blocking one (irecv + isend + wait) and an exchange (sendrecv). Ping-pong
times are half a round trip; sendrecv is one call. Each cell is the median over the rounds, in
microseconds. ``--profile MODE`` then runs that cudampi mode on NumPy under cProfile on rank 0.

To compare two checkouts, run it once with each on PYTHONPATH (``PYTHONPATH=../other/src``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

MODES = ("send/recv", "isend/irecv", "sendrecv")


def _raw(world: Any, mode: str, x: Any, y: Any, peer: int) -> Callable[[], None]:
    rank = world.rank
    if mode == "send/recv":
        if rank == 0:

            def f() -> None:
                world.Send(x, peer, 3)
                world.Recv(y, peer, 3)
        else:

            def f() -> None:
                world.Recv(y, peer, 3)
                world.Send(x, peer, 3)
    elif mode == "isend/irecv":
        if rank == 0:

            def f() -> None:
                r = world.Irecv(y, peer, 3)
                world.Isend(x, peer, 3).Wait()
                r.Wait()
        else:

            def f() -> None:
                world.Irecv(y, peer, 3).Wait()
                world.Isend(x, peer, 3).Wait()
    else:

        def f() -> None:
            world.Sendrecv(x, peer, 3, y, peer, 3)

    return f


def _cudampi(c: Any, rank: int, mode: str, x: Any, y: Any, peer: int) -> Callable[[], None]:
    if mode == "send/recv":
        if rank == 0:

            def f() -> None:
                c.send(x, peer, 3)
                c.recv(y, peer, 3)
        else:

            def f() -> None:
                c.recv(y, peer, 3)
                c.send(x, peer, 3)
    elif mode == "isend/irecv":
        if rank == 0:

            def f() -> None:
                r = c.irecv(y, peer, 3)
                c.isend(x, peer, 3).wait()
                r.wait()
        else:

            def f() -> None:
                c.irecv(y, peer, 3).wait()
                c.isend(x, peer, 3).wait()
    else:

        def f() -> None:
            c.sendrecv(x, peer, y, peer, 3)

    return f


def _time(world: Any, f: Callable[[], None], iters: int, per_call: float) -> float:
    for _ in range(20):
        f()
    world.Barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        f()
    return (time.perf_counter() - t0) / iters * per_call * 1e6


def _arrays(lib: str, nbytes: int, rank: int) -> tuple[Any, Any, Any, Any]:
    """(x, y) for cudampi and their raw mpi4py buffers (torch: the NumPy views)."""
    import numpy as np

    n = nbytes // 4
    x = np.full(n, rank + 1, dtype=np.float32)
    y = np.zeros(n, dtype=np.float32)
    if lib == "numpy":
        return x, y, x, y
    import torch

    tx, ty = torch.from_numpy(x), torch.from_numpy(y)
    return tx, ty, x, y


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--libs", default="numpy,torch")
    p.add_argument("--sizes", default="8,1024", help="bytes, comma separated")
    p.add_argument("--profile", choices=MODES, default=None)
    a = p.parse_args()

    from mpi4py import MPI

    from cudampi.comm import Communicator

    world = MPI.COMM_WORLD.Dup()
    rank = world.rank
    if world.size != 2:
        raise SystemExit("run on 2 ranks")
    peer = 1 - rank
    out = print if rank == 0 else (lambda *x, **k: None)
    c = Communicator(MPI.COMM_WORLD)
    out(f"# cudampi from {sys.modules['cudampi'].__file__}")
    out(f"# {a.iters} messages x {a.rounds} rounds; median us per message, rank 0")
    out("| buffers | bytes | mode | mpi4py | cudampi | ratio |")
    out("|---|---:|---|---:|---:|---:|")
    for lib in a.libs.split(","):
        for nbytes in (int(s) for s in a.sizes.split(",")):
            x, y, rx, ry = _arrays(lib, nbytes, rank)
            for mode in MODES:
                per = 1.0 if mode == "sendrecv" else 0.5
                raw = _raw(world, mode, rx, ry, peer)
                ours = _cudampi(c, rank, mode, x, y, peer)
                t_raw, t_ours = [], []
                for _ in range(a.rounds):
                    t_raw.append(_time(world, raw, a.iters, per))
                    t_ours.append(_time(world, ours, a.iters, per))
                want = float(peer + 1)
                if not (ry == want).all():
                    raise SystemExit(f"rank {rank}: wrong data after {lib} {mode}")
                mr, mo = statistics.median(t_raw), statistics.median(t_ours)
                out(f"| {lib} | {nbytes} | {mode} | {mr:.2f} | {mo:.2f} | {mo / mr:.1f}x |")
                sys.stdout.flush()
    if a.profile:
        x, y, _, _ = _arrays("numpy", 1024, rank)
        f = _cudampi(c, rank, a.profile, x, y, peer)
        _time(world, f, 200, 1.0)
        prof = cProfile.Profile()
        world.Barrier()
        prof.enable()
        for _ in range(a.iters):
            f()
        prof.disable()
        if rank == 0:
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
            print(f"# cProfile, rank 0, {a.iters} x cudampi {a.profile} of 1 KiB NumPy")
            print(buf.getvalue())
    c.close()
    world.Free()
    return 0


if __name__ == "__main__":
    sys.exit(main())
