"""A folder written by ``cudampi env write --out DIR`` and then moved elsewhere, used the way its
own files say: source its cudampi-env.sh, run ``cudampi doctor``, then a 2-rank Communicator
allreduce and a torch ``all_reduce`` through ``cudampi launch`` and, where a throwaway Slurm can
be brought up here, through its job.sbatch (whose ranks inherit every exported CUDAMPI_*)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import cudampi
from tests.mpi.test_launch_slurm import Slurm, _why_skip
from tests.mpirun import bring_up

pytestmark = [pytest.mark.mpi, pytest.mark.torch]

ROOT = Path(__file__).resolve().parents[2]
RANK = str(Path(__file__).with_name("_env_rank.py"))
CLI = (sys.executable, "-m", "cudampi")
WHEEL = f"cudampi-{cudampi.__version__}-py3-none-any.whl"


def user_env(**extra: str) -> dict[str, str]:
    """This shell's environment without cudampi's own variables (a fresh user's shell)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CUDAMPI_")}
    env.update(PYTHONUNBUFFERED="1", **extra)
    return env


@pytest.fixture(scope="module")
def moved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``cudampi env write`` of a 1-node, 2-rank job, then the folder moved somewhere else."""
    base = tmp_path_factory.mktemp("envgen")
    written = base / "written"
    w = subprocess.run(
        [
            sys.executable,
            "-m",
            "cudampi",
            "env",
            "write",
            "--out",
            str(written),
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--cpus-per-task",
            "1",
            "--extras",
            "",
            "--json",
            "--command",
            "python",
            RANK,
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(),
        cwd=base,
    )
    assert w.returncode == 0, w.stdout + w.stderr
    report = json.loads(w.stdout)
    assert report["lock"].startswith("ok") and report["wheel"].startswith("ok"), report
    target = base / "elsewhere" / "deeper" / "env"
    target.parent.mkdir(parents=True)
    shutil.move(str(written), target)
    return target


def test_the_folder_has_what_its_files_need(moved: Path):
    for name in ("requirements.lock", WHEEL, "cudampi-env.sh", "install.sh", "job.sbatch"):
        assert (moved / name).is_file(), name
    # Nothing points back at where it was written or at a checkout.
    for name in ("install.sh", "Dockerfile", "job.sbatch", "environment.yml"):
        text = (moved / name).read_text()
        assert str(moved.parents[2] / "written") not in text, name
        assert "$here/.." not in text and "COPY docker/" not in text, name
    assert f'"$here"/{WHEEL}' in (moved / "install.sh").read_text()
    assert f"COPY {WHEEL} ./" in (moved / "Dockerfile").read_text()
    check = subprocess.run(
        [*CLI, "env", "write", "--spec", str(moved / "env.toml"), "--out", str(moved), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
        env=user_env(),
    )
    assert check.returncode == 0, check.stdout + check.stderr


def _sourced(moved: Path, command: str, **extra: str) -> subprocess.CompletedProcess[str]:
    script = f'{PYTHON_VAR}="{sys.executable}"; . "{moved}/cudampi-env.sh"; {command}'
    return subprocess.run(
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=300,
        env=user_env(**extra),
        cwd=moved.parent,
    )


PYTHON_VAR = "CUDAMPI_PYTHON"


def test_sourced_environment_then_doctor(moved: Path, tmp_path: Path):
    p = _sourced(
        moved,
        f"export {PYTHON_VAR}; env > env.txt; exec {sys.executable} -m cudampi doctor --json",
        CUDAMPI_CACHE_DIR=str(tmp_path / "cache"),
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    report = json.loads(p.stdout)
    assert report["summary"]["fail"] == 0
    exported = dict(
        line.split("=", 1)
        for line in (moved.parent / "env.txt").read_text().splitlines()
        if "=" in line
    )
    assert exported[PYTHON_VAR] == sys.executable  # a CUDAMPI_* name the doctor had to accept
    # pml ucx belongs to the CUDA UCX recipe: exported with its preload only (without the
    # libucx wheel, on a host with neither GPUs nor InfiniBand, it aborts MPI_Init).
    has_ucx = importlib.util.find_spec("libucx") is not None
    assert ("CUDAMPI_UCX_PRELOAD" in exported) == has_ucx
    assert exported.get("OMPI_MCA_pml") == ("ucx" if has_ucx else None)


def test_sourced_environment_then_two_ranks_allreduce(moved: Path):
    p = _sourced(
        moved,
        f"export {PYTHON_VAR}; exec {sys.executable} -m cudampi launch -n 2 {RANK}",
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.count("ENV-OK rank") == 2, p.stdout
    assert PYTHON_VAR in p.stdout  # the ranks saw it, and Config let them run


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory):
    yield from bring_up(lambda: Slurm(tmp_path_factory.mktemp("slurm")), _why_skip())


def test_job_sbatch_runs_the_ranks_under_slurm(moved: Path, slurm: Slurm):
    # What sbatch would run, inside a 2-task allocation: the #SBATCH lines are comments to bash.
    # CUDAMPI_VENV exported as a user would (srun --export=ALL hands it to every rank).
    env = {k: v for k, v in slurm.env.items() if not k.startswith("CUDAMPI_")}
    env.update(CUDAMPI_VENV=sys.prefix, PYTHONUNBUFFERED="1")
    p = subprocess.run(
        ["salloc", "-Q", "-n", "2", "--immediate=60", "bash", str(moved / "job.sbatch")],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=moved.parent,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:] + slurm.logs()
    assert p.stdout.count("ENV-OK rank") == 2, p.stdout
    assert "via slurm CUDAMPI_VENV" in p.stdout
