"""A PMI-1 server: one MPI job out of processes that another launcher started (torchrun, ...).

An MPI library finds its peers through its process manager: ``mpiexec`` (Hydra) answers the
PMI-1 wire protocol on a socket it hands each rank (``PMI_FD``, with ``PMI_RANK``/``PMI_SIZE``).
torchrun starts plain processes, so each would be a one-process MPI job (an MPI singleton).
Rank 0 starts this server (``python -m cudampi.pmi.server --size N``, the job's secret on its
standard input); every rank connects to it, proves it knows the secret (:func:`cudampi.pmi.client.connect`), and
hands the connection to MPI as ``PMI_FD`` before MPI initialises: MPI_Init then builds one
COMM_WORLD of N ranks, exactly as under ``mpiexec``. MPICH, Intel MPI and MVAPICH speak PMI-1;
Open MPI 5 speaks only PMIx, so it stays a singleton (the torch backend then says so and names
the fix).

Only the job's processes may talk to it: the server listens on the interface the job uses
(loopback on one host), a connection whose first line is not ``cmd=cudampi_auth secret=S
rank=R`` (or ``cmd=cudampi_watch secret=S rank=R``) with the job's secret is closed unheard,
lines and key/value sizes are bounded, and a stranger's connection can neither end the job nor
read its key-value space.

The protocol (MPICH ``src/pmi``, ``doc/wiki/design/PMI_v1_Wire_Protocol``): text lines of
``key=value`` pairs, ``cmd=`` first. :class:`PmiState` is the pure state machine (tested without
sockets); :class:`PmiServer` serves it on TCP, one thread a client.

Ending the job is the process manager's duty too: under Hydra an MPI_Abort, or a rank that dies,
makes mpiexec kill every rank. MPICH's PMI-1 client only sends ``cmd=abort`` and returns, and
torchrun knows nothing of MPI. So each rank also opens a *watch* connection
(``cmd=cudampi_watch rank=R``, see :func:`cudampi.pmi.client.watch`): the server sends every watcher
``cmd=cudampi_abort rank=R exitcode=C`` when a rank aborts or closes its PMI connection without
MPI_Finalize, and ``cmd=cudampi_done`` when every rank has finalized; a watcher that hears of an
abort, or loses the server, ends its process. A watcher is Python, and Python runs no thread once
the interpreter is finalizing: a rank already in MPI_Finalize there (mpi4py calls it at exit)
would wait in the PMI barrier for the rank that failed, for ever. So :data:`FAIL_AFTER` seconds
after a failure the server answers that barrier, and every later one, with ``rc=-1``: MPI_Finalize
then fails and MPI ends the process with its error stack ("PMI_Barrier returned -1").
"""

from __future__ import annotations

import argparse
import hmac
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

from cudampi.pmi.wire import (
    MAX_FIRST_LINE,
    MAX_LINE,
    format_reply,
    parse_command,
    recv_line,
)
from cudampi.shm import remove_mpich_segments, unique_kvsname

PMI_VERSION, PMI_SUBVERSION = 1, 1


MAXES = {"kvsname_max": 256, "keylen_max": 64, "vallen_max": 1024}
AUTH_TIMEOUT = 10.0
"""Seconds a new connection has to authenticate before it is closed."""
FAIL_AFTER = 2.0
"""Seconds from a rank's failure to failing the PMI barrier of the ranks left in it: their
watchers end them first (with a message naming the failed rank) where their interpreter runs."""
MAX_PENDING = 64
"""Connections that have not authenticated yet; past it the oldest is closed (a rank sends its
line at once, so a flood of idle connections cannot keep the job's own ranks out)."""


def max_entries(size: int) -> int:
    """Keys the key-value space (and names the name service) hold at most for ``size`` ranks:
    MPICH puts a few per rank; a rank putting without end is cut off, not served."""
    return 1024 + 64 * size


@dataclass
class Client:
    """One connected rank, as the server sees it."""

    rank: int = -1
    finalized: bool = False
    aborted: int | None = None


_Answer = tuple[list[str], list[Client]]
"""Replies to the asking rank, and the ranks a completed barrier releases."""

