"""Element-wise reductions of every array-ops implementation against NumPy, every dtype and op."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from cudampi.comm.arrays import COMPLEX, FLOAT, check_op, ops_allowed
from cudampi.comm.arrays import DTYPES as ALL_DTYPES
from cudampi.comm.arrays.numpy import NumpyOps
from cudampi.comm.arrays.torch import TorchOps
from cudampi.errors import CommError
from tests import oracle

try:
    import torch
except ImportError:  # the 3.10/3.13 unit tiers: the NumPy tests still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")

# NumPy has no bfloat16: every other dtype a collective accepts.
DTYPES = [d for d in ALL_DTYPES if d != "bfloat16"]


def _pair(dtype: str):
    rng = np.random.default_rng(7)
    if dtype == "bool":
        return rng.random(64) < 0.5, rng.random(64) < 0.5
    if dtype.startswith("uint"):
        hi = np.iinfo(dtype).max
        a = rng.integers(0, hi, 64, dtype=dtype, endpoint=True)
        b = rng.integers(0, hi, 64, dtype=dtype, endpoint=True)
        a[:4] = [0, hi, hi // 2 + 1, 1]  # values with the top bit set: signed views would lie
        return a, b
    if dtype.startswith("int"):
        info = np.iinfo(dtype)
        return (
            rng.integers(info.min, info.max, 64, dtype=dtype),
            rng.integers(info.min, info.max, 64, dtype=dtype),
        )
    if dtype.startswith("complex"):
        return (
            (rng.integers(-4, 4, 64) + 1j * rng.integers(-4, 4, 64)).astype(dtype),
            (rng.integers(-4, 4, 64) + 1j * rng.integers(-4, 4, 64)).astype(dtype),
        )
    return rng.integers(-8, 8, 64).astype(dtype), rng.integers(-8, 8, 64).astype(dtype)


def _want(a, b, op, dtype):
    return oracle.combine(a, b, op)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "impl",
    [
        "numpy",
        pytest.param("torch-kernels", marks=needs_torch),
        pytest.param("torch-numpy-views", marks=needs_torch),
    ],
)
def test_reduce_matches_numpy_for_every_op(dtype, impl):
    for op in ops_allowed(dtype):
        a, b = _pair(dtype)
        want = _want(a, b, op, dtype)
        if impl == "numpy":
            d = a.copy()
            NumpyOps().reduce(d, b, op, dtype)
            got = d
        else:
            ops = TorchOps(None, use_numpy=impl == "torch-numpy-views")
            d = torch.from_numpy(a.copy())
            ops.reduce(d, torch.from_numpy(b.copy()), op, dtype)
            got = d.numpy()
        assert np.array_equal(got, want), (impl, dtype, op, got[:6], want[:6])


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d in FLOAT + COMPLEX and d != "bfloat16"])
@pytest.mark.parametrize("impl", ["numpy", pytest.param("torch-kernels", marks=needs_torch)])
def test_avg_divides_each_share_in_place_or_from_a_source(dtype, impl):
    a, _ = _pair(dtype)
    n = 3
    want = a / a.dtype.type(n)
    for apart in (False, True):
        if impl == "numpy":
            d = np.empty_like(a) if apart else a.copy()
            NumpyOps().divide(d, n, dtype, a if apart else None)
        else:
            t = torch.empty_like(torch.from_numpy(a)) if apart else torch.from_numpy(a.copy())
            TorchOps(None, use_numpy=False).divide(
                t, n, dtype, torch.from_numpy(a) if apart else None
            )
            d = t.numpy()
        assert np.allclose(d, want, rtol=2e-3), (dtype, apart, d[:6], want[:6])


def test_avg_is_refused_for_integers_and_named_for_floats():
    for dtype in ("int8", "int32", "uint64"):
        assert "avg" not in ops_allowed(dtype)
        with pytest.raises(CommError, match=f"op='avg' is not defined for {dtype}: the sum"):
            check_op("avg", dtype)
    for dtype in FLOAT + COMPLEX:
        assert check_op("avg", dtype) == "avg"


@needs_torch
def test_bfloat16_reduces_with_torch_kernels():
    a = torch.tensor([1.0, -2.0, 3.0, 25.0], dtype=torch.bfloat16)
    b = torch.tensor([2.0, 5.0, -3.0, 6.0], dtype=torch.bfloat16)
    for use_numpy in (True, False):  # bfloat16 always takes torch kernels
        ops = TorchOps(None, use_numpy=use_numpy)
        for op, want in (
            ("sum", [3, 3, 0, 31]),
            ("max", [2, 5, 3, 25]),
            ("min", [1, -2, -3, 6]),
            ("prod", [2, -10, -9, 150]),
        ):
            d = a.clone()
            ops.reduce(d, b, op, "bfloat16")
            assert d.float().tolist() == [float(w) for w in want], (op, d)
        d = torch.tensor([3.0, 9.0], dtype=torch.bfloat16)
        ops.divide(d, 3, "bfloat16")
        assert d.float().tolist() == [1.0, 3.0]


def test_check_op_names_the_allowed_ops():
    assert check_op("sum", "float32") == "sum"
    with pytest.raises(CommError, match="not a reduction"):
        check_op("mean", "float32")
    with pytest.raises(CommError, match="float16 takes sum, prod, min, max, avg"):
        check_op("bxor", "float16")
    with pytest.raises(CommError, match="complex64"):
        check_op("max", "complex64")
    with pytest.raises(CommError, match="bool"):
        check_op("avg", "bool")


def test_importing_comm_starts_no_mpi_torch_or_cuda():
    code = (
        "import sys, cudampi, cudampi.comm\n"
        "from cudampi.comm import Communicator, Handle\n"
        "import cudampi.comm.communicator, cudampi.comm.algorithms, cudampi.comm.engines.staged\n"
        "bad = [m for m in ('mpi4py.MPI', 'torch', 'cupy') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
