"""What every launcher family is and gives: the records a launch is made of (the launcher, the
decided plan, the batch job's facts, the command) and :class:`LauncherFamily`, whose defaults
describe an MPI's own mpiexec started on hosts the user gave.

A family module (``openmpi.py``, ``slurm.py``, ...) subclasses :class:`LauncherFamily` and
exposes one instance as ``FAMILY``; the registry (:mod:`cudampi.launch.launchers`) finds it by
its name in :data:`cudampi.names.LAUNCH_FAMILIES`. Nothing outside the family modules asks which
family a launcher is: it asks the family.
"""

from __future__ import annotations

import dataclasses
import shlex
import shutil
import signal
import subprocess
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch.events import Seen
from cudampi.launch.hosts import Host, hostfile_text, slot_name
from cudampi.mpiexec import Mpiexec
from cudampi.names import LAUNCH_FLAVOURS, LAUNCHER_LABELS, MPI_FLAVOURS
from cudampi.rankenv import job_env


@dataclass(frozen=True)
class Launcher:
    """One launcher binary and what it is."""

    flavour: str
    """Its family's name (:data:`cudampi.names.LAUNCH_FLAVOURS`)."""
    path: str
    version: str = ""
    name: str = ""
    """Human name of the implementation: 'Open MPI', 'MPICH', 'Intel MPI', 'Slurm'."""

    def __post_init__(self) -> None:
        if self.flavour not in LAUNCH_FLAVOURS:
            raise ConfigError(
                f"launcher flavour must be one of {', '.join(LAUNCH_FLAVOURS)}, "
                f"got {self.flavour!r}"
            )


