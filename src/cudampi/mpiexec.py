"""The one mpiexec command line: Open MPI's mpirun/prterun or MPICH's Hydra mpiexec.

The ground floor, for everything that starts MPI ranks: ``cudampi launch`` (through
:mod:`cudampi.launch.plan`, which decides the values) and the doctor's runtime probe
(:mod:`cudampi.probe.runtime`); ``cudampi bench --np`` goes through ``cudampi launch``. Pure: argv
lists, never shell strings. Also the flags a user gives for where a job runs
(:func:`add_job_flags`), the same for ``cudampi launch`` and ``cudampi doctor --hosts``.
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Mapping
from dataclasses import dataclass

from cudampi.names import MPI_FLAVOURS

ROOT_ENV: Mapping[str, str] = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
}
"""What Open MPI's mpirun needs to run as root (set on the launcher process)."""


@dataclass(frozen=True)
class Mpiexec:
    """What one mpiexec run is asked for; :meth:`argv` spells it for its flavour."""

    path: str
    flavour: str
    """``openmpi`` or ``mpich`` (:data:`cudampi.names.MPI_FLAVOURS`)."""
    nprocs: int
    command: tuple[str, ...]
    """What every rank runs."""
    hosts: str | None = None
    """``h1:4,h2:4`` (Open MPI ``--host``, Hydra ``-hosts``), or use ``hostfile``."""
    hostfile: str | None = None
    per_node: int | None = None
    """Ranks per node (Open MPI ``--map-by ppr:N:node``, Hydra ``-ppn``)."""
    oversubscribe: bool = False
    """More ranks than slots (Open MPI only; Hydra never refuses)."""
    bind: str = "none"
    """The launcher's own binding: none, core, numa or socket."""
    tag_output: bool = False
    rsh_agent: tuple[str, ...] = ()
    """The remote shell (ssh with its options) that starts the remote daemons."""
    iface: str | None = None
    """The network interface of the job (Hydra's ``-iface``)."""
    mca: tuple[tuple[str, str], ...] = ()
    """Open MPI's MCA parameters (``--mca k v``); Hydra has none."""
    env: tuple[tuple[str, str], ...] = ()
    """Exported to every rank (``-x K=V``, ``-genv K V``)."""
    forward: tuple[str, ...] = ()
    """Variables of the launcher's environment forwarded to every rank by name."""
    extra: tuple[str, ...] = ()
    """Raw flags, passed unchanged before the command."""

    def __post_init__(self) -> None:
        if self.flavour not in MPI_FLAVOURS:
            raise ValueError(f"mpiexec flavour {self.flavour!r} is not one of {MPI_FLAVOURS}")

    def argv(self) -> list[str]:
        """The argv that runs this, in the flavour's own flags."""
        flags = _openmpi(self) if self.flavour == "openmpi" else _hydra(self)
        return [self.path, "-n", str(self.nprocs), *flags, *self.extra, *self.command]


def _openmpi(m: Mpiexec) -> list[str]:
    out: list[str] = []
    if m.hostfile is not None:
        out += ["--hostfile", m.hostfile]
    elif m.hosts is not None:
        out += ["--host", m.hosts]
    if m.per_node is not None:
        out += [
            "--map-by",
            f"ppr:{m.per_node}:node" + (":OVERSUBSCRIBE" if m.oversubscribe else ""),
        ]
    elif m.oversubscribe:
        out += ["--oversubscribe"]
    out += ["--bind-to", m.bind]
    if m.tag_output:
        out += ["--tag-output"]
    if m.rsh_agent:
        out += ["--mca", "plm_rsh_agent", shlex.join(m.rsh_agent)]
    for key, value in m.mca:
        out += ["--mca", key, value]
    for key, value in m.env:
        out += ["-x", f"{key}={value}"]
    for name in m.forward:
        out += ["-x", name]
    return out


def _hydra(m: Mpiexec) -> list[str]:
    out: list[str] = []
    if m.hostfile is not None:
        out += ["-f", m.hostfile]
    elif m.hosts is not None:
        out += ["-hosts", m.hosts]
    if m.per_node is not None:
        out += ["-ppn", str(m.per_node)]
    if m.bind != "none":
        out += ["-bind-to", m.bind]
    if m.tag_output:
        out += ["-l"]
    if m.rsh_agent:
        out += ["-launcher", "ssh", "-launcher-exec", shlex.join(m.rsh_agent)]
    if m.iface:
        out += ["-iface", m.iface]
    for key, value in m.env:
        out += ["-genv", key, value]
    if m.forward:
        out += ["-genvlist", ",".join(m.forward)]
    return out


LAUNCHER_STARTUP_FAILURES = ("The PMIx server's listener thread failed to start",)
"""Open MPI (PRRTE) failures before any rank ran: a known intermittent start-up failure (seen
here once in a few hundred launches on a loaded 2-core machine, in two of three CI runs of the
whole suite, and in other projects' CI). Only these are retried (the doctor's probe,
``cudampi launch``); a rank's own failure never is."""


def launcher_never_started(returncode: int | None, stderr: str) -> bool:
    """True when the launcher itself failed to start (so no rank ran) for a known transient
    reason, and one more try is the right answer."""
    return returncode not in (0, None) and any(m in stderr for m in LAUNCHER_STARTUP_FAILURES)


def add_job_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """Where a job's ranks run and how its launcher reaches them, as every command that starts
    a job takes them (``cudampi launch``, ``cudampi doctor --hosts``): ``--hosts`` (mpirun's
    ``-H``/``--host``) or ``--hostfile`` (Hydra's ``-f``), ``--ssh`` and ``--launcher``."""
    where = parser.add_mutually_exclusive_group()
    where.add_argument(
        "--hosts",
        "-H",
        "--host",
        dest="hosts",
        default=None,
        metavar="H1:S,H2:S",
        help="hosts and slots, e.g. h1:4,h2:4 (mpirun's -H/--host)",
    )
    where.add_argument(
        "--hostfile",
        "-f",
        dest="hostfile",
        default=None,
        metavar="FILE",
        help="hostfile: 'host slots=N' or 'host:N' lines (Hydra's -f)",
    )
    parser.add_argument(
        "--ssh",
        default=None,
        metavar="CMD",
        help='remote shell command with options, e.g. "ssh -i key -o StrictHostKeyChecking=no"',
    )
    parser.add_argument(
        "--launcher",
        default="auto",
        help="auto, mpirun, mpiexec, srun or a path (auto: srun in a Slurm allocation, else the "
        "mpiexec beside this python, else PATH)",
    )
