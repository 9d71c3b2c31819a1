"""Rendezvous for ``init_process_group`` under an MPI launcher: rank and size come from MPI.

``cudampi://`` (registered by ``import cudampi.torch``) takes rank and size from
``MPI.COMM_WORLD``, starts a ``TCPStore`` on rank 0 and broadcasts its address over MPI, so no
MASTER_ADDR, MASTER_PORT, RANK or WORLD_SIZE is needed. The default ``env://`` is wrapped so that
a plain ``init_process_group("cudampi")`` under mpirun/mpiexec/srun does the same *when those
variables are missing* (where env:// would raise); with them set (torchrun) env:// runs unchanged.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any
from urllib.parse import urlparse

from cudampi.errors import ConfigError
from cudampi.net import routed_address
from cudampi.rankenv import mpi_launcher

SCHEME = "cudampi"
INIT_METHOD = f"{SCHEME}://"
"""``init_process_group(backend, init_method=cudampi.torch.INIT_METHOD)`` takes ranks from MPI."""

_ENV_VARS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def needs_mpi_rendezvous(url: str, env: Mapping[str, str]) -> bool:
    """Would ``env://`` fail here for want of variables that MPI can stand in for?"""
    query = urlparse(url).query
    missing = [v for v in _ENV_VARS if not env.get(v)]
    if "rank=" in query:
        missing = [v for v in missing if v != "RANK"]
    if "world_size=" in query:
        missing = [v for v in missing if v != "WORLD_SIZE"]
    return bool(missing) and mpi_launcher(env) is not None


def _query_int(url: str, key: str) -> int:
    for pair in urlparse(url).query.split("&"):
        k, _, v = pair.partition("=")
        if k == key and v:
            return int(v)
    return -1


def _store_address(comm: Any, env: Mapping[str, str]) -> str:
    """The address rank 0's TCPStore is reached at: loopback on one host, else a routable one."""
    hosts = comm.allgather(socket.gethostname())
    if env.get("MASTER_ADDR"):
        return env["MASTER_ADDR"]
    if len(set(hosts)) == 1:
        return "127.0.0.1"
    if comm.rank != 0:
        return ""
    return routed_address()


def mpi_rendezvous(
    url: str, timeout: timedelta = timedelta(minutes=30), **kwargs: Any
) -> Iterator[tuple[Any, int, int]]:
    """torch rendezvous handler: ``(store, rank, world_size)`` from MPI.COMM_WORLD.

    Rank 0 starts a TCPStore (on MASTER_PORT if set, else a free port) and broadcasts its address
    and port to every rank over MPI. A rank or world size in the URL must agree with MPI's.
    """
    return _rendezvous(url, timeout, env_ranks=False)


def _rendezvous(url: str, timeout: timedelta, *, env_ranks: bool) -> Iterator[tuple[Any, int, int]]:
    """``env_ranks``: RANK/WORLD_SIZE in the environment count too (env:// reads them)."""
    from mpi4py import MPI
    from torch.distributed import TCPStore

    comm = MPI.COMM_WORLD
    want_rank, want_size = _query_int(url, "rank"), _query_int(url, "world_size")
    if env_ranks:
        want_rank = want_rank if want_rank != -1 else _env_int(os.environ, "RANK")
        want_size = want_size if want_size != -1 else _env_int(os.environ, "WORLD_SIZE")
    host = socket.gethostname()
    asked = max(want_size, _env_int(os.environ, "WORLD_SIZE"))
    if comm.size == 1 and asked > 1:
        raise ConfigError(singleton_message(asked, sys.modules))
    problem = ""
    if (want_rank != -1 and want_rank != comm.rank) or (want_size != -1 and want_size != comm.size):
        problem = (
            f"init_process_group was given rank={want_rank} world_size={want_size} (arguments, "
            "URL or RANK/WORLD_SIZE), but MPI "
            f"says the process on {host} is rank {comm.rank} of {comm.size}. The cudampi "
            "rendezvous takes rank and size from MPI. Fix: drop rank=/world_size= (and RANK/"
            "WORLD_SIZE), or set them to MPI's values."
        )
    _raise_on_every_rank(comm, problem)
    addr = _store_address(comm, os.environ)
    port = int(os.environ.get("MASTER_PORT", "0") or 0)
    store = None
    problem = ""
    if comm.rank == 0:
        try:
            store = TCPStore(addr, port, comm.size, True, timeout=timeout, wait_for_workers=False)
            port = store.port
        except Exception as exc:  # told to every rank, then raised everywhere
            problem = (
                f"cudampi rendezvous: rank 0 on {host} could not start the TCPStore on port "
                f"{port}: {type(exc).__name__}: {exc}. Fix: set MASTER_PORT to a free port (or "
                "unset it to pick one)."
            )
    addr, port = comm.bcast((addr, port), root=0)
    _raise_on_every_rank(comm, problem)
    if store is None:
        try:
            store = TCPStore(addr, port, comm.size, False, timeout=timeout)
        except Exception as exc:  # told to every rank, then raised everywhere
            problem = (
                f"cudampi rendezvous: rank {comm.rank} on {host} cannot reach rank 0's TCPStore "
                f"at {addr}:{port}: {type(exc).__name__}: {exc}. Fix: set MASTER_ADDR to an "
                "address of rank 0's host that every host can reach (and open the port)."
            )
    _raise_on_every_rank(comm, problem)
    yield store, comm.rank, comm.size
    raise RuntimeError("cudampi:// cannot re-rendezvous: the MPI job's membership is fixed")


