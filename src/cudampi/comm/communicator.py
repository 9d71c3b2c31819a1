"""The Communicator: collectives and point-to-point on NumPy, torch, CuPy, JAX and DLPack arrays.

Each call adapts its arrays (:mod:`~cudampi.comm.arrays`), checks them locally, picks a path
(:mod:`~cudampi.comm.paths`), checks across ranks that everyone makes the same call
(:mod:`~cudampi.comm.validate`) and hands flat arrays to one engine (:mod:`~cudampi.comm.engines`,
which declare themselves there). User point-to-point traffic travels on a separate duplicate
of the communicator, so it never matches a collective's internal messages
(:mod:`~cudampi.comm.messages`).
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable
from typing import Any, NoReturn

from cudampi.comm import args
from cudampi.comm.arrays import Buf, adapt, new_like
from cudampi.comm.calls import Plan, Request, prepare
from cudampi.comm.carry import Carry
from cudampi.comm.deadline import Watch, agree_to_start
from cudampi.comm.engines import Engine, Setting, engines_for
from cudampi.comm.engines.base import node_comm
from cudampi.comm.handle import Worker, completed
from cudampi.comm.messages import Messages
from cudampi.comm.paths import (
    Decisions,
    DeviceSupport,
    PathChoice,
    Ranks,
    agreed,
    check_path,
    device_support,
    kinds,
)
from cudampi.comm.repeat import Repeats
from cudampi.comm.validate import Recheck, Signature, agree, check
from cudampi.config import Config
from cudampi.errors import CommError, CommTimeoutError, CudampiError, DeviceError
from cudampi.names import CALLS
from cudampi.observe import QUIET, Observer
from cudampi.shm import remove_singleton_segment_at_exit


class Communicator(Messages):
    """Collectives and point-to-point over an mpi4py communicator (see the module doc).

    Making one is collective: first the ranks agree that every one of them could make its own
    (a rank whose ``path=`` or settings are refused makes every rank raise, before any other
    collective), then once on every setting that changes what a rank sends (``Config.agreed()``,
    the default path and what MPI may be given device memory for). Every call has a deadline
    (``config.timeout``, see :mod:`~cudampi.comm.deadline`). Use it as a context manager, or
    call :meth:`close`, which tells the other ranks this one is gone.

    Threads: its collectives run one at a time, each whole, in the order the threads reach it
    (one lock per communicator), and the ranks pair calls by that order: give each thread its
    own communicator (:meth:`split`) where threads race (a RuntimeWarning says so the first
    time they meet). Messages do not take the lock: MPI matches them by rank and tag.

    Args:
        comm: an mpi4py intracommunicator (``MPI.COMM_WORLD`` or one split from it). It is
            duplicated, so this object's traffic never matches the caller's own messages.
        path: the default path of every call: one of :data:`cudampi.names.PATHS` (auto, ipc,
            nccl, gpu-ring, staged, native, host). A call's ``path=`` wins over it, and it wins
            over CUDAMPI_PATH; auto picks per call from what the probe proved
            (:func:`cudampi.comm.paths.choose`).
        config: the settings (default :meth:`Config.load() <cudampi.config.Config.load>`:
            CUDAMPI_* over the defaults).

    Raises:
        CommError: ``comm`` is None or ``MPI.COMM_NULL``.
        ConfigError: ``path`` is not a path, or a CUDAMPI_* variable is unknown or malformed
            (when ``config`` is not given).
        MismatchError: the ranks differ in a setting they must share; every rank raises.
    """

    def __init__(self, comm: Any, *, path: str | None = None, config: Config | None = None) -> None:
        from mpi4py import MPI

        from cudampi.probe import capabilities as capmod

        if comm is None or comm == MPI.COMM_NULL:
            raise CommError("Communicator needs an mpi4py communicator, got COMM_NULL/None")
        # What this rank checks alone comes first, then the ranks agree that every one could
        # make its communicator: no rank waits in MPI_Comm_dup for one that refused.
        refused: BaseException | None = None
        try:
            self.config = config if config is not None else Config.load()
            self._path_arg = check_path(path, "path")
            found = capmod.lookup(self.config.cache_dir, MPI.Get_library_version(), os.environ)
        except Exception as exc:
            refused = exc
        timeout = Config().timeout if refused is not None else self.config.timeout
        token = agree_to_start(comm, refused, timeout)
        self._path = self._path_arg or self.config.path
        self.mpi_comm = comm.Dup()
        self._coll = comm.Dup()
        self.rank: int = self.mpi_comm.Get_rank()
        self.size: int = self.mpi_comm.Get_size()
        if self.size == 1:
            remove_singleton_segment_at_exit(MPI)
        self.capabilities: capmod.Capabilities | None = found.entry
        if found.ignored and self.rank == 0:
            warnings.warn(f"cudampi: {found.note}", RuntimeWarning, stacklevel=2)
        try:
            shared = node_comm(self._coll, self.config)
            one_node = shared.Get_size() == self.size
            shared.Free()
            ranks = Ranks(self._coll, one_node)
            self._support = device_support(self.config, found.entry, found.note, ranks)
            agree(self._coll, self._agreed())
        except Exception:
            for c in (self._coll, self.mpi_comm):
                c.Free()
            raise
        self._decisions = Decisions(self._support, self._path, self.rank)
        self._watch = Watch(self._coll, self.config.timeout, token)
        self._lock = threading.RLock()
        """Held by one collective at a time, from its number to its end (see the class doc)."""
        self._met = False  # two threads met here (warned once)
        self._seq = 0
        self._engines = engines_for(
            Setting(self._coll, self.mpi_comm, self.rank, self.size, self.config, one_node)
        )
        self._threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._worker: Worker | None = None
        self._device: int | None = None
        self._closed = False
        self._observer = Observer(self.config, self.rank, self.size)
        self._chosen: tuple[PathChoice, int, str] | None = None
        """The last path choice of the call being built (read by the dispatch, for logs)."""
        self._repeats = Repeats()
        """allreduce calls that may skip the front end (cudampi.comm.repeat)."""
        self._messages = Repeats()
        """Point-to-point messages that may skip the front end (cudampi.comm.repeat)."""

    # ------------------------------------------------------------------ lifecycle

    def _agreed(self) -> dict[str, Any]:
        """What every rank must share (see the class doc)."""
        return {**self.config.agreed(), "path": self._path, **agreed(self._support)}

    def close(self) -> None:
        """Finish queued calls, tell the other ranks this one has left (a rank that then waits
        for it in a collective raises within seconds, not at its deadline), and free the
        duplicated communicators."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._repeats.forget()
        self._messages.forget()
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        self._watch.leave()
        self._engines.close()
        self._observer.close()
        for c in (self._coll, self.mpi_comm):
            try:
                c.Free()
            except Exception:
                pass

    def __enter__(self) -> Communicator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<cudampi Communicator rank {self.rank} of {self.size}, path {self._path}>"

    def split(self, color: int, key: int = 0) -> Communicator | None:
        """A sub-communicator of the ranks passing the same ``color`` (None for MPI.UNDEFINED)."""

        def build() -> Plan:
            c, k = args.check_color(color, key)
            return Plan(Signature("split"), lambda: self._coll.Split(c, k))

        new = self._run(build, "split", False)
        from mpi4py import MPI

        if new == MPI.COMM_NULL:
            return None
        try:
            return Communicator(new, path=self._path_arg, config=self.config)
        finally:
            new.Free()

    # ------------------------------------------------------------------ paths

    @property
    def device_support(self) -> DeviceSupport:
        """What MPI may be given device memory for here (from the probe cache or config)."""
        return self._support

    def path_for(
        self, op: str, x: Any, nbytes: int | None = None, *, path: str | None = None
    ) -> PathChoice:
        """The path call ``op`` on ``x`` takes (``path=`` as the call would pass it; None: this
        communicator's default); the returned string has ``.reason`` and ``.stream_ordered``."""
        return self._choose(op, adapt(x), path, nbytes)

    def refusal(
        self, call: str, x: Any, op: str | None = None, *, path: str | None = None
    ) -> str | None:
        """Why ``call`` on ``x`` (reducing with ``op``) would not run on the path this
        communicator takes for it (``path=`` as the call would pass it), or None: the engine's
        library is missing, or it lacks that reduction. Path errors raise, as the call would."""
        kind = kinds()[self.path_for(call, x, path=path).engine]
        return kind.available() or kind.refuses(call, adapt(x).dtype, op)

    def _choose(self, call: str, b: Buf, path: str | None, nbytes: int | None = None) -> PathChoice:
        n = b.nbytes if nbytes is None else nbytes
        choice = self._decisions.choose(call, path, b.on_device, b.dtype, n)
        self._chosen = (choice, n, b.dtype)
        return choice

    # ------------------------------------------------------------------ helpers

    def _buf(self, x: Any, what: str) -> Buf:
        b = adapt(x, what)
        args.check_array(b, what)
        if b.device is not None:
            if self._device is None:
                self._device = b.device
            elif b.device != self._device:
                raise DeviceError(
                    f"{what}: the array is on cuda:{b.device}, but this communicator works on "
                    f"cuda:{self._device} (the device of its first device array). Use one GPU "
                    "per rank (torch.cuda.set_device(local_rank)) or one Communicator per GPU."
                )
        return b

    def _out(self, x: Buf, out: Any, shape: tuple[int, ...], what: str = "out") -> Buf:
        if out is None:
            return new_like(x, shape)
        ob = x if out is x.obj else self._buf(out, what)  # in place: adapted already
        if ob is x and shape == x.shape:  # in place, same shape: only writability to check
            args.check_writable(x, what)
            return x
        args.check_out(x, ob, shape, what)
        return ob

    def _engine(self, choice: PathChoice, b: Buf) -> Engine:
        return self._engines.get(choice.engine, choice.inner, b.lib, b.device)

    def _run(self, build: Callable[[], Plan], what: str, async_op: bool, x: Any = None) -> Any:
        """One collective, whole, under the lock (see the class doc)."""
        if not self._lock.acquire(False):  # (positional: a keyword costs more than the lock)
            self._meet(what)
        try:
            return self._run_locked(build, what, async_op, x)
        finally:
            self._lock.release()

    def _meet(self, what: str) -> None:
        """Another thread is in a call here: wait for it (warning once, see the class doc)."""
        if not self._met:
            self._met = True
            warnings.warn(
                f"cudampi: {what} called while another thread's collective runs on the same "
                f"Communicator (rank {self.rank}): calls run one at a time, and the ranks pair "
                "them in the order each rank's threads reached it, which may differ between "
                "ranks. Give each thread its own communicator (split), or order the calls.",
                RuntimeWarning,
                stacklevel=4,
            )
        self._lock.acquire()

    def _run_locked(
        self, build: Callable[[], Plan], what: str, async_op: bool, x: Any = None
    ) -> Any:
        if self._closed:
            raise CommError(f"{what}: this Communicator was closed")
        self._chosen = None
        if self._watch.failed is not None:
            raise CommTimeoutError(
                f"{what}: this Communicator failed earlier and cannot be used: {self._watch.failed}"
            )
        self._seq += 1  # in the caller's order: the same on every rank that makes the same calls
        seq = self._seq
        try:
            plan = build()
            engine = plan.engine
            ordered = engine is not None and engine.stream_ordered
            if not ordered and engine is not None and engine.ops.device is not None:
                plan.token = engine.ops.capture()
        except Exception as exc:
            if self._reject_ordered(what, x):
                raise
            plan, ordered = Plan(Signature(what), error=exc), False
        # Every collective is observed here, whatever engine runs it: the log line (path and
        # why), the profiler/NVTX range and the timeline event (cudampi.observe).
        chosen = self._chosen
        if chosen is None:
            observed = self._observer.call(what, 0, "none", "mpi", "no data")
        else:
            choice, nbytes, dtype = chosen
            observed = self._observer.call(what, nbytes, dtype, choice.label, choice.reason)
        if ordered:
            # the engine orders its work on the caller's stream and checks across ranks itself:
            # it runs in this thread, after the calls queued before it
            run = plan.run
            assert run is not None
            if self._worker is not None:
                self._worker.drain()
            if observed is QUIET and not async_op:  # the common case, kept short
                return run()

            def inline() -> Any:
                with observed:
                    return run()

            return _inline(inline, what, async_op)
        debug = self.config.debug

        def execute() -> Any:
            data = None if plan.carry is None else plan.carry.data
            rows = check(
                self._coll, plan.sig, plan.error, debug=debug, watch=self._watch, seq=seq, data=data
            )
            run, ops = plan.run, plan.ops
            assert run is not None
            with observed:
                if plan.carry is not None:  # its data came with the check
                    plan.carry.finish(rows)
                if ops is None or ops.device is None:  # host memory: no stream to order
                    return run()
                with ops.device_ctx():
                    ops.begin(plan.token)
                    result = run()
                    ops.fence()
                return result

        return self._submit(execute, what, async_op)

    def _reject_ordered(self, what: str, x: Any) -> bool:
        """A call this rank rejected, where the others may run it on a stream-ordered engine
        (they check on the GPU, not on the host): tell them there, so they raise too instead of
        waiting; True when done (the caller raises its own error at once). A device ``x`` goes
        where the others' would on this communicator's path (``path='ipc'``, or auto's
        verdict), its engine made now if need be, as their call makes it; a host ``x`` meets
        them in the host check; no ``x`` (:meth:`refuse`): the engines made so far are told
        where every device call goes to them (``path='ipc'``)."""
        if x is None:
            engines = self._engines.stream_ordered() if self._path == "ipc" else []
        else:
            try:
                b = adapt(x, "x")
                device = self._device if self._device is not None else b.device
                if device is None or b.device is None:
                    return False
                choice = self._decisions.choose(what, None, True, b.dtype, b.nbytes)
                if not kinds()[choice.engine].stream_ordered:
                    return False
                engines = [self._engines.get(choice.engine, choice.inner, b.lib, device)]
            except Exception:  # (a best guess inside the caller's error, which is raised)
                return False
        for engine in engines:
            engine.reject(what)
        return bool(engines)

    def synchronize(self) -> None:
        """Wait until this rank's calls are complete on the caller's current stream, and raise
        what a stream-ordered engine (ipc) reported: a mismatched call, a rank that did not
        arrive within CUDAMPI_TIMEOUT, a rank that died. Calls on those engines return once
        enqueued (as NCCL's); their errors surface here, at the next call or in the log."""
        if self._worker is not None:
            self._worker.drain()
        self._engines.synchronize()

    def give_up(self, reason: str) -> CommTimeoutError:
        """Fail this communicator because a caller stopped waiting for one of its calls
        (torch's ``Work.wait(timeout=)``), which stays pending in MPI: later calls raise at once,
        a call waiting for its peers stops, and the process ends the MPI job at exit instead of
        waiting for that call in MPI_Finalize. Returns the failure (the first one stays)."""
        return self._watch.give_up(CommTimeoutError(reason))

    def _submit(self, fn: Callable[[], Any], what: str, async_op: bool) -> Any:
        if not self._threaded:
            return _inline(fn, what, async_op)
        if async_op:
            if self._worker is None:
                self._worker = Worker(f"cudampi-comm-{self.rank}", self._watch)
            return self._worker.submit(fn, what)
        if self._worker is None or self._worker.idle:
            return fn()
        return self._worker.submit(fn, what).wait()

    # ------------------------------------------------------------------ collectives

    def _call(self, r: Request, async_op: bool) -> Any:
        """Run one call: prepared (:func:`cudampi.comm.calls.prepare`) in the caller's order."""

        def build() -> Plan:
            r.seq = self._seq
            return prepare(self, r)

        return self._run(build, r.call.name, async_op, r.x)

    def _remember(
        self, r: Request, engine: Engine, dtype: str, sig: Signature, carried: Carry | None
    ) -> None:
        """After an allreduce's full path: let its repeats skip the front end (repeat.py)."""
        if engine.stream_ordered:
            self._repeats.remember(r.x, r.out, r.op, r.path, engine, dtype)
        elif engine.ops.device is None:
            data = None if carried is None else carried.data
            rc = Recheck(self._coll, sig, self._watch, data, self.config.debug)
            self._repeats.remember(r.x, r.out, r.op, r.path, engine, dtype, rc, carried)

    def _check_counts(self, r: Request, error: BaseException | None) -> None:
        """The cross-rank check of counts exchanged inside a call (alltoall's receive counts)."""
        check(self._coll, Signature(r.call.name), error, debug=False, watch=self._watch, seq=r.seq)

    def allreduce(
        self,
        x: Any,
        op: str = "sum",
        *,
        out: Any = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` over all ranks with ``op`` (sum, prod, min, max, avg, band, bor, bxor);
        every rank gets the result (in ``out``; ``out=x`` is in place)."""
        if out is not None and not async_op and self._repeat(x, op, out, path):
            return out
        remember = out is not None and not async_op
        return self._call(
            Request(CALLS["allreduce"], x, op, out=out, path=path, remember=remember), async_op
        )

    def _repeat(self, x: Any, op: str, out: Any, path: str | None) -> bool:
        """Run an allreduce that the full path ran before on these very arrays, unchanged,
        straight on the engine it chose (cudampi.comm.repeat); False: take the full path. On a
        stream-ordered engine the GPU checks the call across ranks; on host memory the host
        check still runs first, with the signature the full path made."""
        e = self._repeats.lookup(x, out, op, path)
        if e is None:
            return False
        if not self._lock.acquire(False):
            self._meet("allreduce")
        try:
            if (
                self._closed
                or self._watch.failed is not None
                or not self._observer.quiet()
                or (self._worker is not None and (e.check is None or not self._worker.idle))
            ):
                return False
            seq = self._seq = self._seq + 1
            check = e.check
            if check is None:  # the engine checks on the GPU
                e.run(x, out, op)
            else:
                rows = check.run(seq)
                if e.carry is None:
                    e.run(x, out, op)
                else:  # its data came with the check
                    e.carry.finish(rows)
            return True
        finally:
            self._lock.release()

    def reduce(
        self,
        x: Any,
        op: str = "sum",
        root: int = 0,
        *,
        out: Any = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` over all ranks onto ``root`` (the result is valid on ``root`` only)."""
        return self._call(Request(CALLS["reduce"], x, op, root, out, path=path), async_op)

    def broadcast(
        self, x: Any, root: int = 0, *, path: str | None = None, async_op: bool = False
    ) -> Any:
        """Copy ``root``'s ``x`` into ``x`` on every rank (in place); returns ``x``."""
        return self._call(Request(CALLS["broadcast"], x, root=root, path=path), async_op)

    def allgather(
        self, x: Any, *, out: Any = None, path: str | None = None, async_op: bool = False
    ) -> Any:
        """Every rank's ``x`` stacked: ``out`` has shape ``(size, *x.shape)`` on every rank."""
        return self._call(Request(CALLS["allgather"], x, out=out, path=path), async_op)

    def allgatherv(
        self,
        x: Any,
        counts: list[int],
        *,
        out: Any = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Flat concatenation of every rank's ``x`` (``counts[i]`` elements from rank i)."""
        return self._call(
            Request(CALLS["allgatherv"], x, out=out, counts=counts, path=path), async_op
        )

    def gather(
        self,
        x: Any,
        root: int = 0,
        *,
        out: Any = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Every rank's ``x`` stacked on ``root`` (shape ``(size, *x.shape)``); None elsewhere."""
        return self._call(Request(CALLS["gather"], x, root=root, out=out, path=path), async_op)

    def scatter(
        self,
        x: Any,
        root: int = 0,
        *,
        out: Any = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Block i of ``root``'s ``x`` (shape ``(size, *s)``) lands in rank i's ``out`` (shape
        ``s``). Other ranks pass ``out``, or an ``x`` of the same shape and dtype as a template."""
        return self._call(Request(CALLS["scatter"], x, root=root, out=out, path=path), async_op)

    def reduce_scatter(
        self,
        x: Any,
        op: str = "sum",
        *,
        out: Any = None,
        counts: list[int] | None = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Reduce ``x`` over ranks and give rank i block i: ``x.shape[0] == size*k`` gives ``out``
        of shape ``(k, *x.shape[1:])``; with ``counts``, a flat ``x`` of ``sum(counts)`` elements
        gives rank i ``counts[i]`` elements."""
        r = Request(CALLS["reduce_scatter"], x, op, out=out, counts=counts, path=path)
        return self._call(r, async_op)

    def alltoall(
        self,
        x: Any,
        *,
        out: Any = None,
        send_counts: list[int] | None = None,
        recv_counts: list[int] | None = None,
        path: str | None = None,
        async_op: bool = False,
    ) -> Any:
        """Block i of ``x`` goes to rank i and block j of the result comes from rank j. Blocks are
        the first axis split in ``size`` equal parts, or, with ``send_counts``, a flat ``x`` split
        by counts (``recv_counts`` may be omitted: then it is exchanged)."""
        r = Request(
            CALLS["alltoall"], x, out=out, counts=send_counts, recv_counts=recv_counts, path=path
        )
        return self._call(r, async_op)

    def refuse(self, call: str, error: Exception) -> NoReturn:
        """Take part in the next collective as a rank whose arguments failed the caller's own
        check (the torch layer checks its list lengths and sizes): every rank raises instead of
        moving data (this one ``error``, the others an error naming this rank), so no rank is
        left waiting. ``call`` names the collective in the others' error."""

        def build() -> Plan:
            raise error

        self._run(build, call, False)
        raise error  # (the cross-rank check raised it already)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank has called barrier (in order with queued collectives)."""
        return self._call(Request(CALLS["barrier"]), async_op)


def _inline(fn: Callable[[], Any], what: str, async_op: bool) -> Any:
    """Run ``fn`` now, in the caller's thread; an async call gets a finished handle."""
    if not async_op:
        return fn()
    try:
        return completed(what, fn())
    except Exception as exc:
        return completed(what, error=exc)


__all__ = ["Communicator", "CudampiError"]