@dataclass(frozen=True)
class Allocation:
    """The batch job ``cudampi launch`` runs in, as its system's family reads it."""

    system: str
    """The batch system (:data:`cudampi.names.JOB_SYSTEMS`)."""
    job_id: str = ""
    nodes: tuple[str, ...] = ()
    """The job's nodes (where --nnodes and MASTER_ADDR look)."""
    tasks: int | None = None
    """The job's task count (the default -n), where the job says it."""
    tasks_from: str = ""
    """The variable that gave ``tasks`` (for the plan's note)."""
    hosts: tuple[Host, ...] = ()
    """The hosts and their slots (tasks per node), for a launcher that must be given them (an
    MPI's mpiexec under PBS or LSF); empty where the launcher knows them itself (srun, jsrun)."""
    hosts_from: str = ""
    """Where ``hosts`` came from (for the plan's note)."""

    @property
    def label(self) -> str:
        return LAUNCHER_LABELS[self.system]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a launch needs, decided; its family's :meth:`LauncherFamily.command` turns it
    into argv + env."""

    launcher: Launcher
    command: tuple[str, ...]
    """What every rank runs (already wrapped in the rank bootstrap)."""
    nprocs: int
    hosts: tuple[Host, ...] = ()
    gpus_per_node: int | None = None
    bind: str = "gpu"
    env: tuple[tuple[str, str], ...] = ()
    """Exported to every rank, on every host."""
    forward: tuple[str, ...] = ()
    """Names of variables of the launcher's own environment forwarded to every rank."""
    launcher_env: tuple[tuple[str, str], ...] = ()
    """Set on the launcher process itself (root permission, Slurm's environment export)."""
    mca: tuple[tuple[str, str], ...] = ()
    """Open MPI MCA parameters (``--mca k v``); as OMPI_MCA_k env under srun."""
    oversubscribe: bool = False
    mpi_flavour: str = "openmpi"
    """The MPI library the ranks use (under srun it picks ``--mpi=``)."""
    iface: str | None = None
    """The network of the job (interface name or CIDR) for MPICH's -iface."""
    rsh_agent: tuple[str, ...] = ()
    """Remote shell command (ssh with its options) used to start remote daemons."""
    extra: tuple[str, ...] = ()
    """Raw flags given after ``--``, passed to the launcher unchanged (before the command)."""
    tag_output: bool = False
    """Prefix every output line with its rank (the launcher's own tagging)."""
    nnodes: int | None = None
    """Nodes asked for (torchrun's --nnodes; srun -N)."""
    multi_host: bool = False
    """Does the job span hosts (:func:`cudampi.launch.hosts.multi_host`, decided once)?"""
    remote_hosts: tuple[str, ...] = ()
    """The hosts that are not this machine, in the order given (the fault summary names a lost
    Open MPI daemon by them)."""
    notes: tuple[str, ...] = ()
    """Why the plan is what it is, in words (printed by --dry-run)."""

    def __post_init__(self) -> None:
        if self.nprocs < 1:
            raise ConfigError(f"-n must be at least 1, got {self.nprocs!r}")
        if not self.command:
            raise ConfigError("nothing to run: give a script, -m module or a program")

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class Command:
    """The exact launch: ``env`` is added to the launcher's environment; ``hostfile`` (text)
    is written to ``hostfile_path`` before ``argv`` runs."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    hostfile_path: str | None = None
    hostfile_text: str | None = None

    def shell(self) -> str:
        """One line a shell can run (for display; cudampi itself never runs a shell string)."""
        prefix = [f"{k}={shlex.quote(v)}" for k, v in self.env]
        return " ".join([*prefix, shlex.join(self.argv)])

    def to_json(self) -> dict[str, Any]:
        return {
            "argv": list(self.argv),
            "env": dict(self.env),
            "hostfile_path": self.hostfile_path,
            "hostfile_text": self.hostfile_text,
        }


class LauncherFamily:
    """One launcher family: how its launcher is found, what the batch job it runs in holds, the
    plan as its argv, what its failure messages mean, and the policies the plan asks it about.

    The defaults are those of an MPI's own mpiexec on hosts the user gave; a family overrides
    what differs. A family that is only a batch system (PBS: the MPI's mpiexec starts the
    ranks) has no :attr:`commands` and gives only :meth:`allocation`.
    """

    name: ClassVar[str] = ""
    """Its name in :data:`cudampi.names.LAUNCH_FAMILIES` (and, for a launcher of its own,
    :data:`~cudampi.names.LAUNCH_FLAVOURS`)."""
    commands: ClassVar[tuple[str, ...]] = ()
    """Executables of its own launcher that ``--launcher`` names (srun, jsrun); the MPI families
    share ``mpirun``/``mpiexec`` and are told apart by ``--version``."""
    mpi_flavours: ClassVar[tuple[str, ...]] = MPI_FLAVOURS
    """The ranks' MPI libraries whose jobs its launcher can start."""
    refuses_oversubscription: ClassVar[bool] = False
    """It refuses more ranks than a host's cores unless told (Open MPI's mpirun)."""
    forwards_environment: ClassVar[bool] = False
    """It gives every rank, on every host, its own environment (srun, jsrun): nothing needs
    forwarding by name."""
    binds_every_node: ClassVar[bool] = False
    """It knows each node's cores (a batch system's launcher), so it may bind ranks to cores
    on nodes this machine cannot see."""
    needs_root_env: ClassVar[bool] = False
    """It refuses to run as root without :data:`cudampi.mpiexec.ROOT_ENV`."""

    @property
    def label(self) -> str:
        return LAUNCHER_LABELS[self.name]

    def parse_version(self, text: str) -> tuple[str, str] | None:
        """``(implementation, version)`` if ``text`` (a launcher's ``--version`` output) is
        this family's launcher, else None."""
        return None

    def launcher_at(self, path: str) -> Launcher:
        """Its own launcher (one of :attr:`commands`) found at ``path``."""
        text = version_text(path)
        name, version = self.parse_version(text) or (self.label, "")
        return Launcher(self.name, path, version, name)

    def find(self, env: Mapping[str, str], *, auto: bool) -> Launcher | None:
        """Its own launcher on ``env``'s PATH: when asked for by name (``auto`` False), or, for
        ``--launcher auto``, when this process runs inside this family's batch job."""
        if not self.commands or (auto and not self.in_job(env)):
            return None
        for command in self.commands:
            found = shutil.which(command, path=env.get("PATH"))
            if found:
                return self.launcher_at(found)
        if auto:
            return None
        raise LaunchError(
            f"--launcher {self.commands[0]}: {self.commands[0]} is not on PATH; run inside a "
            f"{self.label} job"
        )

    def in_job(self, env: Mapping[str, str]) -> bool:
        """Does this process run inside one of this family's batch jobs?"""
        return job_env(env, (self.name,)) is not None

    def allocation(self, env: Mapping[str, str], launcher: Launcher) -> Allocation | None:
        """The facts of this family's batch job that ``launcher`` should use (nodes, tasks, and
        the hosts where ``launcher`` must be given them); None outside such a job."""
        return None

    def command(self, plan: LaunchPlan, hostfile_path: str | None) -> Command:
        """The argv and environment that run ``plan`` with this family's launcher;
        ``hostfile_path`` is where the caller writes :attr:`Command.hostfile_text`."""
        raise LaunchError(f"{self.label} has no launcher of its own: its MPI's mpiexec runs jobs")

    def read_output(self, text: str, seen: Seen) -> None:
        """Record into ``seen`` the rank and host failures its launcher's output reports."""

    def network(
        self, ifname: str | None, subnet: str | None, local_ifname: str | None, notes: list[str]
    ) -> list[tuple[str, str]]:
        """For a job across hosts: the MCA parameters that keep MPI's TCP on the network that
        reaches the hosts (``subnet``/``local_ifname`` as seen from here, ``ifname`` if the user
        named one), and why, in ``notes``."""
        return []

    def interrupt(self, send: Callable[[int], None]) -> None:
        """Ask its launcher to stop the job, as Ctrl-C would."""
        send(signal.SIGINT)

    def after_run(self, returncode: int, since: float) -> None:
        """Clean up what the job's ranks may leave on this host when its launcher ended them
        (``since``: when the job started, in ``time.time()``'s clock)."""

    def rendezvous_host(self, env: Mapping[str, str]) -> str | None:
        """In a rank it started: rank 0's host, where this family's variables say it, else
        None."""
        return None

    def ask_for_nodes(self, nnodes: int) -> str:
        """How to ask this batch system for ``nnodes`` nodes (the fix of a too-small job)."""
        return f"ask {self.label} for {nnodes} node(s)"


