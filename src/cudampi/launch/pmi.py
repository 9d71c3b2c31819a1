"""A PMI-1 server: one MPI job out of processes that another launcher started (torchrun, ...).

An MPI library finds its peers through its process manager: ``mpiexec`` (Hydra) answers the
PMI-1 wire protocol on a socket named by ``PMI_PORT``, and every rank introduces itself with
``PMI_ID``. torchrun starts plain processes, so each would be a one-process MPI job (an MPI
singleton). Rank 0 starts this server (``python -m cudampi.launch.pmi --size N``) and every rank
sets ``PMI_PORT``/``PMI_ID`` before MPI initialises: MPI_Init then builds one COMM_WORLD of N
ranks, exactly as under ``mpiexec``. MPICH, Intel MPI and MVAPICH speak PMI-1; Open MPI 5 speaks
only PMIx, so it stays a singleton (the torch backend then says so and names the fix).

The protocol (MPICH ``src/pmi``, ``doc/wiki/design/PMI_v1_Wire_Protocol``): text lines of
``key=value`` pairs, ``cmd=`` first. :class:`PmiState` is the pure state machine (tested without
sockets); :class:`PmiServer` serves it on TCP, one thread a client.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

PMI_VERSION, PMI_SUBVERSION = 1, 1


def hydra_kvsname(pid: int | None = None) -> str:
    """The key-value space's name, unique to the job, in Hydra's form ``kvs_<pid>_0``.

    MPICH uses more than a lookup key of it: with one fixed name, MPICH 5.0.2 ranks hung in
    MPI_Init right after the PMI exchange on runs after the first (seen here, a killed job
    before them); a name of this server's pid, as Hydra makes them, keeps jobs apart."""
    return f"kvs_{os.getpid() if pid is None else pid}_0"


MAXES = {"kvsname_max": 256, "keylen_max": 64, "vallen_max": 1024}


def parse_command(line: str) -> dict[str, str]:
    """``"cmd=put kvsname=k key=a value=b"`` -> ``{"cmd": "put", "kvsname": "k", ...}``.

    Values never hold spaces in PMI-1 (MPICH escapes them), so a split on blanks is exact.
    """
    out: dict[str, str] = {}
    for token in line.strip().split():
        key, sep, value = token.partition("=")
        if sep:
            out[key] = value
    return out


def format_reply(cmd: str, **fields: object) -> str:
    return " ".join([f"cmd={cmd}", *(f"{k}={v}" for k, v in fields.items())]) + "\n"


@dataclass
class Client:
    """One connected rank, as the server sees it."""

    rank: int = -1
    finalized: bool = False
    aborted: int | None = None


@dataclass
class PmiState:
    """What the job's ranks share: the key-value space, the barrier, who is in.

    ``handle`` answers one request line; a ``barrier_in`` answer is held back until all
    ``size`` ranks have entered, then every waiting rank gets its ``barrier_out`` (``release``
    says to whom).
    """

    size: int
    process_mapping: str | None = None
    kvsname: str = field(default_factory=hydra_kvsname)
    kvs: dict[str, str] = field(default_factory=dict)
    published: dict[str, str] = field(default_factory=dict)
    waiting: list[Client] = field(default_factory=list)
    log: Callable[[str], None] = field(default=lambda msg: None)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a PMI job needs at least 1 rank, got size={self.size!r}")
        if self.process_mapping:
            self.kvs["PMI_process_mapping"] = self.process_mapping

    def handle(self, client: Client, line: str) -> tuple[list[str], list[Client]]:
        """Replies to ``client`` for one request, and the clients a completed barrier releases."""
        req = parse_command(line)
        cmd = req.get("cmd", "")
        if cmd == "initack":
            rank = int(req.get("pmiid", "-1"))
            if not 0 <= rank < self.size:
                self.log(f"PMI_ID {rank} is outside the job of {self.size} ranks")
                return [format_reply("initack", rc=-1)], []
            client.rank = rank
            return [
                format_reply("initack"),
                format_reply("set", size=self.size),
                format_reply("set", rank=rank),
                format_reply("set", debug=0),
            ], []
        if cmd == "init":
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
        if cmd == "get_maxes":
            return [format_reply("maxes", **MAXES, rc=0)], []
        if cmd == "get_appnum":
            return [format_reply("appnum", appnum=0, rc=0)], []
        if cmd == "get_my_kvsname":
            return [format_reply("my_kvsname", kvsname=self.kvsname, rc=0)], []
        if cmd == "get_universe_size":
            return [format_reply("universe_size", size=self.size, rc=0)], []
        if cmd == "put":
            key, value = req.get("key", ""), req.get("value", "")
            if len(key) > MAXES["keylen_max"] or len(value) > MAXES["vallen_max"]:
                return [format_reply("put_result", rc=-1, msg="key_or_value_too_long")], []
            self.kvs[key] = value
            return [format_reply("put_result", rc=0, msg="success")], []
        if cmd == "get":
            got = self.kvs.get(req.get("key", ""))
            if got is None:
                return [format_reply("get_result", rc=-1, msg="key_not_found", value="unknown")], []
            return [format_reply("get_result", rc=0, msg="success", value=got)], []
        if cmd == "barrier_in":
            self.waiting.append(client)
            if len(self.waiting) < self.size:
                return [], []
            released, self.waiting = self.waiting, []
            return [], released
        if cmd == "publish_name":
            self.published[req.get("service", "")] = req.get("port", "")
            return [format_reply("publish_result", rc=0, msg="success")], []
        if cmd == "unpublish_name":
            had = self.published.pop(req.get("service", ""), None) is not None
            return [format_reply("unpublish_result", rc=0 if had else -1)], []
        if cmd == "lookup_name":
            port = self.published.get(req.get("service", ""))
            if port is None:
                return [format_reply("lookup_result", rc=-1, msg="not_found")], []
            return [format_reply("lookup_result", rc=0, port=port)], []
        if cmd == "abort":
            client.aborted = int(req.get("exitcode", "1") or 1)
            self.log(f"rank {client.rank} called MPI_Abort (exit code {client.aborted})")
            return [], []
        if cmd == "finalize":
            client.finalized = True
            return [format_reply("finalize_ack", rc=0)], []
        if cmd == "spawn":
            self.log("MPI_Comm_spawn is not supported by cudampi's PMI server")
            return [format_reply("spawn_result", rc=-1)], []
        self.log(f"unknown PMI request {line.strip()!r}")
        return [format_reply(cmd or "unknown", rc=-1, msg="unsupported")], []

    @staticmethod
    def barrier_out() -> str:
        return format_reply("barrier_out", rc=0)


