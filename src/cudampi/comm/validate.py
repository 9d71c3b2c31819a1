"""Checking that every rank makes the same collective call, before any data moves.

A collective whose ranks disagree on size, dtype, op, root or path would hang or corrupt memory;
one whose input failed a local check on one rank would leave the others waiting. So every
collective first exchanges a small signature, waited on with the communicator's deadline
(:mod:`~cudampi.comm.deadline`), and with CUDAMPI_DEBUG=1 then an allgather of the whole
signature, shapes included. On any disagreement or local failure every rank raises, naming the
ranks and values.

The exchange is one non-blocking collective of a fixed size, the same on every rank whatever
call each one makes, so ranks that disagree still meet in it. On a communicator of up to
:data:`GATHER_RANKS` ranks it is an allgather of every rank's signature block, which also
carries the data of a small allreduce on host memory (up to :data:`CARRY_BYTES`): the call then
needs no second collective, and every rank reduces the ranks' data itself, in rank order
(:mod:`cudampi.comm.carry`). Larger communicators exchange the signature codes in an allreduce
(whose cost grows with the logarithm of the ranks, not with them).
"""

from __future__ import annotations

import functools
import zlib
from dataclasses import dataclass, field
from typing import Any

from cudampi.comm.arrays import DTYPE_CODE
from cudampi.comm.deadline import FIRST_TESTS
from cudampi.errors import CommError, DeviceError, MismatchError
from cudampi.names import CALLS, FORCED_PATHS, REDUCE_OPS

PATH_LABELS = ("none", *FORCED_PATHS, "host-alg", "native-alg")
"""What a call's ``path`` may say: a path, or the algorithm cudampi runs where MPI cannot
(:attr:`cudampi.comm.paths.PathChoice.label`)."""


@dataclass(frozen=True)
class Signature:
    """What every rank must agree on for one collective call (-1 / '' / () = not compared)."""

    call: str
    op: str = ""
    dtype: str = ""
    root: int = -1
    count: int = -1
    counts: tuple[int, ...] = ()
    path: str = "none"
    """The path label every rank must share (:attr:`~cudampi.comm.paths.PathChoice.label`)."""
    algo: int = 0
    """0: not compared; 1: ring; 2: direct (see cudampi.comm.algorithms)."""
    carried: bool = False
    """The data travels in the check's own exchange (:mod:`cudampi.comm.carry`)."""
    shape: tuple[int, ...] | None = field(default=None, compare=False)

    def codes(self) -> list[int]:
        return [
            CALLS[self.call].code,
            REDUCE_OPS.index(self.op) + 1 if self.op else 0,
            DTYPE_CODE.get(self.dtype, 0),
            self.root,
            self.count,
            zlib.crc32(repr(self.counts).encode()) if self.counts else 0,
            PATH_LABELS.index(self.path) if self.path in PATH_LABELS else 0,
            self.algo,
            int(self.carried),
        ]

    def shown(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "op": self.op,
            "dtype": self.dtype,
            "root": self.root,
            "count": self.count,
            "counts": list(self.counts),
            "path": self.path,
            "algorithm": ("", "ring", "direct")[self.algo],
        }
        if self.shape is not None:
            d["shape"] = self.shape
        return d


_ERROR_CLASSES: dict[str, type[CommError]] = {
    "CommError": CommError,
    "DeviceError": DeviceError,
    "MismatchError": MismatchError,
}


def _host_rank() -> str:
    import socket

    return socket.gethostname()


GATHER_RANKS = 16
"""Communicators of up to this many ranks check calls with an allgather of signature blocks."""
CARRY_BYTES = 128
"""The most data of an allreduce that travels in its check (see the module doc)."""
_WORDS = 1 + CARRY_BYTES // 8
"""Words of a rank's block: a digest of its codes and whether it failed, then its data."""
CHECK_TAG = 32_000
"""The tag of the check's messages on a communicator's collective communicator (the deadline's
goodbyes and roll calls use 32_001 and 32_002; the engines' own messages lower tags)."""


def gathers(size: int) -> bool:
    """Whether a communicator of ``size`` ranks checks calls with an allgather of blocks."""
    return 1 < size <= GATHER_RANKS


