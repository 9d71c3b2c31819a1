"""The records of path choice: what the engines are asked and what they answer.

Engines declare themselves (:mod:`cudampi.comm.engines.base`): each says which calls it runs,
which ``path=`` names force it, and, asked with these records, whether auto may take it here
(:class:`Verdict`, once per communicator from :class:`Facts`) and what it makes of one call
(:class:`Ask` -> :class:`PathChoice`). :mod:`cudampi.comm.paths` only orders them.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from cudampi.config import Config
from cudampi.names import CALLS, Call
from cudampi.probe.capabilities import Capabilities

NO_LIMIT = 1 << 62
"""The open end of a size span."""


class PathChoice(str):
    """A path name (a ``str``) that also carries ``reason`` and the ``engine`` that runs it.

    ``inner``: what the engine composes with (the staged engine's host engine, the ipc engine's
    engine between nodes); ``stream_ordered``: the engine orders its work on the caller's CUDA
    stream (it returns once enqueued, and CUDA graph capture can record it).
    """

    reason: str
    engine: str
    inner: str
    label: str
    """What the ranks must agree on: the path plus, where it differs, what actually runs (set
    once: every call reads it)."""
    stream_ordered: bool

    def __new__(
        cls, path: str, reason: str, engine: str, inner: str = "", *, stream_ordered: bool = False
    ) -> PathChoice:
        obj = super().__new__(cls, path)
        obj.reason = reason
        obj.engine = engine
        obj.inner = inner
        obj.label = f"{path}-alg" if engine == "alg" and path in ("host", "native") else str(path)
        obj.stream_ordered = stream_ordered
        return obj


@dataclass(frozen=True)
class Verdict:
    """Whether auto may take an engine for device arrays here, why, and for which message sizes
    (``span``: bytes in [lo, hi)). Made once per communicator (or per host, for the doctor)."""

    ok: bool
    why: str
    span: tuple[int, int] = (0, NO_LIMIT)

    def takes(self, nbytes: int) -> bool:
        return self.ok and self.span[0] <= nbytes < self.span[1]


@dataclass(frozen=True)
class Ranks:
    """The communicator a verdict is for: its collective MPI communicator (a verdict may ask
    every rank, collectively, in the communicator's constructor) and whether it spans one node."""

    coll: Any
    one_node: bool


@dataclass
class Facts:
    """What a verdict is made from: the settings, the probe's cache entry, whether MPI itself
    takes device memory (:class:`DeviceSupport` without verdicts), the MPS daemon, and the ranks
    (None: this host, as the doctor asks). ``verdict(name)`` gives another engine's verdict
    (the nccl engine is taken only where it beats ipc), made once."""

    config: Config
    caps: Capabilities | None
    mpi: DeviceSupport
    mps: bool
    ranks: Ranks | None
    judge: Callable[[str, Facts], Verdict]
    _made: dict[str, Verdict] = field(default_factory=dict)

    def verdict(self, name: str) -> Verdict:
        if name not in self._made:
            self._made[name] = self.judge(name, self)
        return self._made[name]


@dataclass(frozen=True)
class DeviceSupport:
    """What MPI may be given device memory for, and why we believe it (the doctor's verdict on
    a stack), with each engine's :class:`Verdict` for auto."""

    p2p: bool
    p2p_why: str
    collectives: bool
    collectives_why: str
    verdicts: Mapping[str, Verdict] = field(default_factory=dict)
    """Engine name -> may auto take it for device arrays here (absent: not judged, no)."""
    unprobed: str = ""
    """Why auto decides without the probe's word on this stack ("" once it was probed): no
    entry in the capabilities cache, or one that predates the ipc engine's probe."""

    def verdict(self, engine: str) -> Verdict:
        return self.verdicts.get(engine) or Verdict(False, f"the {engine} engine was not judged")


@dataclass(frozen=True)
class Ask:
    """One call as path choice sees it."""

    call: Call
    requested: str
    on_device: bool
    dtype: str
    nbytes: int
    mpi_reduces: bool
    """MPI has a datatype and op for this reduction."""

    @property
    def no_mpi(self) -> bool:
        """A reduction MPI cannot run (no MPI type for the dtype): cudampi's algorithm does."""
        return self.call.reduces and not self.mpi_reduces

    @staticmethod
    def of(
        call: str, requested: str, on_device: bool, dtype: str, nbytes: int, mpi_reduces: bool
    ) -> Ask:
        return Ask(CALLS[call], requested, on_device, dtype, nbytes, mpi_reduces)
