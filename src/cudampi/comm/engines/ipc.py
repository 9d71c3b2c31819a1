"""The ``ipc`` engine: whole collectives as GPU kernels over CUDA IPC, on the caller's stream.

For the ranks of one node (see :mod:`cudampi.comm.ipc.workspace` for the memory and
:mod:`cudampi.comm.ipc.plan` for the launches): a call is one kernel launch per data buffer of
elements, enqueued on the caller's current CUDA stream (torch's or CuPy's) with no host
synchronisation and no MPI call, so ``async_op`` costs nothing and a call can be captured in a
CUDA graph. Ranks check each other's call on the GPU; an error surfaces at this rank's next
call or at ``Communicator.synchronize()``, and the workspace's watchdog logs it at once.

allreduce runs one-shot (every rank reads every rank's data: the fewest steps) up to
``ipc_oneshot_bytes`` and two-shot (reduce-scatter, then all-gather: each byte read once) above,
on registered buffers where every peer can address them (:mod:`cudampi.comm.ipc.registry`).
Across nodes :class:`HierEngine` runs it inside each node.

Point-to-point (path='ipc' on both ranks): a send or receive joins a group that runs as one
kernel when a blocking call, a handle's wait, a collective or ``synchronize()`` comes, so
``sendrecv`` and a batch of isend/irecv move together; messages between two ranks match in the
order sent (no tag reordering, no any-source). Across nodes they go through MPI.
docs/ipc.md has the design and the semantics.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from cudampi.comm.arrays import DTYPE_CODE, ArrayOps, Flat, adapt
from cudampi.comm.choice import Ask, DeviceSupport, Facts, PathChoice, Verdict
from cudampi.comm.engines.base import (
    Engine,
    Engines,
    Setting,
    caller_stream,
    node_comm,
)
from cudampi.comm.handle import Handle
from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
from cudampi.comm.ipc.workspace import Workspace
from cudampi.errors import CommError, DeviceError
from cudampi.names import REDUCE_OPS
from cudampi.probe.capabilities import ProbeOutcome


def _workspace(comm: Any, s: Setting, device: int) -> Workspace:
    c = s.config
    return Workspace(comm, device, capacity=c.ipc_bytes, timeout=c.timeout, blocks=c.ipc_blocks)


ANY_SOURCE_REFUSED = (
    "a receive from any rank needs MPI's matching: ipc messages match per pair of ranks, so "
    "name the source rank (or use path='gpu-ring' or 'staged' for this message on both ranks)"
)


def available() -> str | None:
    """None where the engine can run here, else why not (for path choice and the doctor).
    CuPy is looked up, not imported: every Communicator asks, and importing CuPy costs a
    rank 0.6 s where nothing uses it (a CPU-only job; a broken install fails the probe)."""
    if importlib.util.find_spec("cupy") is None:
        return "CuPy is not installed (pip install 'cudampi[cu12]' or 'cudampi[cu13]')"
    return None


def ipc_support(
    probed: ProbeOutcome | None,
    shared_gpu: bool | None,
    mps: bool,
    missing: str | None,
    *,
    latency_us: float | None = None,
    probed_mps: bool | None = None,
) -> tuple[bool, str]:
    """Whether ``auto`` takes the ipc engine, and why: the probe ran it correctly
    (``probed``), CuPy is there (``missing`` is None), and the ranks do not share a GPU without
    the MPS daemon: ranks time-slicing one GPU make ipc's kernels wait a time slice for each
    other, so there it is the slowest path at every size, and under MPS the fastest
    (docs/benchmarks.md): the rule is per setting, not per size."""
    if missing is not None:
        return False, f"the ipc engine is unavailable: {missing}"
    if probed is None or probed.status == "skipped":
        return False, "the ipc engine was not probed (run `cudampi doctor`)"
    if not probed.ok:
        return False, f"the probe found the ipc engine {probed.status}: {probed.detail}"
    if shared_gpu and not mps:
        return False, (
            "the ranks share a GPU and the MPS daemon is not running: their contexts time-slice "
            "the GPU and ipc's kernels wait a time slice for each other (slower than gpu-ring "
            "there); start nvidia-cuda-mps-control -d, or use one GPU per rank"
        )
    speed = f", {latency_us:.0f} us at 4 KiB" if latency_us else ""
    if speed and probed_mps is not None and probed_mps != mps:
        speed += f" when probed with MPS {'on' if probed_mps else 'off'}"
    where = "ranks sharing a GPU under MPS" if shared_gpu else "one GPU per rank"
    return True, f"the probe proved the ipc engine correct ({where}{speed})"


def _inner(support: DeviceSupport) -> str:
    """What joins the nodes where a communicator spans several: gpu-ring where device p2p is
    proven, else staged."""
    return "alg" if support.p2p else "staged"


class IpcEngine(Engine):
    """Whole collectives (and, asked for, messages) as GPU kernels over CUDA IPC on the caller's
    stream, between the ranks of one node (:class:`HierEngine` joins nodes)."""

    name = "ipc"
    paths = ("ipc",)
    device_only = True
    stream_ordered = True
    any_source = ANY_SOURCE_REFUSED

    @classmethod
    def available(cls) -> str | None:
        return available()

    @classmethod
    def verdict(cls, facts: Facts) -> Verdict:
        caps = facts.caps
        ok, why = ipc_support(
            caps.device_ipc if caps is not None else None,
            caps.ipc_shared_gpu if caps is not None else None,
            facts.mps,
            cls.available(),
            latency_us=caps.ipc_latency_us if caps is not None else None,
            probed_mps=caps.ipc_mps if caps is not None else None,
        )
        return Verdict(ok, why)

    @classmethod
    def unprobed(cls, facts: Facts) -> str:
        caps = facts.caps
        if caps is not None and caps.device_ipc.status == "skipped" and cls.available() is None:
            return "the cached probe result has no result for the ipc engine"
        return ""

    @classmethod
    def route(cls, ask: Ask, support: DeviceSupport) -> PathChoice | None:
        v = support.verdict(cls.name)
        if ask.call.p2p or not v.ok:
            return None  # messages stay on MPI: they match any MPI message, which ipc's do not
        why = f"device memory, {v.why}: GPU kernels over CUDA IPC"
        return PathChoice("ipc", why, "ipc", _inner(support))

    @classmethod
    def forced(cls, ask: Ask, support: DeviceSupport) -> PathChoice:
        if ask.call.p2p:
            why = (
                "requested: a GPU kernel over CUDA IPC on the caller's stream (messages between "
                "two ranks match in order; the peer must use path='ipc' too)"
            )
        else:
            why = "requested: GPU kernels over CUDA IPC on the caller's stream"
        return PathChoice("ipc", why, "ipc", _inner(support))

    def __init__(
        self, setting: Any, ops: ArrayOps, ws: Workspace, stream: int | None = None
    ) -> None:
        super().__init__(setting, ops)
        self.ws = ws
        self.geo = ws.geometry(setting.config.ipc_oneshot_bytes)
        self._fixed_stream = stream
        """Launch on this stream instead of the caller's (the hierarchical engine's use)."""
        self._register = setting.config.ipc_register
        self.registered_calls = 0
        """Calls whose input or output the peers addressed in place (for tests and the log)."""
        self.inplace_sends = 0
        """Sends that their receiver read in place (for tests and the log)."""
        self._eager = L.p2p_eager(ws.capacity)
        self._plans: dict[tuple[Any, ...], list[plan.Launch]] = {}
        self._names: dict[tuple[str, str], dict[str, str]] = {}

    @classmethod
    def make(cls, engines: Engines, ops: ArrayOps, inner: str) -> Engine:
        why = cls.available()
        if why is not None:
            raise DeviceError(f"path='ipc' needs CuPy: {why}")
        if ops.device is None:
            raise DeviceError("path='ipc' moves device arrays; this is host memory")
        s = engines.setting
        if not s.one_node:
            return HierEngine.make(engines, ops, inner)
        dev = ops.device
        return cls(s, ops, engines.keep(("ipc", dev), lambda: _workspace(s.coll.Dup(), s, dev)))

    def close(self) -> None:
        self.ws.close()  # shared by this device's engines; closing twice is a no-op

    # ------------------------------------------------------------------ launching

    def _stream(self) -> int:
        if self._fixed_stream is not None:
            return self._fixed_stream
        return caller_stream(self.ops)

    def _ptr(self, a: Flat | None) -> int:
        return 0 if a is None else self.ops.ptr(a)

    def _planned(self, key: tuple[Any, ...], make: Any) -> list[plan.Launch]:
        """The launches of a call, planned once per distinct call: a training loop repeats the
        same calls on the same buffers, and planning costs more than launching."""
        got = self._plans.get(key)
        if got is None:
            if len(self._plans) >= 1024:
                self._plans.clear()
            got = self._plans[key] = make()
        return got

    def _reduce(self, launches: list[plan.Launch], dtype: str, op: str) -> None:
        names = self._names.get((dtype, op))
        if names is None:
            n = self.ws.size
            names = self._names[(dtype, op)] = {
                "reduce": L.reduce_name(dtype, op, n),
                "twoshot": L.twoshot_name(dtype, op, n),
            }
        self.ws.launch(launches, names, self._stream())

    def _move(self, launches: list[plan.Launch]) -> None:
        self.ws.launch(launches, {"exchange": L.exchange_name(self.ws.size)}, self._stream())

    def _kind(self, a: Flat) -> tuple[int, int]:
        return self.ops.itemsize(a), DTYPE_CODE[adapt(a).dtype]

    @staticmethod
    def _sig(dtype: str, op: str) -> tuple[int, int]:
        return DTYPE_CODE[dtype], REDUCE_OPS.index(op) + 1

    def reject(self, what: str) -> None:
        self._move(plan.reject(self.geo))

    def synchronize(self) -> None:
        """Wait for this rank's launches and raise what they reported."""
        import cupy

        self.ws.flush()
        with cupy.cuda.Device(self.ops.device):
            cupy.cuda.ExternalStream(self._stream(), self.ops.device).synchronize()
        self.ws.check()

    # ------------------------------------------------------------------ collectives

    def allreduce(self, xf: Flat, of: Flat, op: str, dtype: str) -> None:
        isz, n = self.ops.itemsize(xf), xf.shape[0]  # len() of a tensor is Python-level
        x, out = self._ptr(xf), self._ptr(of)
        reg = (0, 0, 0, 0)
        if plan.two_shot(self.geo, n, isz):
            reg = self._registered(x, out)
        launches = self._planned(
            ("allreduce", n, isz, x, out, dtype, op, reg),
            lambda: plan.reduction(
                self.geo, "allreduce", n, isz, x, out, self._sig(dtype, op), registered=reg
            ),
        )
        self._reduce(launches, dtype, op)

    def _registered(self, x: int, out: int) -> tuple[int, int, int, int]:
        """Registry entries of x and out usable at the next launch (0: stage). A rank that
        does not register its own buffers (``ipc_register`` off) still maps what its peers
        registered, so they read and write theirs in place."""
        ws = self.ws
        capturing = ws.capturing(self._stream())
        if not capturing:
            ws.registry.step(ws.launches)
        if not self._register:
            return 0, 0, 0, 0
        rin = ws.registry.lookup(x, ws.launches, publish=not capturing)
        rout = rin if out == x else ws.registry.lookup(out, ws.launches, publish=not capturing)
        if rin[0] or rout[0]:
            self.registered_calls += 1
        return (*rin, *rout)

    def reduce(
        self, xf: Flat, of: Flat, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        isz, n, x, out = self.ops.itemsize(xf), xf.shape[0], self._ptr(xf), self._ptr(of)
        launches = self._planned(
            ("reduce", n, isz, x, out, dtype, op, root),
            lambda: plan.reduction(
                self.geo, "reduce", n, isz, x, out, self._sig(dtype, op), root=root
            ),
        )
        self._reduce(launches, dtype, op)

    def reduce_scatterv(
        self, xf: Flat, of: Flat, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        isz, x, out = self.ops.itemsize(xf), self._ptr(xf), self._ptr(of)
        launches = self._planned(
            ("reduce_scatter", tuple(counts), isz, x, out, dtype, op),
            lambda: plan.reduce_scatter(self.geo, counts, isz, x, out, self._sig(dtype, op)),
        )
        self._reduce(launches, dtype, op)

    def broadcast(self, xf: Flat, root: int) -> None:
        isz, code = self._kind(xf)
        n, x = xf.shape[0], self._ptr(xf)
        launches = self._planned(
            ("broadcast", n, isz, x, code, root),
            lambda: plan.gather_like(
                self.geo, "broadcast", [n] * self.ws.size, isz, x, x, code, root=root
            ),
        )
        self._move(launches)

    def allgatherv(self, xf: Flat, of: Flat, counts: list[int]) -> None:
        isz, code = self._kind(xf)
        call = "allgather" if len(set(counts)) == 1 else "allgatherv"
        x, out = self._ptr(xf), self._ptr(of)
        launches = self._planned(
            (call, tuple(counts), isz, x, out, code),
            lambda: plan.gather_like(self.geo, call, counts, isz, x, out, code),
        )
        self._move(launches)

    def gatherv(self, xf: Flat, of: Flat | None, counts: list[int], root: int) -> None:
        isz, code = self._kind(xf)
        call = "gather"  # (uneven counts differ in the signature's counts word)
        x, out = self._ptr(xf), self._ptr(of)
        launches = self._planned(
            (call, tuple(counts), isz, x, out, code, root),
            lambda: plan.gather_like(self.geo, call, counts, isz, x, out, code, root=root),
        )
        self._move(launches)

    def scatterv(self, xf: Flat | None, of: Flat, counts: list[int], root: int) -> None:
        isz, code = self._kind(of)
        me = self.ws.rank
        recv = [counts[me] if s == root else 0 for s in range(self.ws.size)]
        x, out = self._ptr(xf), self._ptr(of)
        launches = self._planned(
            ("scatter", tuple(counts), isz, x, out, code, root),
            lambda: plan.all_to_all(
                self.geo, "scatter", counts, recv, isz, x, out, code,
                max_pair=max(counts, default=0), root=root,
            ),
        )  # fmt: skip
        self._move(launches)

    def alltoallv(self, xf: Flat, send_counts: list[int], of: Flat, recv_counts: list[int]) -> None:
        isz, code = self._kind(xf)
        from mpi4py import MPI

        # The number of launches must be the same on every rank: it follows from the largest
        # block any rank sends any rank, which no rank knows alone (one host allreduce, the
        # engine's only MPI call on a data path; alltoall is rarely latency-bound).
        mine = max([*send_counts, *recv_counts], default=0)
        biggest = int(self.ws.comm.allreduce(mine, op=MPI.MAX))
        x, out = self._ptr(xf), self._ptr(of)
        launches = self._planned(
            ("alltoall", tuple(send_counts), tuple(recv_counts), isz, x, out, code, biggest),
            lambda: plan.all_to_all(
                self.geo, "alltoall", send_counts, recv_counts, isz, x, out, code,
                max_pair=biggest,
            ),
        )  # fmt: skip
        self._move(launches)

    # ------------------------------------------------------------------ point-to-point

    def flush(self) -> None:
        self.ws.flush()

    def _post(self, f: Flat, send: bool, peer: int, tag: int) -> None:
        if peer < 0:
            raise CommError(ANY_SOURCE_REFUSED)
        if send and tag < 0:
            raise CommError(f"a send's tag must be >= 0, got {tag}")
        nbytes, ptr, stream = f.shape[0] * self.ops.itemsize(f), self._ptr(f), self._stream()
        reg = offset = 0
        if nbytes > self._eager and self._register and peer != self.ws.rank:
            reg, offset = self._in_place(ptr, peer, send, stream)
        self.ws.post(plan.Message(send, peer, ptr, nbytes, tag, reg, offset), stream)

    def _in_place(self, ptr: int, peer: int, send: bool, stream: int) -> tuple[int, int]:
        """A large message's registration (1 + entry, offset; (0, 0): through the inbox).
        Both ends map what their peers published (so a receive makes its sender's buffer
        readable here for the next time); a send is read in place once its receiver did."""
        ws = self.ws
        capturing = ws.capturing(stream)
        if not capturing:
            ws.registry.step(ws.launches)
        if not send:
            return 0, 0
        got = ws.registry.lookup_peer(ptr, peer, publish=not capturing)
        self.inplace_sends += got[0] > 0
        return got

    def send(self, f: Flat, dest: int, tag: int) -> None:
        self._post(f, True, dest, tag)
        self.ws.flush()

    def recv(self, f: Flat, source: int, tag: int) -> None:
        self._post(f, False, source, tag)
        self.ws.flush()

    def _pending(self, what: str) -> Handle:
        """A handle whose wait (or test) launches the group this message is in: in stream
        order, as the collectives' handles, it is then done."""

        def launch(block: bool) -> bool:
            self.ws.flush()
            return True

        return Handle(what, poll=launch)

    def sendrecv(self, xf: Flat, dest: int, of: Flat, source: int, tag: int) -> None:
        self._post(of, False, source, tag)
        self._post(xf, True, dest, tag)
        self.ws.flush()

    def isend(self, f: Flat, dest: int, tag: int) -> Handle:
        self._post(f, True, dest, tag)
        return self._pending(f"isend to rank {dest}")

    def irecv(self, f: Flat, source: int, tag: int) -> Handle:
        self._post(f, False, source, tag)
        return self._pending(f"irecv from rank {source}")


class HierEngine(Engine):
    """Collectives across nodes: ``node`` joins each node's ranks (the ipc engine on device
    arrays; MPI's own collectives on host arrays, which the CPU tests use), ``cross`` joins the
    ranks with the same place on every node (gpu-ring where device p2p is proven, else staged).

    allreduce is a reduce-scatter inside the node, an allreduce of one slice across nodes and an
    allgather inside the node; reduce_scatter and allgather likewise move each byte across nodes
    once per node. The other collectives run flat over the whole communicator on ``flat``. Needs
    the same number of ranks on every node, numbered node after node (what mpirun does by
    default); otherwise every rank raises the same DeviceError.
    """

    name = "ipc"

    def __init__(self, setting: Setting, ops: ArrayOps, node: Engine, cross: Engine,
                 flat: Engine, local: int, per_node: int, nodes: int) -> None:  # fmt: skip
        super().__init__(setting, ops)
        self.node, self.cross, self.flat = node, cross, flat
        self.local, self.per_node, self.nodes = local, per_node, nodes

    @classmethod
    def make(cls, engines: Engines, ops: ArrayOps, inner: str) -> Engine:
        s = engines.setting

        def build() -> tuple[Any, Any, int, int, int]:
            nc = node_comm(s.coll, s.config)
            local, per_node = nc.Get_rank(), nc.Get_size()
            layout = s.coll.allgather((per_node, local))
            nodes = s.size // per_node if per_node else 0
            regular = (
                all(p == per_node and r % per_node == lo for r, (p, lo) in enumerate(layout))
                and nodes * per_node == s.size
            )
            if not regular:
                nc.Free()
                sizes = sorted({p for p, _ in layout})
                raise DeviceError(
                    "path='ipc' across nodes needs the same number of ranks on every node, "
                    f"numbered node after node (node sizes here: {sizes}; rank order "
                    f"{[lo for _, lo in layout]}). Launch with the default by-slot mapping, "
                    "or use path='gpu-ring' or 'staged'."
                )
            cc = s.coll.Split(local, s.rank)
            return nc, cc, local, per_node, nodes

        nc, cc, local, per_node, nodes = engines.keep(("ipc", "hier"), build)
        dev = ops.device
        node_setting = Setting(nc, nc, local, per_node, s.config, True)
        if dev is None:
            node_set = engines.keep(("ipc", "node"), lambda: engines.spawn(node_setting))
            node: Engine = node_set.get("mpi", "", ops.lib, None)
        else:
            stream = _stream_ptr(ops)
            ws = engines.keep(("ipc", dev), lambda: _workspace(nc.Dup(), s, dev))
            node = IpcEngine(node_setting, ops, ws, stream)
        cross_set = engines.keep(
            ("ipc", "cross"),
            lambda: engines.spawn(Setting(cc, cc, cc.Get_rank(), nodes, s.config, False)),
        )
        if dev is None:
            cross = cross_set.get("mpi", "", ops.lib, None)
            flat = engines.get("mpi", "", ops.lib, None)
        else:
            cross = cross_set.get(inner or "staged", "alg", ops.lib, dev)
            flat = engines.get(inner or "staged", "alg", ops.lib, dev)
        return cls(s, ops, node, cross, flat, local, per_node, nodes)

    def close(self) -> None:
        self.node.close()

    # ------------------------------------------------------------------ helpers

    def _settle(self) -> None:
        """The node engine's kernels are on the reduction stream: finish them before MPI."""
        self.ops.fence()

    def _node_split(self, n: int) -> list[int]:
        q, r = divmod(n, self.per_node)
        return [q + (1 if i < r else 0) for i in range(self.per_node)]

    # ------------------------------------------------------------------ hierarchical

    # avg: the node's engine divides by the node's ranks, the cross engine by the nodes, each
    # before its sum: sum / (ranks per node * nodes) without an overflow in between.

    def allreduce(self, xf: Flat, of: Flat, op: str, dtype: str) -> None:
        counts = self._node_split(int(xf.shape[0]))
        part = self.ops.scratch(counts[self.local], xf)
        self.node.reduce_scatterv(xf, part, counts, op, dtype)
        self._settle()
        self.cross.allreduce(part, part, op, dtype)
        self.node.allgatherv(part, of, counts)

    def reduce_scatterv(
        self, xf: Flat, of: Flat, counts: list[int], op: str, dtype: str, *, scratch: bool = False
    ) -> None:
        L, me = self.per_node, self.local
        mine = [counts[m * L + me] for m in range(self.nodes)]
        part = self.ops.scratch(sum(mine), xf)
        lo = pos = 0
        for m in range(self.nodes):
            block = counts[m * L : (m + 1) * L]
            self.node.reduce_scatterv(
                xf[lo : lo + sum(block)], part[pos : pos + block[me]], block, op, dtype
            )
            lo, pos = lo + sum(block), pos + block[me]
        self._settle()
        self.cross.reduce_scatterv(part, of, mine, op, dtype, scratch=True)

    def allgatherv(self, xf: Flat, of: Flat, counts: list[int]) -> None:
        L = self.per_node
        sums = [sum(counts[m * L : (m + 1) * L]) for m in range(self.nodes)]
        me = self.setting.rank // L
        lo = sum(sums[:me])
        self.node.allgatherv(xf, of[lo : lo + sums[me]], counts[me * L : (me + 1) * L])
        part = self.ops.scratch(sums[me], xf)
        self.ops.copy(part, of[lo : lo + sums[me]])
        self._settle()
        self.cross.allgatherv(part, of, sums)

    # ------------------------------------------------------------------ flat

    def reduce(
        self, xf: Flat, of: Flat, op: str, dtype: str, root: int, *, scratch: bool = False
    ) -> None:
        self.flat.reduce(xf, of, op, dtype, root, scratch=scratch)

    def broadcast(self, xf: Flat, root: int) -> None:
        self.flat.broadcast(xf, root)

    def gatherv(self, xf: Flat, of: Flat | None, counts: list[int], root: int) -> None:
        self.flat.gatherv(xf, of, counts, root)

    def scatterv(self, xf: Flat | None, of: Flat, counts: list[int], root: int) -> None:
        self.flat.scatterv(xf, of, counts, root)

    def alltoallv(self, xf: Flat, send_counts: list[int], of: Flat, recv_counts: list[int]) -> None:
        self.flat.alltoallv(xf, send_counts, of, recv_counts)

    def send(self, f: Flat, dest: int, tag: int) -> None:
        self.flat.send(f, dest, tag)

    def recv(self, f: Flat, source: int, tag: int) -> None:
        self.flat.recv(f, source, tag)

    def isend(self, f: Flat, dest: int, tag: int) -> Handle:
        return self.flat.isend(f, dest, tag)

    def irecv(self, f: Flat, source: int, tag: int) -> Handle:
        return self.flat.irecv(f, source, tag)


def _stream_ptr(ops: ArrayOps) -> int:
    """The raw pointer of ``ops``' reduction stream (torch or CuPy)."""
    stream: Any = getattr(ops, "stream", None)  # not on the ArrayOps base
    return int(stream.cuda_stream if ops.lib == "torch" else stream.ptr)
