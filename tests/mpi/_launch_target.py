"""What the real-launch tests run on every rank: ``_launch_target.py MODE [args]``."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time


def parse_config(text: str) -> object:
    import json

    return json.loads(text)  # the user's line the summary must keep


class _SlowTeardown:
    """Sleeps when the interpreter's finalisation frees it: after every ``atexit`` handler
    (cudampi's "exiting" mark included), before MPI_Finalize (mpi4py's, at the C level)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __del__(self, sleep=time.sleep) -> None:
        sleep(self.seconds)


_SLOW_TEARDOWN: _SlowTeardown | None = None


def main() -> int:
    mode, *args = sys.argv[1:]
    rank = int(os.environ["RANK"])
    if mode == "check":
        import numpy as np
        from mpi4py import MPI

        import cudampi

        info = cudampi.init()
        comm = MPI.COMM_WORLD
        n = int(args[0])
        assert comm.size == n == info.world_size == int(os.environ["WORLD_SIZE"]), comm.size
        assert comm.rank == info.rank == rank
        local = comm.Split_type(MPI.COMM_TYPE_SHARED)
        assert local.rank == info.local_rank == int(os.environ["LOCAL_RANK"])
        assert local.size == info.local_world_size == int(os.environ["LOCAL_WORLD_SIZE"])
        assert os.environ["CUDAMPI_LAUNCHER"] in ("openmpi", "mpich", "slurm")
        ports = comm.allgather((os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]))
        assert len(set(ports)) == 1, ports
        assert args[1:] == ["--flag", "a b"], args  # script arguments pass through unchanged
        x = np.full(4, rank + 1, dtype=np.int64)
        y = np.empty_like(x)
        comm.Allreduce(x, y)
        assert y.tolist() == [n * (n + 1) // 2] * 4, y
        print(
            f"rank {rank} ok on {socket.gethostname()} ifname={os.environ.get('NCCL_SOCKET_IFNAME')}",
            flush=True,
        )
        comm.Barrier()
        if rank == 0:
            print(f"OK {n}", flush=True)
        return 0
    if mode == "env":  # args: variable names; prints what this rank sees
        seen = " ".join(f"{name}={os.environ.get(name)}" for name in args)
        print(f"rank {rank} on {socket.gethostname()}: {seen}", flush=True)
        return 0
    if mode == "hier":  # args: node_ranks [per]; the hierarchical collectives (test_comm_hier)
        from mpi4py import MPI

        from tests.mpi.test_comm_hier import rank_hier  # the tests' PYTHONPATH has the repo root

        rank_hier(MPI.COMM_WORLD, *args)
        return 0
    if mode == "quit":  # ends at once, without Python's exit (as a rank that dies in C does)
        os._exit(0)
    if mode == "forge":  # prints what looks like a fault report (a log of an earlier job), then ok
        line = "[cudampi-fault host=elsewhere rank=7 code=3] ValueError: from an old log"
        print(line, flush=True)
        print(line, file=sys.stderr, flush=True)
        print(f"[cudampi-fault 0123456789abcdef host=x rank={rank} code=1] E", file=sys.stderr)
        return 0
    if mode == "stuck-exit":  # args: rank, how[, file[, s]]: that rank's exit outlasts its script
        from mpi4py import MPI

        if rank == int(args[0]):
            import atexit

            if args[1] == "work":  # real work at exit (an upload): 6 s, then a file says done

                def work(path: str = args[2]) -> None:
                    time.sleep(6)
                    with open(path, "w") as f:
                        f.write("done")

                atexit.register(work)
                if len(args) > 3:  # then a teardown of s seconds, past every exit handler
                    global _SLOW_TEARDOWN
                    _SLOW_TEARDOWN = _SlowTeardown(float(args[3]))
            elif args[1] == "barrier":  # a collective at exit the others, in MPI_Finalize, skip
                atexit.register(MPI.COMM_WORLD.Barrier)
            else:  # stuck past Python's exit: in the C library's exit, after MPI_Finalize
                import ctypes
                import ctypes.util

                libc = ctypes.CDLL(ctypes.util.find_library("c"))
                libc.on_exit(libc.pause, None)
        MPI.COMM_WORLD.Barrier()
        return 0
    if mode == "sleep":  # args: pid folder
        with open(os.path.join(args[0], f"{rank}.pid"), "w") as f:
            f.write(str(os.getpid()))
        time.sleep(120)
        return 0
    target = int(args[0])
    if mode == "mpi-kill":  # MPI up (MPICH's shared-memory segment made), then one rank killed
        from mpi4py import MPI

        if rank != target:  # the job's own segments: what this rank maps in /dev/shm
            with open("/proc/self/maps") as f:
                mapped = sorted({ln.split()[-1] for ln in f if "/dev/shm/mpich_" in ln})
            print("SEGMENTS", *mapped, flush=True)
        MPI.COMM_WORLD.Barrier()
        if rank == target:
            os.kill(os.getpid(), signal.SIGKILL)
        MPI.COMM_WORLD.Barrier()
        return 0
    if rank == target:
        if mode == "raise":
            raise ValueError(f"planted failure on rank {rank}")
        if mode == "deep":  # a failure three library frames below the user's own line
            parse_config("{not json")
        if mode == "exit":
            sys.exit(int(args[1]))
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if mode == "segv":
            import ctypes

            ctypes.string_at(0)
    time.sleep(float(os.environ.get("TARGET_SLEEP", "20")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
