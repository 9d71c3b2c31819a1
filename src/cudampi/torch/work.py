"""c10d ``Work`` objects for the cudampi process group.

A collective run in the calling thread (host tensors, a stream-ordered path; every call with
``Options(async_ops=False)``) has a Work that is finished when the call returns. On the host
that is the whole story: the Work wraps an already-completed ``torch.futures.Future``. For CUDA
tensors it is NCCL's: what the call enqueued (a stream-ordered engine such as ``ipc`` only
*enqueues* its kernels on the caller's stream) is marked on that stream, ``wait()`` makes the
caller's current stream wait for it (nothing when that is the same stream) and never blocks
the host, ``is_completed()`` queries it. A collective run on the group's thread
(:class:`AsyncRunner`) has a Work that completes when the thread has run it. ``get_future()``
gives DDP and comm hooks a future they can chain with ``.then``. Point-to-point ``isend``/``irecv`` are truly non-blocking: their Work holds a
:class:`cudampi.comm.Handle` and completes in ``wait()``, so exchange patterns such as
``batch_isend_irecv`` rings cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any


def _devices(tensors: Any) -> list[Any]:
    """The CUDA devices among ``tensors`` (nested lists allowed): a Future must be told them."""
    if not _cuda_started():  # no CUDA tensor can exist: nothing to walk (host calls)
        return []
    found: dict[Any, None] = {}  # (a torch.device hashes as its type and index)
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif getattr(item, "is_cuda", False):
            found[item.device] = None
    return list(found)


def _cuda_started() -> bool:
    import torch

    return bool(torch.cuda.is_initialized())


def _same(x: Any) -> Any:
    return x


@cache
def _dist_timeout_class() -> type:
    import torch.distributed as dist

    from cudampi.errors import CommTimeoutError

    base: Any = getattr(dist, "DistBackendError", RuntimeError)

    class DistTimeoutError(base, CommTimeoutError):
        """A cudampi deadline error as torch's backends raise them (``DistBackendError``, what
        NCCL raises on its timeout), still a :class:`cudampi.errors.CommTimeoutError`."""

    return DistTimeoutError


def as_dist_error(exc: BaseException) -> BaseException:
    """``exc`` (a CommTimeoutError) as a ``torch.distributed.DistBackendError``."""
    return _dist_timeout_class()(str(exc))


def _seconds(timeout: Any) -> float | None:
    """torch's ``Work.wait(timeout)`` (a timedelta; zero or None: no limit given) in seconds."""
    if timeout is None:
        return None
    seconds = (
        float(timeout.total_seconds()) if hasattr(timeout, "total_seconds") else float(timeout)
    )
    return seconds if seconds > 0 else None


def _is_tensor_list(value: Any) -> bool:
    import torch

    if not isinstance(value, list) or not value:
        return False
    if all(isinstance(v, torch.Tensor) for v in value):
        return True
    return all(_is_tensor_list(v) for v in value)


def completed_future(result: Any) -> Any:
    """A completed ``torch.futures.Future`` holding ``result``.

    A tensor list is stored *typed* (an IValue ``List[Tensor]``, as C++ process groups return
    it): DDP's built-in C++ comm hooks (``_register_builtin_comm_hook``) insist on that, and a
    future made in Python holds an opaque Python object. ``torch._C.fork`` of an identity
    function runs it at once and returns such a typed, completed future.
    """
    import torch

    fork = getattr(torch._C, "fork", None)
    if fork is not None and _is_tensor_list(result):
        try:
            return fork(_same, result)
        except (RuntimeError, TypeError, ValueError):
            pass  # fall back to a Python-object future below
    devices = _devices(result)
    fut: Any = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    fut.set_result(result)
    return fut


def completed_work(result: Any) -> Any:
    """A c10d Work that is already done, whose future holds ``result`` (made when first asked
    for: a typed future costs most of a small host collective, and a plain
    ``dist.all_reduce`` never asks)."""
    return _done_work_class()(result)


