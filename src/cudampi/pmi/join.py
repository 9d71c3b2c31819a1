"""One MPI job out of processes torchrun (or any non-MPI launcher) started.

torchrun starts plain processes: each would initialise MPI as a one-process job (an MPI
singleton). When the cudampi group is created before MPI has started, rank 0 starts cudampi's
PMI-1 server (:mod:`cudampi.pmi.server`), publishes its address in torch's rendezvous store, and
every rank connects to it with the job's secret and hands the connection to MPI (``PMI_FD``)
before importing ``mpi4py.MPI``: MPI_Init then makes one COMM_WORLD whose ranks are torch's. That
works for MPIs that speak PMI-1 (MPICH, Intel MPI, MVAPICH): the ranks load cudampi's own MPICH
(:mod:`cudampi.pmi.mpich`) unless MPI4PY_LIBMPI names another. Each rank also keeps a watch
connection to the server: when a rank aborts or dies, the others exit instead of waiting in a
collective for ever. Open MPI 5 speaks only PMIx: where it is what the ranks would load, every
rank raises a ConfigError that names the fixes before any of them starts MPI.

The secret: ``CUDAMPI_PMI_SECRET`` when the environment torchrun passes on has it (the same value
on every host; required when the job spans hosts, since torch's store is readable by anyone who
reaches it); else, on one host, rank 0 makes one and hands it over in a file only this user can
read (its path goes through the store). The server listens on loopback on one host, else on the
address this host reaches MASTER_ADDR from.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

from cudampi.config import PMI_SECRET
from cudampi.errors import ConfigError
from cudampi.net import routed_address
from cudampi.pmi import mpich
from cudampi.pmi.client import (
    InitGuard,
    client_env,
    connect,
    ending_message,
    single_node_mapping,
    watch,
)
from cudampi.rankenv import launched_by, mpi_launcher

STORE_KEY = "cudampi/pmi_address"
SECRET_KEY = "cudampi/pmi_secret_file"
SECRET_ENV = PMI_SECRET
"""The job's PMI secret, set by the user in torchrun's environment (the same on every host)."""
_SERVER: list[subprocess.Popen[str]] = []  # rank 0's PMI server, kept for the process's life
_PMI: list[int] = []  # this rank's PMI connection (a file descriptor MPI reads as PMI_FD)


def mpi_started() -> bool:
    """Has this process initialised MPI already (through mpi4py)?"""
    if "mpi4py.MPI" not in sys.modules:
        return False
    from mpi4py import MPI

    return bool(MPI.Is_initialized())


def needs_join(env: Mapping[str, str], size: int) -> bool:
    """A group of ``size`` > 1 in a process no MPI launcher started, before MPI has started."""
    return size > 1 and mpi_launcher(env) is None and not mpi_started()


def one_host(env: Mapping[str, str]) -> bool:
    """Do all of the launcher's ranks run on this host?

    torchrun says so with LOCAL_WORLD_SIZE == WORLD_SIZE. A launcher that sets no
    LOCAL_WORLD_SIZE (Lightning's own, accelerate's without torchrun) still says so when
    MASTER_ADDR is a loopback address: every rank reached torch's store there, so every rank
    shares this host's network (the server on loopback reaches them all).
    """
    local = env.get("LOCAL_WORLD_SIZE")
    world = env.get("WORLD_SIZE")
    if local and world:
        return local == world
    return _loopback(env.get("MASTER_ADDR") or "")


def _loopback(host: str) -> bool:
    """Is ``host`` a loopback address as written (no name lookup: it could wait on DNS)?"""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _server_host(env: Mapping[str, str]) -> tuple[str, str]:
    """(listen address, address the ranks dial): loopback when torchrun's ranks share this host,
    else the address this host routes towards MASTER_ADDR from (only that interface)."""
    if one_host(env):
        return "127.0.0.1", "127.0.0.1"
    addr = routed_address(env.get("MASTER_ADDR") or None)
    return addr, addr


def _start_server(size: int, env: Mapping[str, str], secret: str) -> str:
    listen, dial = _server_host(env)
    argv = [sys.executable, "-m", "cudampi.pmi.server", "--size", str(size), "--host", listen]
    if launched_by(env).name == "torchrun":  # killed, torchrun ends none of its ranks: we do
        argv += ["--launcher-pid", str(os.getppid())]
    if listen == "127.0.0.1":
        argv += ["--mapping", single_node_mapping(size)]
    child_env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
    proc = subprocess.Popen(
        argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=child_env
    )
    assert proc.stdout is not None and proc.stdin is not None
    proc.stdin.write(secret + "\n")  # its standard input stays open: it closes when we end
    proc.stdin.flush()
    line = proc.stdout.readline().strip()
    if not line.isdigit():
        proc.kill()
        raise ConfigError(
            f"cudampi: rank 0 on {socket.gethostname()} could not start its PMI server "
            f"({' '.join(argv)!r} printed {line!r}, exit code {proc.poll()!r})."
        )
    _SERVER[:] = [proc]
    return f"{dial}:{line}"


def _job_secret(store: Any, rank: int, env: Mapping[str, str], wait: Any) -> tuple[str, str]:
    """(the job's PMI secret, the folder rank 0 made to hand it over or "")."""
    given = env.get(SECRET_ENV, "")
    if given:
        if len(given) < 16:
            raise ConfigError(
                f"{SECRET_ENV} has {len(given)} characters; the PMI secret needs at least 16. "
                f"Fix: export {SECRET_ENV}=$(python -c 'import secrets; print(secrets.token_hex(16))')"
            )
        return given, ""
    if not one_host(env):
        raise ConfigError(
            f"torchrun's ranks span several hosts (WORLD_SIZE={env.get('WORLD_SIZE')}, "
            f"LOCAL_WORLD_SIZE={env.get('LOCAL_WORLD_SIZE')}, "
            f"MASTER_ADDR={env.get('MASTER_ADDR')}), so cudampi's PMI server must "
            f"listen on the network, and only a secret shared by the job's processes keeps "
            f"others out. Fix: export {SECRET_ENV}=<the same random value on every host> in "
            f"torchrun's environment, e.g. {SECRET_ENV}=$(python -c 'import secrets; "
            "print(secrets.token_hex(16))') in the batch script before torchrun"
        )
    folder = ""
    if rank == 0:
        folder = tempfile.mkdtemp(prefix="cudampi-pmi-")  # 0700: this user's only
        path = os.path.join(folder, "secret")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(16))
        store.set(SECRET_KEY, path)
    wait([SECRET_KEY])
    path = store.get(SECRET_KEY).decode()
    try:
        with open(path) as f:
            return f.read().strip(), folder
    except OSError as exc:
        raise ConfigError(
            f"cudampi: rank {rank} on {socket.gethostname()} cannot read the PMI secret that "
            f"rank 0 left in {path!r} ({exc.strerror}): torchrun's ranks must run as one user "
            f"on one host, or set {SECRET_ENV} in torchrun's environment."
        ) from None


