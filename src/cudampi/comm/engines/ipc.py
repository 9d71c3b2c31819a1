"""The ``ipc`` engine: whole collectives as GPU kernels over CUDA IPC, on the caller's stream.

For the ranks of one node (see :mod:`cudampi.comm.ipc.workspace` for the memory and
:mod:`cudampi.comm.ipc.plan` for the launches): a call is one kernel launch per data buffer of
elements, enqueued on the caller's current CUDA stream (torch's or CuPy's) with no host
synchronisation and no MPI call, so ``async_op`` costs nothing and a call can be captured in a
CUDA graph. Ranks check each other's call on the GPU; an error surfaces at this rank's next
call, at ``Communicator.synchronize()`` or at a handle's ``wait()``.

allreduce runs one-shot (every rank reads every rank's data: the fewest steps) up to
``ipc_oneshot_bytes`` and two-shot (reduce-scatter, then all-gather: each byte read once) above.
Point-to-point is MPI's: the engine moves collectives only.
"""

from __future__ import annotations

from typing import Any

from cudampi.comm.buffers import DTYPE_CODE, adapt
from cudampi.comm.engines.base import Engine, Engines
from cudampi.comm.handle import Handle
from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
from cudampi.comm.ipc.workspace import Workspace
from cudampi.comm.ops import REDUCE_OPS, ArrayOps
from cudampi.errors import CommError, DeviceError


def available() -> str | None:
    """None where the engine can run here, else why not (for path choice and the doctor)."""
    try:
        import cupy  # noqa: F401
    except ImportError:
        return "CuPy is not installed (pip install 'cudampi[cu12]' or 'cudampi[cu13]')"
    return None