class PmiServer:
    """Serve :class:`PmiState` on a TCP socket until every rank has finalized or gone.

    ``done`` is set when all ``size`` ranks have connected and each has finalized, aborted or
    disconnected (or when :meth:`close` is called).
    """

    def __init__(
        self,
        size: int,
        host: str = "127.0.0.1",
        port: int = 0,
        process_mapping: str | None = None,
        log: Callable[[str], None] | None = None,
        verbose: bool = False,
    ) -> None:
        self._log = log or (lambda msg: print(f"cudampi pmi: {msg}", file=sys.stderr, flush=True))
        self._verbose = verbose
        self.state = PmiState(size, process_mapping, log=self._log)
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), backlog=max(64, size))
        self.port: int = int(self._sock.getsockname()[1])
        self.clients: list[Client] = []
        self._conns: dict[int, socket.socket] = {}
        self.done = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> PmiServer:
        t = threading.Thread(target=self._accept, name="cudampi-pmi-accept", daemon=True)
        t.start()
        return self

    def _accept(self) -> None:
        while len(self.clients) < self.state.size:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return
            client = Client()
            with self._lock:
                self.clients.append(client)
                self._conns[id(client)] = conn
            t = threading.Thread(
                target=self._serve, args=(client, conn), name="cudampi-pmi", daemon=True
            )
            t.start()
            self._threads.append(t)
        self._sock.close()

    def _send(self, client: Client, text: str) -> None:
        conn = self._conns.get(id(client))
        if conn is not None:
            try:
                conn.sendall(text.encode())
            except OSError:
                pass

    def _serve(self, client: Client, conn: socket.socket) -> None:
        reader = conn.makefile("r", encoding="ascii", newline="\n")
        try:
            for line in reader:
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
                if client.finalized:
                    break
        except (OSError, ValueError):
            pass
        finally:
            conn.close()
            if not client.finalized and client.aborted is None:
                self._log(
                    f"rank {client.rank} closed its PMI connection without MPI_Finalize "
                    "(the process ended or was killed)"
                )
            with self._lock:
                self._conns.pop(id(client), None)
                if len(self.clients) == self.state.size and not self._conns:
                    self.done.set()

    def close(self) -> None:
        self.done.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            for conn in self._conns.values():
                try:
                    conn.close()
                except OSError:
                    pass


def single_node_mapping(size: int) -> str:
    """PMI_process_mapping of ``size`` ranks on one node (Hydra's format)."""
    return f"(vector,(0,1,{size}))"


def client_env(address: str, rank: int) -> dict[str, str]:
    """What a rank must have in its environment before MPI_Init to join the server's job."""
    return {"PMI_PORT": address, "PMI_ID": str(rank)}


def main(argv: list[str] | None = None) -> int:
    """``python -m cudampi.launch.pmi --size N``: print the port, serve, exit when all are done.

    Also exits (after ``--grace`` seconds for ranks still finishing) when its standard input
    closes, i.e. when the rank that started it has ended.
    """
    p = argparse.ArgumentParser(prog="python -m cudampi.launch.pmi", description=__doc__)
    p.add_argument("--size", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    p.add_argument("--port", type=int, default=0)
    p.add_argument("--mapping", default=None, help="PMI_process_mapping value to serve")
    p.add_argument("--grace", type=float, default=60.0)
    p.add_argument("--verbose", action="store_true", help="log every request and reply")
    a = p.parse_args(argv)
    server = PmiServer(a.size, a.host, a.port, a.mapping, verbose=a.verbose).start()
    print(server.port, flush=True)

    def watch_parent() -> None:
        sys.stdin.read()  # returns at EOF: the starting rank is gone
        if not server.clients:
            server.close()
            return
        server.done.wait(a.grace)
        server.close()

    threading.Thread(target=watch_parent, name="cudampi-pmi-parent", daemon=True).start()
    server.done.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
