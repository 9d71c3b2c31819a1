"""The engine contract: one method set that every engine of a communicator implements.

An engine moves data for one array library on one device (an :class:`~cudampi.comm.arrays.ArrayOps`)
and knows nothing about the caller's arrays: the Communicator adapts them, checks them on this
rank and across ranks, chooses the path and hands the engine flat contiguous arrays (1-D views of
the caller's memory, never copies) that are already valid for the call. Every rank calls the same
method with the same counts, op and root; an engine never checks that again.

Collectives (``xf`` the input, ``of`` the output; ``op`` a reduction valid for ``dtype``, ``avg``
included: an engine finishes ``avg`` itself, so it may fuse the division)::

    allreduce(xf, of, op, dtype)                  xf is of: in place
    reduce(xf, of, op, dtype, root, scratch=False)  of is written on root only; xf is of: in place
    broadcast(xf, root)                            in place
    allgatherv(xf, of, counts)                     counts[i] elements from rank i, in rank order
    gatherv(xf, of, counts, root)                  of is None off root
    scatterv(xf, of, counts, root)                 xf is None off root
    reduce_scatterv(xf, of, counts, op, dtype, scratch=False)  of gets counts[rank] elements
    alltoallv(xf, send_counts, of, recv_counts)    of is never xf

``scratch=True``: ``xf`` is a temporary nobody reads again (the staged engine's host copy), so the
engine may overwrite it instead of copying it first. Point-to-point (user messages, on the
communicator's p2p duplicate)::

    send(f, dest, tag)   recv(f, source, tag)   isend(f, dest, tag) -> Handle
    irecv(f, source, tag) -> Handle   (the Communicator sets the handle's result)
    sendrecv(xf, dest, of, source, tag)

Engines are made once per communicator, engine name and (lib, device) by :class:`Engines`, and
keep what they need between calls (streams, host buffers, workspaces) in themselves or, where
engines share it, in :meth:`Engines.keep`. This package never imports the Communicator.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from cudampi.comm.arrays import ArrayOps, ops_for
from cudampi.comm.handle import Handle
from cudampi.config import Config
from cudampi.errors import CommError


@dataclass(frozen=True, eq=False)
class Setting:
    """What every engine of one communicator works with."""

    coll: Any
    """The MPI communicator of collectives (and of their internal point-to-point)."""
    p2p: Any
    """The MPI communicator of user point-to-point, apart so it never matches a collective."""
    rank: int
    size: int
    config: Config
    one_node: bool
    """Every rank of the communicator shares one node."""

    def direct(self, on_device: bool) -> bool:
        """Direct (all-pairs) instead of ring reduce-scatter/allgather for large messages."""
        if self.config.algorithm != "auto":
            return self.config.algorithm == "direct"
        return on_device and self.one_node


def caller_stream(ops: ArrayOps) -> int:
    """The raw pointer of the caller's current CUDA stream on ``ops``' device."""
    if ops.lib == "torch":
        raw = _RAW_STREAM or _raw_stream()
        return int(raw(ops.device))
    import cupy

    with cupy.cuda.Device(ops.device):
        return int(cupy.cuda.get_current_stream().ptr)


_RAW_STREAM: Any = None


def _raw_stream() -> Any:
    """torch's current-stream reader, found once: the raw pointer where torch has it (what
    Triton's launcher reads: no Stream object per call, ~2 us), else the public API."""
    global _RAW_STREAM
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:

        def raw(device: int) -> int:
            return int(torch.cuda.current_stream(device).cuda_stream)

    _RAW_STREAM = raw
    return raw


