"""Ending the whole MPI job from one rank, so the other ranks fail at once instead of waiting in
their next collective for ever.

The ground floor, for every place a rank gives up: the rank bootstrap of ``cudampi launch``, the
torch backend's abort-on-exception, the doctor's probe worker and ``cudampi bench``.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import Any

ABORT_GRACE = 10.0
"""Seconds MPI_Abort has to end this process before SIGALRM does (:func:`abort_job`)."""


def abort_job(code: int, message: str = "", comm: Any = None) -> None:
    """``message`` on the process's real stderr, then ``MPI_Abort(comm, code)`` (``comm``:
    ``MPI.COMM_WORLD`` by default) and the end of this process.

    Does nothing where this process is not running MPI (mpi4py.MPI not imported, MPI not
    initialized or already finalized). Exits the process itself where MPI_Abort returns: under a
    PMI-1 server (torchrun, :mod:`cudampi.pmi.join`) MPICH's MPI_Abort only tells the server, and
    MPI_Finalize at exit would then wait for the ranks the abort is ending. Where MPI_Abort has
    not ended it within :data:`ABORT_GRACE` seconds (Open MPI's abort waits for the launcher's
    answer, which a loaded launcher tearing down a peer that already finalized was once seen not
    to give), SIGALRM ends it (unless the program handles SIGALRM itself), and the job with it.
    """
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None:
        return
    try:
        if not mpi.Is_initialized() or mpi.Is_finalized():
            return
    except Exception:
        return
    err = sys.__stderr__ or sys.stderr
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    if message:
        err.write(message)
        err.flush()
    try:  # the kernel's timer, not a thread: MPI_Abort holds the GIL while it waits
        signal.alarm(max(1, round(ABORT_GRACE)))
    except (ValueError, OSError):
        pass
    try:
        (comm if comm is not None else mpi.COMM_WORLD).Abort(code)
    except Exception:
        pass
    os._exit(code)
