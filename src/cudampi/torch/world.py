"""The MPI communicator under a cudampi group: the world's (``MPI.COMM_WORLD``, the one in
:class:`~cudampi.torch.options.Options`, or the job :mod:`cudampi.pmi.join` makes of torchrun's
processes), checked against torch's ranks; the abort-on-exception hook that ends the MPI job
when one rank raises; and the exit hook that lets torch's C++ threads finish first."""

from __future__ import annotations

import atexit
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from cudampi.abort import abort_job
from cudampi.errors import ConfigError
from cudampi.pmi.join import join_world, needs_join
from cudampi.torch.options import Options
from cudampi.torch.rendezvous import singleton_message


@dataclass
class _World:
    """The MPI communicator under the current default group (one per init_process_group)."""

    mpi_comm: Any
    options: Options


WORLD: list[_World] = []  # the live default group's world; torch has one default group
GROUPS_MADE: list[bool] = []  # [True] once this process has made a cudampi group


def yield_to_torch_threads() -> None:
    """At interpreter exit, while Python is still whole: let torch's C++ threads take the GIL.

    A c10d worker thread (gloo's ``pt_gloo_runloop``) drops its reference to a finished
    collective's tensors after the caller has moved on, and each drop takes the GIL to release
    the tensor's Python object. When a script ends right after a collective (the last all_reduce
    on a gloo group, beside a cudampi world or as torch's default group), that thread can still
    be waiting for the GIL when the interpreter finalizes; it then exits inside a C++ destructor
    and the process aborts (``terminate called without an active exception``, SIGABRT) after
    the script's last line, failing the job (pytorch/pytorch#190489). A thread waiting for the
    GIL gets it as soon as this one sleeps. Only where a group is alive at exit, or this process
    made a cudampi group (whose gloo neighbours may outlive ``destroy_process_group``)."""
    if not GROUPS_MADE and not (dist.is_available() and dist.is_initialized()):
        return
    for _ in range(10):
        time.sleep(0.001)


def install_exit_hook() -> None:
    """Register :func:`yield_to_torch_threads` (at ``import cudampi.torch``)."""
    atexit.register(yield_to_torch_threads)


def timeout_of(dist_opts: Any) -> timedelta | None:
    t = getattr(dist_opts, "timeout", None)
    return t if isinstance(t, timedelta) else None


def where(rank: int, size: int) -> str:
    return f"rank {rank} of {size} on {socket.gethostname()}"


def open_world(options: Options, rank: int, size: int, dist_opts: Any = None) -> _World:
    if options.comm is not None:
        mpi_comm = options.comm
    elif dist_opts is not None and needs_join(os.environ, size):
        # torchrun: MPI has not started; make torch's processes one MPI job (cudampi.pmi.join)
        mpi_comm = join_world(dist_opts.store, rank, size, timeout_of(dist_opts))
    else:
        from mpi4py import MPI

        mpi_comm = MPI.COMM_WORLD
    if mpi_comm.size == 1 and size > 1:
        raise ConfigError(singleton_message(size, sys.modules))
    # Sizes are the same on every rank; ranks may differ on some only: agree before raising, so
    # no rank is left waiting in the next collective.
    mismatch = mpi_comm.size != size or bool(mpi_comm.allreduce(int(mpi_comm.rank != rank)))
    if mismatch:
        raise ConfigError(
            f"torch made this process rank {rank} of a {size}-process group, but its MPI "
            f"communicator says rank {mpi_comm.rank} of {mpi_comm.size} (host "
            f"{socket.gethostname()}; some rank's torch and MPI ranks differ). The cudampi "
            "backend needs torch's ranks to be MPI's. "
            "Fix: under mpirun/mpiexec/srun drop RANK/WORLD_SIZE/rank=/world_size= so the "
            "cudampi rendezvous takes them from MPI (or set init_method='cudampi://'); or pass "
            "pg_options=cudampi.torch.Options(comm=...) with a communicator that matches."
        )
    world = _World(mpi_comm=mpi_comm, options=options)
    WORLD[:] = [world]
    if options.abort_on_exception:
        install_abort_on_exception()
    return world


def open_subgroup_world(
    options: Options, ranks: list[int], store: Any = None, timeout: timedelta | None = None
) -> None:
    """``new_group(backend="cudampi")`` under another default backend (e.g. nccl or gloo).

    Only the new group's members get here, so nothing collective over the world may run: MPI's
    world ranks are checked against torch's on this rank alone.
    """
    rank, size = dist.get_rank(), dist.get_world_size()
    if options.comm is None and needs_join(os.environ, size):
        if len(ranks) != size:
            raise ConfigError(
                f"new_group(backend='cudampi') over ranks {ranks}: these processes were not "
                "started by an MPI launcher and MPI has not started yet, so cudampi must first "
                f"join all {size} of them into one MPI job, which only a group of every rank can "
                "do. Fix: create the first cudampi group over all ranks (new_group(backend="
                "'cudampi') or init_process_group('cudampi')), or launch with `cudampi launch`."
            )
        WORLD[:] = [_World(join_world(store, rank, size, timeout), options)]
        return
    from mpi4py import MPI

    mpi_comm = options.comm if options.comm is not None else MPI.COMM_WORLD
    if (mpi_comm.rank, mpi_comm.size) != (rank, size):
        raise ConfigError(
            f"new_group(backend='cudampi'): torch's default group makes this process rank "
            f"{rank} of {size}, MPI rank {mpi_comm.rank} of {mpi_comm.size} (host "
            f"{socket.gethostname()}). Fix: start the job with an MPI launcher so both agree, "
            "or pass pg_options=cudampi.torch.Options(comm=...) with a matching communicator."
        )
    WORLD[:] = [_World(mpi_comm=mpi_comm, options=options)]


_HOOK_LOCK = threading.Lock()
_HOOK_INSTALLED: list[bool] = []


def install_abort_on_exception() -> None:
    """Chain ``sys.excepthook``: print the traceback, then ``MPI_Abort`` the job.

    Without it a rank that raises exits while the others block forever in their next
    collective. The message goes to the real stderr, since torch's own excepthook (installed
    after the backend is made) buffers what the previous hook writes.
    """
    with _HOOK_LOCK:
        # Once per process: torch wraps sys.excepthook after each init and calls the previous
        # hook, so the first one installed keeps running.
        if _HOOK_INSTALLED:
            return
        _HOOK_INSTALLED.append(True)
        previous = sys.excepthook

        def abort_hook(exc_type: Any, exc: Any, tb: Any) -> None:
            import traceback

            from mpi4py import MPI

            world = MPI.COMM_WORLD
            if exc_type is KeyboardInterrupt or world.size == 1:
                previous(exc_type, exc, tb)  # nobody waits on us (or every rank got ^C)
                return
            text = "".join(traceback.format_exception(exc_type, exc, tb))
            abort_job(
                1,
                f"{text}cudampi: {where(world.rank, world.size)} raised "
                f"{exc_type.__name__}: {exc}; aborting the MPI job so the other ranks fail "
                "now instead of hanging in their next collective.\n",
            )

        sys.excepthook = abort_hook
