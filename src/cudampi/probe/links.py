"""The link test between pairs of nodes, one rank on each node: ``python -m cudampi.probe.links
BYTES A=B [C=D ...]`` (``A=B=cupy``: also with device buffers) under a job of two ranks per pair
(``cudampi doctor --hosts`` starts one such job per round of pairs, through ``cudampi launch``).
Each rank finds itself among the pairs' hosts by its names and addresses, and the pairs
measure at the same time, each on a communicator of its own.

What it measures, rank 0 <-> rank 1: the one-way latency of an 8-byte host message (half the
best round trip of a ping-pong, and of the median one), the bandwidth of ``BYTES`` host messages in each direction (a window of
:data:`WINDOW` messages, the best of repeats within :data:`BUDGET_S`, data checked), and whether
each rank accepts a plain TCP connection from the other on a port the kernel picks (MPI's TCP
and its launcher's daemons use such ports: a firewall that lets only ssh through shows here).
With a backend (``cupy`` or ``torch``) the same latency and bandwidths again with device buffers,
handed to MPI (run only where the doctor proved device point-to-point on both nodes).

Each pair's first rank prints one line ``CUDAMPI_LINK {json}`` on stdout. A rank that fails prints its error and
ends the job (:func:`cudampi.abort.abort_job`); a job that hangs is ended by the caller's
timeout.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import time
import traceback
from functools import partial
from typing import Any

from cudampi.abort import abort_job

MARKER = "CUDAMPI_LINK "
WINDOW = 4
"""Messages in flight per bandwidth repeat (OSU's osu_bw keeps a window of them too)."""
BUDGET_S = 0.3
"""Seconds each bandwidth direction may take beyond its first repeat."""
MAX_REPEATS = 8
LATENCY_ITERS = 200
TCP_TIMEOUT_S = 3.0
TAG_DATA, TAG_ACK, TAG_PING = 11, 12, 13


def pattern(n: int, offset: float) -> Any:
    """The messages' data (the runtime probe's, :func:`cudampi.probe.worker.pattern`)."""
    from cudampi.probe.worker import pattern as probe_pattern

    return probe_pattern(n, offset)


def latency_us(comm: Any, small: Any, sync: Any = None) -> tuple[float, float]:
    """The one-way time of an 8-byte ping-pong in microseconds: the best round trip's half
    (the path itself: a busy CPU only ever adds to it) and the median's."""
    rank, peer = comm.rank, 1 - comm.rank
    times = []
    deadline = time.perf_counter() + BUDGET_S
    for i in range(10 + LATENCY_ITERS):
        t0 = time.perf_counter()
        if rank == 0:
            comm.Send(small, dest=peer, tag=TAG_PING)
            comm.Recv(small, source=peer, tag=TAG_PING)
        else:
            comm.Recv(small, source=peer, tag=TAG_PING)
            comm.Send(small, dest=peer, tag=TAG_PING)
        if sync is not None:
            sync()
        if i >= 10:
            times.append((time.perf_counter() - t0) / 2)
        # rank 0 decides when to stop; rank 1 follows its last ping
        stop = comm.rank == 0 and i >= 20 and time.perf_counter() > deadline
        if comm.bcast(stop, root=0):
            break
    best, median = min(times) * 1e6, statistics.median(times) * 1e6
    return comm.bcast((float(best), float(median)), root=0)


def bandwidth_gbps(comm: Any, sender: int, bufs: list[Any], check: Any, sync: Any = None) -> Any:
    """GB/s of ``len(bufs)`` messages from ``sender`` to the other rank, the best repeat; the
    receiver checks every message (``check(buf) -> bool``). Returns ``(gbps, wrong)``."""
    from mpi4py import MPI

    rank, peer = comm.rank, 1 - comm.rank
    nbytes = sum(b.nbytes for b in bufs)
    ack = bytearray(1)
    best = 0.0
    wrong = 0
    start = time.perf_counter()
    for _rep in range(MAX_REPEATS):
        comm.Barrier()
        t0 = time.perf_counter()
        if rank == sender:
            MPI.Request.Waitall([comm.Isend(b, dest=peer, tag=TAG_DATA) for b in bufs])
            comm.Recv(ack, source=peer, tag=TAG_ACK)
        else:
            MPI.Request.Waitall([comm.Irecv(b, source=peer, tag=TAG_DATA) for b in bufs])
            if sync is not None:
                sync()
            comm.Send(ack, dest=peer, tag=TAG_ACK)
        secs = time.perf_counter() - t0
        if rank != sender:
            wrong += sum(0 if check(b) else 1 for b in bufs)
        best = max(best, nbytes / secs / 1e9)
        stop = rank == sender and time.perf_counter() - start > BUDGET_S
        if comm.bcast(stop, root=sender):
            break
    return comm.bcast(best, root=sender), comm.allreduce(wrong)


def host_link(comm: Any, nbytes: int) -> dict[str, Any]:
    """Host latency and bandwidth both ways (rank 0's view is the result)."""
    import numpy as np

    n = max(1, nbytes // 4)
    best, median = latency_us(comm, bytearray(8))
    out: dict[str, Any] = {"latency_us": best, "latency_median_us": median}
    for sender in (0, 1):
        bufs = [
            pattern(n, sender) if comm.rank == sender else np.zeros(n, np.float32)
            for _ in range(WINDOW)
        ]
        gbps, wrong = bandwidth_gbps(comm, sender, bufs, _host_check(pattern(n, sender)))
        out[f"gbps_{sender}{1 - sender}"] = gbps
        out[f"wrong_{sender}{1 - sender}"] = wrong
    out["bytes"] = n * 4
    return out


def _host_check(expect: Any) -> Any:
    import numpy as np

    return partial(np.array_equal, expect)


def device_link(comm: Any, nbytes: int, backend: str) -> dict[str, Any]:
    """The same with device buffers (the GPU of this rank's local rank)."""
    from cudampi.probe.worker import _Device

    dev = _Device(backend, 0)
    n = max(1, nbytes // 4)
    small = dev.empty(2)
    dev.sync()
    best, median = latency_us(comm, small, dev.sync)
    out: dict[str, Any] = {"device": dev.name, "latency_us": best, "latency_median_us": median}
    for sender in (0, 1):
        bufs = [
            dev.arange(n, float(sender)) if comm.rank == sender else dev.empty(n)
            for _ in range(WINDOW)
        ]
        dev.sync()
        expect = dev.arange(n, float(sender))
        gbps, wrong = bandwidth_gbps(comm, sender, bufs, partial(dev.equal, expect), dev.sync)
        out[f"gbps_{sender}{1 - sender}"] = gbps
        out[f"wrong_{sender}{1 - sender}"] = wrong
    return out


def peer_copy_gbps(
    backend: str, pairs: list[tuple[int, int]], nbytes: int, iters: int = 5
) -> dict[tuple[int, int], float]:
    """GB/s of a device-to-device copy from GPU a to GPU b for each ``(a, b)`` of ``pairs``
    (one process; the best of ``iters`` copies after a warm-up): the copy engine's peer link
    inside a node (NVLink or PCIe), no MPI."""
    n = max(1, nbytes // 4)
    return {(a, b): _peer_copy(backend, a, b, n, iters) for a, b in pairs}


def _peer_copy(backend: str, a: int, b: int, n: int, iters: int) -> float:
    copy: Any
    sync: Any
    if backend == "cupy":
        import cupy

        with cupy.cuda.Device(a):
            src = cupy.ones(n, dtype=cupy.float32)
        with cupy.cuda.Device(b):
            dst = cupy.zeros(n, dtype=cupy.float32)

        def copy() -> None:
            cupy.cuda.runtime.memcpyPeer(dst.data.ptr, b, src.data.ptr, a, n * 4)

        def sync() -> None:
            for d in (a, b):
                cupy.cuda.Device(d).synchronize()
    else:
        import torch

        tsrc = torch.ones(n, dtype=torch.float32, device=f"cuda:{a}")
        tdst = torch.zeros(n, dtype=torch.float32, device=f"cuda:{b}")

        def copy() -> None:
            tdst.copy_(tsrc, non_blocking=True)

        def sync() -> None:
            for d in (a, b):
                torch.cuda.synchronize(d)

    copy()
    sync()
    best = 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        copy()
        sync()
        best = max(best, n * 4 / (time.perf_counter() - t0) / 1e9)
    return best


def tcp_reach(comm: Any, hosts: list[str]) -> dict[str, str]:
    """Does each rank accept a TCP connection from the other on a kernel-chosen port? Each
    listens, they swap ports over MPI, each connects to the other's host as named in
    ``hosts``. ``{"01": "ok", "10": "refused"}`` (``"01"``: rank 0 connecting to rank 1)."""
    peer = 1 - comm.rank
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("", 0))
        listener.listen(4)
        listener.settimeout(TCP_TIMEOUT_S + 1)
        ports = comm.allgather(listener.getsockname()[1])
        result = "ok"
        try:
            with socket.create_connection((hosts[peer], ports[peer]), timeout=TCP_TIMEOUT_S):
                pass
        except ConnectionRefusedError:
            result = "refused"
        except TimeoutError:
            result = f"no answer in {TCP_TIMEOUT_S:g} s"
        except OSError as exc:
            result = exc.strerror or str(exc)
        results = comm.allgather(result)
    return {f"{r}{1 - r}": results[r] for r in (0, 1)}


def run(comm: Any, nbytes: int, hosts: list[str], backend: str | None) -> dict[str, Any]:
    """Every measurement of one pair on the 2-rank ``comm``; every rank returns rank 0's view."""
    names = comm.allgather(socket.gethostname())
    result: dict[str, Any] = {"pair": hosts, "hostnames": names, "host": host_link(comm, nbytes)}
    result["tcp"] = tcp_reach(comm, hosts)
    if backend is not None:
        result["device"] = device_link(comm, nbytes, backend)
    return result


def parse_pairs(specs: list[str]) -> list[tuple[str, str, str | None]]:
    """``A=B`` or ``A=B=cupy`` (with the device test on that backend) -> (a, b, backend)."""
    out = []
    for spec in specs:
        parts = spec.split("=")
        if len(parts) not in (2, 3) or not all(parts[:2]):
            raise ValueError(f"a pair is A=B or A=B=BACKEND, got {spec!r}")
        out.append((parts[0], parts[1], parts[2] if len(parts) == 3 else None))
    return out


def my_pair(pairs: list[tuple[str, str, str | None]]) -> tuple[int, int]:
    """(which pair, which side) this host is, by its names and addresses."""
    from cudampi import net

    local = net.local_names()
    mine = [
        (i, side)
        for i, pair in enumerate(pairs)
        for side in (0, 1)
        if net.is_local(str(pair[side]), local)
    ]
    if len(mine) != 1:
        raise RuntimeError(
            f"{socket.gethostname()} is {'none' if not mine else 'more than one'} of the pairs' "
            f"hosts {[p[:2] for p in pairs]}"
        )
    return mine[0]


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) < 2 or not args[0].isdigit():
        sys.stderr.write(
            "usage: python -m cudampi.probe.links BYTES A=B[=cupy|torch] [C=D[=...] ...]\n"
        )
        return 2
    nbytes = int(args[0])
    pairs = parse_pairs(args[1:])
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    try:
        if world.size != 2 * len(pairs):
            raise RuntimeError(
                f"this rank on {socket.gethostname()} sees a world of {world.size} rank(s), not "
                f"the {2 * len(pairs)} of the pairs: its MPI is not the launcher's"
            )
        index, side = my_pair(pairs)
        comm = world.Split(index, side)
        a, b, backend = pairs[index]
        result = run(comm, nbytes, [a, b], backend)
    except Exception as exc:
        head = f"--- rank {world.rank} of {world.size}: {type(exc).__name__}: {exc}\n"
        abort_job(3, head + traceback.format_exc(), world)
        return 3
    if comm.rank == 0:
        print(MARKER + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
