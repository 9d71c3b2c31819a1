"""The engine contract: one method set that every engine of a communicator implements.

An engine moves data for one array library on one device (an :class:`~cudampi.comm.arrays.ArrayOps`)
and knows nothing about the caller's arrays: the Communicator adapts them, checks them on this
rank and across ranks, chooses the path and hands the engine flat contiguous arrays (1-D views of
the caller's memory, never copies) that are already valid for the call. Every rank calls the same
method with the same counts, op and root; an engine never checks that again.

Collectives (``xf`` the input, ``of`` the output; ``op`` a reduction valid for ``dtype``, ``avg``
included: an engine divides each rank's share itself, before the sum (:meth:`Engine.share`))::

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
engines share it, in :meth:`Engines.keep`. An engine that runs on another (the staged engine's
host engine, the ipc engine's engine between nodes) asks its set for it by name
(:meth:`Engine.peer`, :meth:`Engines.spawn`), never by importing it. This package never imports
the Communicator.

Each engine also declares itself to path choice (:mod:`cudampi.comm.paths` orders them, the
records are :mod:`cudampi.comm.choice`): the calls it runs, the ``path=`` names that ask for it,
whether it is stream-ordered, :meth:`Engine.available` (a library missing), :meth:`Engine.verdict`
(may auto take it for device arrays here, why, for which sizes), :meth:`Engine.route` (auto's
route through it for one call, or None) and :meth:`Engine.forced` (the route when asked for).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from cudampi.comm.arrays import ArrayOps, Flat, ops_for
from cudampi.comm.choice import Ask, DeviceSupport, Facts, PathChoice, Verdict
from cudampi.comm.handle import Handle
from cudampi.config import Config
from cudampi.errors import CommError
from cudampi.names import CALLS

if TYPE_CHECKING:
    from mpi4py.MPI import Comm

F = TypeVar("F", bound=Callable[..., Any])


def unimplemented(fn: F) -> F:
    """Marks an engine method that does not run its call (the base's, or one that refuses):
    an engine runs the calls whose methods it implements (:attr:`Engine.calls`)."""
    fn.unimplemented = True  # type: ignore[attr-defined]
    return fn


@dataclass(frozen=True, eq=False)
class Setting:
    """What every engine of one communicator works with."""

    coll: Comm
    """The MPI communicator of collectives (and of their internal point-to-point)."""
    p2p: Comm
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
    Triton's launcher reads: no Stream object per call), else the public API."""
    global _RAW_STREAM
    import torch

    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:

        def raw(device: int) -> int:
            return int(torch.cuda.current_stream(device).cuda_stream)

    _RAW_STREAM = raw
    return raw


def node_comm(coll: Comm, config: Config) -> Comm:
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
    calls: ClassVar[frozenset[str]] = frozenset()
    """The calls (:data:`cudampi.names.CALLS`) this engine runs; auto passes it over for others.
    An engine declares a call by implementing its engine method (the table's ``engine``); a call
    with no engine method (barrier, split) runs on every engine."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "calls" not in cls.__dict__:
            cls.calls = frozenset(
                name
                for name, c in CALLS.items()
                if not c.engine or not getattr(getattr(cls, c.engine), "unimplemented", False)
            )

    paths: ClassVar[tuple[str, ...]] = ()
    """The ``path=`` names (:data:`cudampi.names.PATHS`) that ask for this engine."""
    device_only: ClassVar[bool] = False
    """It moves device arrays only: asked for on host arrays, the host's own choice runs."""
    agreed: ClassVar[bool] = False
    """Its verdict must be the same on every rank: a communicator refuses to start otherwise
    (auto would take it on some ranks only)."""
    last_resort: ClassVar[bool] = False
    """auto's route where no engine took a call (:meth:`fallback`): one engine says so."""
    any_source: ClassVar[str] = ""
    """Why a receive from any rank cannot match this engine's messages ("": it can)."""
    stream_ordered: ClassVar[bool] = False
    """True: the engine orders its work on the caller's CUDA stream itself; the Communicator then
    neither captures/fences the stream nor runs the host-side check. Its calls run in the
    caller's thread (with the caller's current device and stream), after the calls queued on the
    communicator's worker have finished; an ``async_op`` call returns a finished handle."""

    made_by: Engines | None = None
    """The set that made this engine (:meth:`peer` asks it for other engines)."""

    def __init__(self, setting: Setting, ops: ArrayOps) -> None:
        self.setting = setting
        self.ops = ops

    # ------------------------------------------------------------------ declarations

    @classmethod
    def available(cls) -> str | None:
        """None where this engine can run in this process, else why not (a library missing)."""
        return None

    @classmethod
    def verdict(cls, facts: Facts) -> Verdict:
        """May auto take this engine for device arrays here, why, and for which sizes."""
        return Verdict(False, f"auto does not take the {cls.name} engine")

    @classmethod
    def refuses(cls, call: str, dtype: str, op: str | None) -> str | None:
        """Why this engine would refuse ``call`` on ``dtype`` with reduce ``op`` (a reduction
        its library lacks), or None; asked before running, it saves a failed call."""
        return None

    @classmethod
    def unprobed(cls, facts: Facts) -> str:
        """Why auto decides for this engine without the probe's word ("" where it has it)."""
        return ""

    @classmethod
    def route(cls, ask: Ask, support: DeviceSupport) -> PathChoice | None:
        """auto's route through this engine for ``ask``, or None: auto asks the next engine."""
        return None

    @classmethod
    def fallback(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        """auto's route where no engine took the call (the :attr:`last_resort` engine's)."""
        raise NotImplementedError

    @classmethod
    def forced(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        """The route where ``ask.requested`` is one of :attr:`paths`; a
        :class:`~cudampi.errors.DeviceError` that says why and what to do where it cannot run."""
        raise NotImplementedError

    # ------------------------------------------------------------------ making

    @classmethod
    def make(cls, engines: Engines, ops: ArrayOps, inner: str) -> Engine:
        """The engine for ``ops`` in ``engines``' communicator (``inner``: PathChoice.inner)."""
        return cls(engines.setting, ops)

    def peer(self, name: str, inner: str = "") -> Engine:
        """The ``name`` engine of this engine's set on the same arrays (library and device)."""
        assert self.made_by is not None, "an engine made outside an Engines set has no peers"
        return self.made_by.get(name, inner, self.ops.lib, self.ops.device)

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

    @unimplemented
    def allreduce(self, xf: Flat, of: Flat, op: str, dtype: str) -> None:
        raise NotImplementedError

    @unimplemented
    def reduce(
        self, xf: Flat, of: Flat, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        raise NotImplementedError

    @unimplemented
    def broadcast(self, xf: Flat, root: int) -> None:
        raise NotImplementedError

    @unimplemented
    def allgatherv(self, xf: Flat, of: Flat, counts: list[int]) -> None:
        raise NotImplementedError

    @unimplemented
    def gatherv(self, xf: Flat, of: Flat | None, counts: list[int], root: int) -> None:
        raise NotImplementedError

    @unimplemented
    def scatterv(self, xf: Flat | None, of: Flat, counts: list[int], root: int) -> None:
        raise NotImplementedError

    @unimplemented
    def reduce_scatterv(
        self, xf: Flat, of: Flat, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        raise NotImplementedError

    @unimplemented
    def alltoallv(self, xf: Flat, send_counts: list[int], of: Flat, recv_counts: list[int]) -> None:
        raise NotImplementedError

    # ------------------------------------------------------------------ point-to-point

    @unimplemented
    def send(self, f: Flat, dest: int, tag: int) -> None:
        raise NotImplementedError

    @unimplemented
    def recv(self, f: Flat, source: int, tag: int) -> None:
        raise NotImplementedError

    @unimplemented
    def isend(self, f: Flat, dest: int, tag: int) -> Handle:
        raise NotImplementedError

    @unimplemented
    def irecv(self, f: Flat, source: int, tag: int) -> Handle:
        raise NotImplementedError

    def sendrecv(self, xf: Flat, dest: int, of: Flat, source: int, tag: int) -> None:
        """Send ``xf`` to ``dest`` while receiving ``of`` from ``source``."""
        r = self.irecv(of, source, tag)
        self.isend(xf, dest, tag).wait()
        r.wait()

    # ------------------------------------------------------------------ helpers

    def share(self, dst: Flat, src: Flat, op: str, dtype: str) -> None:
        """``dst`` = ``src`` (``src is dst``: in place; else apart from it), divided by the
        number of ranks where ``op`` is ``avg``: each rank's share, before the sum, so the sum
        cannot overflow where the average fits (:data:`cudampi.comm.arrays.base.SEMANTICS`)."""
        if op == "avg":
            self.ops.divide(dst, self.setting.size, dtype, None if src is dst else src)
        elif src is not dst:
            self.ops.copy(dst, src)


class CollectivesOnly(Engine):
    """An engine of collectives only (nccl): user point-to-point goes through MPI's engines
    (paths choose them for p2p), and a direct call says so."""

    def _no_p2p(self) -> CommError:
        return CommError(
            f"the {self.name} engine moves collectives; point-to-point goes through MPI"
        )

    @unimplemented
    def send(self, f: Flat, dest: int, tag: int) -> None:
        raise self._no_p2p()

    @unimplemented
    def recv(self, f: Flat, source: int, tag: int) -> None:
        raise self._no_p2p()

    @unimplemented
    def isend(self, f: Flat, dest: int, tag: int) -> Handle:
        raise self._no_p2p()

    @unimplemented
    def irecv(self, f: Flat, source: int, tag: int) -> Handle:
        raise self._no_p2p()

    @unimplemented
    def sendrecv(self, xf: Flat, dest: int, of: Flat, source: int, tag: int) -> None:
        raise self._no_p2p()


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
            engine.made_by = self
        return engine

    def spawn(self, setting: Setting) -> Engines:
        """A set of the same engines for another communicator (the ipc engine's node and
        cross-node communicators); the caller closes it."""
        return Engines(setting, self._kinds)

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