@cache
def _done_work_class() -> type:
    work_base: Any = _work_base()

    class DoneWork(work_base):
        """A collective that ran to the end in the caller's thread."""

        def __init__(self, result: Any) -> None:
            super().__init__()
            self._result = result
            self._future: Any = None

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def get_future(self) -> Any:
            if self._future is None:
                self._future = completed_future(self._result)
            return self._future

    return DoneWork


def finished_work(result: Any) -> Any:
    """The Work of a collective that ran in the caller's thread.

    Host tensors: :func:`completed_work`. CUDA tensors: a stream-ordered Work (see the module
    doc) over the caller's current stream, after everything the call enqueued; its future is
    :func:`completed_future`'s, typed as DDP's built-in hooks need. No host synchronisation,
    no allocation: this runs inside CUDA graph capture too. The event that marks the call is
    recorded only when asked for (``wait()`` from another stream, ``is_completed()``): DDP and
    ``dist.all_reduce`` wait on the very stream, where nothing is to be done, and an event costs
    a large part of a call that queues one kernel.
    """
    devices = _devices(result)
    if not devices:
        return completed_work(result)
    return _stream_work_class()(devices, None, result, None, _stream_key()(devices[0].index))


@cache
def _stream_key() -> Callable[[int], tuple[int, int, int]]:
    """torch's current stream of a device as its key (stream id, device index, device type),
    read without making a Stream object (what ``torch.cuda.current_stream`` unpacks). Not the
    raw pointer: the legacy default stream's is 0, which names no stream to record on later."""
    import torch

    read = getattr(torch._C, "_cuda_getCurrentStream", None)
    if read is None:

        def read(index: int) -> tuple[int, int, int]:
            s = torch.cuda.current_stream(index)
            return (s.stream_id, s.device_index, s.device_type)

    return read


def record_done(device: Any, stream: Any = None) -> tuple[Any, Any]:
    """(event, stream): an event recorded on ``stream`` (default: the current stream of
    ``device``), marking everything enqueued on it so far."""
    import torch

    if stream is None:
        stream = torch.cuda.current_stream(device)
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev, stream


def order_after(device: Any, done: tuple[Any, Any]) -> None:
    """Make the current stream of ``device`` wait for ``done`` (:func:`record_done`); nothing
    to do when the event is on that very stream (the stream already runs in order)."""
    import torch

    ev, stream = done
    current = torch.cuda.current_stream(device)
    if current != stream:
        current.wait_event(ev)


def done_query(done: tuple[Any, Any]) -> bool:
    """Whether the work marked by ``done`` has completed (False while a CUDA graph is being
    captured: the event belongs to a graph that has not run, and querying it is illegal)."""
    import torch

    if torch.cuda.is_current_stream_capturing():
        return False
    return bool(done[0].query())


def handle_work(
    handle: Any, result: Any, *, source: int = -1, after: Callable[[], None] | None = None
) -> Any:
    """A c10d Work that completes when the cudampi ``handle`` does (isend/irecv).

    ``after`` runs once the handle is done (e.g. copying a received staging buffer out).
    """
    return _handle_work_class()(handle, result, source, after)


@cache
def _work_base() -> type:
    import torch.distributed as dist

    work_base: Any = dist._Work

    class PyWork(work_base):
        """What HandleWork and AsyncWork share: subclasses set ``_error`` and ``_result`` and
        define ``wait``, ``is_completed`` and ``get_future``."""

        _error: BaseException | None = None
        _result: Any = None

        def is_success(self) -> bool:
            return bool(self.is_completed()) and self._error is None

        def exception(self) -> Any:
            return self._error

        def result(self) -> Any:
            self.wait()
            return self._result

        def synchronize(self) -> None:
            self.wait()

    return PyWork


