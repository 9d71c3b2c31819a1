"""cudampi.torch.world's exit hook: when it yields the GIL to torch's threads (the whole story,
a gloo thread aborting the process after the script's last line, is run for real in
tests/mpi/test_torch_init.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")


def test_the_exit_hook_yields_only_where_a_group_lived(monkeypatch):
    import atexit

    import torch.distributed as dist

    from cudampi.torch import world

    naps: list[float] = []
    monkeypatch.setattr(world.time, "sleep", naps.append)
    monkeypatch.setattr(world, "GROUPS_MADE", [])
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    world.yield_to_torch_threads()
    assert naps == []  # a torch program that never made a group: exit as before
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    world.yield_to_torch_threads()
    assert len(naps) == 10 and sum(naps) == pytest.approx(0.01)
    naps.clear()
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # destroyed, a gloo group kept
    monkeypatch.setattr(world, "GROUPS_MADE", [True])
    world.yield_to_torch_threads()
    assert len(naps) == 10
    registered: list[object] = []
    monkeypatch.setattr(atexit, "register", registered.append)
    world.install_exit_hook()
    assert registered == [world.yield_to_torch_threads]
