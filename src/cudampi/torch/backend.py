"""The ``cudampi`` torch.distributed backend: a Python ``ProcessGroup`` on a cudampi Communicator.

torch creates one :class:`CudampiProcessGroup` per group through
:func:`cudampi.torch.groups.create_process_group`. Each c10d method (:data:`cudampi.torch.methods.
METHODS` names them all, torch 2.4 to 2.13) gets its options decoded once and turns tensors into
the Communicator's calls, using its public API only.

Collectives run in call order. Those on host tensors, and those on CUDA tensors whose path is
stream-ordered (ipc, nccl: kernels queued on the caller's stream), run in the calling thread and
return a Work whose future is already complete (for CUDA, NCCL's stream semantics), so
``async_op=True``, ``get_future().then(...)``, DDP gradient buckets and comm hooks all work
unchanged. A collective on CUDA tensors whose path synchronizes the host runs on one thread per
group instead, overlapping the caller's work (DDP's backward), as NCCL never blocks the host,
unless its caller waits for it at once (``dist.all_reduce(t)``: c10d's ``asyncOp`` false)
(``Options.async_ops``: None, the default, chooses so; True puts every collective on the thread,
False none). ``isend``/``irecv`` are truly non-blocking either way.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from cudampi.errors import CommError
from cudampi.torch.convert import check_dtype, element_counts
from cudampi.torch.debug import DetailChecker
from cudampi.torch.dispatch import check_capturable, threaded
from cudampi.torch.dispatch import collective as _collective
from cudampi.torch.methods import Opts
from cudampi.torch.options import BACKEND_NAME
from cudampi.torch.sparse import allreduce_sparse
from cudampi.torch.tensors import (
    check_gather_sizes,
    check_scatter_sizes,
    contiguous,
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
    handle_work,
)
from cudampi.torch.world import WORLD

if TYPE_CHECKING:
    from cudampi.comm import Communicator


# Typed as Any: the Python overrides follow c10d's (untyped, version-dependent) call convention
# rather than the overload stubs of one torch release.
_ProcessGroup: Any = dist.ProcessGroup


class _Refusing:
    """``with``: an exception raised inside is first told to every rank as this rank's
    refusal of ``call`` (:meth:`cudampi.comm.Communicator.refuse`), then raised here."""

    __slots__ = ("_call", "_comm")

    def __init__(self, comm: Communicator, call: str) -> None:
        self._comm, self._call = comm, call

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> None:
        if isinstance(exc, Exception):
            self._comm.refuse(self._call, exc)


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
        self._comm = comm
        self._mpi_comm = mpi_comm
        self._rank = rank
        self._size = size
        self._is_world = not global_ranks
        self._global_ranks = list(global_ranks) or list(range(size))
        self._cudampi_group_name = group_id
        self._cudampi_group_desc = ""
        self._closed = False
        self._refusing: dict[str, _Refusing] = {}
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

    _threaded = threaded
    _check_capturable = check_capturable

    def _check_open(self) -> None:
        if self._closed:
            raise CommError(
                f"cudampi process group {self._global_ranks} was destroyed. Fix: create a new "
                "group (dist.new_group / init_process_group) before using it."
            )

    def _checks(self, call: str) -> _Refusing:
        """Local checks of one collective's arguments: where one fails on this rank, every rank
        raises in ``call`` (through the Communicator's cross-rank check) instead of the others
        waiting in it for ever."""
        made = self._refusing.get(call)
        if made is None:
            made = self._refusing[call] = _Refusing(self._comm, call)
        return made

    # --- collectives ------------------------------------------------------------------------
    @_collective
    def allreduce(self, tensors: list[torch.Tensor], o: Opts) -> Any:
        spec = o.spec
        for t in tensors:
            if t.is_sparse:
                with self._checks("allgather"):
                    if spec.torch_name != "SUM":
                        raise CommError(
                            f"all_reduce of a sparse tensor with ReduceOp.{spec.torch_name}: "
                            "sparse all_reduce supports ReduceOp.SUM only (as gloo). Fix: use "
                            "SUM, or reduce t.to_dense()."
                        )
                allreduce_sparse(self._comm, t)
                continue
            with self._checks("allreduce"):
                check_dtype(spec, t.dtype)
            buf = contiguous(t)
            premul(buf, spec.premul, in_place=True)
            self._comm.allreduce(buf, spec.op, out=buf)
            write_back(t, buf)
        return tensors

    @_collective
    def allreduce_coalesced(self, tensors: list[torch.Tensor], o: Opts) -> Any:
        spec = o.spec
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
    def broadcast(self, tensors: list[torch.Tensor], o: Opts) -> Any:
        for t in tensors:
            buf = contiguous(t)
            self._comm.broadcast(buf, root=o.root)
            write_back(t, buf)
        return tensors

    @_collective
    def reduce(self, tensors: list[torch.Tensor], o: Opts) -> Any:
        spec, root = o.spec, o.root
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
        o: Opts,
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
        counts = [dst.numel() for dst in outs]
        if all(c == src.numel() for c in counts):
            gathered = self._comm.allgather(src)
            for dst, g in zip(outs, gathered):
                dst.copy_(g.view(dst.shape))
        else:
            flat = self._comm.allgatherv(src.reshape(-1), counts)
            offset = 0
            for dst, c in zip(outs, counts):
                dst.copy_(flat[offset : offset + c].view(dst.shape))
                offset += c

    @_collective
    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_list: list[torch.Tensor],
        o: Opts,
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
    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, o: Opts) -> Any:
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
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], o: Opts
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
        o: Opts,
    ) -> Any:
        spec = o.spec
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
    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, o: Opts) -> Any:
        self._reduce_scatter_into(output, input, o.spec)
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
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], o: Opts
    ) -> Any:
        spec = o.spec
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
        o: Opts,
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
        o: Opts,
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
        for dst, c in zip(output_tensors, recv):
            dst.copy_(flat_out[offset : offset + c].view(dst.shape))
            offset += c
        return output_tensors

    @_collective
    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        o: Opts,
    ) -> Any:
        root = o.root
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
            for dst, g in zip(outs, gathered):
                dst.copy_(g.view(dst.shape))
        return output_tensors

    @_collective
    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        o: Opts,
    ) -> Any:
        root = o.root
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
    def barrier(self, o: Opts) -> Any:
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
        # Wait for the first matching message from any rank, then receive exactly that sender's
        # message: a chunked (staged) message then arrives whole from one rank, and the Work can
        # tell torch the source.
        self._check_open()
        try:
            source = self._comm.probe_any(tensors[0], tag)
        except CommError as exc:  # no rank sent in time, or a path whose messages MPI never sees
            raise as_dist_error(exc) from exc
        return self.recv(tensors, source, tag)

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
