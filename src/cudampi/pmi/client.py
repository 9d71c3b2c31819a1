"""A rank's side of cudampi's PMI-1 server (:mod:`cudampi.pmi.server`): its authenticated PMI
connection handed to MPI (:func:`connect`, :func:`client_env`) and its watch connection, which
ends the process when another rank aborts or dies (:func:`watch`)."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from urllib.parse import unquote

from cudampi.pmi.wire import MAX_FIRST_LINE, format_reply, parse_command, read_line, recv_line


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
    sock = _dial(address, format_reply("cudampi_watch", secret=secret, rank=rank), timeout)
    sock.settimeout(None)

    def run() -> None:
        req = parse_command(read_line(sock.makefile("r", encoding="ascii", newline="\n")))
        if req.get("cmd") == "cudampi_done":
            sock.close()
            return
        if req.get("cmd") == "cudampi_abort":
            why = unquote(req.get("why", "aborted"))
            code = int(req.get("exitcode", "1") or 1) or 1
            on_end(f"rank {req.get('rank', '?')} {why} (exit code {code})", code)
        else:
            on_end(f"the PMI server (rank 0's host) went away at {address}", 1)

    thread = threading.Thread(target=run, name="cudampi-pmi-watch", daemon=True)
    thread.start()
    return thread


def single_node_mapping(size: int) -> str:
    """PMI_process_mapping of ``size`` ranks on one node (Hydra's format)."""
    return f"(vector,(0,1,{size}))"


def client_env(fd: int, rank: int, size: int) -> dict[str, str]:
    """What a rank must have in its environment before MPI_Init to join the server's job over
    its authenticated connection ``fd`` (:func:`connect`), as Hydra hands its ranks theirs."""
    return {"PMI_FD": str(fd), "PMI_RANK": str(rank), "PMI_SIZE": str(size)}
