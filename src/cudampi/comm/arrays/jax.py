"""JAX arrays, through DLPack both ways: in as a NumPy view (host; torch for bfloat16, which
NumPy lacks) or a CuPy/torch view (CUDA), out as a new JAX array over cudampi's result buffer.

JAX arrays are immutable (JAX may share, cache or donate their buffers), so cudampi never
writes into one: a call that would (``out=`` a JAX array, ``out=x``, broadcast on a receiving
rank, a receive) is refused with the array's read-only error on every rank, and a call without
``out`` returns a new JAX array, as mpi4jax's functions do. Its inputs are read in place
(DLPack hands over the buffer, without a copy). A result buffer is allocated 64-byte aligned,
the alignment XLA's CPU client needs to take it over without a copy. A call runs on concrete
arrays: a traced value (inside ``jax.jit``, ``grad`` or ``vmap``) is refused.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from cudampi.comm.arrays.base import (
    ArrayApiChecks,
    ArrayLibrary,
    ArrayOps,
    Buf,
    Checks,
    Stager,
    Unsupported,
)
from cudampi.comm.arrays.cupy import CUPY
from cudampi.comm.arrays.dlpack import CUDA_DEVICES, HOST_DEVICES
from cudampi.comm.arrays.numpy import NUMPY, HostStager
from cudampi.comm.arrays.torch import TORCH
from cudampi.errors import CommError, DeviceError

ALIGN = 64
"""Bytes of alignment XLA's CPU client needs to take a DLPack buffer without a copy."""

_WIDE = ("int64", "uint64", "float64", "complex128")
"""dtypes JAX holds only with ``jax_enable_x64``."""

_WORK: dict[str, ArrayLibrary] = {"numpy": NUMPY, "torch": TORCH, "cupy": CUPY}
"""The libraries JAX arrays are worked on through, by name."""


def _aligned_empty(shape: tuple[int, ...], dtype: Any) -> Any:
    """An uninitialised C-contiguous NumPy array whose data starts on an :data:`ALIGN` boundary."""
    import numpy

    dt = numpy.dtype(dtype)
    n = 1
    for d in shape:
        n *= d
    raw = numpy.empty(n * dt.itemsize + ALIGN, dtype=numpy.uint8)
    off = -raw.__array_interface__["data"][0] % ALIGN
    return raw[off : off + n * dt.itemsize].view(dt).reshape(shape)


def _cuda_view(x: Any) -> Any:
    """A CuPy (else torch) view of the JAX CUDA array ``x`` through DLPack, which orders JAX's
    work on it before the consumer's stream."""
    try:
        import cupy

        return cupy.from_dlpack(x)
    except ImportError:
        pass
    try:
        import torch
    except ImportError:
        raise DeviceError(
            "a JAX array on a CUDA device, but neither CuPy nor torch is installed to operate "
            "on it. Install cupy-cuda12x/13x or torch."
        ) from None
    return torch.from_dlpack(x)


class Jax:
    """JAX arrays (see the module doc and :class:`~cudampi.comm.arrays.base.ArrayLibrary`)."""

    name = "jax"
    read_only_fix = (
        "JAX arrays are immutable: leave out unset and use the JAX array the call returns; "
        "broadcast and receives write into their array, so give them a NumPy copy "
        "(np.array(x)) and convert the result (jnp.asarray)."
    )

    def array_type(self) -> type | None:
        jax = sys.modules.get("jax")
        return None if jax is None else jax.Array

    def adapt(self, x: Any, obj: Any, what: str = "x") -> Buf:
        import jax

        if isinstance(x, jax.core.Tracer):
            raise CommError(
                f"{what}: a traced JAX value ({type(x).__name__}), i.e. a call inside jax.jit, "
                "grad or vmap; cudampi moves concrete arrays. Call it outside the transformation "
                "(or use mpi4jax inside jit)."
            )
        if len(x.devices()) != 1:
            raise DeviceError(
                f"{what}: a JAX array sharded over {len(x.devices())} devices; cudampi moves "
                "one device's memory. Pass one shard (x.addressable_shards[i].data) or gather it."
            )
        dev_type, dev_id = x.__dlpack_device__()
        if int(dev_type) in HOST_DEVICES:
            if x.dtype.name == "bfloat16":  # NumPy's DLPack import has no bfloat16
                try:
                    import torch
                except ImportError:
                    raise CommError(
                        f"{what}: a bfloat16 JAX array; NumPy has no bfloat16, and torch, which "
                        "cudampi moves host bfloat16 with, is not installed."
                    ) from None
                b = TORCH.adapt(torch.from_dlpack(x), obj, what)
            else:
                import numpy

                b = NUMPY.adapt(numpy.from_dlpack(x), obj, what)
        elif int(dev_type) in CUDA_DEVICES:
            view = _cuda_view(x)
            b = _WORK["cupy" if type(view).__module__.startswith("cupy") else "torch"].adapt(
                view, obj, what
            )
        else:
            raise DeviceError(
                f"{what}: a JAX array on DLPack device type {dev_type!r} (id {dev_id!r}); cudampi "
                "moves host memory and CUDA memory only. Move it with jax.device_put first."
            )
        return dataclasses.replace(b, writable=False, impl=JAX)

    def label(self, b: Buf) -> str:
        return "jax"

    def flat(self, b: Buf) -> Any:
        return _WORK[b.lib].flat(b)

    def ptr(self, b: Buf) -> int:
        return _WORK[b.lib].ptr(b)

    def new(self, like: Buf, shape: tuple[int, ...]) -> Buf:
        if like.lib == "numpy":
            a = _aligned_empty(shape, like.arr.dtype)
            b = NUMPY.adapt(a, a)
        else:  # torch's and CuPy's allocators align to 64 bytes and more already
            b = _WORK[like.lib].new(like, shape)
        return dataclasses.replace(b, impl=JAX)

    def result(self, b: Buf) -> Any:
        import jax

        return jax.dlpack.from_dlpack(b.arr)

    def written(self, b: Buf) -> Any:
        return b.obj  # never written (read-only): broadcast's root hands its x back

    def ops(self, device: int | None) -> ArrayOps:
        """The element-wise work of the views :meth:`adapt` makes: NumPy's on the host, CuPy's
        (else torch's) on a CUDA device."""
        return NUMPY.ops(None) if device is None else _cuda_library().ops(device)

    def stager(self, device: int | None) -> Stager:
        return HostStager("numpy") if device is None else _cuda_library().stager(device)

    def checks(self, device: str) -> Checks:
        return JaxChecks(device)