def version_text(path: str) -> str:
    """What ``path --version`` prints (stdout and stderr)."""
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"could not run {path!r} --version: {exc}") from None
    if "Unable to get the user home directory" in out.stdout + out.stderr:
        raise LaunchError(
            f"{path} cannot start: Open MPI needs a home folder and HOME is unset or not a "
            "folder. Fix: export HOME=/path/to/a/folder"
        )
    return out.stdout + out.stderr


def mpiexec_command(plan: LaunchPlan, hostfile_path: str | None, flavour: str) -> Command:
    """mpirun/prterun or Hydra's mpiexec: the plan in :class:`~cudampi.mpiexec.Mpiexec`'s terms
    (a hostfile where the caller writes one, else the hosts on the command line)."""
    hf_text = hostfile_text(plan.hosts, flavour) if plan.hosts else None
    job = Mpiexec(
        plan.launcher.path,
        flavour,
        plan.nprocs,
        plan.command,
        hosts=",".join(slot_name(h, ":") for h in plan.hosts) if plan.hosts else None,
        hostfile=hostfile_path if plan.hosts else None,
        per_node=plan.gpus_per_node,
        oversubscribe=plan.oversubscribe,
        bind="none" if plan.bind == "gpu" else plan.bind,
        tag_output=plan.tag_output,
        rsh_agent=plan.rsh_agent,
        iface=plan.iface,
        mca=plan.mca,
        env=plan.env,
        forward=plan.forward,
        extra=plan.extra,
    )
    return Command(
        tuple(job.argv()), plan.launcher_env, hostfile_path if hf_text else None, hf_text
    )
