"""``cudampi.init()``: one call at the top of a script, right under any launcher.

Under ``cudampi launch``, mpirun, mpiexec, srun, torchrun or plain ``python`` it returns who this
process is (:class:`RankInfo`), sets RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE /
MASTER_ADDR / MASTER_PORT where missing (what ``torch.distributed``'s ``env://`` reads) and
selects the rank's CUDA device. Call it before anything touches CUDA, so the first CUDA context
lands on the rank's own GPU instead of every rank's GPU 0.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any

from cudampi.errors import ConfigError, LaunchError
from cudampi.net import free_port, port_for, routed_address
from cudampi.rankenv import forms_mpi_job, job_key, rank_env


@dataclass(frozen=True)
class RankInfo:
    """Who this process is in its job."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    """torchrun, openmpi, mpich, slurm, env or none (see :mod:`cudampi.rankenv`)."""
    device: int | None
    """CUDA ordinal selected for this rank (in this process's numbering); None: no GPU."""
    host: str
    master_addr: str
    master_port: int

    @property
    def is_root(self) -> bool:
        return self.rank == 0


_STATE: dict[str, RankInfo] = {}


def _job_port(env: MutableMapping[str, str]) -> int:
    """A port every rank of one job computes alike without talking (from the job's id)."""
    key = f"{job_key(env)}|{env.get('MASTER_ADDR', '')}"
    return port_for(int(hashlib.sha256(key.encode()).hexdigest()[:8], 16))


def _rank0_host(launcher: str, env: MutableMapping[str, str]) -> str | None:
    """Rank 0's host where the launcher's variables say it (Slurm's step node list)."""
    from cudampi.launch.launchers import rendezvous_host

    return rendezvous_host(launcher, env)


def _rendezvous_by_mpi() -> tuple[str, int]:
    """Rank 0's address and a free port on it, broadcast over MPI (multi-host, no
    MASTER_ADDR given: only rank 0 knows where it is)."""
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    value = (routed_address(), free_port()) if comm.rank == 0 else None
    addr, port = comm.bcast(value, root=0)
    return str(addr), int(port)


def _gpu_count() -> int:
    from cudampi.launch.gpu import visible_list

    if "torch" in sys.modules:
        try:
            return int(sys.modules["torch"].cuda.device_count())
        except Exception:
            pass
    listed = visible_list(os.environ.get("CUDA_VISIBLE_DEVICES"))
    if listed is not None:
        from cudampi.launch.detect import query_gpus

        return min(len(listed), len(query_gpus())) if listed else 0
    from cudampi.launch.detect import query_gpus

    return len(query_gpus())


def _select_device(device: int) -> str | None:
    """Make ``device`` current in torch and/or CuPy; returns which library did it."""
    import importlib.util

    done = []
    torch_mod: Any = sys.modules.get("torch")
    cupy_mod: Any = sys.modules.get("cupy")
    if torch_mod is None and cupy_mod is None:
        # Neither is loaded yet: selection needs one of them; torch first (the usual user).
        if importlib.util.find_spec("torch") is not None:
            torch_mod = importlib.import_module("torch")
        elif importlib.util.find_spec("cupy") is not None:
            cupy_mod = importlib.import_module("cupy")
    if torch_mod is not None:
        try:
            if torch_mod.cuda.is_available():
                torch_mod.cuda.set_device(device)
                done.append("torch")
        except RuntimeError as exc:
            raise LaunchError(
                f"torch.cuda.set_device({device}) failed: {exc}. LOCAL_RANK "
                f"{os.environ.get('LOCAL_RANK')!r} has no GPU of its own: run at most one rank "
                f"per GPU (--gpus-per-node) or set CUDA_VISIBLE_DEVICES"
            ) from None
    if cupy_mod is not None:
        try:
            cupy_mod.cuda.Device(device).use()
            done.append("cupy")
        except Exception:
            pass
    return "+".join(done) or None


def init(backend: str | None = None, *, select_device: bool = True, **pg_kwargs: Any) -> RankInfo:
    """Find this process's rank, export the torch.distributed variables, select the GPU.

    Sets RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT where they
    are missing. Calling it again returns the first call's info. Torch is imported only if it is
    already imported, a GPU must be selected, or ``backend`` is given.

    Args:
        backend: if given (``"nccl"``, ``"gloo"``, ``"cudampi"``...), also initialize
            ``torch.distributed`` with it over ``env://``, unless it is initialized already.
        select_device: make the rank's GPU current in torch and/or CuPy: the one
            ``cudampi launch`` chose (CUDAMPI_DEVICE), else the local rank modulo the visible
            GPUs (none with CUDAMPI_BIND_GPU=none).
        **pg_kwargs: passed to ``torch.distributed.init_process_group`` with ``backend``.

    Returns:
        Who this process is: rank, sizes, launcher, selected device, host, master address.

    Raises:
        LaunchError: the launcher's variables contradict each other, RANK or WORLD_SIZE
            disagree with the launcher's (an outer job's leaked in), the job spans hosts
            without MASTER_ADDR/MASTER_PORT under a launcher that cannot say where rank 0 is,
            or torch cannot select the rank's GPU.
        ConfigError: MASTER_PORT is not a port number.
    """
    info = _STATE.get("info")
    if info is None:
        info = _init_env(os.environ, select_device)
        _STATE["info"] = info
    if backend is not None:
        _init_process_group(backend, info, pg_kwargs)
    return info


def _init_env(env: MutableMapping[str, str], select_device: bool) -> RankInfo:
    re_ = rank_env(env)
    env.setdefault("RANK", str(re_.rank))
    env.setdefault("WORLD_SIZE", str(re_.world_size))
    env.setdefault("LOCAL_RANK", str(re_.local_rank))
    env.setdefault("LOCAL_WORLD_SIZE", str(re_.local_world_size))
    for name, want in (("RANK", re_.rank), ("WORLD_SIZE", re_.world_size)):
        if env[name] != str(want):
            raise LaunchError(
                f"{name}={env[name]!r} but the launcher ({re_.launcher}) says {want}; an outer "
                f"job's variables leaked in. Unset {name} or launch with one launcher"
            )
    if "MASTER_ADDR" not in env or "MASTER_PORT" not in env:
        if re_.world_size == 1 or re_.local_world_size == re_.world_size:
            env.setdefault("MASTER_ADDR", "127.0.0.1")
            env.setdefault(
                "MASTER_PORT", str(free_port() if re_.world_size == 1 else _job_port(env))
            )
        elif (host := _rank0_host(re_.launcher, env)) is not None:
            env.setdefault("MASTER_ADDR", host)
            env.setdefault("MASTER_PORT", str(_job_port(env)))
        elif forms_mpi_job(re_.launcher):
            addr, port = _rendezvous_by_mpi()
            env.setdefault("MASTER_ADDR", addr)
            env.setdefault("MASTER_PORT", str(port))
        else:
            raise LaunchError(
                f"rank {re_.rank} of {re_.world_size} spans hosts but MASTER_ADDR/MASTER_PORT "
                f"are not set and {re_.launcher!r} cannot tell where rank 0 is; export them "
                f"or start the job with cudampi launch"
            )
    try:
        port = int(env["MASTER_PORT"])
    except ValueError:
        raise ConfigError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number") from None

    device: int | None = None
    if select_device:
        from cudampi.launch.gpu import device_hint

        device = device_hint(env)
        if device is None and env.get("CUDAMPI_BIND_GPU", "local") != "none":
            count = _gpu_count()
            device = re_.local_rank % count if count else None
        if device is not None:
            env.setdefault("CUDAMPI_DEVICE", str(device))
            _select_device(device)
    return RankInfo(
        rank=re_.rank,
        world_size=re_.world_size,
        local_rank=re_.local_rank,
        local_world_size=re_.local_world_size,
        launcher=re_.launcher,
        device=device,
        host=socket.gethostname(),
        master_addr=env["MASTER_ADDR"],
        master_port=port,
    )


def _init_process_group(backend: str, info: RankInfo, kwargs: dict[str, Any]) -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend == "cudampi":
        import importlib

        importlib.import_module("cudampi.torch")  # registers the backend
    dist.init_process_group(
        backend=backend, init_method="env://", rank=info.rank, world_size=info.world_size, **kwargs
    )
