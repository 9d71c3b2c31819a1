"""The cudampi backend under torchrun: real ``torch.distributed.run`` jobs, no MPI launcher.

torchrun starts plain processes; ``init_process_group("cudampi")`` makes them one MPI job
through cudampi's PMI-1 server (cudampi.torch.join). With an MPICH-family MPI (the PyPI
``mpich`` wheel, loaded by mpi4py through MPI4PY_LIBMPI) the same checks as under mpiexec must
pass: every collective against gloo at 2 and 4 ranks, DDP/FSDP parameters equal to gloo's, the
example script, and a rank that raises ends the job fast. With Open MPI 5 (PMIx only) every
rank must raise the error that names the fixes, not hang.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.mpi.test_torch_init import _RAISES  # the same script as under mpiexec
from tests.mpirun import ROOT, mpi_env, mpich_venv

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

pytest.importorskip("torch")

MAIN = str(ROOT / "tests" / "_torchrun_main.py")
HERE = Path(__file__).resolve().parent


def torchrun_env(mpi: str) -> dict[str, str]:
    env = mpi_env({"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"})
    for var in list(env):  # this pytest may itself run under a launcher: the workers must not
        if var.startswith(("OMPI_COMM_WORLD", "PMIX_", "PMI_", "SLURM_", "TORCHELASTIC")):
            env.pop(var)
    for var in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "MPI4PY_LIBMPI"):
        env.pop(var, None)
    if mpi == "mpich":
        venv = mpich_venv()
        if venv is None:
            pytest.skip(
                "no MPICH venv: set CUDAMPI_TEST_MPICH_PYTHON (CI makes .venv-mpich with the "
                "PyPI mpich wheel)"
            )
        env["MPI4PY_LIBMPI"] = str(venv / "lib" / "libmpi.so.12")
    return env


def torchrun(n: int, argv: list[str], mpi: str = "mpich", timeout: float = 300):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += ["--nproc-per-node", str(n), *argv]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, env=torchrun_env(mpi), cwd=ROOT
    )


def ok(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return proc


@pytest.mark.parametrize("n", [2, 4])
def test_every_collective_matches_gloo_under_torchrun(n):
    proc = ok(torchrun(n, [MAIN, str(HERE / "test_torch_backend.py"), "rank_collectives", str(n)]))
    assert "against gloo" in proc.stdout


def test_ddp_and_fsdp_match_gloo_under_torchrun():
    variants = "default,small-buckets-views,builtin-fp16-hook,no-sync-accumulate"
    argv = [MAIN, str(HERE / "test_torch_ddp.py"), "rank_ddp_fsdp", variants]
    proc = ok(torchrun(2, argv))
    assert "match gloo" in proc.stdout


_WHO = """
import os
import torch, torch.distributed as dist
import cudampi.torch

dist.init_process_group("cudampi")
from mpi4py import MPI  # after init: MPI started inside it, as one job

w = MPI.COMM_WORLD
assert (w.rank, w.size) == (dist.get_rank(), dist.get_world_size()), (w.rank, w.size)
assert "PMI_PORT" not in os.environ and "PMI_ID" not in os.environ
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
if dist.get_rank() == 0:
    print(MPI.Get_library_version().split()[0], "world", w.size, "sum", t.item(), flush=True)
dist.destroy_process_group()
"""


def test_mpi_world_is_torch_world_and_the_pmi_variables_are_gone(tmp_path):
    script = tmp_path / "who.py"
    script.write_text(textwrap.dedent(_WHO))
    proc = ok(torchrun(3, [str(script)]))
    assert "MPICH world 3 sum 3.0" in proc.stdout, proc.stdout


def test_the_example_trains_under_torchrun():
    proc = ok(torchrun(2, [str(ROOT / "examples" / "ddp_train.py"), "--json", "--steps", "5"]))
    assert '"world_size": 2' in proc.stdout and '"backend": "cudampi"' in proc.stdout


def test_a_raising_rank_ends_the_torchrun_job_fast(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(_RAISES))
    t0 = time.monotonic()
    proc = torchrun(2, [str(script)], timeout=90)
    elapsed = time.monotonic() - t0
    assert proc.returncode != 0
    assert "ValueError: planted failure" in proc.stderr, proc.stderr[-3000:]
    assert "cudampi: rank 1 of 2" in proc.stderr
    assert elapsed < 90, f"took {elapsed:.0f} s"


def test_open_mpi_under_torchrun_names_the_fix_on_every_rank(tmp_path):
    script = tmp_path / "init.py"
    script.write_text(
        "import torch.distributed as dist, cudampi.torch\ndist.init_process_group('cudampi')\n"
    )
    t0 = time.monotonic()
    proc = torchrun(2, [str(script)], mpi="openmpi", timeout=200)
    assert proc.returncode != 0
    err = proc.stderr
    assert err.count("does not speak PMI-1") >= 2, err[-4000:]
    assert "cudampi launch -n 2 script.py" in err and "MPI4PY_LIBMPI" in err
    assert time.monotonic() - t0 < 90
