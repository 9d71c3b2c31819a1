"""A rank's side of cudampi's PMI-1 server (:mod:`cudampi.pmi.server`): its authenticated PMI
connection handed to MPI (:func:`connect`, :func:`client_env`) and its watch connection, which
ends the process when another rank aborts or dies: a thread (:func:`watch`), and while MPI_Init
runs, when no thread of the rank's Python can, a small process beside it (:class:`InitGuard`)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from types import TracebackType
from urllib.parse import unquote

from cudampi.pmi.wire import MAX_FIRST_LINE, format_reply, parse_command, read_line, recv_line
from cudampi.shm import remove_mpich_segments


def _dial(address: str, first: str, timeout: float) -> socket.socket:
    host, _, port = address.rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=timeout)
    sock.sendall(first.encode())
    return sock


def connect(address: str, rank: int, secret: str, timeout: float = 30.0) -> socket.socket:
    """Rank ``rank``'s PMI connection to the server at ``host:port``, authenticated with the
    job's ``secret``: a blocking socket ready for MPI (:func:`client_env`), which must stay open
    (and referenced) for the life of the process. ``ConnectionError`` if refused."""
    sock = _dial(address, format_reply("cudampi_auth", secret=secret, rank=rank), timeout)
    try:
        reply = parse_command(recv_line(sock, MAX_FIRST_LINE))
    except (OSError, ValueError) as exc:
        sock.close()
        raise ConnectionError(f"the PMI server at {address} refused rank {rank}: {exc}") from None
    if reply.get("cmd") != "cudampi_auth" or reply.get("rc") != "0":
        sock.close()
        raise ConnectionError(f"the PMI server at {address} refused rank {rank}: {reply}")
    sock.settimeout(None)  # blocking, as MPI's PMI client reads it
    return sock


def watch(
    address: str,
    rank: int,
    on_end: Callable[[str, int], None],
    secret: str,
    timeout: float = 30.0,
) -> threading.Thread:
    """Open rank ``rank``'s watch connection to the server at ``host:port``; a daemon thread
    calls ``on_end(message, exit_code)`` if another rank aborts or dies, or the server vanishes
    (it returns quietly once the server says every rank has finalized)."""
    sock = _dial_watch(address, rank, secret, timeout)

    def run() -> None:
        verdict = job_ended(read_line(sock.makefile("r", encoding="ascii", newline="\n")), address)
        if verdict is None:
            sock.close()
            return
        on_end(*verdict)

    thread = threading.Thread(target=run, name="cudampi-pmi-watch", daemon=True)
    thread.start()
    return thread


def _dial_watch(address: str, rank: int, secret: str, timeout: float) -> socket.socket:
    sock = _dial(address, format_reply("cudampi_watch", secret=secret, rank=rank), timeout)
    sock.settimeout(None)
    return sock


def job_ended(line: str, address: str) -> tuple[str, int] | None:
    """What the line a watch connection heard means: ``None`` once every rank has finalized,
    else (why the job is over, the exit code to end with). A failed job's MPICH segments on this
    host are removed here (:mod:`cudampi.shm`): killed ranks leave them, nobody else will."""
    req = parse_command(line)
    if req.get("cmd") == "cudampi_done":
        return None
    if req.get("cmd") == "cudampi_abort":
        if req.get("kvsname"):
            remove_mpich_segments(req["kvsname"])
        why = unquote(req.get("why", "aborted"))
        code = int(req.get("exitcode", "1") or 1) or 1
        rank = req.get("rank", "?")
        who = "" if rank == "-1" else f"rank {rank} "  # -1: no rank, the launcher
        return f"{who}{why} (exit code {code})", code
    return f"the PMI server (rank 0's host) went away at {address}", 1


def ending_message(why: str, rank: int, size: int, where: str = "") -> str:
    """What a rank says when the job's failure ends it (``where``: what it was doing)."""
    return (
        f"cudampi: {why}; ending rank {rank} of {size} on {socket.gethostname()}{where} too, "
        "since the MPI job cannot go on without it.\n"
    )


class InitGuard:
    """``python -m cudampi.pmi.guard`` beside this rank while it is in MPI_Init
    (:mod:`cudampi.pmi.guard` says why): a context manager around the import of ``mpi4py.MPI``.

    Leaving it stops the guard (MPI_Init returned: :func:`watch` takes over). If this rank dies
    meanwhile, the guard sees its pipe close and leaves too."""

    def __init__(
        self, address: str, rank: int, size: int, secret: str, timeout: float = 30.0
    ) -> None:
        sock = _dial_watch(address, rank, secret, timeout)
        read, self._pipe = os.pipe()  # not inherited by anything else this rank starts
        argv = [sys.executable, "-m", "cudampi.pmi.guard", "--pid", str(os.getpid())]
        argv += ["--rank", str(rank), "--size", str(size), "--address", address]
        argv += ["--watch-fd", str(sock.fileno()), "--pipe-fd", str(read)]
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._proc = subprocess.Popen(
                argv, stdin=subprocess.DEVNULL, pass_fds=(sock.fileno(), read)
            )
        except OSError as exc:  # the job can still run; only this safety net is missing
            warnings.warn(
                f"cudampi: rank {rank} could not start its MPI_Init guard ({argv[0]!r}: {exc}); "
                "if another rank dies while this one is in MPI_Init, it may wait there for ever",
                RuntimeWarning,
                stacklevel=2,
            )
        finally:
            sock.close()
            os.close(read)

    def close(self) -> None:
        if self._pipe < 0:
            return
        os.close(self._pipe)
        self._pipe = -1
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGKILL)  # nothing to finish: its watch closes
            self._proc.wait()

    def __enter__(self) -> InitGuard:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


def single_node_mapping(size: int) -> str:
    """PMI_process_mapping of ``size`` ranks on one node (Hydra's format)."""
    return f"(vector,(0,1,{size}))"


def client_env(fd: int, rank: int, size: int) -> dict[str, str]:
    """What a rank must have in its environment before MPI_Init to join the server's job over
    its authenticated connection ``fd`` (:func:`connect`), as Hydra hands its ranks theirs."""
    return {"PMI_FD": str(fd), "PMI_RANK": str(rank), "PMI_SIZE": str(size)}
