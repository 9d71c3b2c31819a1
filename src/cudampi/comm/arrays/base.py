"""What every array library module implements: the :class:`ArrayLibrary` protocol, the
:class:`Buf` record it adapts arrays to, and the dtype and reduction vocabulary they share.

A library has four jobs, each behind one part of the protocol: adapting the caller's arrays to a
:class:`Buf` (and handing results back as the caller's kind of array), element-wise work on one
device (:class:`ArrayOps`: copies, reductions, ``avg``'s divide, the reduction stream), host
staging (:class:`Stager`: host buffers, pinned for device arrays, and device<->host copies) and
the checks the benchmarks and tests run on its arrays (:class:`Checks`: data patterns, expected
values, counting wrong elements). Device-bound parts hold streams, so the library hands out one
per device; the communicator keeps them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from cudampi.errors import CommError
from cudampi.names import REDUCE_OPS

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

FLOAT = ("float16", "bfloat16", "float32", "float64")
COMPLEX = ("complex64", "complex128")


class Flat(Protocol):
    """A flat (1-D, contiguous) array of one library, a view of a caller's memory or a scratch
    buffer: what the Communicator hands its engines and they hand :class:`ArrayOps`."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def __getitem__(self, key: slice, /) -> Flat: ...


@dataclass(slots=True)
class Buf:
    """One array as the collectives see it (made for every array of every call: slots, not
    frozen, whose checked assignments cost a microsecond a call; treat it as read-only).

    ``arr`` is the array in its own library ``lib`` (a view of the caller's memory, never a
    copy): the library whose element-wise ops and engines move it. ``impl`` is the
    :class:`ArrayLibrary` that adapted the caller's object and hands results back in its kind
    (a JAX array's ``arr`` is a NumPy view, its ``impl`` JAX's). ``device`` is None for host
    memory, else the CUDA device ordinal.
    """

    obj: Any
    arr: Any
    lib: str
    device: int | None
    dtype: str
    shape: tuple[int, ...]
    itemsize: int
    contiguous: bool
    writable: bool
    """False for memory that must not be written (a read-only NumPy array, a CUDA array
    interface marked read-only, an immutable JAX array)."""
    impl: ArrayLibrary

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
        return f"{self.impl.label(self)} {self.dtype} array of shape {self.shape} in {self.where()}"


# ----------------------------------------------------------------------------- reductions


SEMANTICS = """What the reductions promise, on every path and engine:

- ``max``/``min`` on floating-point dtypes propagate NaN, as NumPy's ``maximum``/``minimum`` and
  torch's do: an element is NaN where any rank's is. (MPI's own MAX/MIN and NCCL's drop NaN;
  the engines that use them make up for it.)
- ``avg`` is defined for floating-point and complex dtypes: the sum of the ranks' values
  divided by their number, each rank's value divided before the sum (as NCCL's ``ncclAvg``
  does), so an average of values near the dtype's largest is finite where their sum is not.
  Integers have no ``avg`` (torch's NCCL backend has none either): their sum can wrap before
  the division, so the result could be any value; sum with ``op="sum"`` in a dtype wide enough
  and divide.
"""


def ops_allowed(dtype: str) -> tuple[str, ...]:
    """The reduction ops defined for ``dtype`` (bool: sum/max/bor = or, prod/min/band = and;
    see :data:`SEMANTICS`)."""
    if dtype in FLOAT:
        return ("sum", "prod", "min", "max", "avg")
    if dtype in COMPLEX:
        return ("sum", "prod", "avg")
    if dtype == "bool":
        return ("sum", "prod", "min", "max", "band", "bor", "bxor")
    return tuple(op for op in REDUCE_OPS if op != "avg")


