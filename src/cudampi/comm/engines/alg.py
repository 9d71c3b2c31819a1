"""The ``alg`` engine: cudampi's own collective algorithms over direct point-to-point.

It runs the ``gpu-ring`` path on device memory (reductions on the GPU, MPI moving device
buffers), its host twin for dtypes MPI cannot reduce (float16, bfloat16), and, on host buffers,
the inside of the staged engine for those dtypes. The algorithms themselves live in
:mod:`cudampi.comm.algorithms`; this module builds their per-call setting.
"""

from __future__ import annotations

from typing import Any

from cudampi.comm import algorithms
from cudampi.comm.arrays import ArrayOps, Flat
from cudampi.comm.choice import Ask, DeviceSupport, Facts, PathChoice, Verdict
from cudampi.comm.engines.base import Setting
from cudampi.comm.engines.p2p import DirectP2P, apart, message_route
from cudampi.comm.transport import DirectTransport
from cudampi.errors import DeviceError


class AlgEngine(DirectP2P):
    """Ring / direct / recursive-doubling / tree collectives (see :mod:`~cudampi.comm.algorithms`);
    user point-to-point straight on the arrays, as the ``mpi`` engine does it."""

    name = "alg"
    paths = ("gpu-ring",)

    @classmethod
    def verdict(cls, facts: Facts) -> Verdict:
        mpi = facts.mpi
        return Verdict(mpi.p2p, mpi.p2p_why)

    @classmethod
    def route(cls, ask: Ask, support: DeviceSupport) -> PathChoice | None:
        if ask.call.p2p:
            return None  # messages: MPI's own matching (the mpi engine)
        if not ask.on_device:
            if not ask.no_mpi:
                return None
            return PathChoice(
                "host",
                f"host memory; MPI has no {ask.dtype} reduction, so cudampi's algorithm reduces it",
                "alg",
            )
        if not support.p2p:
            return None
        return PathChoice(
            "gpu-ring",
            f"device memory, {support.p2p_why}: GPU reduction over device p2p "
            f"({'ring' if ask.nbytes > 0 else 'no data'})",
            "alg",
        )

    @classmethod
    def forced(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        if ask.call.p2p:
            route = message_route(ask, support)
            assert route is not None  # (None only for auto)
            return route
        if not ask.on_device:
            return PathChoice("gpu-ring", "requested; host memory runs the same algorithm", "alg")
        if not support.p2p:
            raise DeviceError(
                f"{ask.call.name}: path='gpu-ring' needs CUDA-aware MPI point-to-point, which is "
                f"not proven here ({support.p2p_why}). Run `cudampi doctor`, set "
                "CUDAMPI_CUDA_AWARE=yes if you know better, or use path='staged'."
            )
        return PathChoice("gpu-ring", f"requested; {support.p2p_why}", "alg")

    def __init__(self, setting: Setting, ops: ArrayOps) -> None:
        super().__init__(setting, ops)
        self.direct = setting.direct(ops.device is not None)
        self._tx = DirectTransport(setting.coll, ops)

    @property
    def algo(self) -> int:
        return 1 + int(self.direct)

    def _ctx(self, a: Flat) -> algorithms.Ctx:
        s = self.setting
        return algorithms.Ctx(
            s.rank,
            s.size,
            self.ops,
            self._tx,
            self.ops.itemsize(a),
            s.config.chunk_bytes,
            s.config.small_bytes,
            self.direct,
        )

    def _work(self, xf: Flat, op: str, dtype: str, scratch: bool) -> Any:
        """The array the algorithm reduces in place: ``xf`` itself where it is a scratch copy,
        else a copy; divided for ``avg`` (:meth:`share`)."""
        work = xf if scratch else self.ops.scratch(int(xf.shape[0]), xf)
        self.share(work, xf, op, dtype)
        return work

    def allreduce(self, xf: Flat, of: Flat, op: str, dtype: str) -> None:
        if xf is of or op == "avg":
            self.share(of, xf if xf is of else apart(self.ops, xf, of), op, dtype)
            algorithms.allreduce(self._ctx(of), of, op, dtype)
        else:  # the ring reads the input where it lies: no copy of it into the output first
            algorithms.allreduce(self._ctx(of), of, op, dtype, apart(self.ops, xf, of))

    def reduce(
        self, xf: Flat, of: Flat, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        if self.setting.rank == root:
            work = of
            self.share(of, xf if xf is of else apart(self.ops, xf, of), op, dtype)
        else:
            work = self._work(xf, op, dtype, scratch)
        algorithms.reduce(self._ctx(work), work, op, dtype, root)

    def broadcast(self, xf: Flat, root: int) -> None:
        algorithms.broadcast(self._ctx(xf), xf, root)

    # Receives land in ``of`` while ``xf`` is still being sent: where the caller's input
    # overlaps the output (other than in place), it is copied apart first (as the mpi engine
    # does for MPI's sake), or blocks are sent after they were overwritten.

    def allgatherv(self, xf: Flat, of: Flat, counts: list[int]) -> None:
        algorithms.allgatherv(self._ctx(xf), self._apart(xf, of, counts), of, counts)

    def gatherv(self, xf: Flat, of: Flat | None, counts: list[int], root: int) -> None:
        send = xf if of is None else self._apart(xf, of, counts)
        algorithms.gatherv(self._ctx(xf), send, of, counts, root)

    def scatterv(self, xf: Flat | None, of: Flat, counts: list[int], root: int) -> None:
        send = xf if xf is None else apart(self.ops, xf, of)
        algorithms.scatterv(self._ctx(of), send, of, counts, root)

    def _apart(self, xf: Flat, of: Flat, counts: list[int]) -> Any:
        """``xf``, unless it overlaps ``of`` other than as exactly this rank's block."""
        ops, r = self.ops, self.setting.rank
        lo = sum(counts[:r]) * ops.itemsize(of)
        if ops.ptr(xf) == ops.ptr(of) + lo and ops.nbytes(xf) == counts[r] * ops.itemsize(of):
            return xf
        return apart(ops, xf, of)

    def reduce_scatterv(
        self, xf: Flat, of: Flat, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        if scratch or op == "avg":
            work, src = self._work(xf, op, dtype, scratch), None
        else:  # the reduce-scatter reads the input where it lies: a scratch buffer, no copy
            work, src = self.ops.scratch(int(xf.shape[0]), xf), xf
        algorithms.reduce_scatterv(self._ctx(xf), work, of, counts, op, dtype, src)

    def alltoallv(self, xf: Flat, send_counts: list[int], of: Flat, recv_counts: list[int]) -> None:
        send = apart(self.ops, xf, of)
        algorithms.alltoallv(self._ctx(xf), send, send_counts, of, recv_counts)