def check(
    comm: Any,
    sig: Signature,
    local_error: BaseException | None,
    *,
    debug: bool,
    watch: Any = None,
    seq: int = -1,
    data: Any = None,
) -> Any:
    """Collective over ``comm``: return when every rank passed ``sig`` and no local error;
    otherwise raise on every rank (the rank's own error where it had one). ``watch``: the
    communicator's :class:`~cudampi.comm.deadline.Watch` (its deadline; None waits for ever),
    ``seq`` the call's number on the communicator (for its messages). ``data``: the bytes this
    rank carries in the check (a ``sig.carried`` call, see :func:`gathers`); the result is then
    every rank's, as a ``(ranks, nbytes)`` uint8 array, else None."""
    if comm.size == 1:
        if local_error is not None:
            raise local_error
        return None
    if gathers(comm.size):
        got, rows = _gather(comm, sig, local_error is not None, data, watch, seq)
    else:
        got, rows = _reduce(comm, sig, local_error is not None, watch, seq)
    if got and not debug:
        return rows
    return _settle(comm, sig, local_error, rows, debug)


def _settle(
    comm: Any, sig: Signature, local_error: BaseException | None, rows: Any, debug: bool
) -> Any:
    """After an exchange that found a disagreement (or any, under ``debug``): the full one."""
    # Every rank has arrived (the exchange completed): the full exchange cannot wait for ever.
    entries = comm.allgather(
        (
            sig,
            None if local_error is None else (type(local_error).__name__, str(local_error)),
            _host_rank(),
        )
    )
    if debug and all(e[1] is None and e[0] == sig and e[0].shape == sig.shape for e in entries):
        return rows
    _raise_for(comm.rank, sig, local_error, entries, debug)
    return None  # (_raise_for raised)


def _wait(req: Any, watch: Any, call: str, seq: int) -> None:
    if watch is None:
        req.Wait()
    else:
        watch.wait(req, call, seq)


def _reduce(comm: Any, sig: Signature, failed: bool, watch: Any, seq: int) -> tuple[bool, None]:
    """The check as one allreduce of the codes: max(c) == -max(-c), i.e. max == min, for every
    code where all ranks gave the same; the last entry is 1 where any rank failed."""
    from mpi4py import MPI

    vec = _vector(sig, failed)
    out = vec.copy()
    _wait(comm.Iallreduce(vec, out, MPI.MAX), watch, sig.call, seq)
    got = out.tolist()
    return got[-1] == 0 and _agree(got), None


def _gather(
    comm: Any, sig: Signature, failed: bool, data: Any, watch: Any, seq: int
) -> tuple[bool, Any]:
    """The check as an exchange of every rank's block with every other rank (point-to-point:
    MPI's messages cost less than its non-blocking collectives): a digest of the codes and
    whether the rank failed, then the data it carries. All agree where every rank's digest is
    this rank's and it did not fail."""
    ex = _exchange(comm, watch)
    ex.mine[0] = _digest(sig, failed)
    if data is not None:
        ex.my_bytes[8 : 8 + len(data)] = data
    ex.start()
    try:
        _wait(ex, watch, sig.call, seq)
    except BaseException:
        ex.cancel()
        raise
    digests = ex.digests.tolist()
    agree = not failed and digests.count(digests[ex.me]) == len(digests)
    return agree, None if data is None else ex.data(len(data))


def _exchange(comm: Any, watch: Any) -> Exchange:
    """The communicator's :class:`Exchange`, kept on its ``watch`` (made at the first check)."""
    ex = watch.exchange if watch is not None else None
    if ex is None:
        ex = Exchange(comm)
        if watch is not None:
            watch.exchange = ex
    return ex


