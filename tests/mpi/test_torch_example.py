"""examples/ddp_train.py runs as documented: ``cudampi launch -n 2 examples/ddp_train.py``."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.mpirun import ROOT, mpi_env

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")


def test_ddp_example_under_cudampi_launch():
    argv = [
        sys.executable,
        "-m",
        "cudampi",
        "launch",
        "-n",
        "2",
        "examples/ddp_train.py",
        "--steps",
        "8",
        "--width",
        "64",
        "--json",
    ]
    proc = subprocess.run(
        argv, capture_output=True, text=True, timeout=240, env=mpi_env(), cwd=ROOT
    )
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert len(lines) == 1, proc.stdout  # only rank 0 prints
    result = json.loads(lines[0])
    assert result["backend"] == "cudampi" and result["world_size"] == 2
    assert result["replicas_in_sync"] is True
    assert result["samples_per_s"] > 0 and result["steps"] == 8
