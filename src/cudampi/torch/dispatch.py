"""Where a process group's collective runs: now, in the caller's thread (a finished Work), or
on the group's thread (:class:`~cudampi.torch.work.AsyncRunner`), with its c10d options decoded
once; and, inside CUDA graph capture, only on a stream-ordered path."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch

from cudampi.errors import CommError, CommTimeoutError
from cudampi.torch.methods import METHODS, decode
from cudampi.torch.tensors import first_cuda
from cudampi.torch.work import as_dist_error, finished_work
from cudampi.torch.world import where


def collective(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a collective body now (a finished Work: stream-ordered for CUDA tensors, see
    :func:`~cudampi.torch.work.finished_work`) or on the group's AsyncRunner, with its c10d
    options decoded (:func:`cudampi.torch.methods.decode`) in place of the raw object."""
    name = method.__name__
    at = METHODS[name].opts_at

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if self._closed:
            self._check_open()
        if self._detail is not None:
            self._detail.check(name, args, kwargs)
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            check_capturable(self, name, args)
        if at >= 0:
            raw = kwargs.pop("opts", args[at] if at < len(args) else None)
            args = (*args[:at], decode(raw))
        if self._runner is None or not threaded(self, name, args, at):
            try:
                return finished_work(method(self, *args, **kwargs))
            except CommTimeoutError as exc:
                raise as_dist_error(exc) from exc  # what torch's own backends raise
        return self._runner.submit(lambda: method(self, *args, **kwargs), args)

    return run


def threaded(pg: Any, name: str, args: Sequence[Any], at: int | None = None) -> bool:
    """Whether this call runs on the group's thread: every call with ``async_ops=True``;
    under auto, a call behind one still on the thread (call order), or one of CUDA
    tensors whose path synchronizes the host (the Communicator's choice, which it keeps
    per call, dtype, size and device) unless its caller waits for it at once
    (:attr:`~cudampi.torch.methods.Opts.waited`: ``dist.all_reduce(t)`` without ``async_op``,
    where the thread would only add its hand-over to the call). ``at``: where the method's
    options are in ``args`` (:attr:`~cudampi.torch.methods.Method.opts_at`; looked up when not
    given)."""
    assert pg._runner is not None
    if not pg._auto or pg._runner.busy():
        return True
    if at is None:
        at = METHODS[name].opts_at
    if 0 <= at < len(args) and args[at].waited:
        return False
    tensor = first_cuda(args)
    if tensor is None:
        return False
    try:
        return not pg._comm.path_for(METHODS[name].call, tensor).stream_ordered
    except Exception:  # the call itself says what is wrong, in the caller's thread
        return False


def check_capturable(pg: Any, name: str, args: Sequence[Any]) -> None:
    """Inside CUDA graph capture only a stream-ordered engine (ipc, nccl) can run a call:
    the others block the host on the caller's stream, which capture forbids (and which
    would invalidate the graph with an obscure CUDA error). Say so before running."""
    tensor = first_cuda(args)
    if pg._runner is not None and not pg._auto:
        why = "Options(async_ops=True) runs it on a thread and a side stream of its own"
    elif pg._runner is not None and pg._runner.busy():
        why = (
            "earlier collectives of this group still run on its thread (the path of their "
            "tensors synchronizes the host); wait for them (torch.cuda.synchronize and "
            "their Work.wait()) before capturing"
        )
    elif tensor is None:
        why = "it moves no CUDA tensor (a host-side call runs once, at capture, never at replay)"
    else:
        choice = pg._comm.path_for(METHODS[name].call, tensor)
        if choice.stream_ordered:
            return
        why = f"its path here is {str(choice)!r}, which synchronizes the host ({choice.reason})"
    raise CommError(
        f"cudampi: {name} inside CUDA graph capture on {where(pg._rank, pg._size)}: "
        f"{why}. Fix: capture with the default Options and path 'ipc' (CUDAMPI_PATH=ipc, "
        "ranks of one node) so collectives are kernel launches on the capturing stream, and "
        "run host-side calls before the capture."
    )
