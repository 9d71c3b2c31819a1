"""c10d ``Work`` objects for the cudampi process group.

Collectives run to completion when they are called (in call order, on the calling thread), so
their Work wraps an already-completed ``torch.futures.Future``: ``wait()`` returns at once,
``get_future()`` gives DDP and comm hooks a future they can chain with ``.then``. Point-to-point
``isend``/``irecv`` are truly non-blocking: their Work holds a :class:`cudampi.comm.Handle` and
completes in ``wait()``, so exchange patterns such as ``batch_isend_irecv`` rings cannot deadlock.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any


def _devices(tensors: Any) -> list[Any]:
    """The CUDA devices among ``tensors`` (nested lists allowed): a Future must be told them."""
    found: dict[str, Any] = {}
    stack = [tensors]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        elif getattr(item, "is_cuda", False):
            found[str(item.device)] = item.device
    return list(found.values())


def _same(x: Any) -> Any:
    return x


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
    """A c10d Work that is already done, whose future holds ``result``."""
    import importlib

    c10d: Any = importlib.import_module("torch._C._distributed_c10d")
    return c10d._create_work_from_future(completed_future(result))


def handle_work(
    handle: Any, result: Any, *, source: int = -1, after: Callable[[], None] | None = None
) -> Any:
    """A c10d Work that completes when the cudampi ``handle`` does (isend/irecv).

    ``after`` runs once the handle is done (e.g. copying a received staging buffer out).
    """
    return _handle_work_class()(handle, result, source, after)


@cache
def _handle_work_class() -> type:
    import torch.distributed as dist

    work_base: Any = dist._Work

    class HandleWork(work_base):
        """Waits on a :class:`cudampi.comm.Handle`; the future is made when first asked for."""

        def __init__(
            self, handle: Any, result: Any, source: int, after: Callable[[], None] | None
        ) -> None:
            super().__init__()
            self._after = after
            self._handle = handle
            self._result = result
            self._source = source
            self._future: Any = None
            self._error: BaseException | None = None

        def _finish(self) -> None:
            if self._future is not None:
                return
            try:
                self._handle.wait()
            except BaseException as exc:
                self._error = exc
                raise
            if self._after is not None:
                self._after()
            self._future = completed_future(self._result)

        def wait(self, timeout: Any = None) -> bool:
            if self._error is not None:
                raise self._error
            self._finish()
            return True

        def is_completed(self) -> bool:
            return self._future is not None or bool(self._handle.test())

        def is_success(self) -> bool:
            return self.is_completed() and self._error is None

        def exception(self) -> Any:
            return self._error

        def source_rank(self) -> int:
            return self._source

        def _source_rank(self) -> int:
            return self._source

        def result(self) -> Any:
            self.wait()
            return self._result

        def synchronize(self) -> None:
            self.wait()

        def get_future(self) -> Any:
            self._finish()
            return self._future

    return HandleWork
