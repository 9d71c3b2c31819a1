"""The MPI that the ranks of a non-MPI launcher (torchrun, Lightning's, accelerate's) load.

Such ranks become one MPI job through cudampi's PMI-1 server (:mod:`cudampi.pmi.join`), which
MPICH-family MPIs join and Open MPI 5 (PMIx only, the embedded default) cannot. So cudampi keeps
an MPICH of its own for them: PyPI's ``mpich`` wheel installed by ``python -m cudampi.pmi.mpich
install`` into :func:`prefix` (inside this environment, beside nothing mpi4py searches: installed
into the environment itself, its ``libmpi.so.12`` would become what mpi4py loads everywhere,
under ``mpirun`` too). :func:`choose` points mpi4py at it (``MPI4PY_LIBMPI``) in a rank about to
join, unless the user named a library already.

What it costs, said by the doctor too: the probe's verdicts (the capabilities cache) are for the
MPI they were proven with, so under this MPICH device arrays are staged through host memory
until a probe proves more, and its point-to-point between nodes is not CUDA-aware.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass

LIBMPI = "libmpi.so.12"
"""The MPICH ABI's library name (MPICH, Intel MPI, MVAPICH)."""
WHEEL = "mpich"


def prefix(base: str | None = None) -> str:
    """Where ``install`` puts MPICH: under this environment (``sys.prefix``), in a folder of
    its own that mpi4py's search (``<prefix>/lib``) does not look in."""
    return os.path.join(base or sys.prefix, "opt", "cudampi-mpich")


def library(where: str | None = None) -> str:
    """The installed MPICH's ``libmpi.so.12`` (it may not exist)."""
    return os.path.join(where or prefix(), "lib", LIBMPI)


def install_command(where: str | None = None) -> list[str]:
    """pip, installing PyPI's mpich wheel into :func:`prefix` (``--ignore-installed``: an
    mpich already in the environment does not count; it is not where cudampi looks)."""
    return [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--no-deps",
        "--ignore-installed",
        "--no-warn-script-location",
        "--prefix",
        where or prefix(),
        WHEEL,
    ]


INSTALL = "python -m cudampi.pmi.mpich install"
"""The command a user types (in the environment torchrun runs)."""


@dataclass(frozen=True)
class Choice:
    """The MPI library a joining rank loads, and why."""

    path: str | None
    """``MPI4PY_LIBMPI`` as the rank will have it (None: mpi4py's own search)."""
    why: str


def choose(env: Mapping[str, str], where: str | None = None) -> Choice:
    """Which MPI a rank of a non-MPI launcher loads (pure but for a file test): the user's
    ``MPI4PY_LIBMPI``; else cudampi's MPICH where installed; else mpi4py's own choice."""
    given = env.get("MPI4PY_LIBMPI")
    if given:
        return Choice(given, "named by MPI4PY_LIBMPI")
    lib = library(where)
    if os.path.exists(lib):
        return Choice(lib, "cudampi's own")
    return Choice(None, "mpi4py's default: cudampi's MPICH is not installed")


def select(env: MutableMapping[str, str], where: str | None = None) -> Choice:
    """:func:`choose`, and point mpi4py at it in ``env`` (before ``mpi4py.MPI`` is imported)."""
    choice = choose(env, where)
    if choice.path is not None:
        env["MPI4PY_LIBMPI"] = choice.path
    return choice


def loads_open_mpi(choice: Choice) -> bool | None:
    """Is the library a rank would load Open MPI (which cannot join a PMI-1 job)? ``None`` when
    it cannot be told before MPI starts. mpi4py's own test (a symbol only Open MPI has), on the
    library it will load, opened without initialising it."""
    import ctypes

    path = choice.path
    if path is None:
        try:
            import importlib

            # the search mpi4py itself makes at import (a private function of mpi4py >= 4)
            lib = importlib.import_module("mpi4py._mpiabi")._dlopen_libmpi()
        except Exception:
            return None
    else:
        try:
            lib = ctypes.CDLL(path, os.RTLD_LAZY | os.RTLD_LOCAL)
        except OSError:
            return None
    return hasattr(lib, "ompi_mpi_comm_self")


def install(where: str | None = None) -> int:
    """Install PyPI's mpich wheel into :func:`prefix`; 0 when its library is there after."""
    where = where or prefix()
    proc = subprocess.run(install_command(where), check=False)
    if proc.returncode != 0 or not os.path.exists(library(where)):
        print(
            f"cudampi: installing the mpich wheel into {where!r} failed (pip exit "
            f"{proc.returncode}); without it, ranks that torchrun starts cannot form one MPI "
            "job on the embedded Open MPI. Fix: make PyPI reachable and run it again, or point "
            "MPI4PY_LIBMPI at an MPICH-family libmpi.so.12.",
            file=sys.stderr,
        )
        return 1
    print(f"cudampi: MPICH for torchrun's ranks in {where} ({library(where)})")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cudampi.pmi.mpich", description=__doc__)
    p.add_argument("action", choices=["install", "where"])
    a = p.parse_args(argv)
    if a.action == "where":
        print(library())
        return 0 if os.path.exists(library()) else 1
    return install()


if __name__ == "__main__":
    sys.exit(main())
