"""CuPy arrays, on one CUDA device."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from cudampi.comm.arrays.base import (
    BOOL_OP,
    NP_OP,
    WRITABLE_FIX,
    ArrayApiChecks,
    ArrayLibrary,
    ArrayOps,
    Buf,
    Checks,
    Stager,
    Unsupported,
    core,
)
from cudampi.comm.arrays.numpy import HostStager
from cudampi.errors import CommError


class CupyOps(ArrayOps):
    """CuPy arrays on one CUDA device."""

    lib = "cupy"

    def __init__(self, device: int) -> None:
        self.device = device
        self._stream: Any = None

    @property
    def stream(self) -> Any:
        if self._stream is None:
            import cupy

            with cupy.cuda.Device(self.device):
                self._stream = cupy.cuda.Stream(non_blocking=True)
        return self._stream

    def empty(self, n: int, like: Any) -> Any:
        import cupy

        with cupy.cuda.Device(self.device):
            return cupy.empty(n, dtype=like.dtype)

    def ptr(self, a: Any) -> int:
        return int(a.data.ptr)

    def nbytes(self, a: Any) -> int:
        return int(a.nbytes)

    def itemsize(self, a: Any) -> int:
        return int(a.dtype.itemsize)

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        import cupy

        with cupy.cuda.Device(self.device), self.stream:
            yield

    def copy(self, dst: Any, src: Any) -> None:
        import cupy

        n = int(dst.nbytes)
        if n:
            with cupy.cuda.Device(self.device):
                cupy.cuda.runtime.memcpyAsync(
                    dst.data.ptr,
                    src.data.ptr,
                    n,
                    cupy.cuda.runtime.memcpyDeviceToDevice,
                    self.stream.ptr,
                )

    def reduce(self, dst: Any, src: Any, op: str, dtype: str, first: Any = None) -> None:
        import cupy

        name = BOOL_OP[core(op)] if dtype == "bool" else NP_OP[core(op)]
        with self._on_stream():
            getattr(cupy, name)(dst if first is None else first, src, out=dst)

    def divide(self, a: Any, n: int, dtype: str, src: Any = None) -> None:
        import cupy

        with self._on_stream():
            cupy.true_divide(a if src is None else src, a.dtype.type(n), out=a)

    def capture(self) -> Any:
        import cupy

        with cupy.cuda.Device(self.device):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(cupy.cuda.get_current_stream())
        return ev

    def begin(self, token: Any) -> None:
        if token is not None:
            token.synchronize()

    def record(self) -> Any:
        import cupy

        with cupy.cuda.Device(self.device):
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(self.stream)
        return ev

    def wait_event(self, ev: Any) -> None:
        if ev is not None:
            ev.synchronize()

    def fence(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()

    @contextlib.contextmanager
    def device_ctx(self) -> Iterator[None]:
        import cupy

        with cupy.cuda.Device(self.device):
            yield


class CupyStager:
    """Pinned NumPy buffers from CuPy's pinned pool and copies on a dedicated CUDA stream."""

    def __init__(self, device: int) -> None:
        import cupy

        self.device = device
        with cupy.cuda.Device(device):
            self.stream = cupy.cuda.Stream(non_blocking=True)

    def pinned(self, nbytes: int) -> Any:
        import cupyx
        import numpy

        return cupyx.empty_pinned((nbytes,), dtype=numpy.uint8)

    @staticmethod
    def host_ptr(host: Any) -> int:
        return int(host.__array_interface__["data"][0])

    @staticmethod
    def host_nbytes(host: Any) -> int:
        return int(host.nbytes)

    @staticmethod
    def nbytes(a: Any) -> int:
        return int(a.nbytes)

    def _copy(self, dst: int, src: int, n: int, kind: int) -> Any:
        import cupy

        with cupy.cuda.Device(self.device):
            if n:
                cupy.cuda.runtime.memcpyAsync(dst, src, n, kind, self.stream.ptr)
            ev = cupy.cuda.Event(disable_timing=True)
            ev.record(self.stream)
        return ev

    def d2h(self, host: Any, a: Any, lo: int, hi: int) -> Any:
        import cupy

        return self._copy(
            self.host_ptr(host), int(a.data.ptr) + lo, hi - lo, cupy.cuda.runtime.memcpyDeviceToHost
        )

    def h2d(self, a: Any, host: Any, lo: int, hi: int) -> Any:
        import cupy

        return self._copy(
            int(a.data.ptr) + lo, self.host_ptr(host), hi - lo, cupy.cuda.runtime.memcpyHostToDevice
        )

    @staticmethod
    def wait(ev: Any) -> None:
        if ev is not None:
            ev.synchronize()

    def host_view(self, host: Any, like: Any, count: int) -> Any:
        return host[: count * like.dtype.itemsize].view(like.dtype)

    def host_lib(self) -> str:
        return "numpy"


