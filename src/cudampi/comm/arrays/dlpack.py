"""Any other array: objects with ``__cuda_array_interface__`` or ``__dlpack__`` are wrapped
without a copy (CuPy where it is installed, else torch) and results come back as that library's
arrays; host objects with the buffer protocol or ``__array_interface__`` become NumPy views.

The fallback behind the libraries :func:`~cudampi.comm.arrays.adapt` knows by type: it has no
arrays of its own, so every call on its arrays goes to the library that wrapped them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from cudampi.comm.arrays.base import Buf
from cudampi.errors import CommError, DeviceError

HOST_DEVICES = (1, 3)
"""DLPack device types of host memory: kDLCPU, kDLCUDAHost (pinned host)."""
CUDA_DEVICES = (2, 13)
"""DLPack device types of CUDA memory: kDLCUDA, kDLCUDAManaged."""


def adapt_foreign(x: Any, what: str) -> Buf:
    """Wrap ``x``, which no registered library claims by type; a :class:`CommError` if it is
    no array, a :class:`DeviceError` if its memory is neither host nor CUDA memory."""
    if hasattr(x, "__cuda_array_interface__"):
        return _from_cuda_foreign(x, what)
    if hasattr(x, "__dlpack__") and hasattr(x, "__dlpack_device__"):
        dev_type, dev_id = x.__dlpack_device__()
        if int(dev_type) in HOST_DEVICES:
            import numpy

            from cudampi.comm.arrays.numpy import NUMPY

            return NUMPY.adapt(numpy.from_dlpack(x), x, what)
        if int(dev_type) in CUDA_DEVICES:
            return _from_cuda_foreign(x, what)
        raise DeviceError(
            f"{what}: a DLPack array on device type {dev_type!r} (id {dev_id!r}); cudampi moves "
            "host memory and CUDA memory only. Copy it to the host or a CUDA device first."
        )
    if hasattr(x, "__array_interface__") or isinstance(x, (bytearray, memoryview)):
        import numpy

        from cudampi.comm.arrays.numpy import NUMPY

        return NUMPY.adapt(numpy.asarray(x), x, what)
    raise CommError(
        f"{what}: {type(x).__name__!r} is not an array. Pass a NumPy array, a torch tensor, a "
        "CuPy array, a JAX array or an object with __dlpack__ / __cuda_array_interface__."
    )


def _from_cuda_foreign(x: Any, what: str) -> Buf:
    cai = getattr(x, "__cuda_array_interface__", None)
    data = cai.get("data") if isinstance(cai, dict) else None
    read_only = bool(data[1]) if isinstance(data, tuple) and len(data) > 1 else False
    b = wrap_cuda(x, x, what)
    return dataclasses.replace(b, writable=False) if read_only else b


def wrap_cuda(x: Any, obj: Any, what: str) -> Buf:
    """CUDA memory of ``x`` as a CuPy array (else a torch tensor), without a copy: through its
    CUDA array interface where it has one, else DLPack (which orders the producer's stream
    before the consumer's)."""
    try:
        import cupy

        from cudampi.comm.arrays.cupy import CUPY

        return CUPY.adapt(
            cupy.asarray(x) if hasattr(x, "__cuda_array_interface__") else cupy.from_dlpack(x),
            obj,
            what,
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
    from cudampi.comm.arrays.torch import TORCH

    if hasattr(x, "__dlpack__"):
        return TORCH.adapt(torch.from_dlpack(x), obj, what)
    return TORCH.adapt(torch.as_tensor(x, device="cuda"), obj, what)
