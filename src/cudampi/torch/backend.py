"""The ``cudampi`` torch.distributed backend: a Python ``ProcessGroup`` on a cudampi Communicator.

torch creates one :class:`CudampiProcessGroup` per group (``init_process_group`` and every
``new_group``) through :func:`create_process_group`, registered with
``torch.distributed.Backend.register_backend(..., extended_api=True, devices=["cpu", "cuda"])``.
The world group runs on ``MPI.COMM_WORLD`` (or the communicator in :class:`Options`; under
torchrun, the job :mod:`cudampi.pmi.join` makes of torch's processes); subgroups
are ``MPI_Comm_create_group`` over the world, made only by their members, as torch calls the
creator only on members.

Collectives run in call order. Those on host tensors, and those on CUDA tensors whose path is
stream-ordered (ipc, nccl: kernels queued on the caller's stream), run in the calling thread and
return a Work whose future is already complete (for CUDA, NCCL's stream semantics), so
``async_op=True``, ``get_future().then(...)``, DDP gradient buckets and comm hooks all work
unchanged. A collective on CUDA tensors whose path synchronizes the host runs on one thread per
group instead, overlapping the caller's work (DDP's backward), as NCCL never blocks the host
(``Options.async_ops``: None, the default, chooses so; True puts every collective on the thread,
False none). ``isend``/``irecv`` are truly non-blocking either way.
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cudampi.config import Config
from cudampi.errors import (
    CommError,
    CommTimeoutError,
    ConfigError,
    CudampiError,
    MismatchError,
)
from cudampi.torch.convert import check_dtype, element_counts, reduce_spec
from cudampi.torch.debug import DetailChecker, detail_enabled
from cudampi.torch.options import BACKEND_NAME, Options
from cudampi.torch.tensors import (
    check_gather_sizes,
    check_scatter_sizes,
    contiguous,
    first_cuda,
    flatten,
    kinds,
    premul,
    unflatten,
    unflatten_columns,
    write_back,
)
from cudampi.torch.work import (
    AsyncRunner,
    as_dist_error,
    completed_work,
    finished_work,
    handle_work,
)
from cudampi.torch.world import (
    GROUPS_MADE,
    WORLD,
    open_subgroup_world,
    open_world,
    timeout_of,
    where,
)

if TYPE_CHECKING:
    from cudampi.comm.communicator import Communicator


def create_process_group(dist_opts: Any, pg_options: Any = None) -> CudampiProcessGroup:
    """The creator torch calls (``extended_api=True``) for the world group and each subgroup."""
    GROUPS_MADE[:] = [True]
    if pg_options is None:
        options = WORLD[0].options if WORLD and dist_opts.global_ranks_in_group else Options()
    elif isinstance(pg_options, Options):
        options = pg_options
    else:
        raise ConfigError(
            f"pg_options={pg_options!r} is not a cudampi.torch.Options. Fix: pass "
            "cudampi.torch.Options(path=..., comm=...) or nothing."
        )
    rank, size = int(dist_opts.group_rank), int(dist_opts.group_size)
    ranks = [int(r) for r in dist_opts.global_ranks_in_group]
    group_id = str(getattr(dist_opts, "group_id", ""))
    if not ranks:
        world = open_world(options, rank, size, dist_opts)
        mpi_comm = world.mpi_comm.Dup()
    else:
        if not WORLD:
            open_subgroup_world(options, ranks, dist_opts.store, timeout_of(dist_opts))
        parent = WORLD[0].mpi_comm
        mpi_group = parent.Get_group()
        sub_group = mpi_group.Incl(ranks)
        try:
            mpi_comm = parent.Create_group(sub_group)
        finally:
            sub_group.Free()
            mpi_group.Free()
        if mpi_comm.rank != rank or mpi_comm.size != size:
            raise CommError(
                f"cudampi: the MPI subgroup of world ranks {ranks} puts this process at rank "
                f"{mpi_comm.rank} of {mpi_comm.size}, torch at {rank} of {size}. This is a bug."
            )
    from cudampi.comm import Communicator

    runner = None
    from mpi4py import MPI

    threads = MPI.Query_thread() == MPI.THREAD_MULTIPLE
    if options.async_ops or (options.async_ops is None and threads):
        if not threads:
            raise ConfigError(
                f"Options(async_ops=True) needs MPI_THREAD_MULTIPLE, but MPI was initialized at "
                f"thread level {MPI.Query_thread()!r}. Fix: leave mpi4py.rc.thread_level at its "
                "default ('multiple'), or use async_ops=False."
            )
        runner = AsyncRunner(f"cudampi-torch-{group_id or 'world'}")
    config = options.config if options.config is not None else Config.load()
    timeout = timeout_of(dist_opts)
    if timeout is not None and timeout.total_seconds() > 0:
        # torch's timeout= (init_process_group / new_group) is this group's deadline
        config = config.replace(timeout=timeout.total_seconds())
    comm = Communicator(mpi_comm, path=options.path, config=config)
    pg = CudampiProcessGroup(
        comm, mpi_comm, rank, size, ranks, group_id, runner=runner, auto=options.async_ops is None
    )
    if detail_enabled():  # TORCH_DISTRIBUTED_DEBUG=DETAIL: torch's wrapper skips Python groups
        pg._detail = DetailChecker(mpi_comm, ranks or list(range(size)))
        weakref.finalize(pg, pg._detail.close)
    return pg


def _collective(method: Callable[..., Any]) -> Callable[..., Any]:
    """Run a collective body now (a finished Work: stream-ordered for CUDA tensors, see
    :func:`~cudampi.torch.work.finished_work`) or on the group's AsyncRunner."""

    @functools.wraps(method)
    def run(self: CudampiProcessGroup, *args: Any, **kwargs: Any) -> Any:
        self._check_open()
        if self._detail is not None:
            self._detail.check(method.__name__, args, kwargs)
        if torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
            self._check_capturable(method.__name__, args)
        if self._runner is None or not self._threaded(method.__name__, args):
            try:
                return finished_work(method(self, *args, **kwargs))
            except CommTimeoutError as exc:
                raise as_dist_error(exc) from exc  # what torch's own backends raise
        return self._runner.submit(lambda: method(self, *args, **kwargs), args)

    return run


