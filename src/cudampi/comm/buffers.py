"""Adapt any array a collective receives to one view: library, device, dtype, shape, pointer.

NumPy arrays, torch tensors (CPU or CUDA) and CuPy arrays are used as they are. Any other object
with ``__cuda_array_interface__`` or ``__dlpack__`` is wrapped without a copy (CuPy where it is
installed, else torch) and results come back as that library's arrays; host objects with the
buffer protocol or ``__array_interface__`` become NumPy views.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

from cudampi.errors import CommError, DeviceError

DTYPES = (
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint16",
    "uint32",
    "uint64",
    "float16",
    "bfloat16",
    "float32",
    "float64",
    "complex64",
    "complex128",
)
"""Every dtype a collective accepts, by canonical name."""

DTYPE_CODE = {name: i + 1 for i, name in enumerate(DTYPES)}


@dataclass(slots=True)
class Buf:
    """One array as the collectives see it (made for every array of every call: slots, not
    frozen, whose checked assignments cost a microsecond a call; treat it as read-only).

    ``arr`` is the array in its own library (a view of the caller's memory, never a copy);
    ``device`` is None for host memory, else the CUDA device ordinal.
    """

    obj: Any
    arr: Any
    lib: str
    device: int | None
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    contiguous: bool
    writable: bool = True
    """False for memory the array says must not be written (a read-only NumPy array, a CUDA
    array interface marked read-only)."""

    @property
    def count(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.count * self.itemsize

    @property
    def on_device(self) -> bool:
        return self.device is not None

    def where(self) -> str:
        return "host memory" if self.device is None else f"cuda:{self.device}"

    def describe(self) -> str:
        return f"{self.lib} {self.dtype} array of shape {self.shape} in {self.where()}"


def _mod(name: str) -> Any:
    return sys.modules.get(name)


def _canon_torch_dtype(dt: Any) -> str:
    return str(dt).removeprefix("torch.")


def adapt(x: Any, what: str = "x") -> Buf:
    """Wrap ``x`` (see the module doc) without copying; a :class:`CommError` if it is no array."""
    np = _mod("numpy")
    if np is not None and isinstance(x, np.ndarray):
        return _from_numpy(x, x)
    torch = _mod("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return _from_torch(x, x)
    cupy = _mod("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return _from_cupy(x, x)
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cuda_foreign(x, what)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        if int(dev_type) in (1, 3):  # kDLCPU, kDLCUDAHost (pinned host)
            import numpy

            return _from_numpy(numpy.from_dlpack(x), x)
        if int(dev_type) in (2, 13):  # kDLCUDA, kDLCUDAManaged
            return _from_cuda_foreign(x, what)
        raise DeviceError(
            f"{what}: a DLPack array on device type {dev_type!r} (id {dev_id!r}); cudampi moves "
            "host memory and CUDA memory only. Copy it to the host or a CUDA device first."
        )
    if hasattr(x, "__array_interface__") or isinstance(x, (bytearray, memoryview)):
        import numpy

        return _from_numpy(numpy.asarray(x), x)
    raise CommError(
        f"{what}: {type(x).__name__!r} is not an array. Pass a NumPy array, a torch tensor, a "
        "CuPy array or an object with __dlpack__ / __cuda_array_interface__."
    )


_NP_NAMES: dict[Any, str] = {}
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


def _from_numpy(a: Any, obj: Any) -> Buf:
    dt = a.dtype
    name = _NP_NAMES.get(dt)
    if name is None:
        name = _NP_NAMES[dt] = dt.name  # dtype.name is slow to compute; dtypes are few
    flags = a.flags
    # NumPy's shape is a tuple of Python ints already
    return Buf(obj, a, "numpy", None, name, a.shape, dt.itemsize, flags.c_contiguous,
               flags.writeable)  # fmt: skip


_TORCH_NAMES: dict[Any, str] = {}


def _from_torch(t: Any, obj: Any) -> Buf:
    if t.is_cuda:
        device: int | None = t.get_device()
    elif t.is_cpu:
        device = None
    else:
        raise DeviceError(
            f"a torch tensor on device {str(t.device)!r}; cudampi moves CPU and CUDA tensors "
            "only. Move it with .cpu() or .cuda() first."
        )
    dt = t.dtype
    name = _TORCH_NAMES.get(dt)
    if name is None:
        name = _TORCH_NAMES[dt] = _canon_torch_dtype(dt)
    # same memory; in-place writes must not be recorded by autograd. torch.Size holds ints.
    arr = t.detach() if t.requires_grad else t
    return Buf(obj, arr, "torch", device, name, tuple(t.shape), t.element_size(),
               t.is_contiguous())  # fmt: skip


def _from_cupy(a: Any, obj: Any) -> Buf:
    return Buf(
        obj=obj,
        arr=a,
        lib="cupy",
        device=int(a.device.id),
        dtype=a.dtype.name,
        shape=tuple(int(d) for d in a.shape),
        itemsize=int(a.dtype.itemsize),
        contiguous=bool(a.flags.c_contiguous),
    )


def _from_cuda_foreign(x: Any, what: str) -> Buf:
    import dataclasses

    cai = getattr(x, "__cuda_array_interface__", None)
    data = cai.get("data") if isinstance(cai, dict) else None
    read_only = bool(data[1]) if isinstance(data, tuple) and len(data) > 1 else False
    b = _from_cuda_wrapped(x, what)
    return dataclasses.replace(b, writable=False) if read_only else b


def _from_cuda_wrapped(x: Any, what: str) -> Buf:
    try:
        import cupy

        return _from_cupy(
            cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x), x
        )
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        raise DeviceError(
            f"{what}: a CUDA array of type {type(x).__name__!r}, but neither CuPy nor torch is "
            "installed to operate on it. Install cupy-cuda12x/13x or torch."
        ) from None
    if hasattr(x, "__dlpack__"):
        return _from_torch(torch.from_dlpack(x), x)
    return _from_torch(torch.as_tensor(x, device="cuda"), x)


def flat(b: Buf) -> Any:
    """A 1-D view of a contiguous array (never a copy)."""
    if b.lib == "torch":
        return flat_tensor(b.arr)
    return b.arr.reshape(-1)


def flat_tensor(t: Any) -> Any:
    """A 1-D view of a contiguous torch tensor that autograd does not record (never a copy)."""
    if t.requires_grad:
        t = t.detach()
    if t.dim() != 1:
        t = t.reshape(-1)
    if t.numel() <= 1 and t.stride(0) != 1:
        # size-0/1 tensors count as contiguous whatever their stride; byte views need 1
        t = t.as_strided((t.numel(),), (1,))
    return t


def empty_like_shape(b: Buf, shape: tuple[int, ...]) -> Any:
    """A new array in ``b``'s library, device and dtype with ``shape``."""
    if b.lib == "numpy":
        import numpy

        return numpy.empty(shape, dtype=b.arr.dtype)
    if b.lib == "torch":
        import torch

        return torch.empty(shape, dtype=b.arr.dtype, device=b.arr.device)
    import cupy

    with cupy.cuda.Device(b.device):
        return cupy.empty(shape, dtype=b.arr.dtype)


def same_memory(a: Buf, b: Buf) -> bool:
    """True when ``a`` and ``b`` start at the same address (in-place calls)."""
    return (
        a.lib == b.lib and a.device == b.device and data_ptr(a.lib, a.arr) == data_ptr(b.lib, b.arr)
    )


def data_ptr(lib: str, a: Any) -> int:
    if lib == "numpy":
        return np_ptr(a)
    if lib == "torch":
        return int(a.data_ptr())
    return int(a.data.ptr)