class IpcEngine(Engine):
    name = "ipc"
    stream_ordered = True

    def __init__(self, setting: Any, ops: ArrayOps, ws: Workspace) -> None:
        super().__init__(setting, ops)
        self.ws = ws
        self.geo = ws.geometry(setting.config.ipc_oneshot_bytes)

    @classmethod
    def make(cls, engines: Engines, ops: ArrayOps, inner: str) -> Engine:
        why = available()
        if why is not None:
            raise DeviceError(f"path='ipc' needs CuPy: {why}")
        if ops.device is None:
            raise DeviceError("path='ipc' moves device arrays; this is host memory")
        s = engines.setting
        if not s.one_node:
            raise DeviceError(
                "path='ipc' joins the ranks of one node; this communicator spans several nodes. "
                "Use path='gpu-ring' or 'staged' (or auto)."
            )
        dev = ops.device

        def make_ws() -> Workspace:
            return Workspace(
                s.coll.Dup(),
                dev,
                capacity=s.config.ipc_bytes,
                timeout=s.config.timeout,
                blocks=s.config.ipc_blocks,
            )

        return cls(s, ops, engines.keep(("ipc", dev), make_ws))

    def close(self) -> None:
        self.ws.close()  # shared by this device's engines; closing twice is a no-op

    # ------------------------------------------------------------------ launching

    def _stream(self) -> int:
        if self.ops.lib == "torch":
            import torch

            return int(torch.cuda.current_stream(self.ops.device).cuda_stream)
        import cupy

        with cupy.cuda.Device(self.ops.device):
            return int(cupy.cuda.get_current_stream().ptr)

    def _ptr(self, a: Any) -> int:
        return 0 if a is None else self.ops.ptr(a)

    def _reduce(self, launches: list[plan.Launch], dtype: str, op: str) -> None:
        self.ws.launch(launches, {"reduce": L.reduce_name(dtype, op, self.ws.size)}, self._stream())

    def _move(self, launches: list[plan.Launch]) -> None:
        self.ws.launch(launches, {"exchange": L.exchange_name(self.ws.size)}, self._stream())

    def _kind(self, a: Any) -> tuple[int, int]:
        return self.ops.itemsize(a), DTYPE_CODE[adapt(a).dtype]

    @staticmethod
    def _sig(dtype: str, op: str) -> tuple[int, int]:
        return DTYPE_CODE[dtype], REDUCE_OPS.index(op) + 1

    def reject(self, what: str) -> None:
        self._move(plan.reject(self.geo))

    def synchronize(self) -> None:
        """Wait for this rank's launches and raise what they reported."""
        import cupy

        with cupy.cuda.Device(self.ops.device):
            cupy.cuda.ExternalStream(self._stream(), self.ops.device).synchronize()
        self.ws.check()

    # ------------------------------------------------------------------ collectives

    def allreduce(self, xf: Any, of: Any, op: str, dtype: str) -> None:
        isz = self.ops.itemsize(xf)
        launches = plan.reduction(
            self.geo, "allreduce", len(xf), isz, self._ptr(xf), self._ptr(of), self._sig(dtype, op)
        )
        self._reduce(launches, dtype, op)

    def reduce(
        self, xf: Any, of: Any, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        isz = self.ops.itemsize(xf)
        launches = plan.reduction(
            self.geo,
            "reduce",
            len(xf),
            isz,
            self._ptr(xf),
            self._ptr(of),
            self._sig(dtype, op),
            root=root,
        )
        self._reduce(launches, dtype, op)

    def reduce_scatterv(
        self, xf: Any, of: Any, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        isz = self.ops.itemsize(xf)
        launches = plan.reduce_scatter(
            self.geo, counts, isz, self._ptr(xf), self._ptr(of), self._sig(dtype, op)
        )
        self._reduce(launches, dtype, op)

    def broadcast(self, xf: Any, root: int) -> None:
        isz, code = self._kind(xf)
        n = self.ws.size
        launches = plan.gather_like(
            self.geo, "broadcast", [len(xf)] * n, isz, self._ptr(xf), self._ptr(xf), code,
            root=root,
        )  # fmt: skip
        self._move(launches)

    def allgatherv(self, xf: Any, of: Any, counts: list[int]) -> None:
        isz, code = self._kind(xf)
        call = "allgather" if len(set(counts)) == 1 else "allgatherv"
        launches = plan.gather_like(self.geo, call, counts, isz, self._ptr(xf), self._ptr(of), code)
        self._move(launches)

    def gatherv(self, xf: Any, of: Any | None, counts: list[int], root: int) -> None:
        isz, code = self._kind(xf)
        call = "gather" if len(set(counts)) == 1 else "gatherv"
        launches = plan.gather_like(
            self.geo, call, counts, isz, self._ptr(xf), self._ptr(of), code, root=root
        )
        self._move(launches)

    def scatterv(self, xf: Any | None, of: Any, counts: list[int], root: int) -> None:
        isz, code = self._kind(of)
        me = self.ws.rank
        recv = [counts[me] if s == root else 0 for s in range(self.ws.size)]
        launches = plan.all_to_all(
            self.geo, "scatter", counts, recv, isz, self._ptr(xf), self._ptr(of), code,
            max_pair=max(counts, default=0), root=root,
        )  # fmt: skip
        self._move(launches)

    def alltoallv(self, xf: Any, send_counts: list[int], of: Any, recv_counts: list[int]) -> None:
        isz, code = self._kind(xf)
        from mpi4py import MPI

        # The number of launches must be the same on every rank: it follows from the largest
        # block any rank sends any rank, which no rank knows alone (one host allreduce, the
        # engine's only MPI call on a data path; alltoall is rarely latency-bound).
        mine = max([*send_counts, *recv_counts], default=0)
        biggest = int(self.ws.comm.allreduce(mine, op=MPI.MAX))
        launches = plan.all_to_all(
            self.geo, "alltoall", send_counts, recv_counts, isz, self._ptr(xf), self._ptr(of),
            code, max_pair=biggest,
        )  # fmt: skip
        self._move(launches)

    # ------------------------------------------------------------------ point-to-point

    def send(self, f: Any, dest: int, tag: int) -> None:
        raise CommError("the ipc engine moves collectives; point-to-point goes through MPI")

    def recv(self, f: Any, source: int, tag: int) -> None:
        raise CommError("the ipc engine moves collectives; point-to-point goes through MPI")

    def isend(self, f: Any, dest: int, tag: int) -> Handle:
        raise CommError("the ipc engine moves collectives; point-to-point goes through MPI")

    def irecv(self, f: Any, source: int, tag: int) -> Handle:
        raise CommError("the ipc engine moves collectives; point-to-point goes through MPI")
