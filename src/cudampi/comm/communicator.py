"""The Communicator: collectives and point-to-point on NumPy, torch, CuPy and DLPack/CAI arrays.

Each call adapts its arrays (:mod:`~cudampi.comm.buffers`), checks them locally, picks a path
(:mod:`~cudampi.comm.paths`), checks across ranks that everyone makes the same call
(:mod:`~cudampi.comm.validate`) and runs one engine: MPI's own collective (``host``/``native``),
cudampi's algorithms over direct point-to-point (``gpu-ring``), or the staged pipeline through
pinned host buffers (``staged``). Collectives run in call order on one worker thread per
communicator; user point-to-point traffic travels on a separate duplicate of the communicator so
it can never match a collective's internal messages.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cudampi.comm import algorithms as alg
from cudampi.comm import native, staged
from cudampi.comm.buffers import DTYPES, Buf, adapt, empty_like_shape, flat, same_memory
from cudampi.comm.handle import Handle, Worker, completed
from cudampi.comm.ops import ArrayOps, check_op, ops_for
from cudampi.comm.paths import DeviceSupport, PathChoice, check_path, choose, device_support
from cudampi.comm.staging import stager_for
from cudampi.comm.transport import (
    DirectTransport,
    StagedTransport,
    mem,
    opens_sequence,
    recv_into,
    recv_rest,
)
from cudampi.comm.validate import Signature, check
from cudampi.config import Config
from cudampi.errors import CommError, CudampiError, DeviceError


@dataclass
class _Plan:
    """One call, prepared in the caller's thread."""

    sig: Signature
    run: Callable[[], Any] | None = None
    ops: ArrayOps | None = None
    token: Any = None
    error: BaseException | None = None


