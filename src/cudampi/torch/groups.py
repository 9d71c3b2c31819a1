"""Making cudampi process groups: the creator torch calls for the world group and every
subgroup (registered with ``torch.distributed.Backend.register_backend(..., extended_api=True,
devices=["cpu", "cuda"])`` by :func:`register`), beside the world they run on
(:mod:`cudampi.torch.world`).

The world group runs on ``MPI.COMM_WORLD`` (or the communicator in :class:`Options`; under
torchrun, the job :mod:`cudampi.pmi.join` makes of torch's processes); subgroups are
``MPI_Comm_create_group`` over the world, made only by their members, as torch calls the creator
only on members.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch.distributed as dist

from cudampi.config import Config
from cudampi.errors import CommError, ConfigError
from cudampi.torch.backend import CudampiProcessGroup
from cudampi.torch.debug import DetailChecker, detail_enabled
from cudampi.torch.options import BACKEND_NAME, Options
from cudampi.torch.work import AsyncRunner
from cudampi.torch.world import (
    GROUPS_MADE,
    WORLD,
    open_subgroup_world,
    open_world,
    timeout_of,
)


def create_process_group(dist_opts: Any, pg_options: Any = None) -> CudampiProcessGroup:
    """The creator torch calls (``extended_api=True``) for the world group and each subgroup."""
    GROUPS_MADE[:] = [True]
    if pg_options is None:
        options = WORLD[0].options if WORLD and dist_opts.global_ranks_in_group else Options()
    elif isinstance(pg_options, Options):
        options = pg_options
    else:
        raise ConfigError(
            f"pg_options={pg_options!r} is not a cudampi.torch.Options. Fix: pass "
            "cudampi.torch.Options(path=..., comm=...) or nothing."
        )
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    ranks = [int(r) for r in dist_opts.global_ranks_in_group]
    group_id = str(getattr(dist_opts, "group_id", ""))
    if not ranks:
        world = open_world(options, rank, size, dist_opts)
        mpi_comm = world.mpi_comm.Dup()
    else:
        if not WORLD:
            open_subgroup_world(options, ranks, dist_opts.store, timeout_of(dist_opts))
        parent = WORLD[0].mpi_comm
        mpi_group = parent.Get_group()
        sub_group = mpi_group.Incl(ranks)
        try:
            mpi_comm = parent.Create_group(sub_group)
        finally:
            sub_group.Free()
            mpi_group.Free()
        if mpi_comm.rank != rank or mpi_comm.size != size:
            raise CommError(
                f"cudampi: the MPI subgroup of world ranks {ranks} puts this process at rank "
                f"{mpi_comm.rank} of {mpi_comm.size}, torch at {rank} of {size}. This is a bug."
            )
    from cudampi.comm import Communicator

    runner = None
    from mpi4py import MPI

    threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    if options.async_ops or (options.async_ops is None and threads):
        if not threads:
            raise ConfigError(
                f"Options(async_ops=True) needs MPI_THREAD_MULTIPLE, but MPI was initialized at "
                f"thread level {MPI.Query_thread()!r}. Fix: leave mpi4py.rc.thread_level at its "
                "default ('multiple'), or use async_ops=False."
            )
        runner = AsyncRunner(f"cudampi-torch-{group_id or 'world'}")
    config = options.config if options.config is not None else Config.load()
    timeout = timeout_of(dist_opts)
    if timeout is not None and timeout.total_seconds() > 0:
        # torch's timeout= (init_process_group / new_group) is this group's deadline
        config = config.replace(timeout=timeout.total_seconds())
    comm = Communicator(mpi_comm, path=options.path, config=config)
    if runner is not None:
        runner.give_up = comm.give_up
    pg = CudampiProcessGroup(
        comm, mpi_comm, rank, size, ranks, group_id, runner=runner, auto=options.async_ops is None
    )
    if detail_enabled():  # TORCH_DISTRIBUTED_DEBUG=DETAIL: torch's wrapper skips Python groups
        pg._detail = DetailChecker(mpi_comm, ranks or list(range(size)))
        weakref.finalize(pg, pg._detail.close)
    return pg


def register() -> None:
    """Register the ``cudampi`` backend and the ``cudampi://`` rendezvous with torch (idempotent).

    Also lets the default ``env://`` take rank and size from MPI where its variables are missing
    under an MPI launcher, so a plain ``init_process_group("cudampi")`` works under mpirun.
    """
    import importlib

    from cudampi.torch import rendezvous as ours

    # (``torch.distributed.rendezvous`` the attribute is a function; the module is this one.)
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        kwargs: dict[str, Any] = {"extended_api": True}
        try:
            dist.Backend.register_backend(
                BACKEND_NAME, create_process_group, devices=["cpu", "cuda"], **kwargs
            )
        except TypeError:  # a wheel without devices= (older than cudampi supports)
            dist.Backend.register_backend(BACKEND_NAME, create_process_group, **kwargs)
    if ours.SCHEME not in rdzv._rendezvous_handlers:
        rdzv.register_rendezvous_handler(ours.SCHEME, ours.mpi_rendezvous)
    ours.wrap_env_handler(rdzv._rendezvous_handlers)
