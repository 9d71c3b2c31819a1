"""The tests' one NumPy oracle for reductions: what ``op`` over the ranks' arrays must give.

Every test that checks a reduction (the ArrayOps, the collectives at several rank counts, the
ipc kernels' model, the bench's units) asks this module, so an op's meaning is written once.
On bool arrays the arithmetic ops are logical: sum/max/bor are or, prod/min/band are and.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

UFUNC = {
    "sum": np.add,
    "avg": np.add,  # avg reduces as sum; :func:`reduce` divides at the end
    "prod": np.multiply,
    "min": np.minimum,
    "max": np.maximum,
    "band": np.bitwise_and,
    "bor": np.bitwise_or,
    "bxor": np.bitwise_xor,
}
BOOL_UFUNC = {
    "sum": np.logical_or,
    "max": np.logical_or,
    "bor": np.logical_or,
    "prod": np.logical_and,
    "min": np.logical_and,
    "band": np.logical_and,
    "bxor": np.logical_xor,
}


def ufunc(op: str, dtype: Any) -> np.ufunc:
    """The element-wise function that combines two arrays of ``dtype`` under ``op``."""
    return BOOL_UFUNC[op] if np.dtype(dtype) == np.bool_ else UFUNC[op]


def combine(a: np.ndarray, b: np.ndarray, op: str) -> np.ndarray:
    """``a (op) b`` element-wise, wrapping on integer overflow (avg combines as sum)."""
    with np.errstate(over="ignore"):
        return ufunc(op, a.dtype)(a, b)


def reduce(arrays: Sequence[np.ndarray], op: str) -> np.ndarray:
    """``op`` over ``arrays`` (one per rank). ``avg`` sums in a wide type (complex128, float64,
    int64) and divides by the count: true division, floor division for integers."""
    stack = np.stack(list(arrays))
    kind = stack.dtype.kind
    if op == "avg":
        wide = {"c": np.complex128, "f": np.float64}.get(kind, np.int64)
        total = np.add.reduce(stack.astype(wide), axis=0)
        return total // len(stack) if kind in "iu" else total / len(stack)
    with np.errstate(over="ignore"):
        return ufunc(op, stack.dtype).reduce(stack, axis=0)
