"""torch tensors, on the CPU or on one CUDA device."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from cudampi.comm.arrays.base import (
    BOOL_OP,
    WRITABLE_FIX,
    ArrayLibrary,
    ArrayOps,
    Buf,
    Checks,
    Stager,
    Unsupported,
    combine_with,
    core,
)
from cudampi.comm.arrays.numpy import NUMPY_OPS, HostStager
from cudampi.errors import DeviceError

_NAMES: dict[Any, str] = {}

_TORCH_OP = {
    "sum": "add",
    "prod": "mul",
    "min": "minimum",
    "max": "maximum",
    "band": "bitwise_and",
    "bor": "bitwise_or",
    "bxor": "bitwise_xor",
}


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

    def reduce(self, dst: Any, src: Any, op: str, dtype: str, first: Any = None) -> None:
        if self.use_numpy and dtype != "bfloat16":
            a = None if first is None else first.numpy()
            NUMPY_OPS.reduce(dst.numpy(), src.numpy(), op, dtype, a)
            return
        import torch

        c = core(op)
        a = dst if first is None else first
        with self._on_stream():
            if dtype == "bool":
                getattr(torch, BOOL_OP[c])(a, src, out=dst)
            elif dtype in ("uint16", "uint32", "uint64"):
                _unsigned_reduce(torch, dst, src, c, dtype, a)
            else:
                getattr(torch, _TORCH_OP[c])(a, src, out=dst)

    def divide(self, a: Any, n: int, dtype: str, src: Any = None) -> None:
        if self.use_numpy and dtype != "bfloat16":
            NUMPY_OPS.divide(a.numpy(), n, dtype, None if src is None else src.numpy())
            return
        import torch

        with self._on_stream():
            torch.div(a if src is None else src, n, out=a)

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


def _unsigned_reduce(torch: Any, dst: Any, src: Any, c: str, dtype: str, first: Any) -> None:
    """``dst = first (c) src`` for unsigned dtypes (``first`` may be ``dst``): add/mul/bitwise
    through the signed twin (same bits, wrap-around arithmetic); min/max by flipping the sign
    bit so signed order equals unsigned order."""
    twin = _signed_twin(torch, dtype)
    d, s, a = dst.view(twin), src.view(twin), first.view(twin)
    if c in ("min", "max"):
        bits = d.element_size() * 8
        flip = torch.tensor(-(1 << (bits - 1)), dtype=twin, device=d.device)
        sf = torch.bitwise_xor(s, flip)
        torch.bitwise_xor(a, flip, out=d)
        getattr(torch, _TORCH_OP[c])(d, sf, out=d)
        torch.bitwise_xor(d, flip, out=d)
    else:
        getattr(torch, _TORCH_OP[c])(a, s, out=d)


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


class TorchChecks(Checks):
    """torch tensors on ``cpu`` or on the current CUDA device."""

    name = "torch"

    def __init__(self, device: str) -> None:
        super().__init__(device)
        import torch

        self.torch = torch
        if device == "cuda":
            if not torch.cuda.is_available():
                raise Unsupported("torch sees no CUDA device")
            self.dev = torch.device("cuda", torch.cuda.current_device())
        else:
            self.dev = torch.device("cpu")

    def tdtype(self, dtype: str) -> Any:
        return getattr(self.torch, dtype)

    def f64_index(self, count: int) -> Any:
        return self.torch.arange(count, dtype=self.torch.float64, device=self.dev)

    def cast(self, x64: Any, dtype: str) -> Any:
        return x64.to(self.tdtype(dtype)).contiguous()

    def to_f64(self, x: Any) -> Any:
        return x.to(self.torch.float64)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        return self.torch.empty(shape, dtype=self.tdtype(dtype), device=self.dev)

    def fill(self, x: Any, value: float) -> None:
        x.fill_(value)

    def copy_into(self, dst: Any, src: Any) -> None:
        dst.copy_(src)

    def sync(self) -> None:
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def count_mismatch(self, got64: Any, exp64: Any, atol: float, rtol: float) -> int:
        ok = (got64 - exp64).abs() <= atol + rtol * exp64.abs()
        return int(ok.numel() - int(ok.sum().item()))

    def flat(self, x: Any) -> Any:
        return x.view(-1)

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype).removeprefix("torch.")

    def concat(self, parts: list[Any]) -> Any:
        return self.torch.cat(parts)

    def combine(self, a: Any, b: Any, op: str) -> Any:
        t = self.torch
        return combine_with(t, a, b, op, lambda x: x.to(t.int64), lambda x: x.to(t.float64))

    def from_numpy(self, a: Any, dtype: str) -> Any:
        import numpy as np

        torch = self.torch
        if dtype == "bfloat16":
            t = torch.from_numpy(np.ascontiguousarray(a.astype(np.float64))).to(torch.bfloat16)
        else:
            t = torch.from_numpy(np.ascontiguousarray(a.astype(dtype)))
        return t.to(self.dev) if self.device == "cuda" else t

    def to_numpy(self, x: Any) -> Any:
        import numpy as np

        if x.dtype == self.torch.bfloat16:
            return x.float().cpu().numpy().astype(np.float64)
        return x.cpu().numpy()


class Torch:
    """torch tensors (see :class:`~cudampi.comm.arrays.base.ArrayLibrary`)."""

    name = "torch"
    read_only_fix = WRITABLE_FIX

    def array_type(self) -> type | None:
        torch = sys.modules.get("torch")
        return None if torch is None else torch.Tensor

    def adapt(self, t: Any, obj: Any, what: str = "x") -> Buf:
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
        name = _NAMES.get(dt)
        if name is None:
            name = _NAMES[dt] = str(dt).removeprefix("torch.")
        # same memory; in-place writes must not be recorded by autograd. torch.Size holds ints.
        arr = t.detach() if t.requires_grad else t
        return Buf(obj, arr, "torch", device, name, tuple(t.shape), t.element_size(),
                   t.is_contiguous(), True, TORCH)  # fmt: skip

    def label(self, b: Buf) -> str:
        return b.lib

    def flat(self, b: Buf) -> Any:
        return flat_tensor(b.arr)

    def ptr(self, b: Buf) -> int:
        return int(b.arr.data_ptr())

    def new(self, like: Buf, shape: tuple[int, ...]) -> Buf:
        import torch

        t = torch.empty(shape, dtype=like.arr.dtype, device=like.arr.device)
        return self.adapt(t, t)

    def result(self, b: Buf) -> Any:
        return b.arr

    def written(self, b: Buf) -> Any:
        return b.obj if b.obj is b.arr else b.arr

    def ops(self, device: int | None) -> ArrayOps:
        return TorchOps(device)

    def stager(self, device: int | None) -> Stager:
        return HostStager("torch") if device is None else TorchStager(device)

    def checks(self, device: str) -> Checks:
        return TorchChecks(device)


TORCH: ArrayLibrary = Torch()
LIBRARY = TORCH
