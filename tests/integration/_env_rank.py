"""What the generated-environment test runs on every rank: cudampi's own CUDAMPI_* checks
(Config) run inside Communicator() and init_process_group("cudampi"), under whatever the sourced
cudampi-env.sh and job.sbatch exported."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

import cudampi
import cudampi.torch  # registers the backend
from cudampi.comm import Communicator


def main() -> None:
    info = cudampi.init()
    leaked = sorted(k for k in os.environ if k.startswith("CUDAMPI_"))
    with Communicator(MPI.COMM_WORLD) as comm:
        x = np.full(8, comm.rank + 1, dtype=np.float32)
        y = comm.allreduce(x)
        n = comm.size
        assert y.tolist() == [n * (n + 1) / 2] * 8, y
    dist.init_process_group("cudampi")
    t = torch.full((8,), float(dist.get_rank() + 1))
    dist.all_reduce(t)
    assert t.tolist() == [n * (n + 1) / 2] * 8, t
    dist.destroy_process_group()
    print(f"ENV-OK rank {info.rank}/{info.world_size} via {info.launcher} {','.join(leaked)}")


if __name__ == "__main__":
    main()
