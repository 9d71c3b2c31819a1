"""One ipc communicator's GPU side: the ranks' IPC workspaces, the kernels, errors and watchdog.

Made once per communicator (collectively, over MPI on the host: the only MPI traffic of the
engine): every rank allocates one workspace with cudaMalloc, exports it with
cudaIpcGetMemHandle, and maps every peer's. After that a collective is kernel launches on the
caller's stream and nothing else. Errors the kernels find (a mismatched call, a peer that does
not arrive within the timeout, a peer that failed) land in a host-mapped record that the host
reads without synchronising; the next call, ``check()`` or a handle's wait raises them. A
watchdog thread notices a peer process that died and tells the spinning kernels to give up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy

from cudampi.comm.ipc import layout as L
from cudampi.comm.ipc import plan
from cudampi.comm.ipc.registry import SEGMENT, Registry
from cudampi.errors import CommError, DeviceError, MismatchError

log = logging.getLogger("cudampi.ipc")

ERROR_DTYPE = numpy.dtype(
    [
        ("host_abort", numpy.uint32),
        ("code", numpy.uint32),
        ("ready", numpy.uint32),
        ("peer", numpy.uint32),
        ("block", numpy.uint32),
        ("pad", numpy.uint32),
        ("epoch", numpy.uint64),
        ("mine", numpy.uint64, (L.SIG_WORDS,)),
        ("theirs", numpy.uint64, (L.SIG_WORDS,)),
        ("expected", numpy.int64),
        ("got", numpy.int64),
    ]
)
assert ERROR_DTYPE.itemsize == L.ERROR_BYTES
assert ERROR_DTYPE.fields is not None and ERROR_DTYPE.fields["host_abort"][1] == L.ERROR_HOST_ABORT

_MODULES: dict[tuple[int, str], Any] = {}
"""Compiled kernels per (device, name expression); CuPy also caches them on disk."""


def _device(device: int) -> Any:
    import cupy

    return cupy.cuda.Device(device)


def kernel(device: int, name: str) -> Any:
    """The compiled kernel ``name`` (a layout name expression) on ``device``."""
    key = (device, name)
    fn = _MODULES.get(key)
    if fn is None:
        import cupy

        with cupy.cuda.Device(device):
            mod = cupy.RawModule(
                code=L.source(), options=L.COMPILE_OPTIONS, name_expressions=[name]
            )
            fn = mod.get_function(name)
        _MODULES[key] = fn
    return fn


_FUNCTIONS: dict[tuple[int, str], int] = {}
"""The CUfunction of each compiled kernel per (device, name expression)."""


def function(device: int, name: str) -> int:
    """The CUfunction (a driver handle) of the kernel ``name`` on ``device``, for a launch
    through ``cupy.cuda.driver.launchKernel``: a CuPy RawKernel call spends more host time on
    argument handling than the driver spends launching one packed parameter block."""
    key = (device, name)
    fn = _FUNCTIONS.get(key)
    if fn is None:
        import cupy

        with cupy.cuda.Device(device):
            fn = _FUNCTIONS[key] = int(kernel(device, name).kernel.ptr)
    return fn


_OPENED: dict[bytes, list[int]] = {}
"""IPC handles this process opened: handle -> [mapped base, references] (CUDA maps a handle
once per process; two communicators registering the same buffer share the mapping)."""


def ipc_open(handle: bytes) -> int:
    from cupy.cuda import runtime as rt

    got = _OPENED.get(handle)
    if got is None:
        got = _OPENED[handle] = [rt.ipcOpenMemHandle(handle, rt.cudaIpcMemLazyEnablePeerAccess), 0]
    got[1] += 1
    return int(got[0])


def ipc_close(base: int) -> None:
    from cupy.cuda import runtime as rt

    for handle, got in list(_OPENED.items()):
        if got[0] == base:
            got[1] -= 1
            if got[1] <= 0:
                del _OPENED[handle]
                rt.ipcCloseMemHandle(base)
            return


_POINTER_ATTRIBUTES: Any = None


def query_pointer(ptr: int) -> tuple[int, int, int] | None:
    """(allocation base, size, CUDA buffer id) of a device pointer, through NVIDIA's
    cuda-bindings (one cuPointerGetAttributes: this runs at every registered call); None where
    they are missing or the driver cannot describe the pointer."""
    global _POINTER_ATTRIBUTES
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        return None
    if _POINTER_ATTRIBUTES is None:
        a = cu.CUpointer_attribute
        _POINTER_ATTRIBUTES = [
            a.CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            a.CU_POINTER_ATTRIBUTE_RANGE_SIZE,
            a.CU_POINTER_ATTRIBUTE_BUFFER_ID,
        ]
    err, got = cu.cuPointerGetAttributes(3, _POINTER_ATTRIBUTES, ptr)
    if err != cu.CUresult.CUDA_SUCCESS:
        return None
    base, size, buffer_id = got
    if not int(base):
        return None
    return int(base), int(size), int(buffer_id)


def _start_time(pid: int) -> str | None:
    """The kernel's start time of process ``pid`` (None when it cannot be read): with the pid
    it names one process, so a reused pid is not mistaken for a live peer."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


