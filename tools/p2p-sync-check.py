"""Does raw mpi4py Isend/Irecv of CUDA tensors deliver wrong bytes, and is an unsynchronised
producer kernel the cause? Run under `cudampi launch -n 2 tools/p2p-sync-check.py [reps]` (the
launch applies the wheels' CUDA-aware recipe). For each size rank 0 makes the buffer with a
kernel queued behind a ~2 ms sleep kernel, then hands it to MPI either at once ("no sync", what
an mpi4py user who forgets the stream does) or after synchronising the stream ("sync", what the
docs ask); rank 1 receives and counts the elements that differ from the value sent. Prints one
line per mode and size and a JSON summary on rank 1."""

from __future__ import annotations

import json
import sys

import torch
from mpi4py import MPI

w = MPI.COMM_WORLD
assert w.size == 2, "run with 2 ranks"
torch.cuda.set_device(0)
reps = int(sys.argv[1]) if len(sys.argv) > 1 else 20
sizes = [1 << k for k in range(12, 27, 2)]  # 4 KiB .. 64 MiB
cycles = 4_000_000  # the sleep kernel: ~2 ms at the H200's clocks
wrong: dict[str, dict[int, list[int]]] = {"no sync": {}, "sync": {}}
for mode in wrong:
    for nbytes in sizes:
        buf = torch.zeros(nbytes // 4, dtype=torch.float32, device="cuda")
        torch.cuda.synchronize()
        counts = []
        for i in range(reps):
            value = float(i + 1)
            if w.rank == 0:
                torch.cuda._sleep(cycles)
                buf.fill_(value)  # queued behind the sleep on the current stream
                if mode == "sync":
                    torch.cuda.current_stream().synchronize()
                w.Isend(buf, 1, tag=i).Wait()
                torch.cuda.synchronize()
            else:
                buf.zero_()
                torch.cuda.synchronize()
                w.Irecv(buf, 0, tag=i).Wait()
                counts.append(int((buf != value).sum()))
            w.Barrier()
        if w.rank == 1:
            wrong[mode][nbytes] = counts
            bad = sum(1 for c in counts if c)
            print(
                f"{mode:8s} {nbytes:>10d} B: {bad}/{reps} messages wrong, "
                f"{sum(counts)} wrong elements",
                flush=True,
            )
if w.rank == 1:
    print(
        json.dumps(
            {
                "reps": reps,
                "library": MPI.Get_library_version().splitlines()[0],
                "wrong": {m: {str(k): v for k, v in d.items()} for m, d in wrong.items()},
            }
        )
    )