def check_op(op: Any, dtype: str) -> str:
    """``op`` if it names a reduction valid for ``dtype``; a :class:`CommError` otherwise."""
    if not isinstance(op, str) or op not in REDUCE_OPS:
        raise CommError(f"op={op!r} is not a reduction; use one of {', '.join(REDUCE_OPS)}")
    allowed = ops_allowed(dtype)
    if op == "avg" and dtype != "bool" and op not in allowed:
        raise CommError(
            f"op='avg' is not defined for {dtype}: the sum of the ranks' values can wrap around "
            f"in {dtype} before the division, so the average could be any value. Reduce with "
            "op='sum' in a dtype wide enough (int64, float64) and divide by the number of ranks; "
            f"{dtype} takes {', '.join(allowed)}"
        )
    if op not in allowed:
        raise CommError(f"op={op!r} is not defined for {dtype}; {dtype} takes {', '.join(allowed)}")
    return op


def nan_aware(op: str, dtype: str) -> bool:
    """Whether ``op`` on ``dtype`` must propagate NaN (:data:`SEMANTICS`), which MPI's and
    NCCL's own MAX/MIN do not."""
    return op in ("max", "min") and dtype in FLOAT


BOOL_OP = {
    "sum": "logical_or",
    "max": "logical_or",
    "bor": "logical_or",
    "prod": "logical_and",
    "min": "logical_and",
    "band": "logical_and",
    "bxor": "logical_xor",
}
"""The element-wise function of each reduction on bool arrays (NumPy, CuPy and torch names)."""

NP_OP = {
    "sum": "add",
    "prod": "multiply",
    "min": "minimum",
    "max": "maximum",
    "band": "bitwise_and",
    "bor": "bitwise_or",
    "bxor": "bitwise_xor",
}
"""The NumPy (and CuPy) function of each reduction."""


def core(op: str) -> str:
    """The op a reduction combines with (``avg`` sums; the divide comes at the end)."""
    return "sum" if op == "avg" else op


# ----------------------------------------------------------------------------- device work


class ArrayOps:
    """Element-wise work on flat arrays of one library and device: allocate, copy, reduce, fence.

    The collective algorithms only ever touch arrays through these, so the same ring and
    recursive-doubling code reduces NumPy arrays on the host, torch tensors on the host or a
    GPU and CuPy arrays on a GPU. GPU reductions run on a dedicated stream of the communicator;
    the caller's stream is waited for before any memory is read (:meth:`capture` records an
    event in the caller's thread, :meth:`begin` waits for it) and :meth:`fence` makes
    everything queued on the reduction stream complete before MPI touches the memory. Host
    implementations keep the no-op stream methods of this base.
    """

    lib: str = ""
    device: int | None = None

    def empty(self, n: int, like: Any) -> Any:
        raise NotImplementedError

    def scratch(self, n: int, like: Any) -> Any:
        """A new flat buffer of ``n`` elements of ``like``'s kind (dtype, device), contents
        unset; allocated with one element at least, so an empty one still has an address."""
        return self.empty(max(1, n), like)[:n]

    def ptr(self, a: Any) -> int:
        raise NotImplementedError

    def nbytes(self, a: Any) -> int:
        raise NotImplementedError

    def itemsize(self, a: Any) -> int:
        """Bytes per element of ``a``."""
        raise NotImplementedError

    def copy(self, dst: Any, src: Any) -> None:
        raise NotImplementedError

    def reduce(self, dst: Any, src: Any, op: str, dtype: str, first: Any = None) -> None:
        """``dst = dst (op) src`` element-wise, in place, or ``dst = first (op) src`` where
        ``first`` is given (the same order of operands: the same bits); ``avg`` reduces as
        ``sum``."""
        raise NotImplementedError

    def divide(self, a: Any, n: int, dtype: str, src: Any = None) -> None:
        """``a = (src, else a) / n`` element-wise, for ``avg``: each rank's value divided
        before the sum (:data:`SEMANTICS`; floating-point and complex dtypes only)."""
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