@dataclass
class _Group:
    """The sends and receives posted and not launched yet, and the stream they were posted on
    (:meth:`Workspace.post`); the launches of the groups seen so far."""

    messages: list[plan.Message] = field(default_factory=list)
    stream: int = 0
    plans: dict[tuple[plan.Message, ...], list[plan.Launch]] = field(default_factory=dict)


class Workspace:
    """The GPU resources of one ipc communicator on ``device`` (see the module doc).

    ``comm``: an mpi4py communicator whose ranks share one node (its rank order is the
    kernels' rank order); the workspace frees it when it closes. ``capacity``: bytes of each of
    the two data buffers.
    """

    def __init__(
        self, comm: Any, device: int, *, capacity: int, timeout: float, blocks: int = 0
    ) -> None:
        import cupy
        from cupy.cuda import runtime as rt

        self.comm = comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.device = device
        self.capacity = max(4096, -(-capacity // 4096) * 4096)
        self.timeout = timeout
        if self.size > L.MAX_RANKS:
            raise CommError(
                f"the ipc engine joins at most {L.MAX_RANKS} ranks of one node; this node has "
                f"{self.size} in the communicator"
            )
        self.ptr = self.err_ptr = 0
        self._peers: list[int] = []
        self._closed = False
        self._error: BaseException | None = None
        self._streams: dict[int, Any] = {}
        self._last_stream: int | None = None
        self.calls = 0
        self.launches = 0
        """Collective kernel launches enqueued so far (every rank counts the same)."""
        self._group = _Group()
        self._win: Any = None
        local: str | None = None
        info: tuple[Any, ...] = ()
        with cupy.cuda.Device(device):
            try:
                total = L.DATA_OFFSET + 2 * self.capacity + L.p2p_bytes(self.capacity, self.size)
                self.ptr = rt.malloc(total)
                rt.memset(self.ptr, 0, total)
                handle = rt.ipcGetMemHandle(self.ptr)
                self.err_ptr = rt.hostAlloc(4096, rt.hostAllocMapped | rt.hostAllocPortable)
                sms = rt.deviceGetAttribute(rt.cudaDevAttrMultiProcessorCount, device)
                pci = tuple(
                    rt.deviceGetAttribute(a, device)
                    for a in (
                        rt.cudaDevAttrPciDomainId,
                        rt.cudaDevAttrPciBusId,
                        rt.cudaDevAttrPciDeviceId,
                    )
                )
                info = (handle, os.getpid(), _start_time(os.getpid()), pci, sms)
            except Exception as exc:  # a CUDA error on this rank: every rank must hear of it
                local = f"{type(exc).__name__}: {exc}"
            infos = comm.allgather(None if local else info)
            self._fail_together(
                "allocating the workspace", local, [None if i else "failed" for i in infos]
            )
            self._pids = [(i[1], i[2]) for i in infos]
            mapped: list[int] = []
            try:
                for r, i in enumerate(infos):
                    mapped.append(self.ptr if r == self.rank else ipc_open(i[0]))
            except Exception as exc:
                local = f"cudaIpcOpenMemHandle of rank {len(mapped)}'s workspace: {exc}"
            self._peers = mapped
            self._fail_together("mapping the peers' workspaces", local, comm.allgather(local))
            table = numpy.zeros(L.MAX_RANKS, numpy.uint64)
            table[: self.size] = mapped
            rt.memcpy(
                self.ptr + L.HEADER_PEERS, table.ctypes.data, table.nbytes, rt.memcpyHostToDevice
            )
            rt.deviceSynchronize()
            # the device's primary context: a launch where it is current needs no switch
            self._context = cupy.cuda.driver.ctxGetCurrent()
        from mpi4py import MPI

        raw: Any = MPI.memory.fromaddress(self.err_ptr, L.ERROR_BYTES)
        self.err = numpy.frombuffer(raw, ERROR_DTYPE)[0]
        self.err.fill(0)
        # every rank of the group on this rank's GPU?
        self.one_gpu = (on_my_gpu := sum(1 for i in infos if i[3] == info[3])) == self.size
        want = min(blocks or max(1, info[4] // on_my_gpu), L.MAX_BLOCKS)
        self.blocks = int(comm.allreduce(want, op=MPI.MIN))
        self.registry = self._registry(MPI)
        comm.Barrier()
        self._watch = threading.Thread(target=self._watchdog, name="cudampi-ipc-watch", daemon=True)
        self._watch.start()

    def _registry(self, MPI: Any) -> Registry:
        """The buffer registry, its mailbox in an MPI shared-memory window of the node."""
        from cupy.cuda import runtime as rt

        self._win = MPI.Win.Allocate_shared(SEGMENT.itemsize, 1, comm=self.comm)
        self._win.Lock_all(MPI.MODE_NOCHECK)
        segments = []
        for r in range(self.size):
            mem, _ = self._win.Shared_query(r)
            seg = numpy.frombuffer(mem, SEGMENT, 1)[0]
            segments.append(seg)
        segments[self.rank].fill(0)
        row = numpy.zeros(1, numpy.uint64)

        def write_table(peer: int, k: int, base: int) -> None:
            row[0] = base
            at = self.ptr + L.HEADER_REGS + 8 * (peer * L.MAX_REGS + k)
            with _device(self.device):
                rt.memcpy(at, row.ctypes.data, 8, rt.memcpyHostToDevice)

        return Registry(
            self.rank,
            segments,
            query=query_pointer,
            export=rt.ipcGetMemHandle,
            open_=ipc_open,
            close=ipc_close,
            write_table=write_table,
            sync=self._win.Sync,
        )

    def capturing(self, stream_ptr: int) -> bool:
        """Is a CUDA graph being captured on this stream?"""
        from cupy.cuda import runtime as rt

        return bool(rt.streamIsCapturing(stream_ptr) != rt.streamCaptureStatusNone)

    def _joins(self, last: int, stream_ptr: int) -> bool:
        """Must a launch on ``stream_ptr`` first wait for the stream ``last`` launched on?

        Outside a capture, always. Inside one, when ``last`` is captured too: a training step
        captured whole puts calls on several streams of one graph (FSDP2's all-gather and
        reduce-scatter streams), and nothing else need order two of them, so without the edge
        a replay could run two of this communicator's kernels side by side. A ``last`` outside
        the capture ran before it began. The legacy and per-thread default streams (0, 1, 2)
        never join a capture, and asking about them during one would end it."""
        if not self.capturing(stream_ptr):
            return True
        return last > 2 and self.capturing(last)

    def _fail_together(self, what: str, local: str | None, errors: list[str | None]) -> None:
        """Collective: raise on every rank when any rank failed (``errors[r]`` not None)."""
        bad = [r for r, e in enumerate(errors) if e is not None]
        if not bad:
            return
        self._release()
        detail = local or "see the first rank named"
        raise DeviceError(
            f"ipc engine: {what} failed on rank(s) {', '.join(map(str, bad))} of this node "
            f"({detail}); the ipc path is unavailable for this communicator. Use path='gpu-ring' "
            "or 'staged', or check that every rank of the node sees its GPU (CUDA_VISIBLE_DEVICES)."
        )

    # ------------------------------------------------------------------ launching

    def geometry(self, oneshot_bytes: int) -> plan.Geometry:
        """The launches' geometry; ``oneshot_bytes`` -1: :func:`plan.oneshot_auto`."""
        if oneshot_bytes < 0:
            oneshot_bytes = plan.oneshot_auto(self.size, self.one_gpu)
        return plan.Geometry(
            self.rank,
            self.size,
            self.capacity,
            int(self.timeout * 1e9),
            oneshot_bytes,
            self.ptr,
            self.err_ptr,
        )

    def stream(self, ptr: int) -> Any:
        s = self._streams.get(ptr)
        if s is None:
            import cupy

            s = self._streams[ptr] = cupy.cuda.ExternalStream(ptr, self.device)
        return s

    def launch(self, launches: list[plan.Launch], kernels: dict[str, str], stream_ptr: int) -> None:
        """Enqueue a collective's ``launches`` on the stream ``stream_ptr`` (``kernels`` maps
        each launch's kernel to its name expression), after the sends and receives posted before
        it. Launches of one communicator never overlap: a launch on another stream than the last
        one first waits for everything enqueued on that one so far (in a CUDA graph capture,
        an edge of the graph where both streams are captured: :meth:`_joins`)."""
        self.check()
        self.flush()
        self._launch(launches, kernels, stream_ptr)
        self.calls += 1
        self.launches += len(launches)

    def _launch(
        self, launches: list[plan.Launch], kernels: dict[str, str], stream_ptr: int
    ) -> None:
        import cupy

        if cupy.cuda.driver.ctxGetCurrent() != self._context:  # another device is current
            with _device(self.device):
                self._enqueue(launches, kernels, stream_ptr)
        else:
            self._enqueue(launches, kernels, stream_ptr)
        self._last_stream = stream_ptr

    # ------------------------------------------------------------------ point-to-point

    def post(self, message: plan.Message, stream_ptr: int) -> None:
        """Add a send or receive to the group launched at the next :meth:`flush` (a blocking
        call, a handle's wait, a collective, ``synchronize()``): the group runs as one kernel,
        so sends and receives that wait on each other's peers move together. A message on
        another stream than the group's launches the group first."""
        self.check()
        if not 0 <= message.peer < self.size:
            raise CommError(
                f"rank {message.peer} is not a rank of this communicator ({self.size} ranks)"
            )
        g = self._group
        if g.messages and g.stream != stream_ptr:
            self.flush()
        g.messages.append(message)
        g.stream = stream_ptr

    def flush(self) -> None:
        """Launch the posted sends and receives, on the stream they were posted on."""
        g = self._group
        if not g.messages:
            return
        key, g.messages = tuple(g.messages), []
        launches = g.plans.get(key)
        if launches is None:  # a training loop repeats its messages: each group planned once
            if len(g.plans) >= 1024:
                g.plans.clear()
            launches = g.plans[key] = plan.p2p(self.geometry(0), list(key))
        self._launch(launches, {"p2p": L.P2P_NAME}, g.stream)
        self.calls += 1

    def _enqueue(
        self, launches: list[plan.Launch], kernels: dict[str, str], stream_ptr: int
    ) -> None:
        import cupy

        last = self._last_stream
        if last is not None and last != stream_ptr and self._joins(last, stream_ptr):
            ev = cupy.cuda.Event(block=False, disable_timing=True)
            ev.record(self.stream(last))
            self.stream(stream_ptr).wait_event(ev)
        go, blocks, device = cupy.cuda.driver.launchKernel, self.blocks, self.device
        for lc in launches:
            go(function(device, kernels[lc.kernel]), blocks, 1, 1, L.NTHREADS, 1, 1, 0,
               stream_ptr, lc.argv_ptr, 0)  # fmt: skip

    # ------------------------------------------------------------------ errors

    def check(self) -> None:
        """Raise the error a kernel of this communicator reported, if any (never blocks long)."""
        if self._error is not None:
            raise self._error
        if self._closed:
            raise CommError("this ipc communicator was closed")
        if int(self.err["code"]) == 0:
            return
        deadline = time.monotonic() + 1.0
        while int(self.err["ready"]) == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        self._error = self._exception()
        raise self._error

    def _exception(self) -> BaseException:
        e = self.err
        code, peer = int(e["code"]), int(e["peer"])
        mine = plan.describe([int(w) for w in e["mine"]])
        where = f"rank {self.rank} of the node's ipc group ({self.calls} calls so far)"
        if code == L.ERR_MISMATCH:
            words = [int(w) for w in e["theirs"]]
            if words[0] >> 56 == plan.REJECTED:
                return CommError(
                    f"[{mine}]: rank {peer} rejected its arguments for this call (its error says "
                    "why), so no rank ran it; this communicator is unusable now."
                )
            theirs = plan.describe(words)
            return MismatchError(
                f"ranks called different collectives at the same point: {where} called "
                f"[{mine}], rank {peer} called [{theirs}]. Every rank must make the same "
                "collective calls, with the same counts, dtype, op and root, in the same order."
            )
        if code in (L.ERR_RECV, L.ERR_SEND):
            exp, got = int(e["expected"]), int(e["got"])
            if code == L.ERR_RECV:
                what = f"rank {peer} sends {got} bytes where {where} expects {exp}"
            else:
                what = f"{where} sends {got} bytes where rank {peer} expects {exp}"
            return MismatchError(
                f"[{mine}]: {what}. recv_counts[j] must equal rank j's send_counts[i] (and every "
                "rank must pass the same counts to v-collectives)."
            )
        if code == L.ERR_MESSAGE:
            theirs = plan.describe([int(w) for w in e["theirs"]])
            return MismatchError(
                f"rank {peer} sent [{theirs}] where {where} receives [{mine}]: on the ipc path "
                "the messages between two ranks match in the order they are sent, each with the "
                "receive's size and tag (as NCCL's send/recv, which have no tags)."
            )
        if code == L.ERR_TIMEOUT and int(e["mine"][0]) >> 56 in (L.CALL_SEND, L.CALL_RECV):
            other = "receive" if int(e["mine"][0]) >> 56 == L.CALL_SEND else "send"
            eager = L.p2p_eager(self.capacity)
            return CommError(
                f"[{mine}]: rank {peer} did not make the matching {other} within "
                f"{self.timeout:g} s (CUDAMPI_TIMEOUT) at {where}. On the ipc path a send of "
                f"more than {eager} bytes waits for its receive, so two ranks that both send "
                "first wait for ever: use sendrecv, or isend/irecv and then wait; both ranks "
                "must use the ipc path (device arrays, path='ipc'); this communicator is "
                "unusable now."
            )
        if code == L.ERR_TIMEOUT:
            return CommError(
                f"[{mine}]: rank {peer} did not arrive within {self.timeout:g} s "
                f"(CUDAMPI_TIMEOUT) at {where}: it called another collective, none, or is "
                "stuck; this communicator is unusable now."
            )
        if code == L.ERR_HOST and self._dead is not None:
            return CommError(f"[{mine}]: {self._dead}; this communicator is unusable now.")
        return CommError(
            f"[{mine}]: abandoned at {where} because another rank's collective failed (its "
            "error names the cause); this communicator is unusable now."
        )

    _dead: str | None = None

    def _watchdog(self) -> None:
        """Poll for a peer process that died (its kernels will never arrive) and tell this
        rank's kernels to stop waiting; report a kernel's error as soon as it appears."""
        reported = False
        while not self._closed:
            time.sleep(0.05)
            if self._closed:
                return
            if not reported and int(self.err["code"]) and int(self.err["ready"]):
                reported = True
                log.warning("rank %d: %s", self.rank, self._exception())
            if self._dead is None:
                for r, (pid, start) in enumerate(self._pids):
                    if r == self.rank or start is None:
                        continue
                    if _start_time(pid) != start:
                        self._dead = (
                            f"rank {r} of the node's ipc group (pid {pid}) ended while this "
                            "communicator was in use"
                        )
                        self.err["host_abort"] = 1
                        break

    # ------------------------------------------------------------------ teardown

    def close(self) -> None:
        """Collective: wait for this rank's launches, unmap the peers, free the workspace."""
        if self._closed:
            return
        import cupy

        with cupy.cuda.Device(self.device):
            if self._error is None and int(self.err["code"]) == 0:
                self.flush()
            if self._last_stream is not None:
                self.stream(self._last_stream).synchronize()
        self._closed = True
        self._watch.join(timeout=1)
        self._release()

    def _release(self) -> None:
        """Unmap the peers, wait until every rank did (no peer maps this workspace when it is
        freed), free, and free the communicator. Collective, also after a failed setup."""
        import cupy
        from cupy.cuda import runtime as rt

        self._closed = True
        with cupy.cuda.Device(self.device):
            if getattr(self, "registry", None) is not None:
                self.registry.close()
            for r, p in enumerate(self._peers):
                if r != self.rank and p:
                    try:
                        ipc_close(p)
                    except Exception:
                        pass
            self._peers = []
            if self._win is not None:
                try:
                    self._win.Unlock_all()
                    self._win.Free()
                except Exception:
                    pass
                self._win = None
            try:
                self.comm.Barrier()
            except Exception:
                pass
            if self.ptr:
                rt.free(self.ptr)
                self.ptr = 0
            if self.err_ptr:
                rt.freeHost(self.err_ptr)
                self.err_ptr = 0
        try:
            self.comm.Free()
        except Exception:
            pass
