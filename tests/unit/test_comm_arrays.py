"""The array-library registry: one module per library behind one protocol, and JAX through it."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import cudampi.comm.arrays as arrays
from cudampi.comm.arrays import (
    LIBRARIES,
    ArrayLibrary,
    Unsupported,
    adapt,
    checks_for,
    flat,
    library,
    new_like,
    result,
    same_memory,
    written,
)
from cudampi.errors import CommError, ConfigError, DeviceError

HERE = Path(arrays.__file__).parent
NOT_LIBRARIES = {"__init__", "base", "dlpack"}
"""The registry, the protocol and the fallback for arrays of no registered library."""


def test_every_library_module_is_registered_and_implements_the_protocol():
    modules = {p.stem for p in HERE.glob("*.py")} - NOT_LIBRARIES
    assert modules == set(LIBRARIES), "a library module is registered by its name in LIBRARIES"
    for name in LIBRARIES:
        lib = library(name)
        assert isinstance(lib, ArrayLibrary) and lib.name == name
    with pytest.raises(CommError, match="unknown array library 'tensorflow'"):
        library("tensorflow")
    with pytest.raises(ConfigError, match="--array 'tensorflow'"):
        checks_for("tensorflow", "cpu")


def test_importing_the_registry_and_every_library_module_imports_no_array_library():
    code = (
        "import sys\n"
        "from cudampi.comm import arrays\n"
        "for name in arrays.LIBRARIES: arrays.library(name)\n"
        "import cudampi.comm.arrays.dlpack\n"
        "bad = [m for m in ('numpy', 'torch', 'cupy', 'jax', 'mpi4py.MPI') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_subclasses_adapt_as_their_library_and_results_come_back_in_it():
    class Sub(np.ndarray):
        pass

    s = np.arange(6, dtype=np.int16).view(Sub)
    b = adapt(s)
    assert (b.lib, b.impl.name, b.dtype, b.obj) == ("numpy", "numpy", "int16", s)
    assert adapt(s).impl is b.impl  # the second call takes the class cache
    r = new_like(b, (2, 3))
    assert r.shape == (2, 3) and r.dtype == "int16" and not same_memory(b, r)
    assert result(None, r) is r.arr and result(s, r) is s and written(b) is s
    assert same_memory(b, adapt(flat(b)))


# ----------------------------------------------------------------------------- JAX


@pytest.fixture
def jax():
    return pytest.importorskip("jax")


def test_jax_arrays_are_read_in_place_and_never_written(jax):
    import jax.numpy as jnp

    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    b = adapt(x)
    assert (b.lib, b.impl.name, b.dtype, b.shape, b.device) == (
        "numpy",
        "jax",
        "float32",
        (3, 4),
        None,
    )
    assert b.obj is x and not b.writable
    assert b.impl.ptr(b) == x.unsafe_buffer_pointer(), "DLPack in: a view, not a copy"
    assert "jax float32 array of shape (3, 4)" in b.describe()
    assert "immutable" in b.impl.read_only_fix
    assert written(b) is x


def test_jax_results_are_new_jax_arrays_over_cudampis_buffer(jax):
    import jax.numpy as jnp

    b = adapt(jnp.ones(5, dtype=jnp.int32))
    r = new_like(b, (2, 5))
    assert r.writable and r.impl.name == "jax" and r.impl.ptr(r) % 64 == 0
    flat(r)[:] = 7
    got = result(None, r)
    assert isinstance(got, jax.Array) and got.shape == (2, 5) and int(got.sum()) == 70
    assert got.unsafe_buffer_pointer() == r.impl.ptr(r), "DLPack out: no copy where JAX allows"


def test_jax_bfloat16_goes_through_torch_and_traced_values_are_refused(jax):
    import jax.numpy as jnp

    if importlib.util.find_spec("torch"):  # torch moves host bfloat16, which NumPy lacks
        b = adapt(jnp.ones(4, dtype=jnp.bfloat16))
        assert (b.lib, b.impl.name, b.dtype, b.writable) == ("torch", "jax", "bfloat16", False)
        got = result(None, new_like(b, (4,)))
        assert isinstance(got, jax.Array) and got.dtype == jnp.bfloat16

    seen = []

    @jax.jit
    def inside(x):
        try:
            adapt(x)
        except CommError as exc:
            seen.append(str(exc))
        return x

    inside(jnp.ones(3))
    assert seen and "traced JAX value" in seen[0] and "outside" in seen[0]


def test_jax_checks_compute_patterns_and_count_wrong_elements(jax):
    ck = checks_for("jax", "cpu")
    parts = [ck.pattern64(50, r, "bits") for r in range(3)]
    exp = ck.reduce64(parts, "bxor")
    want = np.bitwise_xor.reduce([np.asarray(p).astype(np.int64) for p in parts])
    assert np.array_equal(np.asarray(exp), want)
    got = ck.cast(exp, "int32")
    assert isinstance(got, jax.Array) and ck.count_wrong(got, exp, "int32") == 0
    assert ck.count_wrong(ck.cast(exp + 1, "int32"), exp, "int32") == 50
    assert "bfloat16" in ck.dtypes() and ("float64" in ck.dtypes()) == ck.x64
    with pytest.raises(Unsupported, match="immutable"):
        ck.corrupt(got)
    with pytest.raises(Unsupported, match="immutable"):
        ck.fill(got, 0)
    if not ck.x64:
        with pytest.raises(Unsupported, match="jax_enable_x64"):
            ck.empty((2,), "float64")
    if all(d.platform == "cpu" for d in jax.devices()):
        with pytest.raises(Unsupported, match="no GPU"):
            checks_for("jax", "cuda")


def test_jax_arrays_on_other_devices_are_refused_with_the_fix(jax):
    import jax.numpy as jnp

    x = jnp.ones(2)
    lib = library("jax")
    fake = type("OnOpenCL", (), {})()  # what JAX's adapt sees of an array on another device
    fake.devices = x.devices
    fake.__dlpack_device__ = lambda: (4, 0)
    with pytest.raises(DeviceError, match=r"device type 4.*jax\.device_put"):
        lib.adapt(fake, fake)