class CupyChecks(ArrayApiChecks):
    """CuPy arrays on the current CUDA device; bfloat16 only where CuPy has it."""

    name = "cupy"

    def __init__(self) -> None:
        super().__init__("cuda")
        import cupy as cp

        self.xp = self.cp = cp
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise Unsupported("CuPy sees no CUDA device")

    def check_dtype(self, dtype: str) -> None:
        if dtype == "bfloat16" and not hasattr(self.cp, "bfloat16"):
            raise Unsupported("this CuPy has no bfloat16 (use --array torch)")

    def _dt(self, dtype: str) -> Any:
        return getattr(self.cp, dtype) if dtype == "bfloat16" else dtype

    def cast(self, x64: Any, dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.cp.ascontiguousarray(x64.astype(self._dt(dtype)))

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.cp.empty(shape, dtype=self._dt(dtype))

    def fill(self, x: Any, value: float) -> None:
        x.fill(value)

    def copy_into(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def from_numpy(self, a: Any, dtype: str) -> Any:
        import numpy as np

        self.check_dtype(dtype)
        if dtype == "bfloat16":
            return self.cp.asarray(np.ascontiguousarray(a.astype(np.float64))).astype(
                self._dt(dtype)
            )
        return self.cp.asarray(np.ascontiguousarray(a.astype(dtype)))

    def to_numpy(self, x: Any) -> Any:
        import numpy as np

        if str(x.dtype) == "bfloat16":
            return self.cp.asnumpy(x.astype(self.cp.float64)).astype(np.float64)
        return self.cp.asnumpy(x)


class Cupy:
    """CuPy arrays (see :class:`~cudampi.comm.arrays.base.ArrayLibrary`)."""

    name = "cupy"
    read_only_fix = WRITABLE_FIX

    def array_type(self) -> type | None:
        cupy = sys.modules.get("cupy")
        return None if cupy is None else cupy.ndarray

    def adapt(self, a: Any, obj: Any, what: str = "x") -> Buf:
        return Buf(
            obj=obj,
            arr=a,
            lib="cupy",
            device=int(a.device.id),
            dtype=a.dtype.name,
            shape=tuple(int(d) for d in a.shape),
            itemsize=int(a.dtype.itemsize),
            contiguous=bool(a.flags.c_contiguous),
            writable=True,
            impl=CUPY,
        )

    def label(self, b: Buf) -> str:
        return b.lib

    def flat(self, b: Buf) -> Any:
        return b.arr.reshape(-1)

    def ptr(self, b: Buf) -> int:
        return int(b.arr.data.ptr)

    def new(self, like: Buf, shape: tuple[int, ...]) -> Buf:
        import cupy

        with cupy.cuda.Device(like.device):
            a = cupy.empty(shape, dtype=like.arr.dtype)
        return self.adapt(a, a)

    def result(self, b: Buf) -> Any:
        return b.arr

    def written(self, b: Buf) -> Any:
        return b.obj if b.obj is b.arr else b.arr

    def ops(self, device: int | None) -> ArrayOps:
        if device is None:
            raise CommError("CuPy arrays live on a CUDA device; got a host CuPy request")
        return CupyOps(device)

    def stager(self, device: int | None) -> Stager:
        return HostStager("cupy") if device is None else CupyStager(device)

    def checks(self, device: str) -> Checks:
        if device != "cuda":
            raise Unsupported("CuPy arrays live on a CUDA device, not on the host")
        return CupyChecks()


CUPY: ArrayLibrary = Cupy()
LIBRARY = CUPY
