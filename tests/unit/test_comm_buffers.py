"""Adapting arrays: libraries, DLPack and array-interface objects, contiguity, devices."""

from __future__ import annotations

import numpy as np
import pytest

from cudampi.comm.arrays import adapt, flat, same_memory
from cudampi.comm.validate import Signature, _raise_for
from cudampi.errors import CommError, DeviceError, MismatchError

try:
    import torch
except ImportError:  # the 3.10/3.13 unit tiers: the NumPy tests still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def test_numpy_arrays():
    b = adapt(np.zeros((3, 4), dtype=np.float16))
    assert (b.lib, b.device, b.dtype, b.shape, b.itemsize, b.nbytes) == (
        "numpy",
        None,
        "float16",
        (3, 4),
        2,
        24,
    )
    assert b.contiguous and not adapt(np.zeros((3, 4))[:, ::2]).contiguous


@needs_torch
def test_torch_arrays():
    t = adapt(torch.zeros(5, dtype=torch.bfloat16))
    assert (t.lib, t.dtype, t.itemsize, t.device) == ("torch", "bfloat16", 2, None)
    assert not adapt(torch.zeros(4, 4).t()).contiguous


def test_foreign_host_objects_are_wrapped_without_copy():
    base = np.arange(6, dtype=np.int32)

    class DLPackOnly:
        def __dlpack__(self, **kw):
            return base.__dlpack__(**kw)

        def __dlpack_device__(self):
            return base.__dlpack_device__()

    b = adapt(DLPackOnly())
    assert b.lib == "numpy" and b.dtype == "int32"
    b.arr[0] = 42
    assert base[0] == 42, "a DLPack host array must be a view, not a copy"
    buf = bytearray(8)
    bb = adapt(buf)
    bb.arr[:] = 7
    assert buf == bytearray([7] * 8)


def test_non_arrays_and_unknown_devices_are_rejected():
    with pytest.raises(CommError, match="not an array"):
        adapt([1, 2, 3])

    class OnOpenCL:
        def __dlpack__(self, **kw):
            raise AssertionError("must not be called")

        def __dlpack_device__(self):
            return (4, 0)  # kDLOpenCL

    with pytest.raises(DeviceError, match="device type 4"):
        adapt(OnOpenCL())
    if torch is not None and torch.device("meta").type == "meta":
        with pytest.raises(DeviceError, match="meta"):
            adapt(torch.empty(3, device="meta"))


@needs_torch
def test_flat_views_share_memory_even_for_size_one_tensors():
    t = torch.zeros(1, 1)
    f = flat(adapt(t))
    assert f.stride() == (1,) and f.data_ptr() == t.data_ptr()


def test_flat_views_of_numpy_arrays_share_memory():
    a = np.zeros((2, 3))
    assert flat(adapt(a)).base is a
    assert same_memory(adapt(a), adapt(a)) and not same_memory(adapt(a), adapt(a.copy()))


def test_mismatch_messages_name_the_odd_rank_and_values():
    good = Signature("allreduce", "sum", "float32", count=8, path="host")
    bad = Signature("allreduce", "sum", "float64", count=8, path="host")
    entries = [(good, None, "h"), (good, None, "h"), (bad, None, "h")]
    with pytest.raises(
        MismatchError, match=r"dtype.*ranks 0, 1: 'float32'; rank 2: 'float64'.*rank 2 differs"
    ):
        _raise_for(0, good, None, entries, False)
    # a local error on one rank: that rank re-raises its own, others name it
    err = CommError("x: not contiguous")
    entries = [(good, None, "h"), (good, ("CommError", str(err)), "hostB")]
    with pytest.raises(CommError, match=r"rank 1 on hostB rejected its arguments.*not contiguous"):
        _raise_for(0, good, None, entries, False)
    with pytest.raises(CommError) as info:
        _raise_for(1, good, err, entries, False)
    assert info.value is err
    # shapes are compared only in debug mode
    s1 = Signature("allreduce", "sum", "float32", count=6, path="host", shape=(2, 3))
    s2 = Signature("allreduce", "sum", "float32", count=6, path="host", shape=(3, 2))
    with pytest.raises(MismatchError, match="shape"):
        _raise_for(0, s1, None, [(s1, None, "h"), (s2, None, "h")], True)


@needs_torch
def test_tensors_that_require_grad_are_written_through_a_detached_view():
    t = torch.ones(3, requires_grad=True)
    b = adapt(t)
    assert not b.arr.requires_grad and b.arr.data_ptr() == t.data_ptr()