def _cuda_library() -> ArrayLibrary:
    try:
        import cupy  # noqa: F401

        return CUPY
    except ImportError:
        return TORCH


class JaxChecks(ArrayApiChecks):
    """JAX arrays on the CPU or the first GPU JAX sees. Computed with jax.numpy on the arrays'
    device; in float64 where ``jax_enable_x64`` is on, else in float32 (exact for the small
    integers of the patterns). JAX arrays are immutable: :meth:`fill`, :meth:`copy_into` and
    :meth:`corrupt` raise :class:`Unsupported`."""

    name = "jax"

    def __init__(self, device: str) -> None:
        super().__init__(device)
        try:
            import jax
            import jax.numpy as jnp
        except ImportError as exc:
            raise Unsupported(f"jax is not importable here ({exc})") from None
        self.jax, self.jnp, self.xp = jax, jnp, jnp
        try:
            self.dev = jax.devices("cpu" if device == "cpu" else "gpu")[0]
        except RuntimeError:
            raise Unsupported("JAX sees no GPU") from None
        self.x64 = jax.dtypes.canonicalize_dtype("float64").name == "float64"

    @property
    def f64(self) -> Any:
        return self.jnp.float64 if self.x64 else self.jnp.float32

    @property
    def wide(self) -> Any:
        return self.jnp.int64 if self.x64 else self.jnp.int32

    def check_dtype(self, dtype: str) -> None:
        if dtype in _WIDE and not self.x64:
            raise Unsupported(
                f"JAX holds {dtype} only with jax_enable_x64 (jax.config.update('jax_enable_x64', "
                "True) or JAX_ENABLE_X64=1)"
            )

    def _put(self, a: Any) -> Any:
        return self.jax.device_put(a, self.dev)

    def f64_index(self, count: int) -> Any:
        return self._put(self.jnp.arange(count, dtype=self.f64))

    def cast(self, x64: Any, dtype: str) -> Any:
        self.check_dtype(dtype)
        return x64.astype(getattr(self.jnp, dtype))

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        self.check_dtype(dtype)  # JAX has no uninitialised arrays
        return self._put(self.jnp.zeros(shape, dtype=getattr(self.jnp, dtype)))

    def _immutable(self, what: str) -> Unsupported:
        return Unsupported(f"JAX arrays are immutable: no {what}")

    def fill(self, x: Any, value: float) -> None:
        raise self._immutable("fill in place")

    def copy_into(self, dst: Any, src: Any) -> None:
        raise self._immutable("copy into an array")

    def corrupt(self, x: Any) -> None:
        raise self._immutable("corrupting a result in place")

    def sync(self) -> None:
        self.jax.effects_barrier()

    def from_numpy(self, a: Any, dtype: str) -> Any:
        import numpy as np

        self.check_dtype(dtype)
        if dtype == "bfloat16":
            return self._put(self.jnp.asarray(a.astype(np.float32))).astype(self.jnp.bfloat16)
        return self._put(np.ascontiguousarray(a.astype(dtype)))

    def to_numpy(self, x: Any) -> Any:
        import numpy as np

        if str(x.dtype) == "bfloat16":
            return np.asarray(x.astype(self.jnp.float32)).astype(np.float64)
        return np.asarray(x)


JAX: ArrayLibrary = Jax()
LIBRARY = JAX
