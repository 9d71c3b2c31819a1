"""Host staging buffers and asynchronous device<->host byte copies, per array library.

A stager moves byte ranges of a flat array to and from host buffers: page-locked (pinned) ones
for device arrays, so the copies run asynchronously on a dedicated copy stream at full PCIe/C2C
speed, and plain ones for host arrays (the CPU tests run the same staged pipeline that way).
Pinned memory comes from the library's caching host allocator, so it is reused between calls.
"""

from __future__ import annotations

from typing import Any


def _np_bytes(a: Any) -> Any:
    """A flat uint8 NumPy view of a contiguous host array (NumPy or torch CPU)."""
    import numpy

    if isinstance(a, numpy.ndarray):
        return a.reshape(-1).view(numpy.uint8)
    import torch

    return a.reshape(-1).view(torch.uint8).numpy()


class _NumpyHostBuffers:
    """Host staging buffers that are NumPy arrays (plain, or CuPy's pinned ones)."""

    @staticmethod
    def host_ptr(host: Any) -> int:
        return int(host.__array_interface__["data"][0])

    @staticmethod
    def host_nbytes(host: Any) -> int:
        return int(host.nbytes)


class HostStager(_NumpyHostBuffers):
    """Staging for arrays already in host memory (NumPy or torch CPU): plain buffers, sync copies."""

    def __init__(self, lib: str) -> None:
        self.lib = lib

    def pinned(self, nbytes: int) -> Any:
        import numpy

        return numpy.empty(nbytes, dtype=numpy.uint8)

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
        """``count`` elements of ``like``'s dtype over ``host``, as a host array for host ops."""
        import numpy

        if isinstance(like, numpy.ndarray):
            return host[: count * like.dtype.itemsize].view(like.dtype)
        import torch

        return torch.from_numpy(host[: count * like.element_size()]).view(like.dtype)

    def host_lib(self) -> str:
        return self.lib


class TorchStager:
    """Pinned torch host tensors and copies on a dedicated CUDA copy stream."""

    def __init__(self, device: int) -> None:
        import torch

        self.device = device
        self.stream = torch.cuda.Stream(device=device)

    def pinned(self, nbytes: int) -> Any:
        import torch

        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    @staticmethod
    def host_ptr(host: Any) -> int:
        return int(host.data_ptr())

    @staticmethod
    def host_nbytes(host: Any) -> int:
        return int(host.numel())

    @staticmethod
    def nbytes(a: Any) -> int:
        return int(a.numel() * a.element_size())

    @staticmethod
    def _bytes(a: Any) -> Any:
        import torch

        return a.reshape(-1).view(torch.uint8)

    def d2h(self, host: Any, a: Any, lo: int, hi: int) -> Any:
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            host[: hi - lo].copy_(self._bytes(a)[lo:hi], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    def h2d(self, a: Any, host: Any, lo: int, hi: int) -> Any:
        import torch

        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self._bytes(a)[lo:hi].copy_(host[: hi - lo], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        return ev

    @staticmethod
    def wait(ev: Any) -> None:
        if ev is not None:
            ev.synchronize()

    def host_view(self, host: Any, like: Any, count: int) -> Any:
        return host[: count * like.element_size()].view(like.dtype)

    def host_lib(self) -> str:
        return "torch"


class CupyStager(_NumpyHostBuffers):
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


def stager_for(lib: str, device: int | None) -> Any:
    """The stager for arrays of ``lib`` on ``device`` (None: host)."""
    if device is None:
        return HostStager(lib)
    if lib == "torch":
        return TorchStager(device)
    return CupyStager(device)
