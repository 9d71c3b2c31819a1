"""Habits from torch and mpirun meet the cudampi backend (issue 19): real ranks under mpiexec.

- ``init_process_group("mpi")`` after ``import cudampi.torch``: torch's own "build from source"
  error, then cudampi's line naming the backend to use instead, on every rank;
- ``init_process_group("cudampi")`` without ``import cudampi.torch``: works where cudampi is
  installed (torch's ``torch.backends`` entry points register it at ``import torch``); with
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` torch says "Unknown backend type cudampi" as before.
"""

from __future__ import annotations

import importlib.metadata
import sys
import textwrap

import pytest

from tests.mpirun import ROOT, mpi_env, mpiexec_argv, run_launched

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

_MPI_NAME = """
import torch.distributed as dist
import cudampi.torch

dist.init_process_group("mpi")
"""

_NO_IMPORT = """
import sys
import torch
import torch.distributed as dist

dist.init_process_group("cudampi")  # no `import cudampi.torch` anywhere
t = torch.ones(3)
dist.all_reduce(t)
assert t.tolist() == [float(dist.get_world_size())] * 3, t
if dist.get_rank() == 0:
    print("cudampi without import:", "cudampi.torch" in sys.modules, dist.get_backend(), flush=True)
dist.destroy_process_group()
"""


def _run(tmp_path, body, n=2, env=None):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    argv = [*mpiexec_argv(n), sys.executable, str(script)]
    return run_launched(argv, mpi_env(env), 180, f"{n}-rank script")


def test_mpi_backend_name_gets_the_fix(tmp_path):
    proc = _run(tmp_path, _MPI_NAME)
    assert proc.returncode != 0
    err = proc.stderr
    assert "doesn't have MPI built in" in err, err[-3000:]
    assert err.count("cudampi's MPI backend is named 'cudampi'") == 2, err[-3000:]  # each rank
    assert "init_process_group('cudampi')" in err


def _entry_point_installed() -> bool:
    eps = importlib.metadata.entry_points(group="torch.backends")
    return any(ep.value == "cudampi._torch_autoload:load" for ep in eps)


def test_pyproject_declares_the_entry_point():
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points."torch.backends"]' in text
    assert 'cudampi = "cudampi._torch_autoload:load"' in text


def test_backend_name_works_without_the_import(tmp_path):
    if not _entry_point_installed():
        pytest.skip("this venv's cudampi was installed before the entry point: pip install -e .")
    proc = _run(tmp_path, _NO_IMPORT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cudampi without import: True cudampi" in proc.stdout, proc.stdout
    # Autoload off: torch's own error, as before (nothing of cudampi runs to add a hint).
    # (torchrun-style variables, or env:// fails first: cudampi's env:// fallback is not there.)
    env = {"RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "0"}
    proc = _run(tmp_path, _NO_IMPORT, n=1, env={"TORCH_DEVICE_BACKEND_AUTOLOAD": "0", **env})
    assert proc.returncode != 0
    assert "Unknown backend type cudampi" in proc.stderr, proc.stderr[-3000:]
