"""On a GPU machine: the generated pip-route activation (cudampi-env.sh) is the recipe that makes
device point-to-point work with the PyPI Open MPI wheel + libucx-cu13, and its settings pass."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

from cudampi.env import files
from cudampi.env.settings import check_settings, parse_env_file
from cudampi.env.spec import DEFAULT
from tests.gpu.jobs import time_left
from tests.mpirun import is_open_mpi, mpi_env, mpiexec

pytestmark = pytest.mark.gpu

PROGRAM = r"""
import torch
from mpi4py import MPI
comm = MPI.COMM_WORLD
n = 1 << 22
torch.cuda.set_device(comm.rank % torch.cuda.device_count())
x = torch.arange(n, dtype=torch.float32, device="cuda") + comm.rank
y = torch.zeros_like(x)
torch.cuda.synchronize()
if comm.rank == 0:
    comm.Send(x, dest=1, tag=1); comm.Recv(y, source=1, tag=2)
else:
    comm.Recv(y, source=0, tag=1); comm.Send(x, dest=0, tag=2)
torch.cuda.synchronize()
want = torch.arange(n, dtype=torch.float32, device="cuda") + (1 - comm.rank)
print("rank", comm.rank, "ok" if bool(torch.equal(y, want)) else "WRONG", flush=True)
"""


def test_env_sh_preload_makes_device_sendrecv_work(tmp_path):
    if importlib.util.find_spec("libucx") is None:
        pytest.skip(f"needs {DEFAULT.ucx_package} in this venv (pip install {DEFAULT.ucx_package})")
    if not is_open_mpi():
        pytest.skip("the recipe is Open MPI's pml ucx")
    texts = files.generate(DEFAULT, ("pip",))
    files.write_files(texts, tmp_path)
    prog = tmp_path / "p2p.py"
    prog.write_text(PROGRAM)
    script = (
        f'export CUDAMPI_PYTHON="{sys.executable}"; . "{tmp_path}/cudampi-env.sh"; env > "{tmp_path}/env.txt"; '
        f'exec "{mpiexec()}" -n 2 --oversubscribe --bind-to none '
        f'-x LD_PRELOAD="$CUDAMPI_UCX_PRELOAD" -x UCX_MODULE_DIR "{sys.executable}" "{prog}"'
    )
    env = mpi_env()
    for key in [k for k in env if k.startswith(("OMPI_MCA_pml", "OMPI_MCA_btl", "UCX_TLS"))]:
        del env[key]
    proc = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=time_left(240)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 2, proc.stdout
    exported = parse_env_file((tmp_path / "env.txt").read_text())
    assert exported["OMPI_MCA_pml"] == "ucx" and exported["CUDAMPI_UCX_PRELOAD"].endswith(
        "libucp.so.0"
    )
    relevant = {k: v for k, v in exported.items() if k.startswith(("OMPI_", "UCX_", "NCCL_"))}
    assert (
        check_settings(relevant, gpus=True, multi_node=False, ompi_major=5, built_with_cuda=False)
        == []
    )


def test_sourced_env_with_the_preload_then_doctor_and_two_ranks(tmp_path):
    """Where cudampi-env.sh finds libucx it exports CUDAMPI_UCX_PRELOAD: the doctor, the
    Communicator and the torch backend must take it (they once refused it as unknown)."""
    if importlib.util.find_spec("libucx") is None:
        pytest.skip(f"needs {DEFAULT.ucx_package} in this venv (pip install {DEFAULT.ucx_package})")
    files.write_files(files.generate(DEFAULT, ("pip",)), tmp_path)
    rank = Path(__file__).parents[1] / "integration" / "_env_rank.py"
    script = (
        f'export CUDAMPI_PYTHON="{sys.executable}"; . "{tmp_path}/cudampi-env.sh"; '
        f'test -n "$CUDAMPI_UCX_PRELOAD" || exit 9; '
        f'"{sys.executable}" -m cudampi doctor --json > "{tmp_path}/doctor.json" || exit $?; '
        f'exec "{sys.executable}" -m cudampi launch -n 2 "{rank}"'
    )
    env = {k: v for k, v in mpi_env().items() if not k.startswith("CUDAMPI_")}
    env["CUDAMPI_CACHE_DIR"] = str(tmp_path / "cache")
    proc = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env=env, timeout=time_left(400)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("ENV-OK rank") == 2 and "CUDAMPI_UCX_PRELOAD" in proc.stdout