COMMANDS = (
    "initack",
    "init",
    "get_maxes",
    "get_appnum",
    "get_my_kvsname",
    "get_universe_size",
    "put",
    "get",
    "barrier_in",
    "publish_name",
    "unpublish_name",
    "lookup_name",
    "abort",
    "finalize",
    "spawn",
)
"""The PMI-1 commands the server answers (the rest get ``rc=-1``)."""


@dataclass
class PmiState:
    """What the job's ranks share: the key-value space, the barrier, who is in.

    ``handle`` answers one request line; a ``barrier_in`` answer is held back until all
    ``size`` ranks have entered, then every waiting rank gets its ``barrier_out`` (``release``
    says to whom).
    """

    size: int
    process_mapping: str | None = None
    kvsname: str = field(default_factory=unique_kvsname)
    """Unique to the job, not Hydra's ``kvs_<pid>_0``: MPICH names its shared memory after it,
    and killed jobs leave that behind for a later one with the same pid (:mod:`cudampi.shm`)."""
    kvs: dict[str, str] = field(default_factory=dict)
    published: dict[str, str] = field(default_factory=dict)
    waiting: list[Client] = field(default_factory=list)
    failed: bool = False
    """A rank failed (:meth:`fail`): no barrier can complete."""
    log: Callable[[str], None] = field(default=lambda msg: None)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a PMI job needs at least 1 rank, got size={self.size!r}")
        if self.process_mapping:
            self.kvs["PMI_process_mapping"] = self.process_mapping

    def handle(self, client: Client, line: str) -> tuple[list[str], list[Client]]:
        """Replies to ``client`` for one request, and the clients a completed barrier releases:
        each PMI-1 command is one method (``_<cmd>``)."""
        req = parse_command(line)
        cmd = req.get("cmd", "")
        if cmd in COMMANDS:
            answer: _Answer = getattr(self, "_" + cmd)(client, req)
            return answer
        self.log(f"unknown PMI request {line.strip()!r}")
        return [format_reply(cmd or "unknown", rc=-1, msg="unsupported")], []

    def _initack(self, client: Client, req: dict[str, str]) -> _Answer:
        pmiid = req.get("pmiid", "")
        rank = int(pmiid) if pmiid.isdigit() else -1
        if not 0 <= rank < self.size or client.rank not in (-1, rank):
            self.log(f"PMI_ID {rank} is outside the job of {self.size} ranks")
            return [format_reply("initack", rc=-1)], []
        client.rank = rank
        return [
            format_reply("initack"),
            format_reply("set", size=self.size),
            format_reply("set", rank=rank),
            format_reply("set", debug=0),
        ], []

    def _init(self, client: Client, req: dict[str, str]) -> _Answer:
        version = int(req.get("pmi_version", "1") or 1)
        rc = 0 if version == PMI_VERSION else -1
        return [
            format_reply(
                "response_to_init",
                pmi_version=PMI_VERSION,
                pmi_subversion=PMI_SUBVERSION,
                rc=rc,
            )
        ], []

    def _get_maxes(self, client: Client, req: dict[str, str]) -> _Answer:
        return [format_reply("maxes", **MAXES, rc=0)], []

    def _get_appnum(self, client: Client, req: dict[str, str]) -> _Answer:
        return [format_reply("appnum", appnum=0, rc=0)], []

    def _get_my_kvsname(self, client: Client, req: dict[str, str]) -> _Answer:
        return [format_reply("my_kvsname", kvsname=self.kvsname, rc=0)], []

    def _get_universe_size(self, client: Client, req: dict[str, str]) -> _Answer:
        return [format_reply("universe_size", size=self.size, rc=0)], []

    def _put(self, client: Client, req: dict[str, str]) -> _Answer:
        key, value = req.get("key", ""), req.get("value", "")
        if len(key) > MAXES["keylen_max"] or len(value) > MAXES["vallen_max"]:
            return [format_reply("put_result", rc=-1, msg="key_or_value_too_long")], []
        if key not in self.kvs and len(self.kvs) >= max_entries(self.size):
            self.log(f"rank {client.rank} filled the key-value space ({len(self.kvs)} keys)")
            return [format_reply("put_result", rc=-1, msg="kvs_full")], []
        self.kvs[key] = value
        return [format_reply("put_result", rc=0, msg="success")], []

    def _get(self, client: Client, req: dict[str, str]) -> _Answer:
        got = self.kvs.get(req.get("key", ""))
        if got is None:
            return [format_reply("get_result", rc=-1, msg="key_not_found", value="unknown")], []
        return [format_reply("get_result", rc=0, msg="success", value=got)], []

    def _barrier_in(self, client: Client, req: dict[str, str]) -> _Answer:
        if self.failed:
            self.log(f"failed rank {client.rank}'s PMI barrier: a rank of the job failed")
            return [self.barrier_failed()], []
        self.waiting.append(client)
        if len(self.waiting) < self.size:
            return [], []
        released, self.waiting = self.waiting, []
        return [], released

    def _publish_name(self, client: Client, req: dict[str, str]) -> _Answer:
        service, port = req.get("service", ""), req.get("port", "")
        full = service not in self.published and len(self.published) >= max_entries(self.size)
        if full or len(service) > MAXES["keylen_max"] or len(port) > MAXES["vallen_max"]:
            return [format_reply("publish_result", rc=-1, msg="refused")], []
        self.published[service] = port
        return [format_reply("publish_result", rc=0, msg="success")], []

    def _unpublish_name(self, client: Client, req: dict[str, str]) -> _Answer:
        had = self.published.pop(req.get("service", ""), None) is not None
        return [format_reply("unpublish_result", rc=0 if had else -1)], []

    def _lookup_name(self, client: Client, req: dict[str, str]) -> _Answer:
        found = self.published.get(req.get("service", ""))
        if found is None:
            return [format_reply("lookup_result", rc=-1, msg="not_found")], []
        return [format_reply("lookup_result", rc=0, port=found)], []

    def _abort(self, client: Client, req: dict[str, str]) -> _Answer:
        code = req.get("exitcode", "1")
        client.aborted = int(code) if code.lstrip("-").isdigit() else 1
        self.log(f"rank {client.rank} called MPI_Abort (exit code {client.aborted})")
        return [], []

    def _finalize(self, client: Client, req: dict[str, str]) -> _Answer:
        client.finalized = True
        return [format_reply("finalize_ack", rc=0)], []

    def _spawn(self, client: Client, req: dict[str, str]) -> _Answer:
        self.log("MPI_Comm_spawn is not supported by cudampi's PMI server")
        return [format_reply("spawn_result", rc=-1)], []

    def fail(self) -> list[Client]:
        """A rank failed: the ranks waiting in the barrier, to be answered
        :meth:`barrier_failed`, as every later ``barrier_in`` is."""
        self.failed = True
        stuck, self.waiting = self.waiting, []
        return stuck

    @staticmethod
    def barrier_out() -> str:
        return format_reply("barrier_out", rc=0)

    @staticmethod
    def barrier_failed() -> str:
        return format_reply("barrier_out", rc=-1, msg="a_rank_of_the_job_failed")


