"""Array libraries the benchmarks fill, check and time buffers with: NumPy, torch, CuPy.

One small class per library with the same few methods, so a collective's unit writes its data
pattern and its check once. Test data are small integers (exact in bfloat16 after summing up to
a few dozen ranks); the check compares in float64 on the buffers' own device, so checking a 1 GB
result does not copy it to the host.
"""

from __future__ import annotations

from typing import Any

from cudampi.errors import ConfigError

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64")
"""dtypes the benchmarks take (``--dtype``)."""

DTYPE_ALIASES = {
    "half": "float16",
    "fp16": "float16",
    "bf16": "bfloat16",
    "float": "float32",
    "fp32": "float32",
    "double": "float64",
    "fp64": "float64",
}

NCCL_TYPENAME = {
    "float16": "half",
    "bfloat16": "bfloat16",
    "float32": "float",
    "float64": "double",
    "int8": "int8",
    "uint8": "uint8",
    "int32": "int32",
    "int64": "int64",
}
"""The type column as nccl-tests prints it."""

ITEMSIZE = {
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "int8": 1,
    "uint8": 1,
    "int32": 4,
    "int64": 8,
}

# |got - expected| <= atol + rtol * |expected| counts as right. Sums of small integers are exact;
# avg divides by n, which float16/bfloat16 round.
_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}


def parse_dtype(text: str) -> str:
    """``float``, ``fp32`` or ``float32`` -> ``float32``; anything else is a ConfigError."""
    name = DTYPE_ALIASES.get(text.strip().lower(), text.strip().lower())
    if name not in DTYPES:
        raise ConfigError(
            f"--dtype {text!r} is not a dtype the benchmarks know; use one of {', '.join(DTYPES)}"
        )
    return name


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


class Unsupported(Exception):
    """This library cannot hold this dtype or device; the benchmark row is skipped, with why."""