class Communicator:
    """Collectives and point-to-point over an mpi4py communicator (see the module doc).

    ``comm`` is duplicated, so this object's traffic never matches the caller's own messages.
    ``path`` (auto, gpu-ring, staged, native, host) is the default path of every call; a call's
    ``path=`` wins over it, and it wins over CUDAMPI_PATH.
    """

    def __init__(self, comm: Any, *, path: str | None = None, config: Config | None = None) -> None:
        from mpi4py import MPI

        from cudampi.probe import capabilities as capmod

        if comm is None or comm == MPI.COMM_NULL:
            raise CommError("Communicator needs an mpi4py communicator, got COMM_NULL/None")
        self.config = config if config is not None else Config.load()
        self._path_arg = check_path(path, "path")
        self._path = self._path_arg or self.config.path
        self.mpi_comm = comm.Dup()
        self._coll = comm.Dup()
        self.rank: int = self.mpi_comm.Get_rank()
        self.size: int = self.mpi_comm.Get_size()
        key = capmod.stack_key(MPI.Get_library_version(), os.environ)
        self.capabilities: capmod.Capabilities | None = capmod.load(self.config.cache_dir, key)
        self._support = device_support(self.config, self.capabilities)
        shared = self._coll.Split_type(MPI.COMM_TYPE_SHARED)
        self._one_node = shared.Get_size() == self.size
        shared.Free()
        self._threaded = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self._worker: Worker | None = None
        self._ops: dict[tuple[str, int | None], ArrayOps] = {}
        self._stagers: dict[tuple[str, int | None], Any] = {}
        self._device: int | None = None
        self._closed = False

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Finish queued calls and free the duplicated communicators."""
        if self._closed:
            return
        self._closed = True
        if self._worker is not None:
            self._worker.close()
            self._worker = None
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

        def run() -> Any:
            return self._coll.Split(color, key)

        new = self._collective(lambda: _Plan(Signature("split"), run), "split", False)
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

    def path_for(self, op: str, x: Any, nbytes: int | None = None) -> PathChoice:
        """The path this communicator's default would take for collective ``op`` on ``x``; the
        returned string has ``.reason``."""
        b = adapt(x)
        n = b.nbytes if nbytes is None else nbytes
        return self._choose(op, b, None, n)

    def _choose(self, call: str, b: Buf, path: str | None, nbytes: int | None = None) -> PathChoice:
        requested = check_path(path, "path") or self._path
        return choose(
            call,
            requested,
            b.on_device,
            b.dtype,
            b.nbytes if nbytes is None else nbytes,
            self._support,
            mpi_reduces=native.can_reduce(b.dtype),
        )

    # ------------------------------------------------------------------ helpers

    def _buf(self, x: Any, what: str) -> Buf:
        b = adapt(x, what)
        if b.dtype not in DTYPES:
            raise CommError(
                f"{what}: dtype {b.dtype!r} is not supported; use one of {', '.join(DTYPES)}"
            )
        if not b.contiguous:
            raise CommError(
                f"{what}: the {b.describe()} is not contiguous; MPI moves contiguous memory. "
                "Pass x.contiguous() (torch) or numpy/cupy.ascontiguousarray(x)."
            )
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
            return adapt(empty_like_shape(x, shape))
        ob = self._buf(out, what)
        if ob.lib != x.lib or ob.device != x.device:
            raise DeviceError(
                f"{what}: a {ob.describe()}, but the input is a {x.describe()}; out must be the "
                "same kind of array on the same device"
            )
        if ob.dtype != x.dtype:
            raise CommError(f"{what}: dtype {ob.dtype!r} differs from the input's {x.dtype!r}")
        if ob.count != _prod(shape):
            raise CommError(
                f"{what}: shape {ob.shape} holds {ob.count} elements; this call writes "
                f"{_prod(shape)} (shape {shape})"
            )
        return ob

    def _ops_for(self, b: Buf) -> ArrayOps:
        key = (b.lib, b.device)
        if key not in self._ops:
            self._ops[key] = ops_for(b.lib, b.device)
        return self._ops[key]

    def _host_ops(self, stager: Any) -> ArrayOps:
        return self._ops_for_key(stager.host_lib(), None)

    def _ops_for_key(self, lib: str, device: int | None) -> ArrayOps:
        key = (lib, device)
        if key not in self._ops:
            self._ops[key] = ops_for(lib, device)
        return self._ops[key]

    def _stager(self, b: Buf) -> Any:
        key = (b.lib, b.device)
        if key not in self._stagers:
            self._stagers[key] = stager_for(b.lib, b.device)
        return self._stagers[key]

    def _direct(self, on_device: bool) -> bool:
        """Direct (all-pairs) instead of ring reduce-scatter/allgather for large messages."""
        if self.config.algorithm != "auto":
            return self.config.algorithm == "direct"
        return on_device and self._one_node

    def _algo(self, b: Buf, choice: PathChoice) -> int:
        """What the ranks must agree on about the algorithm (part of the call's signature)."""
        return 1 + int(self._direct(b.on_device and choice.engine == "alg"))

    def _ctx(self, ops: ArrayOps, itemsize: int) -> alg.Ctx:
        return alg.Ctx(
            self.rank,
            self.size,
            ops,
            DirectTransport(self._coll, ops),
            itemsize,
            self.config.chunk_bytes,
            self.config.small_bytes,
            self._direct(ops.device is not None),
        )

    def _collective(self, build: Callable[[], _Plan], what: str, async_op: bool) -> Any:
        if self._closed:
            raise CommError(f"{what}: this Communicator was closed")
        try:
            plan = build()
            if plan.ops is not None:
                plan.token = plan.ops.capture()
        except Exception as exc:
            plan = _Plan(Signature(what), error=exc)
        debug = self.config.debug

        def execute() -> Any:
            check(self._coll, plan.sig, plan.error, debug=debug)
            assert plan.run is not None
            if plan.ops is None:
                return plan.run()
            with plan.ops.device_ctx():
                plan.ops.begin(plan.token)
                result = plan.run()
                plan.ops.fence()
            return result

        return self._submit(execute, what, async_op)

    def _submit(self, fn: Callable[[], Any], what: str, async_op: bool) -> Any:
        if not self._threaded:
            if not async_op:
                return fn()
            try:
                return completed(what, fn())
            except Exception as exc:
                return completed(what, error=exc)
        if async_op:
            if self._worker is None:
                self._worker = Worker(f"cudampi-comm-{self.rank}")
            return self._worker.submit(fn, what)
        if self._worker is None or self._worker.idle:
            return fn()
        return self._worker.submit(fn, what).wait()

    def _staged_inner(self, inner: str, hops: ArrayOps, itemsize: int) -> tuple[bool, alg.Ctx]:
        return inner == "mpi", self._ctx(hops, itemsize)

    # ------------------------------------------------------------------ collectives

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

        def build() -> _Plan:
            xb = self._buf(x, "x")
            check_op(op, xb.dtype)
            ob = self._out(xb, out, xb.shape)
            choice = self._choose("allreduce", xb, path)
            ops = self._ops_for(xb)
            inplace = same_memory(xb, ob)
            sig = Signature(
                "allreduce",
                op,
                xb.dtype,
                count=xb.count,
                engine=choice.label,
                algo=self._algo(xb, choice),
                shape=xb.shape,
            )

            def run() -> Any:
                xf, of = flat(xb), flat(ob)
                self._allreduce_flat(choice, ops, xb, xf, of, inplace, op)
                return _result(out, ob)

            return _Plan(sig, run, ops)

        return self._collective(build, "allreduce", async_op)

    def _allreduce_flat(
        self, choice: PathChoice, ops: ArrayOps, xb: Buf, xf: Any, of: Any, inplace: bool, op: str
    ) -> None:
        dtype, itemsize, count = xb.dtype, xb.itemsize, xb.count
        if choice.engine == "mpi":
            native.allreduce(self._coll, ops, of if inplace else xf, of, op, dtype)
        elif choice.engine == "alg":
            if not inplace:
                ops.copy(of, xf)
            alg.allreduce(self._ctx(ops, itemsize), of, op, dtype)
        else:
            st = self._stager(xb)
            hops = self._host_ops(st)
            use_mpi, hctx = self._staged_inner(choice.inner, hops, itemsize)

            def piece(h: Any) -> None:
                if use_mpi:
                    native.allreduce(self._coll, hops, h, h, op, dtype)
                else:
                    alg.allreduce(hctx, h, op, dtype)

            staged.piecewise(st, xf, of, xf, count, itemsize, self.config.chunk_bytes, piece)
        if op == "avg":
            ops.divide(of, self.size, dtype)

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

        def build() -> _Plan:
            xb = self._buf(x, "x")
            check_op(op, xb.dtype)
            _check_root(root, self.size)
            ob = self._out(xb, out, xb.shape)
            choice = self._choose("reduce", xb, path)
            ops = self._ops_for(xb)
            inplace = same_memory(xb, ob)
            is_root = self.rank == root
            sig = Signature(
                "reduce",
                op,
                xb.dtype,
                root=root,
                count=xb.count,
                engine=choice.label,
                algo=self._algo(xb, choice),
                shape=xb.shape,
            )

            def run() -> Any:
                xf, of = flat(xb), flat(ob)
                dtype, itemsize = xb.dtype, xb.itemsize
                if choice.engine == "mpi":
                    native.reduce(
                        self._coll, ops, of if (inplace and is_root) else xf, of, op, dtype, root
                    )
                elif choice.engine == "alg":
                    if is_root:
                        work = of
                        if not inplace:
                            ops.copy(of, xf)
                    else:
                        work = ops.empty(max(1, xb.count), xf)[: xb.count]
                        ops.copy(work, xf)
                    alg.reduce(self._ctx(ops, itemsize), work, op, dtype, root)
                else:
                    st = self._stager(xb)
                    hops = self._host_ops(st)
                    use_mpi, hctx = self._staged_inner(choice.inner, hops, itemsize)

                    def piece(h: Any) -> None:
                        if use_mpi:
                            native.reduce(self._coll, hops, h, h, op, dtype, root)
                        else:
                            alg.reduce(hctx, h, op, dtype, root)

                    staged.piecewise(
                        st,
                        xf,
                        of if is_root else None,
                        xf,
                        xb.count,
                        itemsize,
                        self.config.chunk_bytes,
                        piece,
                    )
                if op == "avg" and is_root:
                    ops.divide(of, self.size, dtype)
                return _result(out, ob)

            return _Plan(sig, run, ops)

        return self._collective(build, "reduce", async_op)

    def broadcast(
        self, x: Any, root: int = 0, *, path: str | None = None, async_op: bool = False
    ) -> Any:
        """Copy ``root``'s ``x`` into ``x`` on every rank (in place); returns ``x``."""

        def build() -> _Plan:
            xb = self._buf(x, "x")
            _check_root(root, self.size)
            choice = self._choose("broadcast", xb, path)
            ops = self._ops_for(xb)
            sig = Signature(
                "broadcast",
                "",
                xb.dtype,
                root=root,
                count=xb.count,
                engine=choice.label,
                shape=xb.shape,
            )

            def run() -> Any:
                xf = flat(xb)
                if choice.engine == "mpi":
                    native.broadcast(self._coll, ops, xf, root)
                elif choice.engine == "alg":
                    alg.broadcast(self._ctx(ops, xb.itemsize), xf, root)
                else:
                    st = self._stager(xb)
                    hops = self._host_ops(st)
                    hctx = self._ctx(hops, xb.itemsize)
                    is_root = self.rank == root

                    def piece(h: Any) -> None:
                        if choice.inner == "mpi":
                            native.broadcast(self._coll, hops, h, root)
                        else:
                            alg.broadcast(hctx, h, root)

                    staged.piecewise(
                        st,
                        xf if is_root else None,
                        None if is_root else xf,
                        xf,
                        xb.count,
                        xb.itemsize,
                        self.config.chunk_bytes,
                        piece,
                    )
                return x if xb.obj is xb.arr else xb.arr

            return _Plan(sig, run, ops)

        return self._collective(build, "broadcast", async_op)

    def allgather(
        self, x: Any, *, out: Any = None, path: str | None = None, async_op: bool = False
    ) -> Any:
        """Every rank's ``x`` stacked: ``out`` has shape ``(size, *x.shape)`` on every rank."""
        return self._gather_like("allgather", x, None, None, out, path, async_op)

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
        return self._gather_like("allgatherv", x, counts, None, out, path, async_op)

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
        return self._gather_like("gather", x, None, root, out, path, async_op)

    def _gather_like(
        self,
        call: str,
        x: Any,
        counts: list[int] | None,
        root: int | None,
        out: Any,
        path: str | None,
        async_op: bool,
    ) -> Any:
        def build() -> _Plan:
            xb = self._buf(x, "x")
            if root is not None:
                _check_root(root, self.size)
            if counts is not None:
                cs = _check_counts(counts, self.size, "counts")
                if cs[self.rank] != xb.count:
                    raise CommError(
                        f"allgatherv: counts[{self.rank}]={cs[self.rank]} but this rank's x has "
                        f"{xb.count} elements; counts[i] must be rank i's element count"
                    )
                shape: tuple[int, ...] = (sum(cs),)
            else:
                cs = [xb.count] * self.size
                shape = (self.size, *xb.shape)
            receives = root is None or self.rank == root
            ob = self._out(xb, out, shape) if receives else None
            choice = self._choose(call, xb, path)
            ops = self._ops_for(xb)
            sig = Signature(
                call,
                "",
                xb.dtype,
                root=-1 if root is None else root,
                count=-1 if counts is not None else xb.count,
                counts=tuple(cs) if counts is not None else (),
                engine=choice.label,
                algo=self._algo(xb, choice),
                shape=xb.shape if counts is None else None,
            )

            def run() -> Any:
                xf = flat(xb)
                of = flat(ob) if ob is not None else None
                isz = xb.itemsize
                if choice.engine == "staged":
                    st = self._stager(xb)
                    hops = self._host_ops(st)
                    hx = staged.stage_in(st, xf, xf, xb.count, isz)
                    ho = staged.stage_buffer(st, xf, sum(cs), isz) if of is not None else None
                    self._gather_engine(choice.inner, hops, hx, ho, cs, root, isz)
                    if of is not None:
                        staged.stage_out(st, of, ho, sum(cs) * isz)
                else:
                    self._gather_engine(choice.engine, ops, xf, of, cs, root, isz)
                return _result(out, ob) if ob is not None else None

            return _Plan(sig, run, ops)

        return self._collective(build, call, async_op)

    def _gather_engine(
        self,
        engine: str,
        ops: ArrayOps,
        xf: Any,
        of: Any,
        cs: list[int],
        root: int | None,
        isz: int,
    ) -> None:
        if engine == "mpi":
            if root is None:
                native.allgatherv(self._coll, ops, xf, of, cs, isz)
            else:
                native.gatherv(self._coll, ops, xf, of, cs, isz, root)
        elif root is None:
            alg.allgatherv(self._ctx(ops, isz), xf, of, cs)
        else:
            alg.gatherv(self._ctx(ops, isz), xf, of, cs, root)

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

        def build() -> _Plan:
            _check_root(root, self.size)
            is_root = self.rank == root
            if x is None and is_root:
                raise CommError(f"scatter: the root (rank {root}) must pass x")
            if x is None:
                if out is None:
                    raise CommError("scatter: a non-root rank must pass out (or an x template)")
                tb = self._buf(out, "out")
                block: tuple[int, ...] = tb.shape
            else:
                tb = self._buf(x, "x")
                if not tb.shape or tb.shape[0] != self.size:
                    raise CommError(
                        f"scatter: x has shape {tb.shape}; its first axis must be the number of "
                        f"ranks ({self.size})"
                    )
                block = tb.shape[1:]
            ob = self._out(tb, out, block)
            k = ob.count
            choice = self._choose("scatter", tb, path)
            ops = self._ops_for(tb)
            sig = Signature(
                "scatter", "", tb.dtype, root=root, count=k, engine=choice.label, shape=block
            )
            cs = [k] * self.size

            def run() -> Any:
                xf = flat(tb) if (is_root and x is not None) else None
                of = flat(ob)
                isz = tb.itemsize
                if choice.engine == "staged":
                    st = self._stager(tb)
                    hops = self._host_ops(st)
                    hx = staged.stage_in(st, xf, of, k * self.size, isz) if xf is not None else None
                    ho = staged.stage_buffer(st, of, k, isz)
                    self._scatter_engine(choice.inner, hops, hx, ho, cs, root, isz)
                    staged.stage_out(st, of, ho, k * isz)
                else:
                    self._scatter_engine(choice.engine, ops, xf, of, cs, root, isz)
                return _result(out, ob)

            return _Plan(sig, run, ops)

        return self._collective(build, "scatter", async_op)

    def _scatter_engine(
        self, engine: str, ops: ArrayOps, xf: Any, of: Any, cs: list[int], root: int, isz: int
    ) -> None:
        if engine == "mpi":
            native.scatterv(self._coll, ops, xf, of, cs, isz, root)
        else:
            alg.scatterv(self._ctx(ops, isz), xf, of, cs, root)

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

        def build() -> _Plan:
            xb = self._buf(x, "x")
            check_op(op, xb.dtype)
            if counts is None:
                if not xb.shape or xb.shape[0] % self.size:
                    raise CommError(
                        f"reduce_scatter: x has shape {xb.shape}; its first axis must be a "
                        f"multiple of the number of ranks ({self.size}), or pass counts="
                    )
                k0 = xb.shape[0] // self.size
                shape: tuple[int, ...] = (k0, *xb.shape[1:])
                cs = [_prod(shape)] * self.size
            else:
                cs = _check_counts(counts, self.size, "counts")
                if sum(cs) != xb.count:
                    raise CommError(
                        f"reduce_scatter: counts sum to {sum(cs)} but x has {xb.count} elements"
                    )
                shape = (cs[self.rank],)
            ob = self._out(xb, out, shape)
            if same_memory(xb, ob) and self.size > 1 and xb.count:
                raise CommError("reduce_scatter: out must not be x (the output is a block of x)")
            choice = self._choose("reduce_scatter", xb, path)
            ops = self._ops_for(xb)
            sig = Signature(
                "reduce_scatter",
                op,
                xb.dtype,
                count=xb.count,
                counts=tuple(cs),
                engine=choice.label,
                algo=self._algo(xb, choice),
                shape=xb.shape,
            )

            def run() -> Any:
                xf, of = flat(xb), flat(ob)
                isz, dtype = xb.itemsize, xb.dtype
                if choice.engine == "staged":
                    st = self._stager(xb)
                    hops = self._host_ops(st)
                    hx = staged.stage_in(st, xf, xf, xb.count, isz)
                    ho = staged.stage_buffer(st, of, cs[self.rank], isz)
                    self._rs_engine(choice.inner, hops, hx, ho, cs, op, dtype, isz, scratch=False)
                    staged.stage_out(st, of, ho, cs[self.rank] * isz)
                else:
                    self._rs_engine(choice.engine, ops, xf, of, cs, op, dtype, isz, scratch=True)
                if op == "avg":
                    ops.divide(of, self.size, dtype)
                return _result(out, ob)

            return _Plan(sig, run, ops)

        return self._collective(build, "reduce_scatter", async_op)

    def _rs_engine(
        self,
        engine: str,
        ops: ArrayOps,
        xf: Any,
        of: Any,
        cs: list[int],
        op: str,
        dtype: str,
        isz: int,
        *,
        scratch: bool,
    ) -> None:
        if engine == "mpi":
            native.reduce_scatterv(self._coll, ops, xf, of, cs, op, dtype)
            return
        work = xf
        if scratch:
            n = sum(cs)
            work = ops.empty(max(1, n), xf)[:n]
            ops.copy(work, xf)
        alg.reduce_scatterv(self._ctx(ops, isz), work, of, cs, op, dtype)

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
        varying = send_counts is not None

        def build() -> _Plan:
            xb = self._buf(x, "x")
            if not varying:
                if recv_counts is not None:
                    raise CommError("alltoall: recv_counts needs send_counts too")
                if not xb.shape or xb.shape[0] % self.size:
                    raise CommError(
                        f"alltoall: x has shape {xb.shape}; its first axis must be a multiple of "
                        f"the number of ranks ({self.size}), or pass send_counts="
                    )
                k = xb.count // self.size
                sc: list[int] = [k] * self.size
                rc: list[int] | None = list(sc)
                ob: Buf | None = self._out(xb, out, xb.shape)
            else:
                assert send_counts is not None
                sc = _check_counts(send_counts, self.size, "send_counts")
                if sum(sc) != xb.count:
                    raise CommError(
                        f"alltoall: send_counts sum to {sum(sc)} but x has {xb.count} elements"
                    )
                rc = (
                    None
                    if recv_counts is None
                    else _check_counts(recv_counts, self.size, "recv_counts")
                )
                ob = None if rc is None else self._out(xb, out, (sum(rc),))
            if ob is not None and same_memory(xb, ob) and xb.count and self.size > 1:
                raise CommError("alltoall: out must not be x")
            choice = self._choose("alltoall", xb, path)
            ops = self._ops_for(xb)
            sig = Signature(
                "alltoall",
                "",
                xb.dtype,
                count=-1 if varying else xb.count,
                counts=(1,) if varying else (),
                engine=choice.label,
                shape=None if varying else xb.shape,
            )

            def run() -> Any:
                nonlocal rc, ob
                if varying:
                    got = [int(c) for c in self._coll.alltoall(sc)]
                    err: BaseException | None = None
                    if rc is not None and got != rc:
                        bad = [i for i in range(self.size) if got[i] != rc[i]]
                        from cudampi.errors import MismatchError

                        err = MismatchError(
                            f"alltoall: rank {self.rank} expects recv_counts {rc}, but rank "
                            f"{bad[0]} sends it {got[bad[0]]} elements (send_counts[{self.rank}] "
                            f"there); recv_counts[j] must equal rank j's send_counts[{self.rank}]"
                        )
                    check(self._coll, Signature("alltoall"), err, debug=False)
                    rc = got
                    if ob is None:
                        ob = self._out(xb, out, (sum(rc),))
                assert rc is not None and ob is not None
                xf, of = flat(xb), flat(ob)
                isz = xb.itemsize
                if choice.engine == "staged":
                    st = self._stager(xb)
                    hops = self._host_ops(st)
                    hx = staged.stage_in(st, xf, xf, xb.count, isz)
                    ho = staged.stage_buffer(st, xf, sum(rc), isz)
                    self._a2a_engine(choice.inner, hops, hx, sc, ho, rc, isz)
                    staged.stage_out(st, of, ho, sum(rc) * isz)
                else:
                    self._a2a_engine(choice.engine, ops, xf, sc, of, rc, isz)
                return _result(out, ob)

            return _Plan(sig, run, ops)

        return self._collective(build, "alltoall", async_op)

    def _a2a_engine(
        self, engine: str, ops: ArrayOps, xf: Any, sc: list[int], of: Any, rc: list[int], isz: int
    ) -> None:
        if engine == "mpi":
            native.alltoallv(self._coll, ops, xf, sc, of, rc, isz)
        else:
            alg.alltoallv(self._ctx(ops, isz), xf, sc, of, rc)

    def barrier(self, *, async_op: bool = False) -> Any:
        """Return once every rank has called barrier (in order with queued collectives)."""
        return self._collective(
            lambda: _Plan(Signature("barrier"), lambda: None), "barrier", async_op
        )

    # ------------------------------------------------------------------ point-to-point

    def _p2p_prepare(self, x: Any, what: str, path: str | None) -> tuple[Buf, PathChoice, ArrayOps]:
        b = self._buf(x, what)
        choice = self._choose("send", b, path)
        ops = self._ops_for(b)
        with ops.device_ctx():
            ops.begin(ops.capture())  # the caller's stream finished writing/reading x
        return b, choice, ops

    def send(self, x: Any, dest: int, tag: int = 0, *, path: str | None = None) -> None:
        """Blocking send of ``x`` to rank ``dest``."""
        b, choice, ops = self._p2p_prepare(x, "x", path)
        f = flat(b)
        if choice.engine == "staged":
            with ops.device_ctx():
                StagedTransport(self.mpi_comm, self._stager(b), self.config.chunk_bytes).send(
                    f, dest, tag
                )
        else:
            self.mpi_comm.Send(mem(ops.ptr(f), b.nbytes), dest, tag)

    def recv(self, x: Any, source: int, tag: int = 0, *, path: str | None = None) -> Any:
        """Blocking receive into ``x`` from rank ``source`` (MPI.ANY_SOURCE allowed); returns x."""
        b, choice, ops = self._p2p_prepare(x, "x", path)
        f = flat(b)
        if choice.engine == "staged":
            with ops.device_ctx():
                StagedTransport(self.mpi_comm, self._stager(b), self.config.chunk_bytes).recv(
                    f, source, tag
                )
        else:
            recv_into(self.mpi_comm, ops.ptr(f), b.nbytes, source, tag, self.config.chunk_bytes)
        return x

    def isend(self, x: Any, dest: int, tag: int = 0, *, path: str | None = None) -> Handle:
        """Non-blocking send; ``x`` must stay untouched until the handle's ``wait()``."""
        b, choice, ops = self._p2p_prepare(x, "x", path)
        f = flat(b)
        keep: Any = None
        if choice.engine == "staged":
            st = self._stager(b)
            keep = st.pinned(max(1, b.nbytes))
            with ops.device_ctx():
                st.wait(st.d2h(keep, f, 0, b.nbytes))
            req = self.mpi_comm.Isend(mem(st.host_ptr(keep), b.nbytes), dest, tag)
        else:
            req = self.mpi_comm.Isend(mem(ops.ptr(f), b.nbytes), dest, tag)

        def poll(block: bool) -> bool:
            _ = keep  # the staging buffer lives until the send completes
            if block:
                req.Wait()
                return True
            return bool(req.Test())

        h = Handle("isend", poll)
        h._result = None
        return h

    def irecv(self, x: Any, source: int, tag: int = 0, *, path: str | None = None) -> Handle:
        """Non-blocking receive into ``x``; ``wait()`` returns ``x``."""
        from mpi4py import MPI

        b, choice, ops = self._p2p_prepare(x, "x", path)
        f = flat(b)
        n = b.nbytes
        st = self._stager(b) if choice.engine == "staged" else None
        host = st.pinned(max(1, n)) if st is not None else None
        ptr = st.host_ptr(host) if st is not None else ops.ptr(f)
        status = MPI.Status()
        req = self.mpi_comm.Irecv(mem(ptr, n), source, tag)

        def finish() -> None:
            got = status.Get_count(MPI.BYTE)
            if opens_sequence(got, n, self.config.chunk_bytes):
                # a chunked (staged) sender: the rest follows from the same rank
                recv_rest(self.mpi_comm, ptr, n, got, status.Get_source(), tag)
                got = n
            if st is not None:
                with ops.device_ctx():
                    st.wait(st.h2d(f, host, 0, got))

        def poll(block: bool) -> bool:
            if block:
                req.Wait(status)
            elif not req.Test(status):
                return False
            finish()
            return True

        h = Handle("irecv", poll)
        h._result = x
        return h

    def sendrecv(
        self, x: Any, dest: int, out: Any, source: int, tag: int = 0, *, path: str | None = None
    ) -> Any:
        """Send ``x`` to ``dest`` while receiving ``out`` from ``source``; returns ``out``."""
        r = self.irecv(out, source, tag, path=path)
        s = self.isend(x, dest, tag, path=path)
        s.wait()
        return r.wait()


def _prod(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _result(out: Any, ob: Buf) -> Any:
    return out if out is not None else ob.arr


def _check_root(root: Any, size: int) -> None:
    if not isinstance(root, int) or isinstance(root, bool) or not 0 <= root < size:
        raise CommError(f"root={root!r} is not a rank of this communicator (0..{size - 1})")


def _check_counts(counts: Any, size: int, what: str) -> list[int]:
    try:
        cs = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise CommError(f"{what}={counts!r} is not a list of integers") from None
    if len(cs) != size or any(c < 0 for c in cs):
        raise CommError(f"{what}={cs!r}: need {size} non-negative counts, one per rank")
    return cs


__all__ = ["Communicator", "CudampiError"]