class PmiServer:
    """Serve :class:`PmiState` on a TCP socket until every rank has finalized or gone.

    Only connections that open with the job's ``secret`` (:func:`connect`, :func:`watch`) are
    served. ``done`` is set when all ``size`` ranks have connected and each has finalized,
    aborted or disconnected (or when :meth:`close` is called). Watch connections hear
    ``cudampi_abort`` when a rank aborts or dies, ``cudampi_done`` at the end.
    """

    def __init__(
        self,
        size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        process_mapping: str | None = None,
        log: Callable[[str], None] | None = None,
        verbose: bool = False,
        *,
        secret: str,
    ) -> None:
        if len(secret) < 16:
            raise ValueError("the PMI server needs a secret of at least 16 characters")
        self._log = log or (lambda msg: print(f"cudampi pmi: {msg}", file=sys.stderr, flush=True))
        self._verbose = verbose
        self._secret = secret.encode()
        self.state = PmiState(size, process_mapping, log=self._log)
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), backlog=max(64, size))
        self.port: int = int(self._sock.getsockname()[1])
        self.clients: list[Client] = []
        self._conns: dict[int, socket.socket] = {}
        self._watchers: dict[socket.socket, int] = {}  # watch connection -> its rank
        self._waiting: dict[socket.socket, Any] = {}  # not authenticated yet, oldest first
        self.refused = 0
        """Connections closed unheard (no or a wrong secret, too long or too slow a line)."""
        self.aborted: tuple[int, int, str] | None = None  # (rank, exit code, why), first only
        self.done = threading.Event()

    def start(self) -> PmiServer:
        t = threading.Thread(target=self._accept, name="cudampi-pmi-accept", daemon=True)
        t.start()
        return self

    def _accept(self) -> None:
        # Ranks and watchers both connect; accept until closed (watchers may come after all ranks).
        while True:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            with self._lock:
                oldest = next(iter(self._waiting)) if len(self._waiting) >= MAX_PENDING else None
                if oldest is not None:
                    del self._waiting[oldest]
                self._waiting[conn] = peer
            if oldest is not None:
                try:  # wakes its thread, which then refuses it
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threading.Thread(
                target=self._serve, args=(conn, peer), name="cudampi-pmi", daemon=True
            ).start()

    def _send(self, client: Client, text: str) -> None:
        conn = self._conns.get(id(client))
        if conn is not None:
            _send_quietly(conn, text)

    def _refuse(self, conn: socket.socket, peer: Any, why: str) -> None:
        with self._lock:
            self.refused += 1
            n = self.refused
        if n <= 3:  # a few lines, not one per attempt of a flood
            self._log(f"refused a connection from {_peer(peer)}: {why}")
        try:
            conn.close()
        except OSError:
            pass

    def _authenticate(self, conn: socket.socket, peer: Any) -> tuple[str, int] | None:
        """(kind, rank) of a connection whose first line proves the secret; else None (closed).
        kind: ``rank`` or ``watch``."""
        try:
            conn.settimeout(AUTH_TIMEOUT)
            first = recv_line(conn, MAX_FIRST_LINE)
        except (OSError, ValueError) as exc:
            why = "no authentication line in time" if isinstance(exc, TimeoutError) else str(exc)
            self._refuse(conn, peer, why)
            return None
        finally:
            with self._lock:
                self._waiting.pop(conn, None)
        req = parse_command(first)
        kinds = {"cudampi_auth": "rank", "cudampi_watch": "watch"}
        given = req.get("secret", "").encode()
        if req.get("cmd") not in kinds or not hmac.compare_digest(given, self._secret):
            self._refuse(conn, peer, "it did not give the job's secret")
            return None
        rank_text = req.get("rank", "")
        rank = int(rank_text) if rank_text.isdigit() else -1
        kind = kinds[req["cmd"]]
        if kind == "rank" and not 0 <= rank < self.state.size:
            self._refuse(
                conn, peer, f"rank {rank_text!r} is not one of the job's {self.state.size}"
            )
            return None
        conn.settimeout(None)
        return kind, rank

    def _serve(self, conn: socket.socket, peer: Any = None) -> None:
        who = self._authenticate(conn, peer)
        if who is None:
            return
        kind, rank = who
        if kind == "watch":
            self._watch(conn, rank)
            return
        client = Client(rank=rank)
        with self._lock:
            if any(c.rank == rank for c in self.clients):
                taken = True
            else:
                taken = False
                self.clients.append(client)
                self._conns[id(client)] = conn
        if taken:
            self._refuse(conn, peer, f"rank {rank} is already connected")
            return
        _send_quietly(conn, format_reply("cudampi_auth", rc=0))
        reader = conn.makefile("r", encoding="ascii", errors="replace", newline="\n")
        try:
            while True:
                line = reader.readline(MAX_LINE + 1)
                if not line.endswith("\n"):
                    if len(line) > MAX_LINE:
                        self._log(f"rank {rank} sent a line longer than {MAX_LINE} characters")
                    break  # gone (or misbehaving): handled as a rank that ended below
                if self._verbose:
                    self._log(f"rank {client.rank} -> {line.strip()}")
                with self._lock:
                    replies, released = self.state.handle(client, line)
                    if self._verbose:
                        for text in replies:
                            self._log(f"rank {client.rank} <- {text.strip()}")
                    for text in replies:
                        self._send(client, text)
                    for other in released:
                        self._send(other, PmiState.barrier_out())
                    if client.aborted is not None:
                        self._abort(client.rank, client.aborted, "called MPI_Abort")
                if client.finalized:
                    break
        except (OSError, ValueError):
            pass
        finally:
            conn.close()
            with self._lock:
                if not client.finalized and client.aborted is None:
                    self._log(
                        f"rank {client.rank} closed its PMI connection without MPI_Finalize "
                        "(the process ended or was killed)"
                    )
                    self._abort(client.rank, 1, "ended without MPI_Finalize")
                self._conns.pop(id(client), None)
                if len(self.clients) >= self.state.size and not self._conns:
                    self._finish()

    def _watch(self, conn: socket.socket, rank: int) -> None:
        """Hold a watch connection open; tell it now if the job has already failed or ended."""
        with self._lock:
            if self.aborted is not None:
                _send_quietly(conn, _abort_line(*self.aborted, self.state.kvsname))
            elif self.done.is_set():
                _send_quietly(conn, format_reply("cudampi_done"))
            else:
                self._watchers[conn] = rank
        try:
            while conn.recv(256):  # watchers send nothing more: wait for them to go
                pass
        except OSError:
            pass
        with self._lock:
            self._watchers.pop(conn, None)
        conn.close()

    def _abort(self, rank: int, code: int, why: str) -> None:
        """Tell every watcher (but the failing rank's own) that the job is over. Lock held."""
        if self.aborted is not None or self.done.is_set():
            return
        self.aborted = (rank, code, why)
        line = _abort_line(rank, code, why, self.state.kvsname)
        for conn, watcher_rank in list(self._watchers.items()):
            if watcher_rank != rank:
                _send_quietly(conn, line)
        timer = threading.Timer(FAIL_AFTER, self._fail_barriers, args=(rank,))
        timer.daemon = True
        timer.start()

    def _fail_barriers(self, failed: int) -> None:
        """Answer the PMI barrier of the ranks waiting in it, and every later one, with
        ``rc=-1``: it cannot complete without ``failed``."""
        with self._lock:
            if self.done.is_set():
                return
            stuck = self.state.fail()
            if stuck:
                self._log(
                    f"failed the PMI barrier of ranks {', '.join(str(c.rank) for c in stuck)}, "
                    f"still waiting {FAIL_AFTER:g} s after rank {failed}'s failure (in "
                    "MPI_Finalize, most likely): their MPI ends them"
                )
            for client in stuck:
                self._send(client, PmiState.barrier_failed())

    def _finish(self) -> None:
        """Every rank has finalized or gone: release the watchers, then say done. Lock held."""
        if self.aborted is None:
            for conn in self._watchers:
                _send_quietly(conn, format_reply("cudampi_done"))
        self.done.set()

    def parent_gone(self) -> None:
        """The rank that started this server (rank 0) has ended: unless it finalized MPI first,
        the job cannot complete, so every watcher hears so (a rank 0 that died before its PMI
        connection was made would otherwise leave the others waiting for it)."""
        with self._lock:
            if not any(c.rank == 0 and c.finalized for c in self.clients):
                self._abort(0, 1, "ended before MPI_Finalize (it started the PMI server)")

    def launcher_gone(self, launcher: str) -> None:
        """The launcher that started the ranks (``launcher`` names it) has ended: nothing will
        end them now (torchrun's own duty), and the job is not whole: every watcher hears so."""
        with self._lock:
            self._abort(-1, 1, f"{launcher}, which started the job's ranks, ended")

    def live_ranks(self) -> int:
        """Rank connections still open."""
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self.done.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            for conn in [*self._conns.values(), *self._watchers]:
                try:  # shutdown first: it wakes the thread blocked reading this connection
                    conn.shutdown(socket.SHUT_RDWR)
                    conn.close()
                except OSError:
                    pass


