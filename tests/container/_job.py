"""What the container tests run on every rank inside the image: ``_job.py [sleep]``.

A 2-rank :class:`cudampi.Communicator` allreduce of 4 MiB (it crosses the network between the
containers), then one line per rank with the host and the launch settings the rank saw; with
``sleep``, then a line saying so and two minutes of sleep (the test kills a host meanwhile).
"""

from __future__ import annotations

import os
import socket
import sys
import time

import numpy as np
from mpi4py import MPI

import cudampi


def main() -> int:
    cudampi.init()
    comm = cudampi.Communicator(MPI.COMM_WORLD)
    n, rank = comm.size, comm.rank
    x = np.full(1 << 20, rank + 1, dtype=np.float32)
    y = comm.allreduce(x)
    ok = bool((y == n * (n + 1) / 2).all())
    seen = {k: os.environ.get(k, "") for k in ("OMPI_MCA_plm_rsh_agent", "NCCL_SOCKET_IFNAME")}
    print(
        f"rank {rank} of {n} on {socket.gethostname()}: allreduce {'ok' if ok else 'WRONG'} "
        + " ".join(f"{k}={v}" for k, v in seen.items()),
        flush=True,
    )
    if sys.argv[1:] == ["sleep"]:
        print(f"rank {rank} sleeping on {socket.gethostname()}", flush=True)
        time.sleep(120)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
