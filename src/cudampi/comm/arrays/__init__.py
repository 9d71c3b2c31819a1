"""The array libraries the collectives take, one module each, behind one protocol.

Each module here (``numpy``, ``torch``, ``cupy``, ``jax``) holds one ``LIBRARY`` implementing
:class:`~cudampi.comm.arrays.base.ArrayLibrary`: adapting its arrays to a :class:`Buf`,
element-wise work (:class:`ArrayOps`), host staging (:class:`Stager`) and the benchmarks' and
tests' checks (:class:`Checks`). :data:`LIBRARIES` registers them, as mpi4py's test suite
registers its array types (``arrayimpl``); ``dlpack`` is the fallback for any other object with
``__cuda_array_interface__``, ``__dlpack__``, ``__array_interface__`` or the buffer protocol.
A new library is one module with its ``LIBRARY`` and its name in :data:`LIBRARIES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from cudampi.comm.arrays.base import (
    COMPLEX,
    DTYPE_CODE,
    DTYPES,
    FLOAT,
    ArrayLibrary,
    ArrayOps,
    Buf,
    Checks,
    Flat,
    Stager,
    Unsupported,
    check_op,
    is_float,
    nan_aware,
    ops_allowed,
)
from cudampi.errors import CommError, ConfigError

LIBRARIES = ("numpy", "torch", "cupy", "jax")
"""The registered libraries, in the order :func:`adapt` asks whether an object is theirs."""

_LIBS: dict[str, ArrayLibrary] = {}
_BY_TYPE: dict[type, Callable[[Any, Any, str], Buf]] = {}
"""Each array class seen -> the adapt of the library that claimed it (a dict hit instead of
the isinstance walk; a class's answer never changes)."""


def library(name: str) -> ArrayLibrary:
    """The registered library ``name`` (its module is imported on first use; it imports no
    array library itself); a :class:`CommError` for a name not in :data:`LIBRARIES`."""
    lib = _LIBS.get(name)
    if lib is None:
        if name not in LIBRARIES:
            raise CommError(
                f"unknown array library {name!r}; expected one of {', '.join(LIBRARIES)}"
            )
        lib = _LIBS[name] = importlib.import_module(f"{__name__}.{name}").LIBRARY
    return lib


def adapt(x: Any, what: str = "x") -> Buf:
    """Wrap ``x`` without copying: a registered library's array as it is, any other array
    through the ``dlpack`` fallback; a :class:`CommError` if it is no array."""
    fn = _BY_TYPE.get(type(x))
    if fn is not None:
        return fn(x, x, what)
    return _adapt_new_type(x, what)


def _adapt_new_type(x: Any, what: str) -> Buf:
    for name in LIBRARIES:
        lib = _LIBS.get(name) or library(name)
        t = lib.array_type()  # None while that library is not imported: nothing of it to wrap
        if t is not None and isinstance(x, t):
            if len(_BY_TYPE) < 64:
                _BY_TYPE[type(x)] = lib.adapt
            return lib.adapt(x, x, what)
    from cudampi.comm.arrays.dlpack import adapt_foreign

    return adapt_foreign(x, what)


def flat(b: Buf) -> Any:
    """A 1-D view of a contiguous array (never a copy)."""
    return b.impl.flat(b)


def new_like(b: Buf, shape: tuple[int, ...]) -> Buf:
    """A new array of ``b``'s library, device and dtype with ``shape``, for a call's result."""
    return b.impl.new(b, shape)


def result(out: Any, ob: Buf) -> Any:
    """What a call returns: the caller's ``out``, else its new result ``ob`` in the kind of
    array the caller passed."""
    return out if out is not None else ob.impl.result(ob)


def written(b: Buf) -> Any:
    """What a call that wrote into the caller's ``b`` in place returns."""
    return b.impl.written(b)


def same_memory(a: Buf, b: Buf) -> bool:
    """True when ``a`` and ``b`` start at the same address (in-place calls)."""
    return a.lib == b.lib and a.device == b.device and a.impl.ptr(a) == b.impl.ptr(b)


def ops_for(lib: str, device: int | None) -> ArrayOps:
    """A fresh :class:`ArrayOps` for ``lib`` on ``device`` (each communicator keeps one per lib
    and device: :class:`~cudampi.comm.engines.base.Engines`)."""
    return library(lib).ops(device)


def stager_for(lib: str, device: int | None) -> Stager:
    """The stager for arrays of ``lib`` on ``device`` (None: host)."""
    return library(lib).stager(device)


def checks_for(name: str, device: str) -> Checks:
    """The checks of library ``name`` on ``cpu``/``cuda`` (the benchmarks' ``--array``);
    :class:`Unsupported` says why not, a :class:`ConfigError` names an unknown library."""
    if name not in LIBRARIES:
        raise ConfigError(f"--array {name!r}: expected one of {', '.join(LIBRARIES)}")
    try:
        return library(name).checks(device)
    except ImportError as exc:
        raise Unsupported(f"{name} is not importable here ({exc})") from None


__all__ = [
    "COMPLEX",
    "DTYPES",
    "DTYPE_CODE",
    "FLOAT",
    "LIBRARIES",
    "ArrayLibrary",
    "ArrayOps",
    "Buf",
    "Checks",
    "Flat",
    "Stager",
    "Unsupported",
    "adapt",
    "check_op",
    "checks_for",
    "flat",
    "is_float",
    "library",
    "nan_aware",
    "new_like",
    "ops_allowed",
    "ops_for",
    "result",
    "same_memory",
    "stager_for",
    "written",
]
