"""What the engines that move messages with MPI share, below all of them: MPI buffer specs of a
flat array, copying an input apart from an output it overlaps, handles over MPI requests, and
user point-to-point straight on the arrays' memory (:class:`DirectP2P`, the ``mpi`` and ``alg``
engines' messages; the ``staged`` engine's handles).

A message over MPI's count limit (:data:`cudampi.comm.transport.COUNT_LIMIT`, 2 GiB) is sent as
a chunk sequence, the staged engine's framing (:mod:`cudampi.comm.transport`), which every
receiver takes; a receive into a buffer over the limit posts its first receive at the limit and
takes the rest of a sequence from there."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cudampi.comm import transport
from cudampi.comm.args import truncated
from cudampi.comm.arrays import ArrayOps, Flat
from cudampi.comm.choice import Ask, DeviceSupport, PathChoice
from cudampi.comm.deadline import wait_request
from cudampi.comm.engines.base import Engine
from cudampi.comm.handle import Handle
from cudampi.comm.transport import chunk_bounds, finish_recv, mem, mpi
from cudampi.errors import DeviceError


def bytes_spec(ops: ArrayOps, a: Flat) -> Any:
    if ops.lib == "numpy":  # as in _typed (half the cost of a small message's spec by address)
        return [a, mpi().BYTE]
    return mem(ops.ptr(a), ops.nbytes(a))


def overlap(ops: ArrayOps, a: Flat, b: Any) -> bool:
    """Do the flat arrays ``a`` and ``b`` share any byte?"""
    na, nb = ops.nbytes(a), ops.nbytes(b)
    if not na or not nb:
        return False
    pa, pb = ops.ptr(a), ops.ptr(b)
    return pa < pb + nb and pb < pa + na


def apart(ops: ArrayOps, a: Flat, b: Any) -> Any:
    """``a``, or a copy of it where it overlaps ``b``: MPI forbids aliased send and receive
    buffers (MPICH checks: "Buffers must not be aliased"; FSDP2 all-gathers a shard that lives
    inside the output)."""
    if not overlap(ops, a, b):
        return a
    tmp = ops.scratch(int(a.shape[0]), a)
    ops.copy(tmp, a)
    ops.fence()
    return tmp


def request_handle(
    what: str | Callable[[], str], req: Any, keep: Any = None, timeout: float | None = None
) -> Handle:
    """A handle over one MPI request (or a list of them: a chunk sequence); ``keep`` (a staging
    buffer) lives until it completes; ``timeout``: its wait's deadline; ``what``: as
    :class:`Handle` takes it."""
    if isinstance(req, list):
        reqs = req

        def poll_all(block: bool) -> bool:
            _ = keep
            if block:
                mpi().Request.Waitall(reqs)
                return True
            return bool(mpi().Request.Testall(reqs))

        return Handle(what, poll_all, timeout)

    def poll(block: bool) -> bool:  # (one request: the common case, kept short)
        _ = keep
        if block:
            req.Wait()
            return True
        return bool(req.Test())

    return Handle(what, poll, timeout)


def irecv_handle(
    comm: Any,
    buf: Any,
    nbytes: int,
    ptr: Callable[[], int],
    source: int,
    tag: int,
    chunk_bytes: int,
    then: Callable[[int], None] | None = None,
    timeout: float | None = None,
) -> Handle:
    """A non-blocking receive into ``buf`` (an mpi4py buffer spec of up to ``nbytes`` bytes at
    the address ``ptr()``) that also accepts a staged sender's chunk sequence; ``then(got)`` runs
    once the bytes are in (the staged engine copies them to the device there)."""
    status = mpi().Status()
    req = comm.Irecv(buf, source, tag)

    def poll(block: bool) -> bool:
        try:
            if block:
                req.Wait(status)
            elif not req.Test(status):
                return False
        except mpi().Exception as exc:
            if exc.Get_error_class() == mpi().ERR_TRUNCATE:
                raise truncated("irecv", source, tag, nbytes) from exc
            raise
        got = finish_recv(comm, status, nbytes, tag, chunk_bytes, ptr)
        if then is not None:
            then(got)
        return True

    return Handle(lambda: f"irecv from rank {source} (tag {tag})", poll, timeout)


class DirectP2P(Engine):
    """User point-to-point straight on the arrays' memory (the ``mpi`` and ``alg`` engines);
    every wait has the communicator's deadline. The text that names a message (rank, tag) is
    made only when it times out: a small message's whole MPI call is about a microsecond."""

    def _ptr(self, f: Flat) -> Callable[[], int]:
        return lambda: self.ops.ptr(f)

    def _big(self, f: Flat) -> bool:
        """Is ``f`` over the count limit? (An element count far below it answers without the
        size: a small message pays one comparison.)"""
        limit = transport.COUNT_LIMIT
        return int(f.shape[0]) > limit >> 4 and self.ops.nbytes(f) > limit

    def _post_send(self, f: Flat, dest: int, tag: int) -> Any:
        """The send's request: one, or a chunk sequence's list of them (see the module doc)."""
        s = self.setting
        if not self._big(f):
            return s.p2p.Isend(bytes_spec(self.ops, f), dest, tag)
        ptr, n = self.ops.ptr(f), self.ops.nbytes(f)
        bounds = chunk_bounds(n, s.config.chunk_bytes)
        return [s.p2p.Isend(mem(ptr + lo, hi - lo), dest, tag) for lo, hi in bounds]

    def _recv_spec(self, f: Flat) -> Any:
        """The first receive's buffer: ``f``, or its first :data:`COUNT_LIMIT` bytes."""
        if not self._big(f):
            return bytes_spec(self.ops, f)
        return mem(self.ops.ptr(f), transport.COUNT_LIMIT)

    def send(self, f: Flat, dest: int, tag: int) -> None:
        req = self._post_send(f, dest, tag)
        what = lambda: f"send to rank {dest} (tag {tag})"  # noqa: E731
        for r in req if isinstance(req, list) else (req,):
            wait_request(r, self.setting.config.timeout, what)

    def recv(self, f: Flat, source: int, tag: int) -> None:
        s = self.setting
        status = mpi().Status()
        req = s.p2p.Irecv(self._recv_spec(f), source, tag)
        wait_request(req, s.config.timeout, lambda: f"recv from rank {source} (tag {tag})", status)
        finish_recv(s.p2p, status, self.ops.nbytes(f), tag, s.config.chunk_bytes, self._ptr(f))

    def isend(self, f: Flat, dest: int, tag: int) -> Handle:
        req = self._post_send(f, dest, tag)
        return request_handle(
            lambda: f"isend to rank {dest} (tag {tag})", req, timeout=self.setting.config.timeout
        )

    def irecv(self, f: Flat, source: int, tag: int) -> Handle:
        s = self.setting
        return irecv_handle(
            s.p2p,
            self._recv_spec(f),
            self.ops.nbytes(f),
            self._ptr(f),
            source,
            tag,
            s.config.chunk_bytes,
            timeout=s.config.timeout,
        )

    def sendrecv(self, xf: Flat, dest: int, of: Flat, source: int, tag: int) -> None:
        """As the base's (the receive posted first; each wait with the deadline), without the
        two handles."""
        s = self.setting
        status = mpi().Status()
        rreq = s.p2p.Irecv(self._recv_spec(of), source, tag)
        sreq = self._post_send(xf, dest, tag)
        timeout = s.config.timeout
        for r in sreq if isinstance(sreq, list) else (sreq,):
            wait_request(r, timeout, lambda: f"isend to rank {dest} (tag {tag})")
        wait_request(rreq, timeout, lambda: f"irecv from rank {source} (tag {tag})", status)
        finish_recv(s.p2p, status, self.ops.nbytes(of), tag, s.config.chunk_bytes, self._ptr(of))


def message_route(ask: Ask, support: DeviceSupport) -> PathChoice | None:
    """A message that MPI moves on the array itself (the ``mpi`` engine): host memory, or device
    memory where device point-to-point is proven; None where auto should stage it instead. A
    path asked for by name that cannot run raises a :class:`DeviceError` that says why."""
    if not ask.on_device:
        return PathChoice("host", "host memory: MPI point-to-point on the array", "mpi")
    if ask.requested == "host":
        raise DeviceError(
            "path='host' takes host arrays, got a device array. Use path='staged' or auto."
        )
    if support.p2p:
        return PathChoice("gpu-ring", f"device memory, {support.p2p_why}: direct device p2p", "mpi")
    if ask.requested != "auto":
        raise DeviceError(
            f"path={ask.requested!r} needs CUDA-aware MPI point-to-point, which is not proven "
            f"here ({support.p2p_why}). Run `cudampi doctor` or use path='staged'."
        )
    return None
