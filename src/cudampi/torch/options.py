"""``cudampi.torch.Options``: what a cudampi group is made with (``pg_options``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cudampi.config import Config

BACKEND_NAME = "cudampi"


@dataclass(frozen=True)
class Options:
    """``pg_options`` for ``init_process_group("cudampi", pg_options=Options(...))`` (and
    ``new_group(backend="cudampi", pg_options=...)``). Checked when the group is made.

    Args:
        comm: the mpi4py intracommunicator the world group runs on (default ``MPI.COMM_WORLD``,
            or under torchrun the job :mod:`cudampi.pmi.join` makes); its size and ranks must be
            torch's.
        path: the default path of every :class:`cudampi.comm.Communicator` of the group, one of
            :data:`cudampi.names.PATHS` (default: CUDAMPI_PATH, else auto).
        config: the settings of the group's Communicators (default: ``Config.load()``);
            torch's ``timeout=`` replaces its ``timeout``.
        abort_on_exception: an uncaught exception on any rank aborts the whole MPI job, so the
            other ranks fail at once instead of hanging in their next collective.
        async_ops: see the field.

    Raises:
        ConfigError: (when the group is made) ``pg_options`` is not an Options; ``comm``'s size
            or ranks differ from torch's; ``async_ops=True`` without MPI_THREAD_MULTIPLE; a
            ``path`` that is not one.
    """

    comm: Any = None
    path: str | None = None
    config: Config | None = None
    abort_on_exception: bool = True
    async_ops: bool | None = None
    """Where the group's collectives run. ``True``: all of them on a per-group thread, so they
    overlap the caller's work (DDP buckets with backward). ``False``: all in the caller's
    thread. ``None`` (default, auto): a collective on CUDA tensors whose path synchronizes the
    host (staged, gpu-ring, native, hierarchical across nodes) runs on the thread; those of a
    stream-ordered path (ipc, nccl: kernels on the caller's stream, nothing to wait for) and
    host tensors run in the caller's thread, in call order behind anything still on the
    thread. The thread needs MPI_THREAD_MULTIPLE: ``True`` without it is an error, auto then
    runs everything in the caller's thread. DDP's built-in C++ comm hooks
    (``_register_builtin_comm_hook``) need typed futures, which only calls in the caller's
    thread give: use ``False`` with them where the path synchronizes the host."""
