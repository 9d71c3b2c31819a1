"""NumPy arrays (host memory); also the host staging every library's host arrays share."""

from __future__ import annotations

import sys
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
    Unsupported,
    core,
)

_NAMES: dict[Any, str] = {}
_MEMORY: Any = None


def _memory() -> Any:
    """``MPI.memory``, imported once (an import statement costs more than the call)."""
    global _MEMORY
    from mpi4py import MPI

    _MEMORY = MPI.memory
    return _MEMORY


def np_ptr(a: Any) -> int:
    """The data address of a NumPy array (mpi4py's buffer view is the cheapest way to read it)."""
    memory = _MEMORY or _memory()
    try:
        return int(memory(a).address)
    except (TypeError, ValueError, BufferError):  # not exposable as a buffer: ask NumPy
        return int(a.__array_interface__["data"][0])


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

    def reduce(self, dst: Any, src: Any, op: str, dtype: str, first: Any = None) -> None:
        self.ufunc(op, dtype)(dst if first is None else first, src, out=dst)

    @staticmethod
    def ufunc(op: str, dtype: str) -> Any:
        """The NumPy ufunc that combines two arrays of ``dtype`` for reduction ``op``."""
        import numpy

        return getattr(numpy, BOOL_OP[core(op)] if dtype == "bool" else NP_OP[core(op)])

    def divide(self, a: Any, n: int, dtype: str, src: Any = None) -> None:
        import numpy

        numpy.true_divide(a if src is None else src, a.dtype.type(n), out=a)


NUMPY_OPS = NumpyOps()


def _np_bytes(a: Any) -> Any:
    """A flat uint8 NumPy view of a contiguous host array (NumPy or torch CPU)."""
    import numpy

    if isinstance(a, numpy.ndarray):
        return a.reshape(-1).view(numpy.uint8)
    import torch

    return a.reshape(-1).view(torch.uint8).numpy()


class HostStager:
    """Staging for arrays already in host memory (NumPy or torch CPU): plain buffers, sync copies."""

    def __init__(self, lib: str) -> None:
        self.lib = lib

    def pinned(self, nbytes: int) -> Any:
        import numpy

        return numpy.empty(nbytes, dtype=numpy.uint8)

    @staticmethod
    def host_ptr(host: Any) -> int:
        return int(host.__array_interface__["data"][0])

    @staticmethod
    def host_nbytes(host: Any) -> int:
        return int(host.nbytes)

    @staticmethod
    def nbytes(a: Any) -> int:
        return int(_np_bytes(a).nbytes)

    def d2h(self, host: Any, a: Any, lo: int, hi: int) -> Any:
        host[: hi - lo] = _np_bytes(a)[lo:hi]
        return None

    def h2d(self, a: Any, host: Any, lo: int, hi: int) -> Any:
        src = host[: hi - lo]
        _np_bytes(a)[lo:hi] = src if hasattr(src, "__array_interface__") else src.numpy()
        return None

    @staticmethod
    def wait(ev: Any) -> None:
        return None

    def host_view(self, host: Any, like: Any, count: int) -> Any:
        import numpy

        if isinstance(like, numpy.ndarray):
            return host[: count * like.dtype.itemsize].view(like.dtype)
        import torch

        return torch.from_numpy(host[: count * like.element_size()]).view(like.dtype)

    def host_lib(self) -> str:
        return self.lib


class NumpyChecks(ArrayApiChecks):
    """Host arrays (NumPy); no bfloat16."""

    name = "numpy"

    def __init__(self) -> None:
        super().__init__("cpu")
        import numpy as np

        self.xp = self.np = np

    def check_dtype(self, dtype: str) -> None:
        if dtype == "bfloat16":
            raise Unsupported("NumPy has no bfloat16 (use --array torch for bfloat16 host buffers)")

    def cast(self, x64: Any, dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.np.ascontiguousarray(x64.astype(dtype))

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.np.empty(shape, dtype=dtype)

    def fill(self, x: Any, value: float) -> None:
        x.fill(value)

    def copy_into(self, dst: Any, src: Any) -> None:
        self.np.copyto(dst, src)

    def from_numpy(self, a: Any, dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.np.ascontiguousarray(a.astype(dtype))

    def to_numpy(self, x: Any) -> Any:
        return x


class Numpy:
    """NumPy arrays: used as they are (see :class:`~cudampi.comm.arrays.base.ArrayLibrary`)."""

    name = "numpy"
    read_only_fix = WRITABLE_FIX

    def array_type(self) -> type | None:
        np = sys.modules.get("numpy")
        return None if np is None else np.ndarray

    def adapt(self, a: Any, obj: Any, what: str = "x") -> Buf:
        dt = a.dtype
        name = _NAMES.get(dt)
        if name is None:
            name = _NAMES[dt] = dt.name  # dtype.name is slow to compute; dtypes are few
        flags = a.flags
        # NumPy's shape is a tuple of Python ints already
        return Buf(obj, a, "numpy", None, name, a.shape, dt.itemsize, flags.c_contiguous,
                   flags.writeable, NUMPY)  # fmt: skip

    def label(self, b: Buf) -> str:
        return b.lib

    def flat(self, b: Buf) -> Any:
        return b.arr.reshape(-1)

    def ptr(self, b: Buf) -> int:
        return np_ptr(b.arr)

    def new(self, like: Buf, shape: tuple[int, ...]) -> Buf:
        import numpy

        a = numpy.empty(shape, dtype=like.arr.dtype)
        return self.adapt(a, a)

    def result(self, b: Buf) -> Any:
        return b.arr

    def written(self, b: Buf) -> Any:
        return b.obj if b.obj is b.arr else b.arr

    def ops(self, device: int | None) -> ArrayOps:
        return NUMPY_OPS

    def stager(self, device: int | None) -> HostStager:
        return HostStager("numpy")

    def checks(self, device: str) -> Checks:
        if device != "cpu":
            raise Unsupported("NumPy arrays live on the host, not on a CUDA device")
        return NumpyChecks()


NUMPY: ArrayLibrary = Numpy()
LIBRARY = NUMPY