@runtime_checkable
class Stager(Protocol):
    """Host staging for one library on one device: host buffers (page-locked for device arrays,
    so copies run asynchronously on a copy stream at full PCIe/C2C speed; plain ones for host
    arrays, so the CPU tests run the same staged pipeline) and byte-range copies between a flat
    array and them. A copy returns a token for :meth:`wait` (None: already done)."""

    def pinned(self, nbytes: int) -> Any:
        """A host buffer of ``nbytes`` bytes (uint8)."""
        ...

    def host_ptr(self, host: Any) -> int: ...

    def host_nbytes(self, host: Any) -> int: ...

    def nbytes(self, a: Any) -> int:
        """Bytes of the flat array ``a``."""
        ...

    def d2h(self, host: Any, a: Any, lo: int, hi: int) -> Any:
        """Bytes ``lo:hi`` of ``a`` into the front of ``host``."""
        ...

    def h2d(self, a: Any, host: Any, lo: int, hi: int) -> Any:
        """The front of ``host`` into bytes ``lo:hi`` of ``a``."""
        ...

    def wait(self, ev: Any) -> None: ...

    def host_view(self, host: Any, like: Any, count: int) -> Any:
        """``count`` elements of ``like``'s dtype over ``host``, as a host array for host ops."""
        ...

    def host_lib(self) -> str:
        """The library of :meth:`host_view`'s arrays (whose host engine moves them)."""
        ...


# ----------------------------------------------------------------------------- checks

_RTOL = {"float16": 2e-3, "bfloat16": 1.6e-2, "float32": 1e-6, "float64": 1e-12}
"""|got - expected| <= atol + rtol * |expected| counts as right. Sums of small integers are exact;
avg divides by n, which float16/bfloat16 round."""


def is_float(dtype: str) -> bool:
    return dtype.startswith(("float", "bfloat"))


class Unsupported(Exception):
    """This library cannot hold this dtype or live on this device; the benchmark row or test is
    skipped, with why."""


class Checks:
    """Arrays of one library on one device (``cpu``, or ``cuda``: the current CUDA device) as
    the benchmarks and tests fill and check them. Test data are small integers (exact in
    bfloat16 after summing up to a few dozen ranks); the check compares in float64 on the
    arrays' own device, so checking a 1 GB result does not copy it to the host. Each library
    fills in the primitives; the patterns and the check are written once, here."""

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

    def dtype_name(self, x: Any) -> str:
        raise NotImplementedError

    def concat(self, parts: list[Any]) -> Any:
        raise NotImplementedError

    def combine(self, a: Any, b: Any, op: str) -> Any:
        """Elementwise ``op`` (sum, prod, min, max, band, bor, bxor) of two float64 arrays."""
        raise NotImplementedError

    def from_numpy(self, a: Any, dtype: str) -> Any:
        """The NumPy array ``a`` as a new contiguous array of ``dtype`` on the device (bfloat16
        from ``a``'s values in float64); :class:`Unsupported` where the library has no
        ``dtype``. The tests build every input from NumPy reference values this way."""
        raise NotImplementedError

    def to_numpy(self, x: Any) -> Any:
        """``x`` as a NumPy array on the host: a view of host memory where the library shares it
        (the tests write through it), bfloat16 as float64 (which NumPy lacks)."""
        raise NotImplementedError

    # -- built on the primitives ------------------------------------------------------------
    def dtypes(self, among: tuple[str, ...] = DTYPES) -> list[str]:
        """The dtypes of ``among`` this library holds."""
        out = []
        for d in among:
            try:
                self.check_dtype(d)
            except Unsupported:
                continue
            out.append(d)
        return out

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

    def reduce64(self, parts: list[Any], op: str) -> Any:
        """The float64 result of reducing ``parts`` (one per rank) with ``op``."""
        acc = parts[0]
        for p in parts[1:]:
            acc = self.combine(acc, p, "sum" if op == "avg" else op)
        return acc / len(parts) if op == "avg" else acc


