"""Handles for non-blocking calls, and the FIFO worker that runs a communicator's collectives.

Every collective of a communicator runs on one worker thread in submission order, so all ranks
execute collectives in the same order even when the caller mixes blocking and non-blocking calls
(a blocking call runs inline only when nothing is queued before it).
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

from cudampi.errors import CommTimeoutError


class Handle:
    """The pending result of a non-blocking call.

    ``wait()`` blocks until the call has finished and returns its result (re-raising its error on
    this rank); ``test()`` says whether it has finished without blocking. ``timeout`` is the
    default deadline of ``wait()`` (the communicator's; None: none). ``what`` names the call in
    errors: its text, or a function that makes it when asked (a message's handle is made per
    message; its text is needed only for an error). A handle with ``poll`` completes by polling
    in the thread that waits; one without is finished by another thread (the worker).

    A collective's ``wait`` that gives up (its deadline, or ``timeout=``) leaves the call pending
    in MPI: its communicator (``watch``, its :class:`~cudampi.comm.deadline.Watch`) is failed
    then, as a call past its deadline fails it, and the process ends the job at exit instead of
    waiting for the call in MPI_Finalize. To ask without giving up, use ``test()``.
    """

    watch: Any = None
    """A collective's communicator's :class:`~cudampi.comm.deadline.Watch` (None: a message's
    handle, whose timeout leaves the communicator usable)."""

    def __init__(
        self,
        what: str | Callable[[], str] = "call",
        poll: Callable[[bool], bool] | None = None,
        timeout: float | None = None,
    ) -> None:
        self._what = what
        self._done = False
        # only a handle another thread finishes needs an event to block on (and it costs more
        # than the rest of a message's handle)
        self._event = threading.Event() if poll is None else None
        self._result: Any = None
        self._error: BaseException | None = None
        self._poll = poll
        self._timeout = timeout

    @property
    def what(self) -> str:
        """The call this handle is for (as errors name it)."""
        return self._what if isinstance(self._what, str) else self._what()

    def _finish(self, result: Any = None, error: BaseException | None = None) -> None:
        self._result, self._error = result, error
        self._done = True
        if self._event is not None:
            self._event.set()

    def _progress(self, block: bool) -> None:
        if self._poll is None or self._done:
            return
        try:
            done = self._poll(block)
        except BaseException as exc:
            self._finish(error=exc)
            return
        if done and not self._done:
            self._finish(self._result)

    @property
    def done(self) -> bool:
        """True once the call has finished (successfully or not)."""
        self._progress(False)
        return self._done

    def test(self) -> bool:
        """Non-blocking: True once the call has finished."""
        return self.done

    def wait(self, timeout: float | None = None) -> Any:
        """Block until finished (at most ``timeout`` seconds, default the handle's deadline) and
        return the result; :class:`~cudampi.errors.CommTimeoutError` past the deadline."""
        if not self._done:
            limit = self._timeout if timeout is None else timeout
            if self._event is not None:
                if not self._event.wait(limit):
                    raise self._late(limit)()
            elif limit is None:
                self._progress(True)
            elif not self.done:  # not at once: poll until the deadline
                from cudampi.comm.deadline import spin

                spin(lambda: self.done, limit, self._late(limit))
        if self._error is not None:
            raise self._error
        return self._result

    def _late(self, limit: float | None) -> Callable[[], BaseException]:
        def error() -> BaseException:
            late = CommTimeoutError(
                f"{self.what} did not complete within {limit:g} s: another rank may not have "
                "made the matching call. Check that every rank makes the same calls in the same "
                "order (CUDAMPI_TIMEOUT sets the deadline)."
            )
            if self.watch is None:
                return late
            return self.watch.give_up(
                CommTimeoutError(
                    f"{late} The call stays pending, so this communicator cannot be used again "
                    "and the MPI job ends when this process exits."
                )
            )

        return error

    def __repr__(self) -> str:
        state = "done" if self._done else "pending"
        return f"<cudampi Handle {self.what} {state}>"


def completed(what: str, result: Any = None, error: BaseException | None = None) -> Handle:
    h = Handle(what)
    h._finish(result, error)
    return h


class Worker:
    """One daemon thread running submitted calls first-in first-out. ``watch``: the
    communicator's :class:`~cudampi.comm.deadline.Watch`; its handles fail it where a wait
    gives up, and at exit it waits for the calls still queued here (each is under its
    deadline) before the process says goodbye."""

    def __init__(self, name: str, watch: Any = None) -> None:
        self._queue: queue.Queue[tuple[Callable[[], Any], Handle] | None] = queue.Queue()
        self._pending = 0
        self._watch = watch
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()
        if watch is not None:
            me = weakref.ref(self)  # (a worker nobody holds is still collected)

            def drain() -> None:
                worker = me()
                if worker is not None:
                    worker.drain(watch.timeout * 2 + 10)

            watch.drain = drain

    @property
    def idle(self) -> bool:
        with self._lock:
            return self._pending == 0

    def submit(self, fn: Callable[[], Any], what: str) -> Handle:
        h = Handle(what)
        h.watch = self._watch
        with self._lock:
            self._pending += 1
        self._queue.put((fn, h))
        return h

    def drain(self, timeout: float | None = None) -> None:
        """Return once every call submitted so far has run (a CommTimeoutError after
        ``timeout`` seconds, which fails the communicator)."""
        if not self.idle:
            self.submit(lambda: None, "the calls queued before this one").wait(timeout)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, h = item
            result: Any = None
            error: BaseException | None = None
            try:
                result = fn()
            except BaseException as exc:
                error = exc
            with self._lock:
                self._pending -= 1
            h._finish(result, error)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.drain = None
        self._queue.put(None)
        self._thread.join(timeout=60)