class Recheck:
    """The cross-rank check of one call the full path prepared, made once for its repeats
    (:mod:`cudampi.comm.repeat`): :meth:`run` with the call's number is :func:`check` with no
    local error, the same exchange and the same outcome (every rank raises where any differs),
    without working out again what cannot change between repeats (the digest, where the
    carried bytes go and come back)."""

    __slots__ = (
        "_startall", "comm", "data", "debug", "digest", "digests", "dst", "ex", "mine", "n",
        "rows", "sig", "watch",
    )  # fmt: skip

    def __init__(
        self, comm: Any, sig: Signature, watch: Any, data: Any = None, debug: bool = False
    ) -> None:
        self.comm, self.sig, self.watch, self.data, self.debug = comm, sig, watch, data, debug
        self.ex: Exchange | None = None
        self.n = comm.size
        if gathers(self.n) and watch is not None and not debug:
            ex = self.ex = _exchange(comm, watch)
            self._startall, self.mine, self.digests = ex._startall, ex.mine, ex.digests
            self.digest = _digest(sig, False)
            self.dst = None if data is None else ex.my_bytes[8 : 8 + len(data)]
            self.rows = None if data is None else ex.data(len(data))

    def run(self, seq: int) -> Any:
        """The check of call number ``seq``: every rank's carried bytes (or None)."""
        ex = self.ex
        if ex is None:  # (no exchange of blocks: the check as the full path makes it)
            return check(
                self.comm, self.sig, None, debug=self.debug, watch=self.watch, seq=seq,
                data=self.data,
            )  # fmt: skip
        self.mine[0] = self.digest
        if self.dst is not None:
            self.dst[...] = self.data
        reqs = ex.reqs
        self._startall(reqs)
        try:  # Watch.wait's first polls, inline: one request at a time (a persistent request
            # that completed tests true until started again), then the wait under the deadline
            for req in reqs:
                if req.Test():
                    continue
                for _ in range(FIRST_TESTS):
                    if req.Test():
                        break
                else:
                    self.watch.wait(ex, self.sig.call, seq)
                    break
        except BaseException:
            ex.cancel()
            raise
        if self.digests.tolist().count(self.digest) == self.n:
            return self.rows
        return _settle(self.comm, self.sig, None, self.rows, False)


class Exchange:
    """One communicator's check exchange, made once: a row of words per rank (this rank's sent
    to every other, theirs received in place) and persistent requests that start each call's
    exchange without making any (:data:`CHECK_TAG`); :func:`check` keeps it on the
    communicator's :class:`~cudampi.comm.deadline.Watch`, which frees it."""

    def __init__(self, comm: Any) -> None:
        import numpy
        from mpi4py import MPI

        # (the calls bound once: an import statement costs more than a poll, and a wait polls)
        self._startall, self._testall, self._waitall = (
            MPI.Prequest.Startall,
            MPI.Request.Testall,
            MPI.Request.Waitall,
        )
        self.me, n = comm.rank, comm.size
        self.rows = numpy.zeros((n, _WORDS), dtype=numpy.int64)
        self.mine = self.rows[self.me]
        self.bytes = self.rows.view(numpy.uint8)
        self.my_bytes = self.bytes[self.me]
        self.digests = self.rows[:, 0]
        self._data: dict[int, Any] = {}
        others = [r for r in range(n) if r != self.me]
        self.reqs = [comm.Recv_init(self.rows[r], r, CHECK_TAG) for r in others]
        self.reqs += [comm.Send_init(self.mine, r, CHECK_TAG) for r in others]

    def data(self, nbytes: int) -> Any:
        """Every rank's carried bytes: a ``(ranks, nbytes)`` view of the rows."""
        view = self._data.get(nbytes)
        if view is None:
            view = self._data[nbytes] = self.bytes[:, 8 : 8 + nbytes]
        return view

    def start(self) -> None:
        self._startall(self.reqs)

    def Test(self) -> bool:
        return bool(self._testall(self.reqs))

    def Wait(self) -> None:
        self._waitall(self.reqs)

    def cancel(self) -> None:
        """After a failed wait: what is pending will never be read (the communicator failed)."""
        for req in self.reqs:
            try:
                if not req.Test():
                    req.Cancel()
            except Exception:  # the communicator is failing: nothing else to do with it
                pass

    def free(self) -> None:
        for req in self.reqs:
            try:
                req.Free()
            except Exception:  # freeing at teardown must not mask the real error
                pass
        self.reqs = []