_CALL_OF = {
    "broadcast": "broadcast",
    "reduce": "reduce",
    "allgather": "allgather",
    "allgather_coalesced": "allgather",
    "all_gather_single": "allgather",
    "all_gather_single_coalesced": "allgather",
    "reduce_scatter": "reduce_scatter",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_single_coalesced": "reduce_scatter",
    "all_to_all_single": "alltoall",
    "alltoall": "alltoall",
    "gather": "gather",
    "scatter": "scatter",
}
"""The Communicator call behind a group method (the others: allreduce)."""


# Typed as Any: the Python overrides follow c10d's (untyped, version-dependent) call convention
# rather than the overload stubs of one torch release.
_ProcessGroup: Any = dist.ProcessGroup


class CudampiProcessGroup(_ProcessGroup):
    """One torch.distributed group whose collectives run on a :class:`cudampi.comm.Communicator`.

    Method names cover torch 2.4 to 2.13 (``_allgather_base`` became ``all_gather_single``,
    ``_reduce_scatter_base`` ``reduce_scatter_single``, ``alltoall_base`` ``all_to_all_single``).
    """

    supports_splitting = False
    supports_coalescing = False
    supports_time_estimate = False
    _detail: DetailChecker | None = None  # set under TORCH_DISTRIBUTED_DEBUG=DETAIL

    def __init__(
        self,
        comm: Communicator,
        mpi_comm: Any,
        rank: int,
        size: int,
        global_ranks: Sequence[int] = (),
        group_id: str = "",
        *,
        runner: AsyncRunner | None = None,
        auto: bool = False,
    ) -> None:
        super().__init__(rank, size)
        self._runner = runner
        self._auto = auto and runner is not None
        self._host_path: dict[tuple[str, Any, int, Any], bool] = {}
        self._comm = comm
        self._mpi_comm = mpi_comm
        self._rank = rank
        self._size = size
        self._is_world = not global_ranks
        self._global_ranks = list(global_ranks) or list(range(size))
        self._cudampi_group_name = group_id
        self._cudampi_group_desc = ""
        self._closed = False
        self._finalizer = weakref.finalize(self, _close, comm, mpi_comm, runner)
        # Not at interpreter exit: a group still open then is one this process leaves while the
        # others may call collectives on it; its Communicator tells them so (comm.deadline).
        self._finalizer.atexit = False

    # --- identity ---------------------------------------------------------------------------
    def getBackendName(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return (
            f"CudampiProcessGroup(rank={self._rank}, size={self._size}, ranks={self._global_ranks})"
        )

    @property
    def communicator(self) -> Communicator:
        """The :class:`cudampi.comm.Communicator` this group runs on."""
        return self._comm

    def _set_group_name(self, name: str) -> None:
        # torch <= 2.5 keeps a group's name in its backends, and a Python group has none, so the
        # name is also kept here (DeviceMesh and functional collectives look groups up by it).
        self._cudampi_group_name = name
        try:
            super()._set_group_name(name)
        except RuntimeError:
            pass

    @property
    def group_name(self) -> str:
        return self._cudampi_group_name

    def _set_group_desc(self, desc: str) -> None:
        self._cudampi_group_desc = desc
        try:
            super()._set_group_desc(desc)
        except (RuntimeError, AttributeError):
            pass

    @property
    def group_desc(self) -> str:
        return self._cudampi_group_desc

    def _get_backend(self, device: Any) -> CudampiProcessGroup:
        # A Python group has no c10d backend per device; torch's Python code that asks for one
        # (FSDP allocation, init_process_group(device_id=...)) only reads the supports_* flags.
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        return False

    def shutdown(self) -> None:
        """Free this group's communicators (``destroy_process_group`` calls it)."""
        self._closed = True
        if self._is_world:
            WORLD.clear()  # a later init_process_group / new_group starts from scratch
        self._finalizer()

    def abort(self) -> None:
        self.shutdown()

    def _threaded(self, name: str, args: Sequence[Any]) -> bool:
        """Whether this call runs on the group's thread: every call with ``async_ops=True``;
        under auto, a call behind one still on the thread (call order), or one of CUDA
        tensors whose path synchronizes the host (remembered per call, dtype, size, device:
        ``path_for`` is the same for them, and DDP repeats its buckets)."""
        assert self._runner is not None
        if not self._auto or self._runner.busy():
            return True
        tensor = first_cuda(args)
        if tensor is None:
            return False
        key = (name, tensor.dtype, tensor.numel(), tensor.device)
        known = self._host_path.get(key)
        if known is None:
            try:
                choice = self._comm.path_for(_CALL_OF.get(name, "allreduce"), tensor)
            except Exception:  # the call itself says what is wrong, in the caller's thread
                return False
            if len(self._host_path) >= 4096:  # sizes that keep changing: forget, ask again
                self._host_path.clear()
            known = self._host_path[key] = not choice.stream_ordered
        return known

    def _check_capturable(self, name: str, args: Sequence[Any]) -> None:
        """Inside CUDA graph capture only a stream-ordered engine (ipc, nccl) can run a call:
        the others block the host on the caller's stream, which capture forbids (and which
        would invalidate the graph with an obscure CUDA error). Say so before running."""
        tensor = first_cuda(args)
        if self._runner is not None and not self._auto:
            why = "Options(async_ops=True) runs it on a thread and a side stream of its own"
        elif self._runner is not None and self._runner.busy():
            why = (
                "earlier collectives of this group still run on its thread (the path of their "
                "tensors synchronizes the host); wait for them (torch.cuda.synchronize and "
                "their Work.wait()) before capturing"
            )
        elif tensor is None:
            why = (
                "it moves no CUDA tensor (a host-side call runs once, at capture, never at replay)"
            )
        else:
            choice = self._comm.path_for(_CALL_OF.get(name, "allreduce"), tensor)
            if choice.stream_ordered:
                return
            why = f"its path here is {str(choice)!r}, which synchronizes the host ({choice.reason})"
        raise CommError(
            f"cudampi: {name} inside CUDA graph capture on {where(self._rank, self._size)}: "
            f"{why}. Fix: capture with the default Options and path 'ipc' (CUDAMPI_PATH=ipc, "
            "ranks of one node) so collectives are kernel launches on the capturing stream, and "
            "run host-side calls before the capture."
        )

    def _check_open(self) -> None:
        if self._closed:
            raise CommError(
                f"cudampi process group {self._global_ranks} was destroyed. Fix: create a new "
                "group (dist.new_group / init_process_group) before using it."
            )

    @contextlib.contextmanager
    def _checks(self, call: str) -> Iterator[None]:
        """Local checks of one collective's arguments: where one fails on this rank, every rank
        raises in ``call`` (through the Communicator's cross-rank check) instead of the others
        waiting in it for ever."""
        try:
            yield
        except Exception as exc:
            self._comm.refuse(call, exc)
            raise

    # --- collectives ------------------------------------------------------------------------
    @_collective
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        spec = reduce_spec(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for t in tensors:
            if t.layout == torch.sparse_coo:
                self._allreduce_sparse(t, spec)
                continue
            with self._checks("allreduce"):
                check_dtype(spec, t.dtype)
            buf = contiguous(t)
            premul(buf, spec.premul, in_place=True)
            self._comm.allreduce(buf, spec.op, out=buf)
            write_back(t, buf)
        return tensors

    def _allreduce_sparse(self, t: torch.Tensor, spec: Any) -> None:
        """Sum sparse COO tensors as gloo does: gather every rank's indices and values, add them
        up (``coalesce``) and put the result, coalesced, in ``t`` on every rank. SUM only."""
        with self._checks("allgather"):
            if spec.torch_name != "SUM":
                raise CommError(
                    f"all_reduce of a sparse tensor with ReduceOp.{spec.torch_name}: sparse "
                    "all_reduce supports ReduceOp.SUM only (as gloo). Fix: use SUM, or reduce "
                    "t.to_dense()."
                )
        x = t.coalesce()
        nnz, sparse_dim = x._nnz(), x.sparse_dim()
        mine = [sparse_dim, *x.shape]
        metas = self._comm.allgather(torch.tensor([nnz, *mine], dtype=torch.int64))
        if any(m[1:].tolist() != mine for m in metas):
            odd = next(i for i, m in enumerate(metas) if m[1:].tolist() != mine)
            raise MismatchError(
                f"all_reduce of sparse tensors: rank {self._rank} has shape {list(x.shape)} "
                f"with {sparse_dim} sparse dims, rank {odd} shape {metas[odd][2:].tolist()} "
                f"with {int(metas[odd][1])}. Every rank must pass a sparse tensor of the same "
                "shape and sparse dims."
            )
        nnzs = [int(m[0]) for m in metas]
        row = math.prod(x.shape[sparse_dim:])  # elements per entry (dense dims of a hybrid)
        # Every rank's entries, one after another (nnz-major, so allgatherv concatenates them).
        idx = self._comm.allgatherv(
            x.indices().t().contiguous().view(-1), [n * sparse_dim for n in nnzs]
        )
        vals = self._comm.allgatherv(x.values().contiguous().view(-1), [n * row for n in nnzs])
        total = sum(nnzs)
        summed = torch.sparse_coo_tensor(
            idx.view(total, sparse_dim).t(),
            vals.view(total, *x.shape[sparse_dim:]),
            x.shape,
            dtype=x.dtype,
            device=x.device,
        ).coalesce()
        t.copy_(summed)

    @_collective
    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        spec = reduce_spec(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        with self._checks("allreduce"):
            for t in tensors:
                if t.layout == torch.sparse_coo:
                    raise CommError(
                        "all_reduce_coalesced of a sparse tensor: coalesced calls take dense "
                        "tensors. Fix: all_reduce the sparse tensor on its own."
                    )
                check_dtype(spec, t.dtype)
        # One flat buffer and one Communicator call per (device, dtype), not one per tensor.
        for group in kinds(tensors):
            flat = flatten(group)
            premul(flat, spec.premul, in_place=True)
            self._comm.allreduce(flat, spec.op, out=flat)
            unflatten(flat, group)
        return tensors

    @_collective
    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        for t in tensors:
            buf = contiguous(t)
            self._comm.broadcast(buf, root=root)
            write_back(t, buf)
        return tensors

    @_collective
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> Any:
        spec = reduce_spec(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        root = int(opts.rootRank) if opts is not None else 0
        for t in tensors:
            with self._checks("reduce"):
                check_dtype(spec, t.dtype)
            src = premul(contiguous(t), spec.premul, in_place=False)
            # Only the root's tensor changes (as with NCCL); the others keep their input.
            if self._rank == root:
                out = contiguous(t)
                self._comm.reduce(src, spec.op, root=root, out=out)
                write_back(t, out)
            else:
                self._comm.reduce(src, spec.op, root=root)
        return tensors

    @_collective
    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        for outs, inp in zip(output_tensors, input_tensors):
            self._allgather_list(outs, inp)
        return output_tensors

    def _allgather_list(self, outs: list[torch.Tensor], inp: torch.Tensor) -> None:
        with self._checks("allgather"):
            if len(outs) != self._size:
                raise CommError(
                    f"all_gather: {len(outs)} output tensors for a group of {self._size}. Fix: "
                    "pass one output tensor per rank."
                )
        src = contiguous(inp)
        counts = [o.numel() for o in outs]
        if all(c == src.numel() for c in counts):
            gathered = self._comm.allgather(src)
            for o, g in zip(outs, gathered):
                o.copy_(g.view(o.shape))
        else:
            flat = self._comm.allgatherv(src.reshape(-1), counts)
            offset = 0
            for o, c in zip(outs, counts):
                o.copy_(flat[offset : offset + c].view(o.shape))
                offset += c

    @_collective
    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        # torch's layout is by rank, then tensor: output_lists[r][i] receives rank r's
        # input_list[i] (allgather's is by tensor, then rank).
        with self._checks("allgather"):
            if len(output_lists) != self._size or any(
                len(o) != len(input_list) for o in output_lists
            ):
                raise CommError(
                    f"all_gather_coalesced: output_tensor_lists has {len(output_lists)} lists of "
                    f"{sorted({len(o) for o in output_lists})} tensors for a group of "
                    f"{self._size} and {len(input_list)} input tensors. Fix: pass one list per "
                    "rank, each with one tensor per input tensor."
                )
        for i, inp in enumerate(input_list):
            self._allgather_list([outs[i] for outs in output_lists], inp)
        return output_lists

    @_collective
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> Any:
        self._allgather_into(output, input)
        return [output]

    _allgather_base = all_gather_single

    def _allgather_into(self, output: torch.Tensor, input: torch.Tensor) -> None:
        with self._checks("allgather"):
            check_gather_sizes(output, input, self._size)
        src = contiguous(input)
        out = contiguous(output)
        self._comm.allgather(src, out=out.view(self._size, *src.shape))
        write_back(output, out)

    @_collective
    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        with self._checks("allgather"):
            if len(outputs) != len(inputs):
                raise CommError(
                    f"all_gather_into_tensor_coalesced: {len(outputs)} outputs for "
                    f"{len(inputs)} inputs. Fix: pass one output per input."
                )
            for out, inp in zip(outputs, inputs):
                check_gather_sizes(out, inp, self._size)
        # Every tensor's input side by side in one buffer (k elements in all): one allgather
        # gives a (size, k) block whose columns are each tensor's (size, n) output.
        for idx in kinds(inputs, index=True):
            ins = [inputs[i] for i in idx]
            outs = [outputs[i] for i in idx]
            if len(idx) == 1:
                self._allgather_into(outs[0], ins[0])
                continue
            flat = flatten(ins)
            gathered = flat.new_empty((self._size, flat.numel()))
            self._comm.allgather(flat, out=gathered)
            unflatten_columns(gathered, outs, [t.numel() for t in ins])
        return outputs

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    @_collective
    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        spec = reduce_spec(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        for out, ins in zip(output_tensors, input_tensors):
            with self._checks("reduce_scatter"):
                check_dtype(spec, out.dtype)
                if len(ins) != self._size:
                    raise CommError(
                        f"reduce_scatter: {len(ins)} input tensors for a group of {self._size}. "
                        "Fix: pass one input tensor per rank."
                    )
            counts = [t.numel() for t in ins]
            flat = torch.cat([t.reshape(-1) for t in ins])
            premul(flat, spec.premul, in_place=True)
            if all(c == out.numel() for c in counts):
                buf = contiguous(out)
                self._comm.reduce_scatter(flat.view(self._size, -1), spec.op, out=buf.view(1, -1))
                write_back(out, buf)
            else:
                res = self._comm.reduce_scatter(flat, spec.op, counts=counts)
                out.copy_(res.view(out.shape))
        return output_tensors

    @_collective
    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> Any:
        spec = reduce_spec(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        self._reduce_scatter_into(output, input, spec)
        return [output]

    _reduce_scatter_base = reduce_scatter_single

    def _reduce_scatter_into(self, output: torch.Tensor, input: torch.Tensor, spec: Any) -> None:
        with self._checks("reduce_scatter"):
            check_dtype(spec, input.dtype)
            check_scatter_sizes(output, input, self._size)
        src = premul(contiguous(input), spec.premul, in_place=False)
        out = contiguous(output)
        self._comm.reduce_scatter(src.view(self._size, -1), spec.op, out=out.view(1, -1))
        write_back(output, out)

    @_collective
    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> Any:
        spec = reduce_spec(opts.reduceOp if opts is not None else dist.ReduceOp.SUM)
        with self._checks("reduce_scatter"):
            if len(outputs) != len(inputs):
                raise CommError(
                    f"reduce_scatter_tensor_coalesced: {len(outputs)} outputs for "
                    f"{len(inputs)} inputs. Fix: pass one output per input."
                )
            for out, inp in zip(outputs, inputs):
                check_dtype(spec, inp.dtype)
                check_scatter_sizes(out, inp, self._size)
        # Rank r's block of every input side by side in row r of one (size, k) buffer: one
        # reduce_scatter gives this rank's k elements, every tensor's output one after another.
        for idx in kinds(inputs, index=True):
            outs = [outputs[i] for i in idx]
            if len(idx) == 1:
                self._reduce_scatter_into(outs[0], inputs[idx[0]], spec)
                continue
            counts = [t.numel() for t in outs]
            rows = torch.cat([inputs[i].reshape(self._size, n) for i, n in zip(idx, counts)], dim=1)
            premul(rows, spec.premul, in_place=True)
            flat = rows.new_empty((1, rows.shape[1]))
            self._comm.reduce_scatter(rows, spec.op, out=flat)
            unflatten(flat.view(-1), outs)
        return outputs

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    @_collective
    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Sequence[int],
        input_split_sizes: Sequence[int],
        opts: Any = None,
    ) -> Any:
        with self._checks("alltoall"):
            send = element_counts(input_split_sizes, list(input.shape), self._size, "input")
            recv = element_counts(output_split_sizes, list(output.shape), self._size, "output")
        src = contiguous(input)
        out = contiguous(output)
        if len(set(send)) == 1 and send == recv:
            self._comm.alltoall(src.view(self._size, -1), out=out.view(self._size, -1))
        else:
            self._comm.alltoall(src.view(-1), out=out.view(-1), send_counts=send, recv_counts=recv)
        write_back(output, out)
        return [output]

    alltoall_base = all_to_all_single

    @_collective
    def alltoall(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        with self._checks("alltoall"):
            if len(output_tensors) != self._size or len(input_tensors) != self._size:
                raise CommError(
                    f"all_to_all: {len(input_tensors)} inputs and {len(output_tensors)} outputs "
                    f"for a group of {self._size}. Fix: pass one tensor per rank in each list."
                )
        send = [t.numel() for t in input_tensors]
        recv = [t.numel() for t in output_tensors]
        flat_in = torch.cat([t.reshape(-1) for t in input_tensors])
        flat_out = torch.empty(sum(recv), dtype=flat_in.dtype, device=flat_in.device)
        self._comm.alltoall(flat_in, out=flat_out, send_counts=send, recv_counts=recv)
        offset = 0
        for o, c in zip(output_tensors, recv):
            o.copy_(flat_out[offset : offset + c].view(o.shape))
            offset += c
        return output_tensors

    @_collective
    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        src = contiguous(input_tensors[0])
        with self._checks("gather"):
            if self._rank == root and len(output_tensors[0]) != self._size:
                raise CommError(
                    f"gather: {len(output_tensors[0])} output tensors on the root for a group "
                    f"of {self._size}. Fix: pass gather_list with one tensor per rank."
                )
        gathered = self._comm.gather(src, root=root)
        if self._rank == root:
            outs = output_tensors[0]
            for o, g in zip(outs, gathered):
                o.copy_(g.view(o.shape))
        return output_tensors

    @_collective
    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> Any:
        root = int(opts.rootRank) if opts is not None else 0
        out = contiguous(output_tensors[0])
        if self._rank == root:
            ins = input_tensors[0]
            with self._checks("scatter"):
                if len(ins) != self._size:
                    raise CommError(
                        f"scatter: {len(ins)} input tensors on the root for a group of "
                        f"{self._size}. Fix: pass scatter_list with one tensor per rank."
                    )
                src = torch.stack([contiguous(t).view(out.shape) for t in ins])
            self._comm.scatter(src, root=root, out=out)
        else:
            self._comm.scatter(None, root=root, out=out)
        write_back(output_tensors[0], out)
        return output_tensors

    @_collective
    def barrier(self, opts: Any = None) -> Any:
        self._comm.barrier()
        return []

    # --- point to point ---------------------------------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> Any:
        self._check_open()
        buf = contiguous(tensors[0])
        handle = self._comm.isend(buf, int(dstRank), tag=int(tag))

        def after() -> None:
            del keep[:]  # a contiguous copy lives until the send completes

        keep = [buf]
        return handle_work(handle, tensors, after=after)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> Any:
        self._check_open()
        t = tensors[0]
        buf = contiguous(t)
        handle = self._comm.irecv(buf, int(srcRank), tag=int(tag))
        after: Callable[[], None] | None = None
        if buf is not t:

            def after() -> None:
                t.copy_(buf)

        return handle_work(handle, tensors, source=int(srcRank), after=after)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> Any:
        # Probe (blocking) for the first matching message on the Communicator's point-to-point
        # communicator, then receive exactly that sender's message: a chunked (staged) message
        # then arrives whole from one rank, and the Work can tell torch the source.
        from mpi4py import MPI

        from cudampi.comm.deadline import spin
        from cudampi.comm.engines.ipc import ANY_SOURCE_REFUSED

        self._check_open()
        try:
            on_ipc = self._comm.path_for("recv", tensors[0]).engine == "ipc"
        except CudampiError:
            on_ipc = False  # the receive itself says why
        if on_ipc:  # its sends are kernels no MPI probe sees: say so now, not at the deadline
            raise as_dist_error(
                CommError(f"recv (tag {tag}, CUDAMPI_PATH=ipc): {ANY_SOURCE_REFUSED} (src=)")
            )
        status = MPI.Status()
        limit = self._comm.config.timeout
        late = CommTimeoutError(
            f"recv from any rank (tag {tag}) did not start within {limit:g} s: no rank sent"
        )
        try:
            spin(
                lambda: bool(self._comm.mpi_comm.Iprobe(MPI.ANY_SOURCE, int(tag), status)),
                limit,
                lambda: late,
            )
        except CommTimeoutError as exc:
            raise as_dist_error(exc) from exc
        return self.recv(tensors, status.Get_source(), tag)

    # --- coalescing (ops already ran; nothing is pending at the end) ------------------------
    def _start_coalescing(self, device: Any) -> None:
        self._check_open()

    def _end_coalescing(self, device: Any) -> Any:
        self._comm.flush()  # the ipc path's grouped sends and receives: one launch, now
        if self._runner is not None and self._threaded("barrier", ()):
            return self._runner.submit(list, [])  # done once everything queued before it is
        return completed_work([])


def _close(comm: Communicator, mpi_comm: Any, runner: AsyncRunner | None = None) -> None:
    if runner is not None:
        runner.close()  # queued collectives finish before their communicator goes
    try:
        comm.close()
    finally:
        try:
            from mpi4py import MPI

            if not MPI.Is_finalized() and mpi_comm != MPI.COMM_NULL:
                mpi_comm.Free()
        except Exception:  # freeing at teardown must not mask the real error
            pass


def register() -> None:
    """Register the ``cudampi`` backend and the ``cudampi://`` rendezvous with torch (idempotent).

    Also lets the default ``env://`` take rank and size from MPI where its variables are missing
    under an MPI launcher, so a plain ``init_process_group("cudampi")`` works under mpirun.
    """
    import importlib

    from cudampi.torch import rendezvous as ours

    # (``torch.distributed.rendezvous`` the attribute is a function; the module is this one.)
    rdzv = importlib.import_module("torch.distributed.rendezvous")

    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        kwargs: dict[str, Any] = {"extended_api": True}
        try:
            dist.Backend.register_backend(
                BACKEND_NAME, create_process_group, devices=["cpu", "cuda"], **kwargs
            )
        except TypeError:  # a wheel without devices= (older than cudampi supports)
            dist.Backend.register_backend(BACKEND_NAME, create_process_group, **kwargs)
    if ours.SCHEME not in rdzv._rendezvous_handlers:
        rdzv.register_rendezvous_handler(ours.SCHEME, ours.mpi_rendezvous)
    ours.wrap_env_handler(rdzv._rendezvous_handlers)
