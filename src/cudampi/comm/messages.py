"""User point-to-point on a Communicator: send, recv, their non-blocking forms, sendrecv, a
receive from any rank. Messages travel on the communicator's point-to-point duplicate, so they
never match a collective's internal messages; a message on an array the full path checked before,
unchanged since, reuses what it decided (:mod:`cudampi.comm.repeat`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cudampi.comm.args import check_writable
from cudampi.comm.arrays import Buf, flat
from cudampi.comm.choice import PathChoice
from cudampi.comm.deadline import spin
from cudampi.comm.handle import Handle
from cudampi.comm.paths import kinds
from cudampi.comm.repeat import Repeats
from cudampi.config import Config
from cudampi.errors import CommError, CommTimeoutError, CudampiError

if TYPE_CHECKING:
    from cudampi.comm.engines import Engine, Engines


class Messages:
    """The point-to-point half of :class:`~cudampi.comm.communicator.Communicator`."""

    config: Config
    mpi_comm: Any
    _messages: Repeats
    _engines: Engines

    def _buf(self, x: Any, what: str) -> Buf:
        raise NotImplementedError

    def _choose(self, call: str, b: Buf, path: str | None, nbytes: int | None = None) -> PathChoice:
        raise NotImplementedError

    def _engine(self, choice: PathChoice, b: Buf) -> Engine:
        raise NotImplementedError

    def path_for(
        self, op: str, x: Any, nbytes: int | None = None, *, path: str | None = None
    ) -> PathChoice:
        raise NotImplementedError

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
            b = self._buf(x, what)
            if writes:
                check_writable(b, what)
            engine = self._engine(self._choose("send", b, path), b)
            self._messages.remember(x, x, op, path, engine, b.dtype)
            f = flat(b)
        if not engine.stream_ordered and engine.ops.device is not None:
            with engine.ops.device_ctx():
                engine.ops.begin(engine.ops.capture())  # the caller's stream is done with x
        return f, engine

    def send(self, x: Any, dest: int, tag: int = 0, *, path: str | None = None) -> None:
        """Blocking send of ``x`` to rank ``dest``."""
        f, engine = self._p2p_prepare(x, "x", path)
        engine.send(f, dest, tag)

    def recv(self, x: Any, source: int, tag: int = 0, *, path: str | None = None) -> Any:
        """Blocking receive into ``x`` from rank ``source`` (MPI.ANY_SOURCE allowed); returns x."""
        f, engine = self._p2p_prepare(x, "x", path, writes=True)
        engine.recv(f, source, tag)
        return x

    def isend(self, x: Any, dest: int, tag: int = 0, *, path: str | None = None) -> Handle:
        """Non-blocking send; ``x`` must stay untouched until the handle's ``wait()``."""
        f, engine = self._p2p_prepare(x, "x", path)
        return engine.isend(f, dest, tag)

    def irecv(self, x: Any, source: int, tag: int = 0, *, path: str | None = None) -> Handle:
        """Non-blocking receive into ``x``; ``wait()`` returns ``x``."""
        f, engine = self._p2p_prepare(x, "x", path, writes=True)
        h = engine.irecv(f, source, tag)
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
        spin(
            lambda: bool(self.mpi_comm.Iprobe(MPI.ANY_SOURCE, int(tag), status)),
            limit,
            lambda: CommTimeoutError(
                f"recv from any rank (tag {tag}) did not start within {limit:g} s: no rank sent"
            ),
        )
        return int(status.Get_source())

    def flush(self) -> None:
        """Launch the sends and receives the ipc path holds back to run as one group (a blocking
        call, a handle's wait, a collective or :meth:`synchronize` launches them too); for
        callers that post isend/irecv and wait elsewhere, as torch's batch_isend_irecv does."""
        self._engines.flush()

    def sendrecv(
        self, x: Any, dest: int, out: Any, source: int, tag: int = 0, *, path: str | None = None
    ) -> Any:
        """Send ``x`` to ``dest`` while receiving ``out`` from ``source``; returns ``out``."""
        of, receiver = self._p2p_prepare(out, "out", path, writes=True)
        xf, sender = self._p2p_prepare(x, "x", path)
        if receiver is sender:
            sender.sendrecv(xf, dest, of, source, tag)
            return out
        r = receiver.irecv(of, source, tag)
        sender.isend(xf, dest, tag).wait()
        r.wait()
        return out