@functools.lru_cache(maxsize=256)
def _digest(sig: Signature, failed: bool) -> int:
    """The codes of ``sig`` and whether the rank failed, as one 64-bit word (a rank that
    differs in any code, or failed, differs here)."""
    import hashlib

    text = repr((sig.codes(), failed)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little", signed=True)


@functools.lru_cache(maxsize=256)
def _codes(sig: Signature) -> Any:
    import numpy

    codes = sig.codes()
    return numpy.array([*codes, *(-c for c in codes), 0], dtype=numpy.int64)


def _vector(sig: Signature, failed: bool) -> Any:
    """What this rank contributes to the cheap check (a training loop repeats a few calls:
    their vectors are made once); the caller must not write into it."""
    if failed:
        vec = _codes(sig).copy()
        vec[-1] = 1
        return vec
    return _codes(sig)


def _agree(got: list[int]) -> bool:
    """Did every rank give the same codes? ``got`` holds max(c) for each code c, then max(-c):
    each pair sums to max(c) - min(c) >= 0, so all agree exactly when the whole sum is 0 (in
    Python's ints, no overflow; a third of the cost of comparing NumPy slices this small)."""
    k = (len(got) - 1) // 2
    return sum(got[: 2 * k]) == 0


def _raise_for(
    rank: int,
    sig: Signature,
    local_error: BaseException | None,
    entries: list[tuple[Signature, tuple[str, str] | None, str]],
    debug: bool,
) -> None:
    failed = [(i, e[1], e[2]) for i, e in enumerate(entries) if e[1] is not None]
    if failed:
        if local_error is not None:
            raise local_error
        i, (cls_name, msg), host = failed[0]
        cls = _ERROR_CLASSES.get(cls_name, CommError)
        others = f" (and {len(failed) - 1} more rank(s))" if len(failed) > 1 else ""
        raise cls(
            f"{sig.call}: rank {i} on {host} rejected its arguments{others}, so no rank ran the "
            f"call: {msg}"
        )
    names = ["op", "dtype", "root", "count", "counts", "path", "algorithm"]
    if debug:
        names.append("shape")
    shown = [e[0].shown() for e in entries]
    if any(s[0].call != sig.call for s in entries):
        calls = ", ".join(f"rank {i}: {e[0].call}" for i, e in enumerate(entries))
        raise MismatchError(
            f"ranks called different collectives at the same point ({calls}). Every rank must "
            "make the same collective calls in the same order."
        )
    for name in names:
        values = [s.get(name) for s in shown]
        if any(v != values[0] for v in values):
            groups: dict[str, list[int]] = {}
            for i, v in enumerate(values):
                groups.setdefault(repr(v), []).append(i)
            majority = max(groups.values(), key=len)
            odd = [i for i in range(len(values)) if i not in majority]
            desc = "; ".join(
                f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
                for v, rs in groups.items()
            )
            hint = (
                " (ranks picked different paths: pass the same path= on every rank, or the same "
                "kind of array)"
                if name == "path"
                else " (set the same CUDAMPI_ALGORITHM on every rank)"
                if name == "algorithm"
                else ""
            )
            raise MismatchError(
                f"{sig.call}: ranks disagree on {name} ({desc}); rank {odd[0]} differs from the "
                f"rest{hint}. Every rank must pass the same {name} to one collective call."
            )
    raise MismatchError(f"{sig.call}: ranks disagree on the call's signature: {shown!r}")


AGREED_HINT = {
    "device p2p": "run `cudampi doctor` on every host with the job's settings, or set the same "
    "CUDAMPI_CUDA_AWARE on every rank",
    "device collectives": "run `cudampi doctor` on every host with the job's settings, or set "
    "the same CUDAMPI_NATIVE_COLLECTIVES on every rank",
}


def agree(comm: Any, values: dict[str, Any]) -> None:
    """Collective over ``comm``, once when a communicator is made: every rank must have the same
    ``values`` (the settings that change what a rank sends, and the path choice's inputs), so no
    call can run with ranks that chunk, pick algorithms or check differently. A
    :class:`MismatchError` on every rank names each setting that differs and which ranks have
    which value."""
    if comm.size == 1:
        return
    from cudampi.config import Config

    seen = comm.allgather((values, _host_rank()))
    lines = []
    for name in values:
        got = [v.get(name) for v, _ in seen]
        if all(g == got[0] for g in got):
            continue
        groups: dict[str, list[int]] = {}
        for i, g in enumerate(got):
            groups.setdefault(repr(g), []).append(i)
        desc = "; ".join(
            f"rank{'s' if len(rs) > 1 else ''} {', '.join(map(str, rs))}: {v}"
            for v, rs in groups.items()
        )
        fix = AGREED_HINT.get(name) or (
            f"set the same {Config.env_name(name)} on every rank (or pass the same config=)"
            if name in Config.fields()
            else "pass the same value on every rank"
        )
        lines.append(f"{name} ({desc}): {fix}")
    if lines:
        raise MismatchError(
            "the ranks of this communicator disagree on settings that change what each rank "
            "sends, so no collective could run correctly: " + "; ".join(lines) + "."
        )