@cache
def _handle_work_class() -> type:
    work_base: Any = _work_base()

    class HandleWork(work_base):
        """Waits on a :class:`cudampi.comm.Handle`; the future is made when first asked for
        (a typed future costs more than a small message: ``dist.send``/``recv`` never ask)."""

        def __init__(
            self, handle: Any, result: Any, source: int, after: Callable[[], None] | None
        ) -> None:
            super().__init__()
            self._after = after
            self._handle = handle
            self._result = result
            self._source = source
            self._done = False
            self._future: Any = None
            self._error: BaseException | None = None

        def _finish(self, timeout: float | None = None) -> None:
            from cudampi.errors import CommTimeoutError

            if self._done:
                return
            try:
                self._handle.wait(timeout)
            except CommTimeoutError as exc:
                self._error = as_dist_error(exc)
                raise self._error from exc
            except BaseException as exc:
                self._error = exc
                raise
            if self._after is not None:
                self._after()
            self._done = True

        def wait(self, timeout: Any = None) -> bool:
            """Complete the transfer; ``timeout`` (a timedelta) caps the wait, else the group's
            deadline does."""
            if self._error is not None:
                raise self._error
            self._finish(_seconds(timeout))
            return True

        def is_completed(self) -> bool:
            """Done, the received bytes where the caller reads them (``after`` ran): a caller
            that polls this and never waits reads a complete result, as with gloo."""
            if not self._done and self._error is None and self._handle.test():
                try:
                    self._finish()
                except BaseException:
                    pass  # kept: wait() raises it, exception() returns it
            return self._done or self._error is not None

        def source_rank(self) -> int:
            return self._source

        def _source_rank(self) -> int:
            return self._source

        def get_future(self) -> Any:
            self._finish()
            if self._future is None:
                self._future = completed_future(self._result)
            return self._future

    return HandleWork


class AsyncRunner:
    """One thread that runs a group's collectives in call order (all of them with
    ``Options(async_ops=True)``; by default those whose path synchronizes the host).

    ``submit`` returns at once with a Work; the collective runs on this thread while the caller
    goes on (DDP computes the next gradient buckets meanwhile). CUDA work runs on a side stream
    that first waits for an event recorded on the caller's stream at submit time, so the
    Communicator waits for exactly what the caller had queued, not for later kernels.
    Requires MPI_THREAD_MULTIPLE: point-to-point calls stay on the caller's thread.

    ``give_up`` (the group's ``Communicator.give_up``) fails the group where a ``Work.wait
    (timeout=)`` gives up: the op is still pending in MPI, and the process must end the job at
    exit instead of waiting for it in MPI_Finalize.
    """

    give_up: Callable[[str], BaseException] | None = None

    def __init__(self, name: str) -> None:
        import queue
        import threading

        self._queue: queue.Queue[tuple[Callable[[], Any], Any, Any] | None] = queue.Queue()
        self._streams: dict[str, Any] = {}
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def busy(self) -> bool:
        """Whether a submitted op has not finished yet (what runs in the caller's thread must
        wait its turn behind it: ``Options(async_ops=None)``)."""
        return self._queue.unfinished_tasks > 0

    def submit(self, fn: Callable[[], Any], tensors: Any) -> Any:
        """Queue ``fn`` (returns the Work's result); the Work completes when it has run."""
        import torch

        devices = _devices(tensors)
        ready = None
        if devices:
            # What the caller queued so far is what this op reads: an event now, not the
            # caller's stream later (by then backward has queued the next buckets' kernels).
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(devices[0]))
        work = _async_work_class()(devices)
        work._give_up = self.give_up
        self._queue.put((fn, (devices[0], ready) if devices else None, work))
        return work

    def _side_stream(self, device: Any) -> Any:
        import torch

        key = str(device)
        if key not in self._streams:
            self._streams[key] = torch.cuda.Stream(device)
        return self._streams[key]

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, cuda, work = item
            try:
                self._run(fn, cuda, work)
            finally:
                self._queue.task_done()  # after the Work completed: busy() is False only then

    def _run(self, fn: Callable[[], Any], cuda: Any, work: Any) -> None:
        import torch

        try:
            if cuda is None:
                work._complete(fn())
            else:
                device, ready = cuda
                side = self._side_stream(device)
                side.wait_event(ready)
                with torch.cuda.device(device), torch.cuda.stream(side):
                    result = fn()
                    work._complete(result, record_done(device, side))
        except BaseException as exc:
            from cudampi.errors import CommTimeoutError

            work._fail(as_dist_error(exc) if isinstance(exc, CommTimeoutError) else exc)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join(timeout=600)