def node_comm(coll: Any, config: Config) -> Any:
    """The ranks of ``coll`` that share this rank's node (MPI's shared-memory split), cut into
    groups of ``config.node_ranks`` consecutive ranks where that is set. The caller frees it."""
    from mpi4py import MPI

    shared = coll.Split_type(MPI.COMM_TYPE_SHARED, key=coll.Get_rank())
    if config.node_ranks <= 0:
        return shared
    try:
        return shared.Split(shared.Get_rank() // config.node_ranks, shared.Get_rank())
    finally:
        shared.Free()


class Engine:
    """One way to run collectives and point-to-point (see the module doc for the method set)."""

    name: ClassVar[str] = ""
    stream_ordered: ClassVar[bool] = False
    """True: the engine orders its work on the caller's CUDA stream itself; the Communicator then
    neither captures/fences the stream nor runs the host-side check. Its calls run in the
    caller's thread (with the caller's current device and stream), after the calls queued on the
    communicator's worker have finished; an ``async_op`` call returns a finished handle."""

    def __init__(self, setting: Setting, ops: ArrayOps) -> None:
        self.setting = setting
        self.ops = ops

    @classmethod
    def make(cls, engines: Engines, ops: ArrayOps, inner: str) -> Engine:
        """The engine for ``ops`` in ``engines``' communicator (``inner``: PathChoice.inner)."""
        return cls(engines.setting, ops)

    @property
    def algo(self) -> int:
        """What the ranks must agree on about the algorithm (a Signature's ``algo``): 1 ring,
        2 direct. Engines that run no cudampi algorithm on device memory report the host rule."""
        return 1 + int(self.setting.direct(False))

    def close(self) -> None:
        """Release what the engine holds (the communicator is closing)."""

    def synchronize(self) -> None:
        """Wait for what this engine enqueued on the caller's stream and raise what it reported
        (stream-ordered engines; the others finish their calls before returning)."""

    def flush(self) -> None:
        """Launch what the engine holds back (the ipc engine's grouped sends and receives)."""

    def reject(self, what: str) -> None:
        """Stream-ordered engines: tell the other ranks, where they check calls, that this rank
        rejected its arguments for ``what`` (they raise instead of waiting)."""

    # ------------------------------------------------------------------ collectives

    def allreduce(self, xf: Any, of: Any, op: str, dtype: str) -> None:
        raise NotImplementedError

    def reduce(
        self, xf: Any, of: Any, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        raise NotImplementedError

    def broadcast(self, xf: Any, root: int) -> None:
        raise NotImplementedError

    def allgatherv(self, xf: Any, of: Any, counts: list[int]) -> None:
        raise NotImplementedError

    def gatherv(self, xf: Any, of: Any | None, counts: list[int], root: int) -> None:
        raise NotImplementedError

    def scatterv(self, xf: Any | None, of: Any, counts: list[int], root: int) -> None:
        raise NotImplementedError

    def reduce_scatterv(
        self, xf: Any, of: Any, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        raise NotImplementedError

    def alltoallv(self, xf: Any, send_counts: list[int], of: Any, recv_counts: list[int]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ point-to-point

    def send(self, f: Any, dest: int, tag: int) -> None:
        raise NotImplementedError

    def recv(self, f: Any, source: int, tag: int) -> None:
        raise NotImplementedError

    def isend(self, f: Any, dest: int, tag: int) -> Handle:
        raise NotImplementedError

    def irecv(self, f: Any, source: int, tag: int) -> Handle:
        raise NotImplementedError

    def sendrecv(self, xf: Any, dest: int, of: Any, source: int, tag: int) -> None:
        """Send ``xf`` to ``dest`` while receiving ``of`` from ``source``."""
        r = self.irecv(of, source, tag)
        self.isend(xf, dest, tag).wait()
        r.wait()

    # ------------------------------------------------------------------ helpers

    def finish_avg(self, of: Any, op: str, dtype: str) -> None:
        """Divide a sum by the number of ranks where ``op`` is ``avg``."""
        if op == "avg":
            self.ops.divide(of, self.setting.size, dtype)


class CollectivesOnly(Engine):
    """An engine of collectives only (nccl): user point-to-point goes through MPI's engines
    (paths choose them for p2p), and a direct call says so."""

    def _no_p2p(self) -> CommError:
        return CommError(
            f"the {self.name} engine moves collectives; point-to-point goes through MPI"
        )

    def send(self, f: Any, dest: int, tag: int) -> None:
        raise self._no_p2p()

    def recv(self, f: Any, source: int, tag: int) -> None:
        raise self._no_p2p()

    def isend(self, f: Any, dest: int, tag: int) -> Handle:
        raise self._no_p2p()

    def irecv(self, f: Any, source: int, tag: int) -> Handle:
        raise self._no_p2p()


def core_op(op: str) -> str:
    """The reduction that runs on the wire: ``avg`` is a ``sum`` divided afterwards."""
    return "sum" if op == "avg" else op


class Engines:
    """One communicator's engines, made on first use and kept until it closes.

    ``kinds`` maps a :class:`~cudampi.comm.paths.PathChoice` ``engine`` name to its class. The
    array ops are kept here too, one per (lib, device), so every engine of a device (and the
    Communicator's stream handling) shares one reduction stream.
    """

    def __init__(self, setting: Setting, kinds: Mapping[str, type[Engine]]) -> None:
        self.setting = setting
        self._kinds = kinds
        self._ops: dict[tuple[str, int | None], ArrayOps] = {}
        self._made: dict[tuple[str, str, str, int | None], Engine] = {}
        self._kept: dict[Any, Any] = {}

    def ops(self, lib: str, device: int | None) -> ArrayOps:
        key = (lib, device)
        if key not in self._ops:
            self._ops[key] = ops_for(lib, device)
        return self._ops[key]

    def get(self, name: str, inner: str, lib: str, device: int | None) -> Engine:
        """The ``name`` engine for arrays of ``lib`` on ``device`` (None: host)."""
        key = (name, inner, lib, device)
        engine = self._made.get(key)
        if engine is None:
            kind = self._kinds.get(name)
            if kind is None:
                raise CommError(
                    f"no engine {name!r}; this communicator has {', '.join(self._kinds)}"
                )
            engine = self._made[key] = kind.make(self, self.ops(lib, device), inner)
        return engine

    def keep(self, key: Any, make: Callable[[], Any]) -> Any:
        """Per-communicator state that several engines share (made once by ``make``); the key
        starts with the owning module's engine name."""
        if key not in self._kept:
            self._kept[key] = make()
        return self._kept[key]

    def synchronize(self) -> None:
        for engine in list(self._made.values()):
            engine.synchronize()

    def flush(self) -> None:
        for engine in list(self._made.values()):
            engine.flush()

    def stream_ordered(self) -> list[Engine]:
        """The stream-ordered engines made so far (one per device and array library)."""
        seen: dict[int, Engine] = {}
        for engine in self._made.values():
            if engine.stream_ordered:
                seen.setdefault(id(getattr(engine, "ws", engine)), engine)
        return list(seen.values())

    def close(self) -> None:
        for engine in self._made.values():
            engine.close()
        self._made.clear()
        self._kept.clear()