class ArrayLib:
    """Buffers of one library on one device. Subclasses fill in the primitives."""

    name = "?"

    def __init__(self, device: str) -> None:
        self.device = device

    # -- primitives -------------------------------------------------------------------------
    def f64_index(self, count: int) -> Any:
        """``[0, 1, ..., count-1]`` as float64 on the device."""
        raise NotImplementedError

    def cast(self, x64: Any, dtype: str) -> Any:
        """A new array of ``dtype`` holding the float64 values ``x64``."""
        raise NotImplementedError

    def to_f64(self, x: Any) -> Any:
        raise NotImplementedError

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        raise NotImplementedError

    def fill(self, x: Any, value: float) -> None:
        raise NotImplementedError

    def copy_into(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        """Wait for every queued device operation (no-op on the host)."""

    def count_mismatch(self, got64: Any, exp64: Any, atol: float, rtol: float) -> int:
        raise NotImplementedError

    def flat(self, x: Any) -> Any:
        raise NotImplementedError

    def check_dtype(self, dtype: str) -> None:
        """Raise :class:`Unsupported` if this library cannot hold ``dtype``."""

    # -- built on the primitives ------------------------------------------------------------
    def pattern64(self, count: int, rank: int, kind: str, offset: int = 0) -> Any:
        """The value rank ``rank`` contributes at element ``offset + i`` (float64)."""
        i = self.f64_index(count) + float(offset)
        if kind == "prod":  # 1 or 2: products of many ranks stay exact
            return (i + rank) % 2 + 1
        if kind == "bits":  # 0..63, for band/bor/bxor
            return (i * 7 + rank * 13) % 64
        return (i + 3 * rank) % 5 + 1

    def pattern(self, count: int, rank: int, kind: str, dtype: str, offset: int = 0) -> Any:
        return self.cast(self.pattern64(count, rank, kind, offset), dtype)

    def count_wrong(self, got: Any, exp64: Any, dtype: str) -> int:
        """How many elements of ``got`` differ from the float64 ``exp64`` (NaN is wrong)."""
        rtol = _RTOL.get(dtype, 0.0)
        atol = 0.0 if not is_float(dtype) else 1e-12
        return self.count_mismatch(self.to_f64(self.flat(got)), self.flat(exp64), atol, rtol)

    def corrupt(self, x: Any) -> None:
        """Change element 0 of ``x`` in place (the test-only wrong-data hook)."""
        f = self.flat(x)
        if f.shape[0] == 0:
            return
        bad = self.cast(self.to_f64(f[0:1]) + 17.0, self.dtype_name(f))
        self.copy_into(f[0:1], bad)

    def dtype_name(self, x: Any) -> str:
        raise NotImplementedError

    def concat(self, parts: list[Any]) -> Any:
        raise NotImplementedError

    def combine(self, a: Any, b: Any, op: str) -> Any:
        """Elementwise ``op`` (sum, prod, min, max, band, bor, bxor) of two float64 arrays."""
        raise NotImplementedError

    def reduce64(self, parts: list[Any], op: str) -> Any:
        """The float64 result of reducing ``parts`` (one per rank) with ``op``."""
        acc = parts[0]
        for p in parts[1:]:
            acc = self.combine(acc, p, "sum" if op == "avg" else op)
        return acc / len(parts) if op == "avg" else acc


def _combine(xp: Any, a: Any, b: Any, op: str, to_int: Any, to_f64: Any) -> Any:
    if op == "sum":
        return a + b
    if op == "prod":
        return a * b
    if op == "min":
        return xp.minimum(a, b)
    if op == "max":
        return xp.maximum(a, b)
    bit = {"band": xp.bitwise_and, "bor": xp.bitwise_or, "bxor": xp.bitwise_xor}.get(op)
    if bit is None:
        raise ConfigError(f"unknown reduction {op!r}")
    return to_f64(bit(to_int(a), to_int(b)))


class NumpyLib(ArrayLib):
    """Host arrays (NumPy); no bfloat16."""

    name = "numpy"

    def __init__(self) -> None:
        super().__init__("cpu")
        import numpy as np

        self.np = np

    def check_dtype(self, dtype: str) -> None:
        if dtype == "bfloat16":
            raise Unsupported("NumPy has no bfloat16 (use --array torch for bfloat16 host buffers)")

    def f64_index(self, count: int) -> Any:
        return self.np.arange(count, dtype=self.np.float64)

    def cast(self, x64: Any, dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.np.ascontiguousarray(x64.astype(dtype))

    def to_f64(self, x: Any) -> Any:
        return x.astype(self.np.float64)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.np.empty(shape, dtype=dtype)

    def fill(self, x: Any, value: float) -> None:
        x.fill(value)

    def copy_into(self, dst: Any, src: Any) -> None:
        self.np.copyto(dst, src)

    def count_mismatch(self, got64: Any, exp64: Any, atol: float, rtol: float) -> int:
        ok = self.np.abs(got64 - exp64) <= atol + rtol * self.np.abs(exp64)
        return int(ok.size - int(ok.sum()))

    def flat(self, x: Any) -> Any:
        return x.reshape(-1)

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype)

    def concat(self, parts: list[Any]) -> Any:
        return self.np.concatenate(parts)

    def combine(self, a: Any, b: Any, op: str) -> Any:
        np = self.np
        return _combine(np, a, b, op, lambda x: x.astype(np.int64), lambda x: x.astype(np.float64))


class TorchLib(ArrayLib):
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
        return _combine(t, a, b, op, lambda x: x.to(t.int64), lambda x: x.to(t.float64))


class CupyLib(ArrayLib):
    """CuPy arrays on the current CUDA device; bfloat16 only where CuPy has it."""

    name = "cupy"

    def __init__(self) -> None:
        super().__init__("cuda")
        import cupy as cp

        self.cp = cp
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise Unsupported("CuPy sees no CUDA device")

    def check_dtype(self, dtype: str) -> None:
        if dtype == "bfloat16" and not hasattr(self.cp, "bfloat16"):
            raise Unsupported("this CuPy has no bfloat16 (use --array torch)")

    def _dt(self, dtype: str) -> Any:
        return getattr(self.cp, dtype) if dtype == "bfloat16" else dtype

    def f64_index(self, count: int) -> Any:
        return self.cp.arange(count, dtype=self.cp.float64)

    def cast(self, x64: Any, dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.cp.ascontiguousarray(x64.astype(self._dt(dtype)))

    def to_f64(self, x: Any) -> Any:
        return x.astype(self.cp.float64)

    def empty(self, shape: tuple[int, ...], dtype: str) -> Any:
        self.check_dtype(dtype)
        return self.cp.empty(shape, dtype=self._dt(dtype))

    def fill(self, x: Any, value: float) -> None:
        x.fill(value)

    def copy_into(self, dst: Any, src: Any) -> None:
        dst[...] = src

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def count_mismatch(self, got64: Any, exp64: Any, atol: float, rtol: float) -> int:
        ok = self.cp.abs(got64 - exp64) <= atol + rtol * self.cp.abs(exp64)
        return int(ok.size - int(ok.sum().item()))

    def flat(self, x: Any) -> Any:
        return x.reshape(-1)

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype)

    def concat(self, parts: list[Any]) -> Any:
        return self.cp.concatenate(parts)

    def combine(self, a: Any, b: Any, op: str) -> Any:
        cp = self.cp
        return _combine(cp, a, b, op, lambda x: x.astype(cp.int64), lambda x: x.astype(cp.float64))


def make_lib(kind: str, device: str) -> ArrayLib:
    """``numpy``/``torch``/``cupy`` on ``cpu``/``cuda``; :class:`Unsupported` says why not."""
    try:
        if kind == "numpy":
            if device != "cpu":
                raise Unsupported("NumPy arrays live on the host, not on a CUDA device")
            return NumpyLib()
        if kind == "torch":
            return TorchLib(device)
        if kind == "cupy":
            if device != "cuda":
                raise Unsupported("CuPy arrays live on a CUDA device, not on the host")
            return CupyLib()
    except ImportError as exc:
        raise Unsupported(f"{kind} is not importable here ({exc})") from None
    raise ConfigError(f"--array {kind!r}: expected numpy, torch or cupy")
