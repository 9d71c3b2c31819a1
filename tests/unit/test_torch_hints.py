"""cudampi.torch.hints: the fix named for torch's own errors (pure)."""

from __future__ import annotations

import pytest

pytest.importorskip(
    "torch", reason="cudampi.torch needs torch (the 3.10/3.13 unit tiers have none)"
)

from cudampi.torch.hints import hint_for
from cudampi.torch.rendezvous import lightning_hint, singleton_message


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


def test_singleton_message_names_lightnings_fix_when_lightning_is_loaded():
    assert lightning_hint(["torch", "mpi4py"]) == ""
    msg = singleton_message(2, ["torch", "lightning", "mpi4py.MPI"])
    assert "plugins=[LightningEnvironment()]" in msg and "cudampi launch -n 2" in msg
    assert "LightningEnvironment" not in singleton_message(2)
