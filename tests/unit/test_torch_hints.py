"""cudampi.torch.hints: the fix named for torch's own errors (pure)."""

from __future__ import annotations

from cudampi.torch.hints import hint_for


def test_mpi_backend_from_a_stock_wheel():
    msg = (
        "RuntimeError: Distributed package doesn't have MPI built in. MPI is only included if "
        "you build PyTorch from source on a host that has MPI installed."
    )
    hint = hint_for(msg)
    assert "init_process_group('cudampi')" in hint and "import cudampi.torch" in hint


def test_unregistered_cudampi_backend():
    for msg in ("AssertionError: Unknown backend type cudampi", "Invalid backend: 'cudampi'"):
        assert "import cudampi.torch" in hint_for(msg), msg


def test_other_errors_get_no_hint():
    assert hint_for("AssertionError: Unknown backend type nccl") == ""
    assert hint_for("ValueError: something else") == ""
