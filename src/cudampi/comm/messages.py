"""The Communicator's point-to-point methods: send, recv, their non-blocking forms, sendrecv,
probe_any and flush, each a short forwarder to the engine the message's array chooses.

User messages travel on the communicator's point-to-point duplicate, apart from the collectives'
traffic, and are not serialised with the collectives (a receive in one thread never holds up a
collective in another, as torch's process groups run them). An invalid rank or tag, a closed
communicator, a receive smaller than its message: MPI reports them as bare error classes
(MPI_ERR_RANK, MPI_ERR_TAG, MPI_ERR_TRUNCATE, MPI_ERR_COMM); the call then raises a
:class:`~cudampi.errors.CommError` that names it and the value (:func:`cudampi.comm.args.
message_error`), at no cost to a message that succeeds. A message that gives up at its deadline
raises a :class:`~cudampi.errors.CommTimeoutError` and leaves the communicator usable (unlike a
collective's: MPI matches later messages by rank and tag, and MPI_Finalize does not wait for a
receive nobody matched).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cudampi.comm import args
from cudampi.comm.arrays import flat
from cudampi.comm.deadline import spin
from cudampi.comm.engines import Engine
from cudampi.comm.handle import Handle
from cudampi.comm.paths import PathChoice, kinds
from cudampi.errors import CommError, CommTimeoutError, CudampiError

if TYPE_CHECKING:
    from cudampi.comm.arrays import Buf
    from cudampi.comm.deadline import Watch
    from cudampi.comm.engines.base import Engines
    from cudampi.comm.repeat import Repeats
    from cudampi.config import Config


class Messages:
    """Point-to-point on a :class:`~cudampi.comm.communicator.Communicator` (its base class)."""

    if TYPE_CHECKING:  # what the Communicator gives these methods
        config: Config
        mpi_comm: Any
        size: int
        _closed: bool
        _watch: Watch
        _messages: Repeats
        _engines: Engines

        def _buf(self, x: Any, what: str) -> Buf: ...

        def _choose(self, call: str, b: Buf, path: str | None) -> PathChoice: ...

        def _engine(self, choice: PathChoice, b: Buf) -> Engine: ...

        def path_for(
            self, op: str, x: Any, nbytes: int | None = None, *, path: str | None = None
        ) -> PathChoice: ...

    def _p2p_prepare(
        self, x: Any, what: str, path: str | None, *, writes: bool = False
    ) -> tuple[Any, Engine]:
        """The flat view of message buffer ``x`` and the engine that moves it. A message on an
        array the full path checked before, unchanged since, reuses what it decided
        (cudampi.comm.repeat); its errors are the full path's, as nothing was remembered."""
        op = "recv" if writes else "send"
        e = self._messages.lookup(x, x, op, path)
        if e is not None:
            engine, f = e.engine, e.kind.flat(x)
        else:
            if self._closed:  # (closing forgets every entry: a closed one never gets here)
                raise CommError(f"{op}: this Communicator was closed")
            b = self._buf(x, what)
            if writes:
                args.check_writable(b, what)
            engine = self._engine(self._choose("send", b, path), b)
            self._messages.remember(x, x, op, path, engine, b.dtype)
            f = flat(b)
        if not engine.stream_ordered and engine.ops.device is not None:
            with engine.ops.device_ctx():
                engine.ops.begin(engine.ops.capture())  # the caller's stream is done with x
        return f, engine

    def _p2p_error(
        self, exc: BaseException, call: str, peer: Any, tag: Any, nbytes: int = -1
    ) -> BaseException:
        """What a message call that failed with ``exc`` raises (see the module doc); ``nbytes``:
        a receive's buffer size."""
        if isinstance(exc, CommTimeoutError):
            return exc
        return args.message_error(exc, call, peer, tag, self.mpi_comm, self._closed, nbytes)

    def send(self, x: Any, dest: int, tag: int = 0, *, path: str | None = None) -> None:
        """Blocking send of ``x`` to rank ``dest``."""
        f, engine = self._p2p_prepare(x, "x", path)
        try:
            engine.send(f, dest, tag)
        except Exception as exc:
            raise self._p2p_error(exc, "send", dest, tag) from exc

    def recv(self, x: Any, source: int, tag: int = 0, *, path: str | None = None) -> Any:
        """Blocking receive into ``x`` from rank ``source`` (MPI.ANY_SOURCE allowed); returns x."""
        f, engine = self._p2p_prepare(x, "x", path, writes=True)
        try:
            engine.recv(f, source, tag)
        except Exception as exc:
            raise self._p2p_error(exc, "recv", source, tag, engine.ops.nbytes(f)) from exc
        return x

    def isend(self, x: Any, dest: int, tag: int = 0, *, path: str | None = None) -> Handle:
        """Non-blocking send; ``x`` must stay untouched until the handle's ``wait()``."""
        f, engine = self._p2p_prepare(x, "x", path)
        try:
            h = engine.isend(f, dest, tag)
        except Exception as exc:
            raise self._p2p_error(exc, "isend", dest, tag) from exc
        return h

    def irecv(self, x: Any, source: int, tag: int = 0, *, path: str | None = None) -> Handle:
        """Non-blocking receive into ``x``; ``wait()`` returns ``x``."""
        f, engine = self._p2p_prepare(x, "x", path, writes=True)
        try:
            h = engine.irecv(f, source, tag)
        except Exception as exc:
            raise self._p2p_error(exc, "irecv", source, tag) from exc
        h._result = x
        return h

    def probe_any(self, x: Any, tag: int = 0, *, path: str | None = None) -> int:
        """The rank whose message with ``tag`` (for a receive into ``x``) is first to arrive
        from any rank, waiting up to the deadline; a receive from that rank then takes exactly
        its message. Raises a :class:`CommError` where ``x``'s path matches messages per pair of
        ranks (ipc: name the source), a :class:`CommTimeoutError` where no rank sent in time."""
        from mpi4py import MPI

        try:
            choice: PathChoice | None = self.path_for("recv", x, path=path)
        except CudampiError:
            choice = None  # the receive itself says why
        refused = kinds()[choice.engine].any_source if choice is not None else ""
        if refused:
            raise CommError(f"recv (tag {tag}, path {str(choice)!r}): {refused} (src=)")
        status, limit = MPI.Status(), self.config.timeout
        try:
            spin(
                lambda: bool(self.mpi_comm.Iprobe(MPI.ANY_SOURCE, int(tag), status)),
                limit,
                lambda: CommTimeoutError(
                    f"recv from any rank (tag {tag}) did not start within {limit:g} s: no rank sent"
                ),
            )
        except CommTimeoutError:
            raise
        except Exception as exc:
            raise self._p2p_error(exc, "recv", MPI.ANY_SOURCE, tag) from exc
        return int(status.Get_source())

    def flush(self) -> None:
        """Launch the sends and receives the ipc path holds back to run as one group (a blocking
        call, a handle's wait, a collective or :meth:`synchronize` launches them too); for
        callers that post isend/irecv and wait elsewhere, as torch's batch_isend_irecv does."""
        self._engines.flush()

    def sendrecv(
        self,
        x: Any,
        dest: int,
        out: Any,
        source: int,
        tag: int = 0,
        *,
        path: str | None = None,
    ) -> Any:
        """Send ``x`` to ``dest`` while receiving ``out`` from ``source``; returns ``out``."""
        of, receiver = self._p2p_prepare(out, "out", path, writes=True)
        xf, sender = self._p2p_prepare(x, "x", path)
        try:
            if receiver is sender:
                sender.sendrecv(xf, dest, of, source, tag)
                return out
            r = receiver.irecv(of, source, tag)
            sender.isend(xf, dest, tag).wait()
            r.wait()
        except Exception as exc:
            bad = args.peer_error("sendrecv", dest, self.size, receives=False)
            nbytes = receiver.ops.nbytes(of)
            raise bad or self._p2p_error(exc, "sendrecv", source, tag, nbytes) from exc
        return out


__all__ = ["Messages"]
