"""Habits from torch and mpirun meet the cudampi backend: real ranks under mpirun, ``cudampi
launch`` and torchrun.

- ``init_process_group("mpi")`` after ``import cudampi.torch``: torch's own "build from source"
  error, then cudampi's line naming the backend to use instead, on every rank, under each
  launcher (and in ``cudampi launch``'s summary of the failed ranks);
- a collective that one rank skips raises on the others with torch's words for it (``Timed
  out``, which torch's own tests and users' retry code match) beside cudampi's detail;
- ``init_process_group("cudampi")`` without ``import cudampi.torch``: works where cudampi is
  installed (torch's ``torch.backends`` entry points register it at ``import torch``); with
  ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` torch says "Unknown backend type cudampi" as before.
"""

from __future__ import annotations

import importlib.metadata
import re
import subprocess
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


_SKIPS = """
import datetime, sys, time
import torch, torch.distributed as dist
import cudampi.torch

dist.init_process_group("cudampi", timeout=datetime.timedelta(seconds=3))
t = torch.ones(4)
if dist.get_rank() == 0:
    try:
        dist.all_reduce(t)  # rank 1 never makes this call
    except Exception as exc:
        print("raised:", type(exc).__name__, str(exc).replace("\\n", " "), flush=True)
else:
    time.sleep(8)
"""

TORCH_TIMEOUT_WORDS = re.compile(r" (Timed out|closed|timeout) ")
"""What torch's own tests (and users' retry code) match in a timed-out collective's error."""
HINT = "cudampi's MPI backend is named 'cudampi'"
LAUNCHERS = ["mpirun", "cudampi-launch", "torchrun"]


def _run(tmp_path, body, n=2, env=None, launcher="mpirun"):
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    if launcher == "torchrun":
        from tests.mpi.test_torch_torchrun import torchrun_env

        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        argv += ["--nproc-per-node", str(n), str(script)]
        full = {**torchrun_env("default"), **(env or {})}
        return subprocess.run(argv, capture_output=True, text=True, timeout=180, env=full)
    if launcher == "cudampi-launch":
        argv = [sys.executable, "-m", "cudampi", "launch", "-n", str(n), str(script)]
    else:
        argv = [*mpiexec_argv(n), sys.executable, str(script)]
    return run_launched(argv, mpi_env(env), 180, f"{n}-rank script")


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_mpi_backend_name_gets_the_fix(tmp_path, launcher):
    proc = _run(tmp_path, _MPI_NAME, launcher=launcher)
    assert proc.returncode != 0
    err = proc.stderr
    assert "doesn't have MPI built in" in err, err[-3000:]
    assert "init_process_group('cudampi')" in err
    # After each raising rank's traceback (the first rank to fail may end the job before the
    # other raised, so one or two), and in cudampi launch's summary of each such rank.
    raised = "RuntimeError: Distributed package doesn't have MPI built in"
    cut = err.find("cudampi launch: the job failed")
    ranks, summary = (err[:cut], err[cut:]) if cut >= 0 else (err, "")
    assert ranks.count(HINT) == ranks.count(raised) >= 1, ranks[-3000:]
    if launcher == "cudampi-launch":
        assert summary.count(HINT) == summary.count(raised) >= 1, summary


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_a_skipped_collective_times_out_in_torchs_words(tmp_path, launcher):
    proc = _run(tmp_path, _SKIPS, launcher=launcher)
    raised = [ln for ln in proc.stdout.splitlines() if ln.startswith("raised:")]
    assert len(raised) == 1, (proc.stdout[-2000:], proc.stderr[-3000:])
    line = raised[0]
    assert "rank 1 did not arrive within 3 s" in line, line  # cudampi's detail, kept
    assert TORCH_TIMEOUT_WORDS.search(line), line


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
