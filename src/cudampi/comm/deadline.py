"""Deadlines: no call waits for ever for a rank that does not come.

Every collective starts with the cross-rank check (:mod:`~cudampi.comm.validate`), a
non-blocking allreduce that :meth:`Watch.wait` waits on with the communicator's deadline
(``Config.timeout``, ``CUDAMPI_TIMEOUT``; torch's ``timeout=`` under the torch backend). It
ends in one of three ways:

- every rank arrives: the call goes on (its data then moves without a deadline: every rank is
  in it, and a rank that dies now ends the job through its launcher);
- a rank has left: a process that closes a communicator, or exits with one open, tells its
  peers so (:meth:`Watch.leave`, :func:`_at_exit`); a rank that waits for it raises after
  :data:`GRACE` seconds (the leaver's last call may still be completing here);
- the deadline passes: the ranks that wait call the roll (each asks the others which call they
  wait in, and answers while it waits itself), and :data:`ROLL_GRACE` seconds later the ranks
  that did not answer are named.

Either way :class:`~cudampi.errors.CommTimeoutError` names the call, its sequence number on this
communicator and the ranks, and the communicator is failed: later calls raise at once, and a
process that exits after a failure aborts the MPI job (a collective left pending can hang
MPI_Finalize). Point-to-point waits (:func:`wait_request`) have the same deadline. A caller that
gives up on a call itself (a handle's ``wait(timeout=)``, torch's ``Work.wait(timeout=)``) fails
the communicator the same way (:meth:`Watch.give_up`): the call is still pending in MPI. At exit
a process first lets the calls still queued on its communicators finish (each under its
deadline: a peer that never makes the call fails it), then says goodbye, then aborts the job
where any communicator of the process failed, closed or not (:func:`_at_exit`).

Making a communicator starts with :func:`agree_to_start` on the caller's communicator, under the
deadline, before any other collective: a rank that refused its arguments makes every rank raise.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from cudampi.errors import CommError, CommTimeoutError

GOODBYE_TAG = 32_001
"""Tag of a departing process's notice on a communicator's collective duplicate (cudampi's own
algorithms use tag 1 there and MPI's collectives never match point-to-point)."""
ROLLCALL_TAG = 32_002
GRACE = 2.0
"""Seconds a call still waits after hearing that a rank left (its last call may be finishing)."""
ROLL_GRACE = 1.0
"""Seconds the roll call waits for answers."""
DRAIN = 0.25
"""Seconds a process leaving with communicators open waits for its peers' goodbyes."""
SPIN = 0.02
"""Seconds of tight polling before a wait starts to sleep between polls."""
NAP = 2e-4
START = 10.0
"""Seconds the ranks wait for each other at least when making a communicator
(:func:`agree_to_start`): processes reach it at different times (their imports, their start),
which a short deadline for calls must not count as a rank that never came."""
FIRST_TESTS = 16
"""Polls of a point-to-point request before its wait starts the deadline's clock (each ~0.1 us:
a peer that is already there completes a small message within them)."""


def spin(
    test: Callable[[], bool],
    timeout: float,
    expired: Callable[[], BaseException],
    idle: Callable[[], None] | None = None,
) -> None:
    """Call ``test()`` until it is true; ``idle()`` between polls (it may raise); raise
    ``expired()`` once ``timeout`` seconds have passed. Polls tightly first (latency), then
    naps (the CPU of the ranks that share it)."""
    if test():
        return
    start = time.monotonic()
    deadline = start + timeout
    n = 0
    while not test():
        n += 1
        now = time.monotonic()
        if idle is not None and n % 32 == 0:
            idle()
        if now > deadline:
            raise expired()
        if now - start > SPIN:
            time.sleep(NAP)


def wait_request(
    req: Any, timeout: float, what: str | Callable[[], str], status: Any = None
) -> None:
    """``req.Wait(status)``, but at most ``timeout`` seconds (point-to-point). ``what`` names
    the message in the timeout error: its text, or a function that makes it, called only then
    (a message that completes within :data:`FIRST_TESTS` polls, the common case, builds no text
    and reads no clock)."""
    for _ in range(FIRST_TESTS):
        if req.Test(status):
            return

    def test() -> bool:
        return bool(req.Test(status))

    def expired() -> BaseException:
        return CommTimeoutError(
            f"{what if isinstance(what, str) else what()} did not complete within {timeout:g} s: "
            "Timed out waiting for the other rank's matching call (CUDAMPI_TIMEOUT sets the "
            "deadline)"
        )

    spin(test, timeout, expired)


class Watch:
    """One communicator's deadline: its waits, the ranks heard leaving, its failure."""

    def __init__(self, comm: Any, timeout: float, token: int = 0) -> None:
        self.comm = comm
        self.rank = int(comm.Get_rank())
        self.size = int(comm.Get_size())
        self.timeout = timeout
        self.token = token
        """This communicator's number (:func:`agree_to_start`), in its goodbyes: a goodbye sent
        to a communicator that was freed since may reach a later one that MPI gave the same
        context, which must not take it for its own."""
        self.departed: set[int] = set()
        self.failed: CommTimeoutError | None = None
        self.closed = False
        self.drain: Callable[[], None] | None = None
        """Waits for the calls still queued on the communicator (at exit, before goodbye)."""
        self._call = ("", -1)  # the call this rank waits in, for roll calls
        self._seen: dict[int, tuple[int, int]] = {}  # rank -> (seq, 1) heard in a roll call
        self._sent: list[Any] = []
        self.exchange: Any = None
        """The cross-rank check's buffers and persistent requests
        (:class:`cudampi.comm.validate.Exchange`), made at the first check; freed at close."""
        _register(self)

    def wait(self, req: Any, call: str, seq: int) -> None:
        """Wait for the collective request ``req`` of ``call`` number ``seq`` (see module doc)."""
        if self.failed is not None:
            raise self.failed
        for _ in range(FIRST_TESTS):  # the peers are there already, or a moment away
            if req.Test():
                return
        self._call = (call, seq)
        left_at: list[float] = []

        def idle() -> None:
            if self.failed is not None:  # given up on by another thread (give_up)
                raise self.failed
            self._listen()
            if self.departed:
                now = time.monotonic()
                if not left_at:
                    left_at.append(now)
                elif now - left_at[0] > GRACE:
                    raise self._fail(call, seq, left=sorted(self.departed))

        def expired() -> BaseException:
            return self._fail(call, seq, answered=self._roll_call(seq))

        try:
            spin(req.Test, self.timeout, expired, idle)
        finally:
            self._call = ("", -1)

    def _fail(
        self,
        call: str,
        seq: int,
        *,
        left: list[int] | None = None,
        answered: dict[int, int] | None = None,
    ) -> CommTimeoutError:
        where = f"{call} (call #{seq} on this communicator)"
        me = f"rank {self.rank} of {self.size}"
        if left:
            msg = (
                f"{where}: {_ranks(left)} left the job (its process is exiting) or closed this "
                f"communicator while {me} waits for it: every rank must make the same collective "
                "calls before it closes. The job cannot go on."
            )
        else:
            answered = answered or {}
            here = [r for r, s in answered.items() if s == seq]
            elsewhere = {r: s for r, s in answered.items() if s != seq}
            missing = [r for r in range(self.size) if r != self.rank and r not in answered]
            parts = [f"{_ranks(missing)} did not arrive within {self.timeout:g} s"] * bool(missing)
            if not missing and not elsewhere:  # all answered from this call: one came late
                parts = [f"every rank reached it, but not all within {self.timeout:g} s"]
            if here:
                parts.append(f"{_ranks(here)} wait{'s' if len(here) == 1 else ''} here too")
            for r, s in sorted(elsewhere.items()):
                parts.append(f"rank {r} waits in call #{s}")
            cause = (
                "A rank skipped this call, is stuck in other work, or died"
                if missing or elsewhere
                else "A rank came late (slow work before this call, or a loaded machine): raise "
                "the deadline if that is expected"
            )
            msg = (
                f"{where}: {'; '.join(parts)} ({me}). Timed out after {self.timeout:g} s. "
                f"{cause}; the deadline is CUDAMPI_TIMEOUT (torch: init_process_group(timeout=)). "
                "The job cannot go on."
            )
        return self.give_up(CommTimeoutError(msg))

    def give_up(self, error: CommTimeoutError) -> CommTimeoutError:
        """Fail this communicator with ``error`` (the first failure stays): a call left pending
        in MPI makes later calls unsafe, and MPI_Finalize could wait for it for ever, so the
        process ends the job at exit (:func:`_at_exit`), even once the communicator is closed."""
        if self.failed is None:
            self.failed = error
            _record(error)
        return self.failed

    # --- messages between the ranks of this communicator ---------------------------------

    def _listen(self) -> None:
        """Take in goodbyes and roll calls; answer the roll while this rank waits."""
        import numpy
        from mpi4py import MPI

        status = MPI.Status()
        while self.comm.Iprobe(MPI.ANY_SOURCE, GOODBYE_TAG, status):
            src = status.Get_source()
            got = numpy.zeros(1, dtype=numpy.int64)
            self.comm.Recv(got, src, GOODBYE_TAG)
            if int(got[0]) == self.token:  # (else a goodbye to a communicator freed before)
                self.departed.add(int(src))
        while self.comm.Iprobe(MPI.ANY_SOURCE, ROLLCALL_TAG, status):
            src = int(status.Get_source())
            got = numpy.zeros(2, dtype=numpy.int64)
            self.comm.Recv(got, src, ROLLCALL_TAG)
            seq, asks = int(got[0]), int(got[1])
            self._seen[src] = (seq, asks)
            if asks and self._call[1] >= 0:
                self._send(src, self._call[1], asks=0)

    def _send(self, dest: int, seq: int, *, asks: int) -> None:
        import numpy

        msg = numpy.array([seq, asks], dtype=numpy.int64)
        self._sent.append((msg, self.comm.Isend(msg, dest, ROLLCALL_TAG)))

    def _roll_call(self, seq: int) -> dict[int, int]:
        """rank -> the call number it waits in, for every rank that answered in time."""
        self._seen.clear()
        for r in range(self.size):
            if r != self.rank:
                self._send(r, seq, asks=1)
        until = time.monotonic() + ROLL_GRACE
        while time.monotonic() < until:
            self._listen()
            if len(self._seen) >= self.size - 1:
                break
            time.sleep(0.01)
        return {r: s for r, (s, _) in self._seen.items()}

    def goodbye(self) -> None:
        """Tell every other rank that this rank is leaving (closing, or exiting with the
        communicator open)."""
        if self.closed or self.size == 1:
            return
        import numpy

        note = numpy.array([self.token], dtype=numpy.int64)
        reqs = []
        for r in range(self.size):
            if r != self.rank:
                try:
                    reqs.append(self.comm.Isend(note, r, GOODBYE_TAG))
                except Exception:
                    pass
        until = time.monotonic() + 0.5
        for req in reqs:
            try:
                while not req.Test() and time.monotonic() < until:
                    time.sleep(0.001)
            except Exception:
                pass

    def leave(self) -> None:
        """The communicator is closing: say goodbye, take in the peers' goodbyes where they
        close too (at most :data:`DRAIN` seconds), and stop watching."""
        if not self.closed:
            self.goodbye()
            hear_goodbyes([self], DRAIN)
        self.close()

    def close(self) -> None:
        self.closed = True
        _LIVE.discard(self)
        if self.exchange is not None:
            self.exchange.free()
            self.exchange = None


def hear_goodbyes(watches: list[Watch], seconds: float) -> None:
    """Take in the peers' goodbyes on ``watches`` (a process leaving with communicators open)
    until every peer's has come or ``seconds`` have passed: the ranks of a job leave at about
    the same time, and a notice left unreceived at MPI_Finalize makes UCX warn on every rank
    ("unexpected tag-receive descriptor ... was not matched")."""
    until = time.monotonic() + seconds
    pending = [w for w in watches if w.size > 1 and not w.closed]
    while pending:
        for w in pending:
            try:
                w._listen()
            except Exception:  # MPI refuses now: nothing more to hear on this one
                w.departed.update(r for r in range(w.size) if r != w.rank)
        pending = [w for w in pending if len(w.departed) < w.size - 1]
        if not pending or time.monotonic() >= until:
            return
        time.sleep(0.001)


def agree_to_start(comm: Any, refused: BaseException | None, timeout: float) -> int:
    """Collective over the caller's ``comm``, the first call of making a communicator on it:
    every rank says whether it could make its own (``refused``: the error of one that could
    not). Returns the communicator's number (:attr:`Watch.token`, rank 0's draw) where every
    rank could; raises on every rank otherwise (its own error on a rank that refused, a
    :class:`CommError` naming that rank on the others). A rank that does not come within
    ``timeout`` seconds (:data:`START` at least) makes the others raise a
    :class:`CommTimeoutError`, and the process then ends the job at exit (the exchange stays
    pending in MPI)."""
    import numpy

    timeout = max(timeout, START)

    size = int(comm.Get_size())
    if size == 1:
        if refused is not None:
            raise refused
        return 0
    mine = numpy.array([int(refused is not None), int.from_bytes(os.urandom(7), "little")])
    every = numpy.zeros(2 * size, dtype=numpy.int64)
    req = comm.Iallgather(mine.astype(numpy.int64), every)

    def expired() -> BaseException:
        error = CommTimeoutError(
            f"making a Communicator: not every rank of the {size} came within {timeout:g} s "
            f"(rank {comm.Get_rank()} waits). Every rank of the communicator passed in must make "
            "its Communicator at the same point; the deadline is CUDAMPI_TIMEOUT. The job cannot "
            "go on."
        )
        _record(error)
        return error

    spin(req.Test, timeout, expired)
    flags = every[0::2]
    if not flags.any():
        return int(every[1])
    # every rank is here: what each refused can be exchanged without a deadline
    said = comm.allgather(None if refused is None else f"{type(refused).__name__}: {refused}")
    if refused is not None:
        raise refused
    first = int(numpy.flatnonzero(flags)[0])
    more = f" (and {int(flags.sum()) - 1} more rank(s))" if flags.sum() > 1 else ""
    raise CommError(
        f"making a Communicator: rank {first}{more} refused its arguments, so no rank made one: "
        f"{said[first]}"
    )


def _ranks(ranks: list[int]) -> str:
    if not ranks:
        return "no rank"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


_LIVE: weakref.WeakSet[Watch] = weakref.WeakSet()
_LOCK = threading.Lock()
_INSTALLED: list[bool] = []
_FAILED: list[str] = []
"""Every failure of this process's communicators (closed ones included) and of their making."""


def _register(watch: Watch) -> None:
    with _LOCK:
        _LIVE.add(watch)
        _install()


def _record(error: BaseException) -> None:
    with _LOCK:
        _FAILED.append(str(error))
        _install()


def _install() -> None:
    if not _INSTALLED:
        _INSTALLED.append(True)
        atexit.register(_at_exit)


def _at_exit() -> None:
    """At interpreter exit (before mpi4py finalizes MPI): let the calls still queued on open
    communicators finish (or fail at their deadline), say goodbye on each, and abort the job
    instead of finalizing where any communicator of this process failed."""

    from mpi4py import MPI

    if not MPI.Is_initialized() or MPI.Is_finalized():
        return
    live = list(_LIVE)
    for w in live:
        if w.drain is not None and w.failed is None:
            try:
                w.drain()
            except Exception:
                pass  # its failure is recorded
    for w in live:
        w.goodbye()
    if not _FAILED:
        hear_goodbyes(live, DRAIN)
    if _FAILED:
        from cudampi.abort import abort_job

        abort_job(
            1,
            f"cudampi: a communicator failed ({_FAILED[0]}); aborting the MPI job at exit, since "
            "MPI_Finalize could wait for ever for the call left pending.\n",
        )


__all__ = ["GRACE", "Watch", "agree_to_start", "spin", "wait_request"]