def join_world(store: Any, rank: int, size: int, timeout: timedelta | None = None) -> Any:
    """``MPI.COMM_WORLD`` of one job of ``size`` ranks, ``rank`` being torch's rank here.

    Collective over torch's ranks (all of them must call it, through the world group's creator).
    """

    def wait(keys: list[str]) -> None:
        if timeout is not None:
            store.wait(keys, timeout)

    choice = mpich.select(os.environ)  # before mpi4py.MPI: the MPI every rank here will load
    if mpich.loads_open_mpi(choice):  # said now, on every rank, before any rank starts a server
        raise ConfigError(torchrun_message(size, f"Open MPI, {choice.why}"))
    secret, folder = _job_secret(store, rank, os.environ, wait)
    try:
        if rank == 0:
            store.set(STORE_KEY, _start_server(size, os.environ, secret))
        wait([STORE_KEY])
        address = store.get(STORE_KEY).decode()
        # MPI owns the connection from here on: a socket object would close it when collected
        # (at interpreter exit, before MPI_Finalize's last PMI barrier), a bare fd stays open.
        fd = connect(address, rank, secret).detach()
        _PMI[:] = [fd]
        guard = InitGuard(address, rank, size, secret)  # started before PMI_FD is set below
        names = ("PMI_FD", "PMI_RANK", "PMI_SIZE", "PMI_PORT", "PMI_ID")
        saved = {k: os.environ.pop(k, None) for k in names}
        os.environ.update(client_env(fd, rank, size))
        try:
            with guard:  # no thread of ours runs in MPI_Init: a process watches the job there
                from mpi4py import MPI  # MPI_Init: talks to the PMI server, meets the others
        finally:
            # Later processes (a DataLoader worker that execs Python, a tool) must not pose as us.
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
    finally:
        if folder:  # every rank read it before MPI_Init could return here
            shutil.rmtree(folder, ignore_errors=True)
    world = MPI.COMM_WORLD
    if world.size != size or world.rank != rank:
        for proc in _SERVER:
            proc.kill()
        lib = " ".join(MPI.Get_library_version().split())[:80]
        raise ConfigError(torchrun_message(size, f"{lib}, {choice.why}", world.size))
    watch(address, rank, _end_with_the_job(rank, size), secret)
    return world


def _end_with_the_job(rank: int, size: int) -> Callable[[str, int], None]:
    """What a rank does when its watch connection says the job failed: no launcher will kill
    it (torchrun does not know the ranks are one MPI job, least of all across hosts), and it may
    be blocked in a collective for ever, so it says why and exits at once."""

    def end(why: str, code: int) -> None:
        err = sys.__stderr__ or sys.stderr
        err.write(ending_message(why, rank, size))
        err.flush()
        os._exit(code)

    return end


def torchrun_message(size: int, library: str, got: int = 1) -> str:
    """Why torchrun's processes did not become one MPI job, and what to do instead."""
    return (
        f"cudampi: torch asks for a group of {size} processes that no MPI launcher started "
        f"(torchrun, say), so cudampi joins them through its PMI-1 server; but the MPI they "
        f"load ({library}) does not speak PMI-1 (Open MPI 5 speaks only PMIx) and would make "
        f"{got}-process jobs. Fix: `{mpich.INSTALL}` once in this environment (PyPI's mpich "
        "wheel, where only cudampi loads it), and leave MPI4PY_LIBMPI unset or point it at an "
        f"MPICH-family libmpi.so.12; or launch with `cudampi launch -n {size} script.py` or "
        f"`mpirun -n {size} python script.py`; or use backend 'gloo'/'nccl' under torchrun."
    )


__all__ = ["join_world", "mpi_started", "needs_join", "torchrun_message"]
