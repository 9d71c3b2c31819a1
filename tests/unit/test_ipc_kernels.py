"""The ipc kernels compile with NVRTC for Ampere and Hopper (no GPU needed), and their layout
agrees with cudampi.comm.ipc.layout (the kernels static_assert it while compiling)."""

from __future__ import annotations

import importlib.util

import pytest

from cudampi.comm.arrays import ops_allowed
from cudampi.comm.ipc import layout as L

if importlib.util.find_spec("cupy_backends") is None:
    pytest.skip(
        "NVRTC's Python binding comes with CuPy: pip install cupy-cuda13x nvidia-cuda-nvrtc "
        "(.ci/run does)",
        allow_module_level=True,
    )


def names() -> list[str]:
    """Every element kind, every op of one integer and one float type, half types with avg on
    8 ranks, and the rank counts that change the unrolled loops."""
    out = [L.reduce_name(dt, "sum", 2) for dt in L.KINDS]
    out += [L.reduce_name("int32", op, 2) for op in ops_allowed("int32")]
    out += [L.reduce_name("float32", op, 2) for op in ops_allowed("float32")]
    out += [L.reduce_name("float16", "avg", 8), L.reduce_name("bfloat16", "avg", 8)]
    out += [L.reduce_name("complex64", "prod", 3), L.reduce_name("uint64", "min", 5)]
    out += [L.reduce_name("float32", "sum", n) for n in (3, 4, L.MAX_RANKS)]
    out += [L.twoshot_name(dt, "sum", 2) for dt in ("float32", "bfloat16", "bool", "complex128")]
    out += [L.twoshot_name("float16", "avg", 8), L.twoshot_name("float32", "max", L.MAX_RANKS)]
    out += [L.exchange_name(n) for n in (2, 3, L.MAX_RANKS)]
    out += [L.P2P_NAME]
    return list(dict.fromkeys(out))


def test_kernels_compile_for_ampere_and_hopper() -> None:
    """Both architectures at once, one process each (NVRTC holds a core for ~15 s an arch)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    archs = ["sm_80", "sm_90"]
    with ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(L.compile_cubin, names(), arch) for arch in archs]
        try:
            cubins = [f.result(timeout=300) for f in futures]
        except RuntimeError as exc:
            if "libnvrtc" in str(exc) or "nvrtc" in type(exc).__name__.lower():
                pytest.skip(f"NVRTC is not loadable here: {exc}")
            raise
    for arch, cubin in zip(archs, cubins):
        assert cubin[:4] == b"\x7fELF", arch
        # each kernel's own code, as tools/kernel-sass-diff.py compares it: one section each,
        # whole 16-byte instructions (sm_70 and later), none empty
        code = L.kernel_code(cubin)
        assert len(code) == len(names()), (arch, sorted(code))
        assert all(len(c) > 0 and len(c) % 16 == 0 for c in code.values()), arch
        assert any("p2p_kernel" in k for k in code), sorted(code)


def test_a_layout_the_kernels_do_not_follow_fails_to_compile(monkeypatch) -> None:
    monkeypatch.setattr(L, "HEADER_BYTES", L.HEADER_BYTES + 8)
    L.source.cache_clear()
    try:
        with pytest.raises(RuntimeError, match="Header size differs"):
            L.compile_cubin([L.exchange_name(2)], "sm_90")
    finally:
        L.source.cache_clear()


def test_bool_reduces_with_bitwise_ops() -> None:
    assert L.reduce_name("bool", "sum", 2) == L.reduce_name("bool", "bor", 2)
    assert L.reduce_name("bool", "min", 2) == L.reduce_name("bool", "band", 2)
    assert "KU8" in L.reduce_name("bool", "bxor", 4)
