"""The PMI-1 protocol's state, pure: the job's key-value space, its barriers and names, and what
each request a rank sends gets back (MPICH ``src/pmi``, ``doc/wiki/design/PMI_v1_Wire_Protocol``).
:class:`PmiState` is tested without sockets; :mod:`cudampi.pmi.server` serves it on TCP."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from cudampi.pmi.wire import format_reply, parse_command
from cudampi.shm import unique_kvsname

PMI_VERSION, PMI_SUBVERSION = 1, 1


MAXES = {"kvsname_max": 256, "keylen_max": 64, "vallen_max": 1024}


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
