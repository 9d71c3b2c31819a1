"""Moving bytes between ranks: directly on an array's pointer, or staged through host buffers.

:class:`DirectTransport` hands MPI the array's own address (host memory, or device memory when
the stack was proven CUDA-aware). :class:`StagedTransport` never gives MPI a device pointer: it
copies device memory to pinned host buffers in chunks (device->host of chunk k+1 overlaps the MPI
transfer of chunk k; on receipt, the host->device copy of chunk k overlaps the transfer of chunk
k+1).

Framing: a direct message is one MPI message; a staged message of more than ``chunk_bytes`` is
a sequence of chunk messages of exactly ``chunk_bytes`` (the last one shorter). Every receiver
accepts both: a message of exactly ``chunk_bytes`` that is shorter than the receive buffer opens a
sequence, any other shorter message is complete as MPI would deliver it. So ranks that stage and
ranks that do not can talk to each other (all ranks must use the same ``chunk_bytes``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from cudampi.comm.arrays import ArrayOps, Stager
from cudampi.errors import CommError

COUNT_LIMIT = 2**31 - 1
"""The largest count or displacement one MPI call is given (a C int): MPI's classic calls take
no more, and the Open MPI 5.0 wheel refuses its large-count ``_c`` calls with MPI_ERR_ARG. A
message over it travels in pieces (:func:`pieces`)."""
PIECE = 1 << 30
"""Elements (bytes for a message) of one piece of a message over :data:`COUNT_LIMIT`."""

_EMPTY = bytearray(1)
_MPI: Any = None


def pieces(n: int) -> list[tuple[int, int]]:
    """``[0, n)`` in pieces MPI takes in one call: itself up to :data:`COUNT_LIMIT`, else
    :data:`PIECE` at a time (read at call time: tests stand a small limit in for 2 GiB)."""
    if n <= COUNT_LIMIT:
        return [(0, n)]
    return [(lo, min(n, lo + PIECE)) for lo in range(0, n, PIECE)]


def mpi() -> Any:
    """mpi4py's ``MPI``, imported on first use (importing it starts MPI) and kept: an import
    statement costs a third of a small message's MPI call."""
    return _MPI or _import_mpi()


def _import_mpi() -> Any:
    global _MPI
    from mpi4py import MPI

    _MPI = MPI
    return MPI


def mem(ptr: int, nbytes: int) -> Any:
    """An mpi4py buffer spec of ``nbytes`` raw bytes at address ``ptr``."""
    MPI = mpi()
    if nbytes == 0:
        return [_EMPTY, 0, MPI.BYTE]
    return [MPI.memory.fromaddress(ptr, nbytes), MPI.BYTE]


def typed_mem(ptr: int, nbytes: int, count: int, mpi_type: Any) -> Any:
    """An mpi4py buffer spec of ``count`` elements of ``mpi_type`` at ``ptr``."""
    MPI = mpi()
    if nbytes == 0:
        return [_EMPTY, 0, mpi_type]
    return [MPI.memory.fromaddress(ptr, nbytes), count, mpi_type]


