"""Path adapters: one class per way of moving the data, all with the same methods.

``ipc``, ``nccl``, ``gpu-ring``, ``staged``, ``native``, ``host``: a
:class:`cudampi.comm.Communicator` forced onto that path. ``torch-nccl``, ``torch-gloo``,
``torch-cudampi``: torch.distributed groups of that backend. Peers, measured in the same run
for the ratios: ``mpi`` (mpi4py directly; device buffers staged through pinned host copies,
i.e. plain "MPI host-staged") and ``copy`` (one raw device-to-device copy of the same size; a
host memcpy on the CPU).

A path that cannot run a case says why (:class:`Skip`, or a reason from ``check``) instead of
being run blindly: ``native`` on device memory only where the probe proved MPI's collectives
take device buffers; ``nccl`` and ``torch-nccl`` only with a GPU per rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from cudampi.bench.session import Session
from cudampi.comm.arrays import Checks, is_float
from cudampi.names import BITWISE_OPS, PATHS

COMMUNICATOR_PATHS = PATHS
"""The Communicator on each of its paths: ``auto`` (what it chooses per call, as a user's code
gets it), and forced onto each other one (``nccl``: cudampi's NCCL engine, beside torch's own
NCCL as ``torch-nccl``)."""
TORCH_PATHS = {"torch-nccl": "nccl", "torch-gloo": "gloo", "torch-cudampi": "cudampi"}
DDP_PATHS: dict[str, str | None] = {
    "ddp-nocomm": None,
    **TORCH_PATHS,
    "torch-cudampi-async": "cudampi-async",
}
"""``bench ddp``'s paths and the backend of each one's group. Beside the torch paths:
``torch-cudampi-async``, a cudampi group with ``Options(async_ops=True)``, where gradient buckets
are reduced on the group's thread while backward goes on; ``ddp-nocomm`` (None: the run's
default group), DDP whose comm hook hands every bucket back untouched: DDP's own cost without
gradient communication."""
FSDP_PATHS: dict[str, str] = {p: b for p, b in DDP_PATHS.items() if b is not None}
"""``bench fsdp``'s FSDP2 paths (``fully_shard`` on a group of that backend), DDP's less
``ddp-nocomm``."""
FSDP_PEERS: dict[str, str] = {f"ddp-{p}": p for p in FSDP_PATHS}
"""``bench fsdp``'s DDP peers: ``ddp-<path>`` is DistributedDataParallel on ``<path>``'s backend,
the same model in the same run (the FSDP2/DDP ratio's denominator)."""
PEERS = ("mpi", "copy")
BENCH_PATHS = (*COMMUNICATOR_PATHS, *TORCH_PATHS, *PEERS)
"""Every path ``--paths`` accepts (``all`` is all of them)."""

DESCRIPTION = {
    "auto": "cudampi's default: the path the Communicator chooses per call (its runs: line)",
    "ipc": "cudampi's GPU kernels over CUDA IPC, on the caller's stream (ranks of one node)",
    "nccl": "cudampi's NCCL engine, bootstrapped over MPI, on the caller's stream (a GPU per rank)",
    "gpu-ring": "cudampi's ring/recursive-doubling algorithms over MPI point-to-point",
    "staged": "cudampi, buffers staged through pinned host memory in pipelined chunks",
    "native": "cudampi handing the buffers (host or device) to MPI's own collective",
    "host": "cudampi on host arrays: MPI's own collective",
    "torch-nccl": "torch.distributed, NCCL backend",
    "torch-gloo": "torch.distributed, Gloo backend",
    "torch-cudampi": "torch.distributed, cudampi backend",
    "torch-cudampi-async": "torch.distributed, cudampi backend with Options(async_ops=True)",
    "ddp-nocomm": "DDP's own cost without gradient communication (a comm hook that returns "
    "each bucket untouched): the ceiling for every backend",
    "mpi": "peer: mpi4py directly (device buffers staged through pinned host copies)",
    "copy": "peer: one raw copy of the same size (device-to-device; memcpy on the host)",
}


class Skip(Exception):
    """This path cannot run here; the message says why (it becomes the 'skipped' reason)."""


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return f"{type(exc).__name__}: {first[:300]}"


T = TypeVar("T")


def attempt(s: Session, build: Callable[[], T]) -> tuple[T | None, str | None]:
    """Run ``build`` on every rank: its result here, and what went wrong as every rank agrees
    (None: nothing, on any rank; else :meth:`Session.first_error` of a :class:`Skip`'s reason
    or the exception described). The result is this rank's also when another rank failed: the
    caller closes it then. Collective."""
    made: T | None = None
    error: str | None = None
    try:
        made = build()
    except Skip as exc:
        error = str(exc)
    except Exception as exc:  # a path that cannot be built is a skip, not a crash
        error = describe_error(exc)
    return made, s.first_error(error)


class PathAdapter:
    """Base of every adapter: every op not overridden is unsupported (a skip, with why)."""

    name = "?"
    inplace_reduce = False
    """allreduce/reduce work in place on ``recv`` (which the unit fills with the input)."""

    def __init__(self, lib: Checks) -> None:
        self.lib = lib

    def check(self, op: str, dtype: str, redop: str | None, session: Session) -> str | None:
        """Why this path cannot run this case here, or None when it can."""
        if redop in BITWISE_OPS and is_float(dtype):
            return f"{redop} is a bitwise reduction: integer dtypes only, not {dtype}"
        if redop == "avg" and not is_float(dtype):
            return f"avg of integers would round: float dtypes only, not {dtype}"
        if op == "copy":
            return None if self.name == "copy" else "copy is the raw-copy peer, not a path op"
        if self.name == "copy":
            return f"the copy peer only copies; it has no {op}"
        return None

    def _unsupported(self, op: str) -> Skip:
        return Skip(f"{self.name} has no {op}")

    def allreduce(self, send: Any, recv: Any, op: str) -> None:
        raise self._unsupported("allreduce")

    def reduce(self, send: Any, recv: Any, op: str, root: int) -> None:
        raise self._unsupported("reduce")

    def reduce_scatter(self, send: Any, recv: Any, op: str) -> None:
        raise self._unsupported("reduce_scatter")

    def allgather(self, send: Any, recv: Any) -> None:
        raise self._unsupported("allgather")

    def alltoall(self, send: Any, recv: Any) -> None:
        raise self._unsupported("alltoall")

    def broadcast(self, buf: Any, root: int) -> None:
        raise self._unsupported("broadcast")

    def sendrecv(self, send: Any, recv: Any, dest: int, source: int) -> None:
        raise self._unsupported("sendrecv")

    def copy(self, send: Any, recv: Any) -> None:
        raise self._unsupported("copy")

    def close(self) -> None:
        """Release communicators and staging memory."""


class CudampiPath(PathAdapter):
    """A cudampi Communicator whose every call is forced onto one path; with ``in_place`` its
    allreduce and reduce run in place (the output buffer holds the input), as torch's do."""

    def __init__(self, name: str, lib: Checks, session: Session, *, in_place: bool = False) -> None:
        super().__init__(lib)
        self.name = name
        self.inplace_reduce = in_place
        try:
            from cudampi.comm import Communicator
        except ImportError as exc:
            raise Skip(f"cudampi.comm is not importable ({exc})") from None
        if name == "nccl":
            _check_nccl(session, lib)
        self.comm = Communicator(session.world, path=name)

    def check(self, op: str, dtype: str, redop: str | None, session: Session) -> str | None:
        reason = super().check(op, dtype, redop, session)
        if reason:
            return reason
        # Ask the Communicator itself which engine this path would use, so a path the probe
        # did not prove (native on device memory: MPI's reduction on device pointers
        # segfaults on Open MPI 4.1.6 and 5.0.11) is skipped, never run blindly.
        from cudampi.errors import CudampiError

        try:
            probe = self.lib.empty((1,), dtype)
            self.choice = self.comm.path_for(op, probe)
        except CudampiError as exc:
            return str(exc)
        if self.name == "nccl" and op == "sendrecv":
            return "nccl moves collectives; point-to-point goes through MPI (the gpu-ring row)"
        if self.name in ("ipc", "nccl") and self.choice != self.name:
            return f"{self.name} moves device arrays; here it would run {self.choice}"
        if op == "copy":
            return None
        return self.comm.refusal(op, probe, redop)

    def allreduce(self, send: Any, recv: Any, op: str) -> None:
        self.comm.allreduce(recv if self.inplace_reduce else send, op, out=recv)

    def reduce(self, send: Any, recv: Any, op: str, root: int) -> None:
        self.comm.reduce(recv if self.inplace_reduce else send, op, root, out=recv)

    def reduce_scatter(self, send: Any, recv: Any, op: str) -> None:
        self.comm.reduce_scatter(send, op, out=recv)

    def allgather(self, send: Any, recv: Any) -> None:
        self.comm.allgather(send, out=recv)

    def alltoall(self, send: Any, recv: Any) -> None:
        self.comm.alltoall(send, out=recv)

    def broadcast(self, buf: Any, root: int) -> None:
        self.comm.broadcast(buf, root)

    def sendrecv(self, send: Any, recv: Any, dest: int, source: int) -> None:
        self.comm.sendrecv(send, dest, recv, source)

    def close(self) -> None:
        self.comm.close()


class TorchPath(PathAdapter):
    """A torch.distributed process group of one backend over every rank."""

    inplace_reduce = True

    def __init__(self, name: str, lib: Checks, session: Session) -> None:
        super().__init__(lib)
        self.name = name
        self.backend = TORCH_PATHS[name]
        if lib.name != "torch":
            raise Skip(f"{name} moves torch tensors only, not {lib.name} arrays")
        import torch.distributed as dist

        if not dist.is_available():
            raise Skip("this torch is built without torch.distributed")
        if self.backend == "nccl":
            why = session.nccl_refusal(lib.device)
            if why is not None:
                raise Skip(why)
            if not dist.is_nccl_available():
                raise Skip("this torch is built without NCCL")
        self.dist = dist
        self.group = session.torch_group(self.backend)
        R = dist.ReduceOp
        self.ops = {
            "sum": R.SUM,
            "prod": R.PRODUCT,
            "min": R.MIN,
            "max": R.MAX,
            "avg": R.AVG,
            "band": R.BAND,
            "bor": R.BOR,
            "bxor": R.BXOR,
        }

    def check(self, op: str, dtype: str, redop: str | None, session: Session) -> str | None:
        reason = super().check(op, dtype, redop, session)
        if reason:
            return reason
        if op == "sendrecv" and session.size < 2:
            return "torch.distributed cannot send to its own rank"
        if op == "sendrecv" and self.backend == "gloo" and self.lib.device == "cuda":
            # Seen on the H200 (torch 2.11): gloo's tcp pair writev()s the device pointer,
            # fails with EFAULT ("Bad address") and aborts the process.
            return "gloo's send/recv take CPU tensors only (CUDA tensors abort with EFAULT)"
        return None

    def allreduce(self, send: Any, recv: Any, op: str) -> None:
        self.dist.all_reduce(recv, op=self.ops[op], group=self.group)

    def reduce(self, send: Any, recv: Any, op: str, root: int) -> None:
        self.dist.reduce(recv, dst=root, op=self.ops[op], group=self.group)

    def reduce_scatter(self, send: Any, recv: Any, op: str) -> None:
        self.dist.reduce_scatter_tensor(recv, send, op=self.ops[op], group=self.group)

    def allgather(self, send: Any, recv: Any) -> None:
        self.dist.all_gather_into_tensor(recv.view(-1), send, group=self.group)

    def alltoall(self, send: Any, recv: Any) -> None:
        self.dist.all_to_all_single(recv, send, group=self.group)

    def broadcast(self, buf: Any, root: int) -> None:
        self.dist.broadcast(buf, src=root, group=self.group)

    def sendrecv(self, send: Any, recv: Any, dest: int, source: int) -> None:
        d = self.dist
        ops = [d.P2POp(d.isend, send, dest, self.group), d.P2POp(d.irecv, recv, source, self.group)]
        for work in d.batch_isend_irecv(ops):
            work.wait()


class MpiPath(PathAdapter):
    """The plain-MPI peer: mpi4py on host memory; device buffers copied through pinned host
    buffers around every call, the way code without a CUDA-aware MPI does it."""

    name = "mpi"

    def __init__(self, lib: Checks, session: Session) -> None:
        super().__init__(lib)
        from mpi4py import MPI

        self.MPI = MPI
        self.comm = session.world.Dup()
        self.ops = {
            "sum": MPI.SUM,
            "prod": MPI.PROD,
            "min": MPI.MIN,
            "max": MPI.MAX,
            "band": MPI.BAND,
            "bor": MPI.BOR,
            "bxor": MPI.BXOR,
        }
        self._host: dict[str, tuple[tuple[tuple[int, ...], str], Any, Any]] = {}
        """role (send, recv, buf) -> ((shape, dtype), NumPy view, pinned holder)."""

    def check(self, op: str, dtype: str, redop: str | None, session: Session) -> str | None:
        reason = super().check(op, dtype, redop, session)
        if reason:
            return reason
        if dtype == "bfloat16":
            return "MPI has no bfloat16 datatype"
        if redop == "avg":
            return "MPI has no average reduction"
        return None

    def _twin(self, x: Any, role: str) -> Any:
        """The NumPy array MPI is handed for ``x``: ``x`` itself (or its NumPy view) on the
        host; for a device array, a pinned host buffer of its shape, one per role, reused
        across calls and replaced (freeing the old one) when the size changes."""
        lib = self.lib
        if lib.device == "cpu":
            return x.numpy() if lib.name == "torch" else x
        want = (tuple(x.shape), str(x.dtype))
        held = self._host.get(role)
        if held is None or held[0] != want:
            self._host.pop(role, None)
            if lib.name == "torch":
                import torch

                pinned = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
                self._host[role] = (want, pinned.numpy(), pinned)
            else:
                import cupy
                import numpy as np

                mem = cupy.cuda.alloc_pinned_memory(max(x.nbytes, 1))
                arr = np.frombuffer(mem, x.dtype, x.size).reshape(x.shape)
                self._host[role] = (want, arr, mem)
        return self._host[role][1]

    def _down(self, x: Any, role: str = "send") -> Any:
        """The host twin of ``x`` holding ``x``'s data (device -> host copy)."""
        h = self._twin(x, role)
        if self.lib.device != "cpu":
            if self.lib.name == "torch":
                self._host[role][2].copy_(x)
            else:
                x.get(out=h)
        return h

    def _up(self, h: Any, x: Any, role: str = "recv") -> None:
        """Copy the host twin ``h`` back into the device array ``x`` (no-op on the host)."""
        if self.lib.device == "cpu":
            return
        if self.lib.name == "torch":
            x.copy_(self._host[role][2])
        else:
            x.set(h)

    def allreduce(self, send: Any, recv: Any, op: str) -> None:
        hr = self._twin(recv, "recv")
        self.comm.Allreduce(self._down(send), hr, op=self.ops[op])
        self._up(hr, recv)

    def reduce(self, send: Any, recv: Any, op: str, root: int) -> None:
        hr = self._twin(recv, "recv")
        self.comm.Reduce(self._down(send), hr, op=self.ops[op], root=root)
        if self.comm.rank == root:
            self._up(hr, recv)

    def reduce_scatter(self, send: Any, recv: Any, op: str) -> None:
        hr = self._twin(recv, "recv")
        self.comm.Reduce_scatter_block(self._down(send), hr, op=self.ops[op])
        self._up(hr, recv)

    def allgather(self, send: Any, recv: Any) -> None:
        hr = self._twin(recv, "recv")
        self.comm.Allgather(self._down(send), hr)
        self._up(hr, recv)

    def alltoall(self, send: Any, recv: Any) -> None:
        hr = self._twin(recv, "recv")
        self.comm.Alltoall(self._down(send), hr)
        self._up(hr, recv)

    def broadcast(self, buf: Any, root: int) -> None:
        root_rank = self.comm.rank == root
        h = self._down(buf, "buf") if root_rank else self._twin(buf, "buf")
        self.comm.Bcast(h, root=root)
        if not root_rank:
            self._up(h, buf, "buf")

    def sendrecv(self, send: Any, recv: Any, dest: int, source: int) -> None:
        hr = self._twin(recv, "recv")
        self.comm.Sendrecv(self._down(send), dest, recvbuf=hr, source=source)
        self._up(hr, recv)

    def close(self) -> None:
        self._host.clear()
        self.comm.Free()


def _check_nccl(session: Session, lib: Checks) -> None:
    """:class:`Skip`, with why, where cudampi's nccl engine cannot run this benchmark."""
    from cudampi.comm.paths import unavailable

    why = session.nccl_refusal(lib.device) or unavailable().get("nccl")
    if why is not None:
        raise Skip(why)


class CopyPath(PathAdapter):
    """The raw-copy peer."""

    name = "copy"

    def copy(self, send: Any, recv: Any) -> None:
        self.lib.copy_into(recv, send)


def open_path(name: str, lib: Checks, session: Session, *, in_place: bool = False) -> PathAdapter:
    """The adapter of ``name`` on ``lib``'s arrays; :class:`Skip` says why it cannot run.
    ``in_place``: a cudampi path reduces in place (``--in-place``)."""
    if name in COMMUNICATOR_PATHS:
        return CudampiPath(name, lib, session, in_place=in_place)
    if name in TORCH_PATHS:
        return TorchPath(name, lib, session)
    if name == "mpi":
        return MpiPath(lib, session)
    if name == "copy":
        return CopyPath(lib)
    raise Skip(f"unknown path {name!r}; known: {', '.join(BENCH_PATHS)}")
