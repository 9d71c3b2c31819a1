from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FIXTURES = Path(__file__).with_name("fixtures")


def _has_cuda() -> bool:
    if shutil.which("nvidia-smi") is None:
        return False
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


HAS_CUDA = _has_cuda()


OPEN_MPI_TEST_SETTINGS = {"OMPI_MCA_btl": "^ofi"}
"""What every Open MPI job of the suite runs with, unless the run sets it itself. Open MPI 5
opens its ofi BTL in every MPI_Init and, finding no fabric to use, closes it with a ``sleep(1)``
(btl_ofi_component.c: "If we don't sleep, sockets provider freaks out"): every rank of every
job waited a second in MPI_Init (a bare 2-rank job: 1.20 s, 0.22 s without it). Nothing here
has a fabric ofi could use; the suite's own settings of OMPI_MCA_btl (the settings tests) are
left as they are."""


def pytest_configure(config: pytest.Config) -> None:
    for name, value in OPEN_MPI_TEST_SETTINGS.items():
        os.environ.setdefault(name, value)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        # an xdist worker gets COLUMNS=80 LINES=24, a terminal it does not have: the CLIs the
        # tests run would wrap their reports at 80 columns, as a serial run never does
        for name in ("COLUMNS", "LINES"):
            os.environ.pop(name, None)


TOGETHER = {
    "tests/container/": "container",  # the tier's image: a session fixture of its conftest.py
    "tests/netns/test_doctor_job.py": "netns-doctor",  # a cluster each (module fixtures);
    "tests/netns/test_launch_two_hosts.py": "netns-launch",  # a test there needs the one before
    "tests/netns/test_torchrun_two_hosts.py": "netns-torchrun",
    "tests/mpi/test_launch_slurm.py": "slurm",  # one Slurm on this machine at a time
    "tests/integration/test_env_generated.py": "slurm",
    "tests/mpi/test_doctor_cli.py": "doctor-cli",  # its pip installs, once (session fixtures)
    "tests/mpi/test_launch_habits.py": "launch-habits",  # its program, built once
    "tests/mpi/test_torch_ddp.py": "torch-ddp",  # its 2-rank runs: one job (a module fixture)
    "tests/mpi/test_torch_backend.py": "torch-backend",  # the same
    "tests/mpi/test_comm_jax.py": "comm-jax",  # the same
    # (its fault cases, each its own job, stay free to spread over the workers)
    "tests/mpi/test_torch_faults.py::test_a_check_that": "torch-faults",  # the same
    "tests/mpi/test_torch_faults.py::test_a_recv_from_any": "torch-faults",
    "tests/mpi/test_torch_faults.py::test_settings_that_differ": "torch-faults",
}
"""Under pytest-xdist (README command 2: ``-n 3``) the tests that share a world brought up once
run on one worker, in their order: the test files, folders or tests (node id prefixes) here,
by group. Every other test goes to whichever worker is free (xdist's own ``xdist_group`` marks
do not reach its scheduler under pytest 9)."""


@pytest.hookimpl(optionalhook=True)  # without pytest-xdist, nothing to schedule
def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object:
    from xdist.scheduler import LoadScopeScheduling

    class Together(LoadScopeScheduling):
        """xdist's scope scheduling with a scope per test, or per group of :data:`TOGETHER`;
        the groups (more tests to a scope) are handed out first."""

        def _split_scope(self, nodeid: str) -> str:
            group = next((g for where, g in TOGETHER.items() if nodeid.startswith(where)), None)
            return group or nodeid

    return Together(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU: run on the GPU machine (pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    return FIXTURES


@pytest.fixture()
def isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Point the capabilities cache at a fresh folder for this test."""
    monkeypatch.setenv("CUDAMPI_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def cudampi_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run the real ``cudampi`` console entry point in a child process."""
    full_env = dict(os.environ)
    full_env.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "cudampi", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=full_env,
    )