def chunk_bounds(nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges of the chunks a staged message of ``nbytes`` is sent in."""
    step = max(1, chunk_bytes)
    return [(lo, min(nbytes, lo + step)) for lo in range(0, nbytes, step)]


class DirectTransport:
    """MPI point-to-point on the arrays' own memory. Zero-byte transfers are skipped (both sides
    compute the same sizes, so both skip); a transfer over :data:`COUNT_LIMIT` bytes is several
    messages in order (both sides cut it alike), whose requests travel as a list."""

    def __init__(self, comm: Any, ops: ArrayOps, tag: int = 1) -> None:
        self.comm = comm
        self.ops = ops
        self.tag = tag

    def isend(self, a: Any, dest: int) -> Any:
        return self._post(self.comm.Isend, a, dest)

    def irecv(self, a: Any, source: int) -> Any:
        return self._post(self.comm.Irecv, a, source)

    def _post(self, call: Any, a: Any, peer: int) -> Any:
        n = self.ops.nbytes(a)
        if n == 0:
            return mpi().REQUEST_NULL
        ptr = self.ops.ptr(a)
        if n <= COUNT_LIMIT:
            return call(mem(ptr, n), peer, self.tag)
        return [call(mem(ptr + lo, hi - lo), peer, self.tag) for lo, hi in pieces(n)]

    @staticmethod
    def wait(req: Any) -> None:
        if isinstance(req, list):
            mpi().Request.Waitall(req)
        else:
            req.Wait()

    @staticmethod
    def waitall(reqs: list[Any]) -> None:
        if reqs:
            flat = [q for r in reqs for q in (r if isinstance(r, list) else (r,))]
            mpi().Request.Waitall(flat)

    def sendrecv(self, send: Any, dest: int, recv: Any, source: int) -> None:
        self.waitall([self.irecv(recv, source), self.isend(send, dest)])


def opens_sequence(got: int, nbytes: int, chunk_bytes: int) -> bool:
    """Whether a first message of ``got`` bytes into a buffer of ``nbytes`` starts a chunk
    sequence (see the module doc)."""
    return got < nbytes and got == chunk_bytes


def finish_recv(
    comm: Any, status: Any, nbytes: int, tag: int, chunk_bytes: int, ptr: Callable[[], int]
) -> int:
    """After the first message of a receive of up to ``nbytes`` arrived (``status``): where it
    opened a chunk sequence (see the module doc), receive the rest from the same rank at the
    address ``ptr()`` (asked for only then). Returns the bytes received."""
    got = int(status.Get_count(mpi().BYTE))
    if not opens_sequence(got, nbytes, chunk_bytes):
        return got
    recv_rest(comm, ptr(), nbytes, got, status.Get_source(), tag)
    return nbytes


def recv_rest(comm: Any, ptr: int, nbytes: int, done: int, source: int, tag: int) -> None:
    """Receive the remaining chunks of a sequence whose first ``done`` bytes arrived."""
    from mpi4py import MPI

    status = MPI.Status()
    while done < nbytes:
        comm.Recv(mem(ptr + done, min(nbytes - done, COUNT_LIMIT)), source, tag, status)
        got = status.Get_count(MPI.BYTE)
        if got == 0:
            raise CommError(
                f"rank {source} sent an empty chunk after {done} of {nbytes} bytes; sender and "
                "receiver disagree on the message size or on chunk_bytes (CUDAMPI_CHUNK_BYTES)"
            )
        done += got


class StagedTransport:
    """Point-to-point through pinned host buffers, chunked and pipelined (see the module doc).

    ``stager`` supplies pinned host buffers and asynchronous device<->host copies for one device
    array library (:class:`~cudampi.comm.arrays.Stager`).
    """

    def __init__(
        self, comm: Any, stager: Stager, chunk_bytes: int, timeout: float | None = None
    ) -> None:
        self.comm = comm
        self.stager = stager
        self.chunk_bytes = max(1, chunk_bytes)
        self.timeout = timeout

    def _wait(self, req: Any, what: str) -> None:
        if self.timeout is None:
            req.Wait()
        else:
            from cudampi.comm.deadline import wait_request

            wait_request(req, self.timeout, what)

    def send(self, a: Any, dest: int, tag: int) -> None:
        st = self.stager
        n = st.nbytes(a)
        chunks = chunk_bounds(n, self.chunk_bytes)
        what = f"send to rank {dest} (tag {tag})"
        if len(chunks) <= 1:
            host = st.pinned(max(n, 1))
            st.wait(st.d2h(host, a, 0, n))
            self._wait(self.comm.Isend(mem(st.host_ptr(host), n), dest, tag), what)
            return
        slots = [st.pinned(self.chunk_bytes) for _ in range(2)]
        reqs: list[Any] = [None, None]
        ev = st.d2h(slots[0], a, *chunks[0])
        for k, (lo, hi) in enumerate(chunks):
            st.wait(ev)
            if k + 1 < len(chunks):
                nxt = (k + 1) % 2
                if reqs[nxt] is not None:
                    self._wait(reqs[nxt], what)
                ev = st.d2h(slots[nxt], a, *chunks[k + 1])
            reqs[k % 2] = self.comm.Isend(mem(st.host_ptr(slots[k % 2]), hi - lo), dest, tag)
        for r in reqs:
            if r is not None:
                self._wait(r, what)

    def recv(self, a: Any, source: int, tag: int) -> int:
        from mpi4py import MPI

        st = self.stager
        n = st.nbytes(a)
        status = MPI.Status()
        if self.timeout is None:
            msg = self.comm.Mprobe(source, tag, status)
        else:
            from cudampi.comm.deadline import spin
            from cudampi.errors import CommTimeoutError

            found: list[Any] = []

            def probe() -> bool:
                m = self.comm.Improbe(source, tag, status)
                if m is not None:
                    found.append(m)
                return m is not None

            limit = self.timeout
            spin(
                probe,
                limit,
                lambda: CommTimeoutError(
                    f"recv from rank {source} (tag {tag}) did not start within {limit:g} s: "
                    "the other rank did not send (CUDAMPI_TIMEOUT sets the deadline)"
                ),
            )
            msg = found[0]
        first = status.Get_count(MPI.BYTE)
        src = status.Get_source()
        if not opens_sequence(first, n, self.chunk_bytes):
            # one message: receive it whole, then copy to the device
            host = st.pinned(max(n, 1))
            msg.Recv(mem(st.host_ptr(host), min(n, COUNT_LIMIT)))
            st.wait(st.h2d(a, host, 0, min(first, n)))
            return int(src)
        # a chunk sequence: chunk k+1 arrives while chunk k is copied to the device
        slots = [st.pinned(max(first, self.chunk_bytes)) for _ in range(2)]
        evs: list[Any] = [None, None]
        done, k = 0, 0
        msg.Recv(mem(st.host_ptr(slots[0]), first))
        got = first
        while True:
            evs[k % 2] = st.h2d(a, slots[k % 2], done, done + got)
            done += got
            if done >= n:
                break
            if got == 0:
                raise CommError(
                    f"received an empty chunk from rank {src} after {done} of {n} bytes; "
                    "sender and receiver disagree on the message size"
                )
            k += 1
            if evs[k % 2] is not None:
                st.wait(evs[k % 2])
            want = min(n - done, st.host_nbytes(slots[k % 2]))
            self.comm.Recv(mem(st.host_ptr(slots[k % 2]), want), src, tag, status)
            got = status.Get_count(MPI.BYTE)
        for ev in evs:
            if ev is not None:
                st.wait(ev)
        return int(src)
