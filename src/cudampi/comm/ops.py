"""Element-wise work on flat arrays of one library and device: allocate, copy, reduce, fence.

The collective algorithms only ever touch arrays through an :class:`ArrayOps`, so the same ring
and recursive-doubling code reduces NumPy arrays on the host, torch tensors on the host or a GPU
and CuPy arrays on a GPU. GPU reductions run on a dedicated stream of the communicator; the
caller's stream is waited for before any memory is read (:meth:`ArrayOps.capture` records an
event in the caller's thread, :meth:`ArrayOps.begin` waits for it) and :meth:`ArrayOps.fence`
makes everything queued on the reduction stream complete before MPI touches the memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from cudampi.comm.buffers import np_ptr
from cudampi.errors import CommError
from cudampi.names import REDUCE_OPS

FLOAT = ("float16", "bfloat16", "float32", "float64")
COMPLEX = ("complex64", "complex128")


def ops_allowed(dtype: str) -> tuple[str, ...]:
    """The reduction ops defined for ``dtype`` (bool: sum/max/bor = or, prod/min/band = and)."""
    if dtype in FLOAT:
        return ("sum", "prod", "min", "max", "avg")
    if dtype in COMPLEX:
        return ("sum", "prod", "avg")
    if dtype == "bool":
        return ("sum", "prod", "min", "max", "band", "bor", "bxor")
    return REDUCE_OPS


def check_op(op: Any, dtype: str) -> str:
    """``op`` if it names a reduction valid for ``dtype``; a :class:`CommError` otherwise."""
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise CommError(f"op={op!r} is not a reduction; use one of {', '.join(REDUCE_OPS)}")
    allowed = ops_allowed(dtype)
    if op not in allowed:
        raise CommError(f"op={op!r} is not defined for {dtype}; {dtype} takes {', '.join(allowed)}")
    return op


_BOOL_OP = {
    "sum": "logical_or",
    "max": "logical_or",
    "bor": "logical_or",
    "prod": "logical_and",
    "min": "logical_and",
    "band": "logical_and",
    "bxor": "logical_xor",
}
_NP_OP = {
    "sum": "add",
    "prod": "multiply",
    "min": "minimum",
    "max": "maximum",
    "band": "bitwise_and",
    "bor": "bitwise_or",
    "bxor": "bitwise_xor",
}
_TORCH_OP = {
    "sum": "add",
    "prod": "mul",
    "min": "minimum",
    "max": "maximum",
    "band": "bitwise_and",
    "bor": "bitwise_or",
    "bxor": "bitwise_xor",
}


def _core(op: str) -> str:
    return "sum" if op == "avg" else op


class ArrayOps:
    """The interface; see the module doc. Host implementations have no-op stream methods."""

    lib: str = ""
    device: int | None = None

    def empty(self, n: int, like: Any) -> Any:
        raise NotImplementedError

    def ptr(self, a: Any) -> int:
        raise NotImplementedError

    def nbytes(self, a: Any) -> int:
        raise NotImplementedError

    def itemsize(self, a: Any) -> int:
        """Bytes per element of ``a``."""
        raise NotImplementedError

    def copy(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    def reduce(self, dst: Any, src: Any, op: str, dtype: str) -> None:
        """``dst = dst (op) src`` element-wise, in place (``avg`` reduces as ``sum``)."""
        raise NotImplementedError

    def divide(self, a: Any, n: int, dtype: str) -> None:
        """Finish ``avg``: true division for floats and complex, floor division for integers."""
        raise NotImplementedError

    def capture(self) -> Any:
        """In the caller's thread: a token for 'everything queued so far on the caller's stream'."""
        return None

    def begin(self, token: Any) -> None:
        """Wait until the work that ``token`` marks is complete."""

    def record(self) -> Any:
        """A marker of the work queued so far on the reduction stream."""
        return None

    def wait_event(self, ev: Any) -> None:
        """Block the host until ``ev`` (from :meth:`record`) has completed."""

    def fence(self) -> None:
        """Block the host until all work on the reduction stream is complete."""

    @contextlib.contextmanager
    def device_ctx(self) -> Iterator[None]:
        yield


class NumpyOps(ArrayOps):
    """NumPy arrays in host memory."""

    lib = "numpy"
    device = None

    def empty(self, n: int, like: Any) -> Any:
        import numpy

        return numpy.empty(n, dtype=like.dtype)

    def ptr(self, a: Any) -> int:
        return np_ptr(a)

    def nbytes(self, a: Any) -> int:
        return int(a.nbytes)

    def itemsize(self, a: Any) -> int:
        return int(a.dtype.itemsize)

    def copy(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def reduce(self, dst: Any, src: Any, op: str, dtype: str) -> None:
        import numpy

        name = _BOOL_OP[_core(op)] if dtype == "bool" else _NP_OP[_core(op)]
        getattr(numpy, name)(dst, src, out=dst)

    def divide(self, a: Any, n: int, dtype: str) -> None:
        import numpy

        if dtype in FLOAT or dtype in COMPLEX:
            numpy.true_divide(a, a.dtype.type(n), out=a)
        else:
            numpy.floor_divide(a, a.dtype.type(n), out=a)


_NUMPY_OPS = NumpyOps()


def _signed_twin(torch: Any, dtype: str) -> Any:
    return {
        "uint16": torch.int16,
        "uint32": torch.int32,
        "uint64": torch.int64,
    }[dtype]


class TorchOps(ArrayOps):
    """torch tensors on the CPU (``device=None``) or on one CUDA device.

    CPU tensors of dtypes NumPy has are reduced through zero-copy NumPy views (faster, and torch
    lacks add/min/max for uint16/32/64); ``use_numpy=False`` forces torch kernels, which is what
    the GPU runs, so the CPU tests cover the torch kernels too.
    """

    lib = "torch"

    def __init__(self, device: int | None = None, *, use_numpy: bool = True) -> None:
        self.device = device
        self.use_numpy = use_numpy and device is None
        self._stream: Any = None

    @property
    def stream(self) -> Any:
        if self._stream is None and self.device is not None:
            import torch

            self._stream = torch.cuda.Stream(device=self.device)
        return self._stream

    def empty(self, n: int, like: Any) -> Any:
        import torch

        return torch.empty(n, dtype=like.dtype, device=like.device)

    def ptr(self, a: Any) -> int:
        return int(a.data_ptr())

    def nbytes(self, a: Any) -> int:
        return int(a.nbytes)

    def itemsize(self, a: Any) -> int:
        return int(a.element_size())

    @contextlib.contextmanager
    def _on_stream(self) -> Iterator[None]:
        if self.device is None:
            yield
            return
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            yield

    def copy(self, dst: Any, src: Any) -> None:
        with self._on_stream():
            dst.copy_(src, non_blocking=True)

    def reduce(self, dst: Any, src: Any, op: str, dtype: str) -> None:
        if self.use_numpy and dtype != "bfloat16":
            _NUMPY_OPS.reduce(dst.numpy(), src.numpy(), op, dtype)
            return
        import torch

        core = _core(op)
        with self._on_stream():
            if dtype == "bool":
                getattr(torch, _BOOL_OP[core])(dst, src, out=dst)
            elif dtype in ("uint16", "uint32", "uint64"):
                _torch_unsigned_reduce(torch, dst, src, core, dtype)
            else:
                getattr(torch, _TORCH_OP[core])(dst, src, out=dst)

    def divide(self, a: Any, n: int, dtype: str) -> None:
        if self.use_numpy and dtype != "bfloat16":
            _NUMPY_OPS.divide(a.numpy(), n, dtype)
            return
        import torch

        with self._on_stream():
            if dtype in FLOAT or dtype in COMPLEX:
                a.div_(n)
            elif dtype in ("uint16", "uint32", "uint64"):
                _torch_unsigned_floordiv(torch, a, n, dtype)
            else:
                torch.floor_divide(a, n, out=a)

    def capture(self) -> Any:
        if self.device is None:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def begin(self, token: Any) -> None:
        if token is not None:
            token.synchronize()

    def record(self) -> Any:
        if self.device is None:
            return None
        import torch

        ev = torch.cuda.Event()
        ev.record(self.stream)
        return ev

    def wait_event(self, ev: Any) -> None:
        if ev is not None:
            ev.synchronize()

    def fence(self) -> None:
        if self.device is not None and self._stream is not None:
            self._stream.synchronize()

    @contextlib.contextmanager
    def device_ctx(self) -> Iterator[None]:
        if self.device is None:
            yield
            return
        import torch

        with torch.cuda.device(self.device):
            yield


def _torch_unsigned_reduce(torch: Any, dst: Any, src: Any, core: str, dtype: str) -> None:
    """Unsigned add/mul/bitwise through the signed twin (same bits, wrap-around arithmetic);
    min/max by flipping the sign bit so signed order equals unsigned order."""
    twin = _signed_twin(torch, dtype)
    d, s = dst.view(twin), src.view(twin)
    if core in ("min", "max"):
        bits = d.element_size() * 8
        flip = torch.tensor(-(1 << (bits - 1)), dtype=twin, device=d.device)
        sf = torch.bitwise_xor(s, flip)
        torch.bitwise_xor(d, flip, out=d)
        getattr(torch, _TORCH_OP[core])(d, sf, out=d)
        torch.bitwise_xor(d, flip, out=d)
    else:
        getattr(torch, _TORCH_OP[core])(d, s, out=d)


def _torch_unsigned_floordiv(torch: Any, a: Any, n: int, dtype: str) -> None:
    twin = _signed_twin(torch, dtype)
    s = a.view(twin)
    if dtype != "uint64":
        wide = s.to(torch.int64) & ((1 << (s.element_size() * 8)) - 1)
        s.copy_(torch.floor_divide(wide, n).to(twin))
        return
    # uint64: halve with a logical shift so the value fits int64, divide, then fix the remainder.
    half = (s >> 1) & 0x7FFFFFFFFFFFFFFF
    q = torch.floor_divide(half, n) << 1
    rem = s - q * n  # exact: true value - q*n < 2n, wrap-around cancels
    q += torch.floor_divide(rem, n)
    s.copy_(q)


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

    def reduce(self, dst: Any, src: Any, op: str, dtype: str) -> None:
        import cupy

        name = _BOOL_OP[_core(op)] if dtype == "bool" else _NP_OP[_core(op)]
        with self._on_stream():
            getattr(cupy, name)(dst, src, out=dst)

    def divide(self, a: Any, n: int, dtype: str) -> None:
        import cupy

        with self._on_stream():
            if dtype in FLOAT or dtype in COMPLEX:
                cupy.true_divide(a, a.dtype.type(n), out=a)
            else:
                cupy.floor_divide(a, a.dtype.type(n), out=a)

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


def ops_for(lib: str, device: int | None) -> ArrayOps:
    """A fresh :class:`ArrayOps` for ``lib`` on ``device`` (each communicator keeps one per lib
    and device: :class:`~cudampi.comm.engines.base.Engines`)."""
    if lib == "numpy":
        return _NUMPY_OPS
    if lib == "torch":
        return TorchOps(device)
    if lib == "cupy":
        if device is None:
            raise CommError("CuPy arrays live on a CUDA device; got a host CuPy request")
        return CupyOps(device)
    raise CommError(f"unknown array library {lib!r}; expected one of numpy, torch, cupy")
