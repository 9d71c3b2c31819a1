"""The MPI job a benchmark runs in: world and node ranks, device binding, torch.distributed.

The session dups the world communicator for its own agreement traffic (barriers, the min/avg/max
of times, the #wrong sum), binds each rank to GPU ``local_rank % gpus`` when ``device`` is cuda,
and starts torch.distributed only when a torch path is asked for (a TCPStore on rank 0, its port
sent over MPI, so no fixed port can collide).
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import Any

from cudampi.errors import BenchError


@dataclass
class Session:
    """One rank's view of the job. Build with :func:`open_session`; close with :meth:`close`."""

    comm: Any
    """A Dup of the world communicator: the benchmark's own agreement traffic."""
    world: Any
    """The communicator the benchmarked paths are built on (the caller's)."""
    rank: int
    size: int
    local_rank: int
    local_size: int
    nodes: int
    device: str
    gpus: int = 0
    gpu_index: int | None = None
    gpu_name: str | None = None
    torch_default: str = "gloo"
    """Backend of torch's default group; "cudampi" when torch-cudampi is wanted, because the
    cudampi backend builds its subgroups on its own world group."""
    _dist_started: bool = False
    _groups: dict[str, Any] = field(default_factory=dict)

    @property
    def shares_gpu(self) -> bool:
        """More ranks on this node than GPUs: ranks share one GPU (and its HBM)."""
        return self.device == "cuda" and self.local_size > max(self.gpus, 1)

    def nccl_refusal(self, device: str) -> str | None:
        """Why NCCL cannot move ``device`` ("cuda" or "cpu") arrays of this session's ranks, or
        None: it moves device memory only, and refuses two ranks on one GPU."""
        if device != "cuda":
            if self.device == "cuda":
                return "NCCL moves device arrays, not host buffers"
            return "NCCL moves device arrays; this run is on the host"
        if self.shares_gpu:
            return (
                f"NCCL needs one GPU per rank: {self.local_size} ranks share {self.gpus} GPU(s) "
                "on this node"
            )
        return None

    # -- agreement over the job -------------------------------------------------------------
    def barrier(self) -> None:
        self.comm.Barrier()

    def agree_max(self, value: float) -> float:
        from mpi4py import MPI

        return float(self.comm.allreduce(float(value), op=MPI.MAX))

    def stats(self, value: float) -> tuple[float, float, float]:
        """(min, avg, max) of one number over the ranks."""
        from mpi4py import MPI

        lo = self.comm.allreduce(float(value), op=MPI.MIN)
        total = self.comm.allreduce(float(value), op=MPI.SUM)
        hi = self.comm.allreduce(float(value), op=MPI.MAX)
        return float(lo), float(total) / self.size, float(hi)

    def total(self, value: int) -> int:
        from mpi4py import MPI

        return int(self.comm.allreduce(int(value), op=MPI.SUM))

    def first_error(self, error: str | None) -> str | None:
        """Every rank learns the error (None when no rank had one): the text alone when every
        rank saw the same one, else the first failing rank's, tagged with its rank."""
        errors = self.comm.allgather(error)
        bad = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not bad:
            return None
        if len(bad) == self.size and len({e for _, e in bad}) == 1:
            return bad[0][1]
        rank, text = bad[0]
        return f"rank {rank}: {text}"

    # -- torch.distributed -------------------------------------------------------------------
    def torch_group(self, backend: str) -> Any:
        """The process group of ``backend`` (gloo, nccl, cudampi) over all ranks, made once.

        Collective: every rank must ask for the same backends in the same order.
        """
        if backend in self._groups:
            return self._groups[backend]
        import torch.distributed as dist

        if not self._dist_started:
            try:
                self._start_dist(self.torch_default)
            except Exception as exc:
                if self.torch_default == "gloo":
                    raise
                # the cudampi backend could not make the world group: the others still run
                self._groups["cudampi"] = exc
                self.torch_default = "gloo"
                self._start_dist("gloo")
        if isinstance(self._groups.get(backend), Exception):
            raise self._groups[backend]
        if backend == self.torch_default:
            group = dist.group.WORLD
        elif backend == "cudampi-async":
            if isinstance(self._groups.get("cudampi"), Exception):
                raise self._groups["cudampi"]
            from cudampi.torch import Options

            group = dist.new_group(
                list(range(self.size)), backend="cudampi", pg_options=Options(async_ops=True)
            )
        else:
            group = dist.new_group(list(range(self.size)), backend=backend)
        self._groups[backend] = group
        return group

    def _start_dist(self, backend: str) -> None:
        import datetime

        import torch.distributed as dist

        if backend == "cudampi":
            import cudampi.torch  # noqa: F401  (registers the "cudampi" backend)

        if dist.is_initialized():
            raise BenchError(
                "torch.distributed is already initialised in this process; run `cudampi bench` "
                "as its own program (it starts its own process groups)"
            )
        hosts = self.comm.allgather(socket.gethostname())
        addr = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        store = None
        port = 0
        if self.rank == 0:
            # wait_for_workers=False: the workers learn the port only after this returns
            store = dist.TCPStore(
                addr,
                0,
                self.size,
                True,
                timeout=datetime.timedelta(seconds=120),
                wait_for_workers=False,
            )
            port = int(store.port)
        port = int(self.comm.bcast(port, root=0))
        if self.rank != 0:
            store = dist.TCPStore(
                addr, port, self.size, False, timeout=datetime.timedelta(seconds=120)
            )
        dist.init_process_group(
            backend,
            store=store,
            rank=self.rank,
            world_size=self.size,
            timeout=datetime.timedelta(seconds=300),
        )
        self._dist_started = True

    def close(self) -> None:
        if self._dist_started:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._dist_started = False
            self._groups.clear()
        if self.comm is not None:
            self.comm.Free()
            self.comm = None


def cuda_device_count() -> int:
    """CUDA devices this process sees (torch, else CuPy); 0 when neither sees any."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.device_count())
        return 0
    except ImportError:
        pass
    try:
        import cupy

        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:
        return 0


def open_session(world: Any, device: str) -> Session:
    """Describe this rank of ``world`` and bind it to a GPU when ``device`` is cuda."""
    from mpi4py import MPI

    comm = world.Dup()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.rank)
    local_rank, local_size = node.rank, node.size
    leaders = comm.allreduce(1 if local_rank == 0 else 0, op=MPI.SUM)
    node.Free()
    s = Session(
        comm=comm,
        world=world,
        rank=comm.rank,
        size=comm.size,
        local_rank=local_rank,
        local_size=local_size,
        nodes=int(leaders),
        device=device,
    )
    if device == "cuda":
        s.gpus = cuda_device_count()
        if s.gpus < 1:
            raise BenchError(
                f"--device cuda but rank {s.rank} on {socket.gethostname()} sees no CUDA device; "
                "use --device cpu, or check CUDA_VISIBLE_DEVICES and the driver (`nvidia-smi`)"
            )
        s.gpu_index = local_rank % s.gpus
        try:
            import torch

            torch.cuda.set_device(s.gpu_index)
            s.gpu_name = torch.cuda.get_device_name(s.gpu_index)
        except ImportError:
            import cupy

            cupy.cuda.Device(s.gpu_index).use()
            props = cupy.cuda.runtime.getDeviceProperties(s.gpu_index)
            name = props.get("name", b"")
            s.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
    return s