def _peer(peer: Any) -> str:
    if isinstance(peer, tuple) and len(peer) >= 2:
        return f"{peer[0]}:{peer[1]}"
    return str(peer)


def _send_quietly(conn: socket.socket, text: str) -> None:
    try:
        conn.sendall(text.encode())
    except OSError:
        pass  # that peer is gone; its own connection's end is handled where it is read


def _abort_line(rank: int, code: int, why: str, kvsname: str) -> str:
    """What watchers hear when ``rank`` failed; ``kvsname`` lets each remove the job's MPICH
    segments on its host (:func:`cudampi.pmi.client.job_ended`)."""
    return format_reply("cudampi_abort", rank=rank, exitcode=code, why=quote(why), kvsname=kvsname)


LAUNCHER_GRACE = 10.0
"""Seconds the ranks get to end (their watchers were told) after the launcher ended, before the
server leaves."""


def launcher_name(pid: int) -> str:
    """The launcher's program name (``torchrun``), from its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = [w.decode(errors="replace") for w in f.read().split(b"\0") if w]
    except OSError:
        return "process"
    if len(argv) > 2 and argv[1] == "-m":  # python -m torch.distributed.run is torchrun
        return "torchrun" if argv[2] == "torch.distributed.run" else argv[2]
    words = [os.path.basename(w) for w in argv[:2]]
    return next((w for w in words if not w.startswith("python")), words[0] if words else "process")


def wait_for_exit(pid: int, poll: float = 0.5) -> None:
    """Return when process ``pid`` (not a child) has ended: a pidfd says so at once (Linux 5.3
    and newer); else poll."""
    try:
        fd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        fd = -1
    if fd >= 0:
        try:
            select.select([fd], [], [])
        finally:
            os.close(fd)
        return
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        except PermissionError:
            pass
        time.sleep(poll)


def main(argv: list[str] | None = None) -> int:
    """``python -m cudampi.pmi.server --size N``: read the job's secret (the first line of
    standard input), print the port, serve, exit when all are done.

    When its standard input closes (the rank that started it has ended) without that rank's
    MPI_Finalize, every rank is told the job failed; then it serves the ranks still finishing
    (``--grace`` seconds after the last leaves). With ``--launcher-pid`` (torchrun's), when the
    launcher ends (killed, say: it then ends no rank), every rank is told, and it leaves.
    """
    p = argparse.ArgumentParser(prog="python -m cudampi.pmi.server", description=__doc__)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (the job's network)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--mapping", default=None, help="PMI_process_mapping value to serve")
    p.add_argument("--grace", type=float, default=60.0)
    p.add_argument(
        "--launcher-pid",
        type=int,
        default=0,
        help="the launcher that started the ranks (torchrun): when it ends, so does the job",
    )
    p.add_argument("--verbose", action="store_true", help="log every request and reply")
    a = p.parse_args(argv)
    secret = sys.stdin.readline().strip()  # not an argument: argv is visible to every user
    try:
        server = PmiServer(a.size, a.host, a.port, a.mapping, verbose=a.verbose, secret=secret)
    except ValueError as exc:
        print(f"cudampi pmi: {exc} (the first line of standard input)", file=sys.stderr)
        return 2
    server.start()
    print(server.port, flush=True)

    def watch_parent() -> None:
        sys.stdin.read()  # returns at EOF: the starting rank is gone
        server.parent_gone()
        # Ranks still connected are still running (had the starting rank failed, they were told
        # to end): serve them to the end, but leave once no rank has stayed connected for --grace.
        while not server.done.wait(a.grace):
            if server.live_ranks() == 0:
                break
        server.close()

    def watch_launcher(pid: int) -> None:
        name = launcher_name(pid)
        wait_for_exit(pid)
        server.launcher_gone(f"the launcher {name} (pid {pid})")
        deadline = time.monotonic() + LAUNCHER_GRACE  # the told ranks end and disconnect
        while server.live_ranks() and time.monotonic() < deadline:
            time.sleep(0.1)
        server.close()

    threading.Thread(target=watch_parent, name="cudampi-pmi-parent", daemon=True).start()
    if a.launcher_pid:
        threading.Thread(
            target=watch_launcher, args=(a.launcher_pid,), name="cudampi-pmi-launcher", daemon=True
        ).start()
    server.done.wait()
    # Ranks killed on this host left their MPICH segment (cudampi.shm); after a clean end MPICH
    # removed it and this finds nothing.
    removed = remove_mpich_segments(server.state.kvsname)
    if removed:
        print(f"cudampi pmi: removed {' '.join(removed)}, left by the job's ranks", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