def _raise_on_every_rank(comm: Any, problem: str) -> None:
    """Raise ``problem`` (of any rank) as a ConfigError on every rank: no rank is left waiting."""
    problems = [p for p in comm.allgather(problem) if p]
    if problems:
        raise ConfigError(problem or problems[0])


def _env_int(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env.get(name, "-1") or -1)
    except ValueError:
        return -1


def singleton_message(world_size: int, modules: Iterable[str] = ()) -> str:
    """Why a 1-process MPI job cannot be a group of ``world_size``, and what to do instead.

    ``modules``: the names of the loaded modules (``sys.modules``); where Lightning is among
    them, the message names its fix too.
    """
    return (
        f"torch asks for a group of {world_size} processes, but this process is a 1-process MPI "
        "job (an MPI singleton): no mpirun/mpiexec/srun started it, and MPI was already running "
        "before the cudampi group was created (mpi4py.MPI imported earlier), so cudampi could "
        "not join the processes into one job. Fix: launch with `cudampi launch -n "
        f"{world_size} script.py` or `mpirun -n {world_size} python script.py` (no MASTER_ADDR "
        "needed); under torchrun, import mpi4py.MPI only after init_process_group('cudampi') "
        "and use an MPICH-family MPI (see docs/torch.md); or use backend 'gloo'/'nccl'."
        + lightning_hint(modules)
    )


def lightning_hint(modules: Iterable[str]) -> str:
    """The fix under Lightning's own launcher, if Lightning is among ``modules``, else ``""``."""
    if not any(m in ("lightning", "pytorch_lightning", "lightning_fabric") for m in modules):
        return ""
    return (
        " Lightning is loaded: under its own launcher (`python train.py` with devices=N) its "
        "MPIEnvironment detection calls MPI.COMM_WORLD.Get_size(), which starts MPI in every "
        "process before cudampi can join them. Fix: pass the environment explicitly, "
        "Trainer(..., plugins=[LightningEnvironment()]) (from lightning.pytorch.plugins."
        "environments; then cudampi joins the processes as under torchrun: MPICH-family MPI), "
        "or start the script with `cudampi launch`/mpirun, where Lightning's MPIEnvironment is "
        "right."
    )


def together(timeout: timedelta) -> None:
    """Where MPI runs already (a group made before, destroyed since): return once every rank of
    the MPI job is here, at most ``timeout``. env:// starts each group's TCPStore on the same
    MASTER_PORT: without this a rank that comes back to ``init_process_group`` first reaches
    rank 0's previous store, which rank 0 closes when it gets to ``destroy_process_group``
    (DistNetworkError "Failed to recv", or a wait for a store that never fills)."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        return
    world = mpi.COMM_WORLD
    if world.Get_size() == 1:
        return
    from cudampi.comm.deadline import spin
    from cudampi.errors import CommTimeoutError

    seconds = timeout.total_seconds()
    spin(
        world.Ibarrier().Test,
        seconds,
        lambda: CommTimeoutError(
            f"init_process_group: not every rank of the MPI job came within {seconds:g} s "
            f"(rank {world.Get_rank()} of {world.Get_size()} waits): every rank must call it"
        ),
    )


def wrap_env_handler(handlers: dict[str, Callable[..., Any]]) -> None:
    """Make ``handlers['env']`` fall back to :func:`mpi_rendezvous` where env:// would fail.

    Idempotent. Only used where the env variables are missing *and* an MPI launcher started
    this process, i.e. exactly where stock env:// raises "environment variable ... expected".
    """
    original = handlers.get("env")
    if original is None or getattr(original, "_cudampi_wrapped", False):
        return

    def env_or_mpi(url: str, **kwargs: Any) -> Iterator[tuple[Any, int, int]]:
        timeout = kwargs.get("timeout", timedelta(minutes=30))
        if needs_mpi_rendezvous(url, os.environ):
            return _rendezvous(url, timeout, env_ranks=True)
        together(timeout)
        return original(url, **kwargs)

    env_or_mpi._cudampi_wrapped = True  # type: ignore[attr-defined]
    env_or_mpi.__doc__ = original.__doc__
    handlers["env"] = env_or_mpi
