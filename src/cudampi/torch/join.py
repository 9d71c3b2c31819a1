"""One MPI job out of processes torchrun (or any non-MPI launcher) started.

torchrun starts plain processes: each would initialise MPI as a one-process job (an MPI
singleton). When the cudampi group is created before MPI has started, rank 0 starts cudampi's
PMI-1 server (:mod:`cudampi.launch.pmi`), publishes its address in torch's rendezvous store, and
every rank points MPI at it (``PMI_PORT``/``PMI_ID``) before importing ``mpi4py.MPI``: MPI_Init
then makes one COMM_WORLD whose ranks are torch's. That works for MPIs that speak PMI-1 (MPICH,
Intel MPI, MVAPICH). Each rank also keeps a watch connection to the server: when a rank aborts or
dies, the others exit instead of waiting in a collective for ever. Open MPI 5 speaks only PMIx:
its processes stay singletons, and every rank raises a ConfigError that names the fixes.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from cudampi.errors import ConfigError
from cudampi.launch.pmi import client_env, single_node_mapping, watch
from cudampi.torch.rendezvous import mpi_launcher

STORE_KEY = "cudampi/pmi_address"
_SERVER: list[subprocess.Popen[str]] = []  # rank 0's PMI server, kept for the process's life


def mpi_started() -> bool:
    """Has this process initialised MPI already (through mpi4py)?"""
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI

    return bool(MPI.Is_initialized())


def needs_join(env: Mapping[str, str], size: int) -> bool:
    """A group of ``size`` > 1 in a process no MPI launcher started, before MPI has started."""
    return size > 1 and mpi_launcher(env) is None and not mpi_started()


def _server_host(env: Mapping[str, str]) -> tuple[str, str]:
    """(listen address, address the ranks dial): loopback when torchrun's ranks share this host,
    else every interface and the address this host routes towards MASTER_ADDR from."""
    local = env.get("LOCAL_WORLD_SIZE")
    world = env.get("WORLD_SIZE")
    if local and world and local == world:
        return "127.0.0.1", "127.0.0.1"
    master = env.get("MASTER_ADDR") or ""
    addr = ""
    if master:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((master, int(env.get("MASTER_PORT") or 1)))  # sends nothing
                addr = s.getsockname()[0]
            except OSError:
                addr = ""
    if not addr or addr.startswith("127."):
        try:
            addr = socket.gethostbyname(socket.gethostname())
        except OSError:
            addr = "127.0.0.1"
    return "0.0.0.0", addr


def _start_server(size: int, env: Mapping[str, str]) -> str:
    listen, dial = _server_host(env)
    argv = [sys.executable, "-m", "cudampi.launch.pmi", "--size", str(size), "--host", listen]
    if listen == "127.0.0.1":
        argv += ["--mapping", single_node_mapping(size)]
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        raise ConfigError(
            f"cudampi: rank 0 on {socket.gethostname()} could not start its PMI server "
            f"({' '.join(argv)!r} printed {line!r}, exit code {proc.poll()!r})."
        )
    _SERVER[:] = [proc]
    return f"{dial}:{line}"


def join_world(store: Any, rank: int, size: int, timeout: timedelta | None = None) -> Any:
    """``MPI.COMM_WORLD`` of one job of ``size`` ranks, ``rank`` being torch's rank here.

    Collective over torch's ranks (all of them must call it, through the world group's creator).
    """
    if rank == 0:
        store.set(STORE_KEY, _start_server(size, os.environ))
    if timeout is not None:
        store.wait([STORE_KEY], timeout)
    address = store.get(STORE_KEY).decode()
    saved = {k: os.environ.get(k) for k in ("PMI_PORT", "PMI_ID")}
    os.environ.update(client_env(address, rank))
    try:
        from mpi4py import MPI  # MPI_Init: reaches the PMI server and meets the other ranks
    finally:
        # Later processes (a DataLoader worker that execs Python, a tool) must not pose as us.
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    world = MPI.COMM_WORLD
    if world.size != size or world.rank != rank:
        for proc in _SERVER:
            proc.kill()
        raise ConfigError(torchrun_message(size, MPI.Get_library_version(), world.size))
    watch(address, rank, _end_with_the_job(rank, size))
    return world


def _end_with_the_job(rank: int, size: int) -> Callable[[str, int], None]:
    """What a rank does when its watch connection says the job failed: no launcher will kill
    it (torchrun does not know the ranks are one MPI job, least of all across hosts), and it may
    be blocked in a collective for ever, so it says why and exits at once."""

    def end(why: str, code: int) -> None:
        err = sys.__stderr__ or sys.stderr
        err.write(
            f"cudampi: {why}; ending rank {rank} of {size} on {socket.gethostname()} too, "
            "since the MPI job cannot go on without it.\n"
        )
        err.flush()
        os._exit(code)

    return end


def torchrun_message(size: int, library: str, got: int = 1) -> str:
    """Why torchrun's processes did not become one MPI job, and what to do instead."""
    lib = " ".join(library.split())[:80]
    return (
        f"torch asks for a group of {size} processes that no MPI launcher started (torchrun, "
        f"say). cudampi pointed MPI at its PMI-1 server so they would form one job, but the MPI "
        f"that mpi4py loads ({lib}) made a {got}-process job instead: it does not speak PMI-1 "
        "(Open MPI 5 speaks only PMIx), so each process is an MPI singleton. Fix: launch with "
        f"`cudampi launch -n {size} script.py` or `mpirun -n {size} python script.py` (no "
        "MASTER_ADDR needed); or keep torchrun with an MPICH-family MPI: `python -m venv "
        "/opt/mpich && /opt/mpich/bin/pip install mpich`, then "
        "MPI4PY_LIBMPI=/opt/mpich/lib/libmpi.so.12 in torchrun's environment; or use backend "
        "'gloo'/'nccl' under torchrun."
    )


__all__ = ["join_world", "mpi_started", "needs_join", "torchrun_message"]