@cache
def _stream_work_class() -> type:
    work_base: Any = _work_base()

    class StreamWork(work_base):
        """A collective whose host part has run; its CUDA part is marked by ``done`` (an event
        and the stream it was recorded on) or, for a call that ran in the caller's thread, by
        ``at`` (its stream's key, :func:`_stream_key`): the event is then recorded when first
        needed, on that stream, and marks the call and whatever was queued there after it
        (waiting for more is never wrong; a wait from the same stream needs no event at all).
        As NCCL's Work: ``wait()`` orders the caller's current stream after the call without
        blocking the host, ``is_completed()`` queries the event. :class:`AsyncRunner`'s Work
        is the same, with a host part that finishes later (``_host_wait``)."""

        def __init__(
            self,
            devices: list[Any],
            fut: Any = None,
            result: Any = None,
            done: Any = None,
            at: tuple[int, int, int] | None = None,
        ):
            super().__init__()
            self._device = devices[0] if devices else None
            self._fut = fut
            self._result = result
            self._error: BaseException | None = None
            self._done: tuple[Any, Any] | None = done
            self._at = at

        def _host_wait(self, limit: float | None = None) -> None:
            """Block until the host part has run (here it has)."""

        def _host_done(self) -> bool:
            return True

        def _marked(self) -> tuple[Any, Any] | None:
            """``done``, recorded now on the call's stream if it was not yet."""
            if self._done is None and self._at is not None:
                import torch

                sid, index, kind = self._at
                stream = torch.cuda.Stream(stream_id=sid, device_index=index, device_type=kind)
                self._done = record_done(self._device, stream)
            return self._done

        def wait(self, timeout: Any = None) -> bool:
            self._host_wait(_seconds(timeout))
            if self._error is not None:
                raise self._error
            at = self._at
            if self._done is None and at is not None and _stream_key()(at[1]) == at:
                return True  # the call's own stream runs in order
            done = self._marked()
            if done is not None:
                order_after(self._device, done)
            return True

        def is_completed(self) -> bool:
            if not self._host_done():
                return False
            if self._error is not None:
                return True
            done = self._marked()
            return done is None or done_query(done)

        def get_future(self) -> Any:
            if self._fut is None:  # a finished call's future, made on first use
                self._fut = completed_future(self._result)
            return self._fut

    return StreamWork


@cache
def _async_work_class() -> type:
    import threading

    import torch

    stream_work: Any = _stream_work_class()

    class AsyncWork(stream_work):
        """Completed by :class:`AsyncRunner`; ``wait()`` re-raises the op's own exception type.

        As for NCCL's Work, ``wait()`` on CUDA tensors also makes the caller's current stream
        wait for the kernels the op queued on the runner's side stream, so what the caller then
        queues (DDP's C++ reading ``.item()`` of an allgathered size) sees the op's results.
        """

        def __init__(self, devices: list[Any]) -> None:
            fut: Any = torch.futures.Future(devices=devices) if devices else torch.futures.Future()
            super().__init__(devices, fut)
            self._event = threading.Event()
            self._give_up: Callable[[str], BaseException] | None = None

        def _complete(self, result: Any, done: Any = None) -> None:
            self._result = result
            self._done = done
            self._fut.set_result(result)
            self._event.set()

        def _fail(self, exc: BaseException) -> None:
            self._error = exc
            self._fut.set_exception(exc)
            self._event.set()

        def _host_wait(self, limit: float | None = None) -> None:
            """Wait for the runner to have run the op; at most ``limit`` seconds
            (``Work.wait(timeout=)``), past which the group fails (``AsyncRunner.give_up``):
            the op is still pending."""
            if not self._event.wait(limit):
                from cudampi.errors import CommTimeoutError

                why = (
                    f"the collective did not complete within Work.wait(timeout={limit:g} s); it "
                    "stays pending, so this process group cannot be used again and the job ends "
                    "when this process exits"
                )
                error = CommTimeoutError(why) if self._give_up is None else self._give_up(why)
                raise as_dist_error(error)

        def _host_done(self) -> bool:
            return self._event.is_set()

    return AsyncWork
