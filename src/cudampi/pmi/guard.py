"""A rank's guard while MPI_Init runs: ends the rank when the job fails before its watch thread can.

mpi4py calls MPI_Init holding Python's GIL, so no thread of the rank's Python runs until it
returns (a thread ticking every 0.5 s stops while MPI_Init waits for a peer), and neither does a
Python signal handler. A rank whose peer died during MPI_Init waits there for ever when it waits
anywhere but in a PMI barrier (which the server fails, :data:`cudampi.pmi.server.FAIL_AFTER`):
seen here as rank 0 failing on a stale MPICH shared-memory segment while rank 1 waited for it in
MPICH's shared-memory setup, under Lightning's own launcher, which does not end the others.

So :class:`cudampi.pmi.client.InitGuard` runs this process beside the rank for the length of
MPI_Init: it holds a watch connection to the PMI server and, when the server says a rank failed
(or goes away, and MPI_Init has not returned :data:`SERVER_GONE_GRACE` s later), writes why, and
kills the rank with SIGKILL (the only signal that needs nothing of the rank). It leaves quietly
when the rank closes the pipe it holds (MPI_Init returned, or the rank is gone: then its pid is
not killed, so a reused pid is never hit).

``python -m cudampi.pmi.guard --pid P --rank R --size N --address A --watch-fd W --pipe-fd F``
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import socket
import sys

from cudampi.pmi.client import ending_message, job_ended
from cudampi.pmi.wire import parse_command, read_line

SERVER_GONE_GRACE = 30.0
"""Seconds a rank still in MPI_Init gets after the server went away without saying that a rank
failed. An MPI that speaks PMI fails by itself then (its PMI connection closed); one that does
not (Open MPI 5: a singleton, rank 0 ended the server on seeing so) finishes MPI_Init and says
so itself. Only a rank stuck elsewhere in MPI_Init is killed."""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudampi.pmi.guard", description=__doc__)
    p.add_argument("--pid", type=int, required=True, help="the rank's process")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--address", required=True, help="the PMI server's host:port")
    p.add_argument("--watch-fd", type=int, required=True, help="an open watch connection")
    p.add_argument("--pipe-fd", type=int, required=True, help="closes when the guard must go")
    a = p.parse_args(argv)
    sock = socket.socket(fileno=a.watch_fd)
    ready, _, _ = select.select([a.pipe_fd, sock], [], [])
    if a.pipe_fd in ready:  # the rank is through MPI_Init, or gone
        return 0
    line = read_line(sock.makefile("r", encoding="ascii", newline="\n"))
    verdict = job_ended(line, a.address)
    if verdict is None:  # every rank finalized: nothing to guard
        return 0
    failed = parse_command(line).get("cmd") == "cudampi_abort"
    ready, _, _ = select.select([a.pipe_fd], [], [], 0 if failed else SERVER_GONE_GRACE)
    if ready:
        return 0
    err = sys.stderr
    err.write(ending_message(verdict[0], a.rank, a.size, " (still in MPI_Init)"))
    err.flush()
    os.kill(a.pid, signal.SIGKILL)
    return 0


if __name__ == "__main__":
    sys.exit(main())
