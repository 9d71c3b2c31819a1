"""The launcher families, one module each (``openmpi``, ``mpich``, ``slurm``, ``pbs``, ``lsf``),
and the manager that only orders them.

Each module declares one :class:`~cudampi.launch.launchers.base.LauncherFamily` as ``FAMILY``:
how its launcher is found, the facts of its batch job, its argv, its failure messages, its
policies. The registry loads the modules named in :data:`cudampi.names.LAUNCH_FAMILIES`, in that
order, so a new launcher is its module plus its name there (docs/ARCHITECTURE.md, "a new
launcher"). Nothing else in cudampi compares a launcher's name: it asks its family.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from functools import cache

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch.launchers.base import (
    Allocation,
    Command,
    Launcher,
    LauncherFamily,
    LaunchPlan,
    version_text,
)
from cudampi.names import LAUNCH_FAMILIES

__all__ = [
    "Allocation",
    "Command",
    "LaunchPlan",
    "Launcher",
    "LauncherFamily",
    "allocation",
    "choices",
    "families",
    "family",
    "find_launcher",
    "identify",
    "parse_version",
    "rendezvous_host",
]


@cache
def families() -> tuple[LauncherFamily, ...]:
    """Every family, in :data:`~cudampi.names.LAUNCH_FAMILIES` order."""
    out = []
    for name in LAUNCH_FAMILIES:
        fam = importlib.import_module(f"{__name__}.{name}").FAMILY
        if not isinstance(fam, LauncherFamily) or fam.name != name:
            raise TypeError(f"{__name__}.{name}.FAMILY must be the LauncherFamily named {name!r}")
        out.append(fam)
    return tuple(out)


def family(name: str) -> LauncherFamily:
    """The family called ``name`` (a launcher's flavour, a batch system)."""
    for fam in families():
        if fam.name == name:
            return fam
    raise ConfigError(f"no launcher family {name!r}; cudampi knows {', '.join(LAUNCH_FAMILIES)}")


def choices() -> tuple[str, ...]:
    """What ``--launcher`` takes besides a path: auto, the MPIs' mpirun and mpiexec, and every
    family's own launcher (srun, jsrun)."""
    own = [c for fam in families() for c in fam.commands]
    return ("auto", "mpirun", "mpiexec", *own)


def identify(path: str) -> Launcher:
    """The launcher at ``path``: by its name where a family owns it (srun, jsrun), else by what
    its ``--version`` says."""
    base = os.path.basename(path)
    for fam in families():
        if base in fam.commands:
            return fam.launcher_at(path)
    flavour, name, version = parse_version(version_text(path))
    return Launcher(flavour, path, version, name)


def parse_version(text: str) -> tuple[str, str, str]:
    """``(family, implementation, version)`` from a launcher's ``--version`` output."""
    for fam in families():
        said = fam.parse_version(text)
        if said is not None:
            return fam.name, said[0], said[1]
    first = text.strip().splitlines()[0] if text.strip() else ""
    raise LaunchError(
        f"cannot tell which MPI this launcher belongs to from its --version output {first!r}; "
        f"cudampi knows Open MPI (mpirun/prterun), MPICH/Intel MPI (Hydra mpiexec), srun and "
        f"jsrun. Pick one with --launcher and its path on PATH"
    )


def find_launcher(choice: str, env: Mapping[str, str]) -> Launcher | None:
    """A family's own launcher for ``choice``: the one named (srun, jsrun), or for ``auto``
    the launcher of the batch job this process runs in, when it is on PATH; None where the
    MPI's mpirun/mpiexec is to be taken."""
    for fam in families():
        if choice in fam.commands:
            return fam.find(env, auto=False)
    if choice == "auto":
        for fam in families():
            found = fam.find(env, auto=True)
            if found is not None:
                return found
    return None


def allocation(env: Mapping[str, str], launcher: Launcher) -> Allocation | None:
    """The batch job this process runs in, as ``launcher`` should use it; None outside one."""
    for fam in families():
        alloc = fam.allocation(env, launcher)
        if alloc is not None:
            return alloc
    return None


def rendezvous_host(launcher: str, env: Mapping[str, str]) -> str | None:
    """In a rank ``launcher`` started (a name of :data:`cudampi.names.LAUNCHERS`): rank 0's
    host where that launcher's variables say it, else None."""
    if launcher not in LAUNCH_FAMILIES:
        return None
    return family(launcher).rendezvous_host(env)