class ArrayApiChecks(Checks):
    """:class:`Checks` for a library with NumPy's array API (NumPy, CuPy, jax.numpy), ``xp``:
    the primitives it spells the same way, written once. ``f64`` is the float dtype the checks
    compute in, ``wide`` the integer dtype bitwise reductions run in."""

    xp: Any

    @property
    def f64(self) -> Any:
        return self.xp.float64

    @property
    def wide(self) -> Any:
        return self.xp.int64

    def f64_index(self, count: int) -> Any:
        return self.xp.arange(count, dtype=self.f64)

    def to_f64(self, x: Any) -> Any:
        return x.astype(self.f64)

    def count_mismatch(self, got64: Any, exp64: Any, atol: float, rtol: float) -> int:
        xp = self.xp
        ok = xp.abs(got64 - exp64) <= atol + rtol * xp.abs(exp64)
        return int(ok.size - int(ok.sum()))

    def flat(self, x: Any) -> Any:
        return x.reshape(-1)

    def dtype_name(self, x: Any) -> str:
        return str(x.dtype)

    def concat(self, parts: list[Any]) -> Any:
        return self.xp.concatenate(parts)

    def combine(self, a: Any, b: Any, op: str) -> Any:
        wide, f64 = self.wide, self.f64
        return combine_with(self.xp, a, b, op, lambda x: x.astype(wide), lambda x: x.astype(f64))


WRITABLE_FIX = (
    "Pass a writable array (numpy: a copy, or np.frombuffer of a bytearray; a memmap opened "
    "with mode 'r+')."
)
"""What a read-only array's error says to do (the libraries whose arrays can be writable)."""


def combine_with(xp: Any, a: Any, b: Any, op: str, to_int: Any, to_f64: Any) -> Any:
    """:meth:`Checks.combine` for a library of NumPy's API ``xp`` (bitwise ops on integers)."""
    from cudampi.errors import ConfigError

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


# ----------------------------------------------------------------------------- the protocol


@runtime_checkable
class ArrayLibrary(Protocol):
    """One array library (one module of :mod:`cudampi.comm.arrays`, its ``LIBRARY``).

    Adapting: :meth:`array_type` is the class :func:`~cudampi.comm.arrays.adapt` dispatches on
    (None while the library is not imported: nothing to adapt then), :meth:`adapt` wraps one
    of its arrays without a copy. The methods that take a :class:`Buf` are called on the
    ``impl`` that adapted it. Then the parts bound to a device (None: host): :meth:`ops`,
    :meth:`stager` and :meth:`checks`.
    """

    name: str
    read_only_fix: str
    """What to do when a call would write into a read-only array of this library."""

    def array_type(self) -> type | None: ...

    def adapt(self, x: Any, obj: Any, what: str = "x") -> Buf:
        """Wrap ``x`` (an instance of :meth:`array_type`, or an array the caller's ``obj``
        became) without copying."""
        ...

    def label(self, b: Buf) -> str:
        """The library's name in messages about ``b``."""
        ...

    def flat(self, b: Buf) -> Any:
        """A 1-D view of ``b``'s contiguous array (never a copy)."""
        ...

    def ptr(self, b: Buf) -> int:
        """The address of ``b``'s first element."""
        ...

    def new(self, like: Buf, shape: tuple[int, ...]) -> Buf:
        """A new array of ``like``'s library, device and dtype with ``shape``: a call's result."""
        ...

    def result(self, b: Buf) -> Any:
        """What a call returns for its result ``b`` (from :meth:`new`), once written."""
        ...

    def written(self, b: Buf) -> Any:
        """What a call that wrote into the caller's ``b`` in place (broadcast) returns."""
        ...

    def ops(self, device: int | None) -> ArrayOps:
        """Element-wise work on ``device`` (a new one, with its own streams, but for NumPy)."""
        ...

    def stager(self, device: int | None) -> Stager:
        """Host staging for arrays on ``device``."""
        ...

    def checks(self, device: str) -> Checks:
        """The benchmarks' and tests' checks on ``cpu`` or ``cuda``; :class:`Unsupported` says
        why not (no such device, library not importable)."""
        ...
