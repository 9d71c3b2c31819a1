"""A decided :class:`~cudampi.launch.plan.LaunchPlan` -> the exact argv and environment of its
launcher: mpirun/prterun or Hydra's mpiexec (:class:`cudampi.mpiexec.Mpiexec`, the one mpiexec
command line), or srun (pure)."""

from __future__ import annotations

import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from cudampi.launch.hosts import hostfile_text, slot_name
from cudampi.launch.plan import LaunchPlan
from cudampi.mpiexec import Mpiexec


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


def build_command(plan: LaunchPlan, hostfile_path: str | None = None) -> Command:
    """The argv and environment that run ``plan`` with its launcher.

    ``hostfile_path`` is where the caller will write :attr:`Command.hostfile_text` (only used
    when the plan has hosts and the launcher takes a hostfile).
    """
    builders = {"openmpi": _openmpi, "mpich": _mpich, "slurm": _slurm}
    return builders[plan.launcher.flavour](plan, hostfile_path)


def _openmpi(plan: LaunchPlan, hostfile_path: str | None) -> Command:
    return _mpiexec(plan, hostfile_path, "openmpi")


def _mpich(plan: LaunchPlan, hostfile_path: str | None) -> Command:
    return _mpiexec(plan, hostfile_path, "mpich")


def _mpiexec(plan: LaunchPlan, hostfile_path: str | None, flavour: str) -> Command:
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


_SRUN_CPU_BIND = {
    "gpu": "none",
    "none": "none",
    "core": "cores",
    "numa": "ldoms",
    "socket": "sockets",
}


def _slurm(plan: LaunchPlan, hostfile_path: str | None) -> Command:
    del hostfile_path  # srun takes --nodelist; the allocation already knows its hosts
    argv: list[str] = [plan.launcher.path, "-n", str(plan.nprocs)]
    if plan.hosts:
        argv += ["--nodelist", ",".join(h.name for h in plan.hosts), "-N", str(len(plan.hosts))]
    elif plan.nnodes is not None:
        argv += ["-N", str(plan.nnodes)]
    if plan.gpus_per_node is not None:
        argv += [f"--ntasks-per-node={plan.gpus_per_node}"]
    argv += [
        f"--cpu-bind={_SRUN_CPU_BIND[plan.bind]}",
        "--kill-on-bad-exit=1",
        f"--mpi={'pmi2' if plan.mpi_flavour == 'mpich' else 'pmix'}",
    ]
    if plan.oversubscribe:
        argv += ["--overcommit"]
    if plan.tag_output:
        argv += ["--label"]
    argv += [*plan.extra, *plan.command]
    # srun exports the launcher's whole environment by default (--export=ALL); values may
    # contain commas that --export cannot carry, so the rank environment goes there.
    env = dict(plan.launcher_env)
    env.update(plan.env)
    env.update({f"OMPI_MCA_{k}": v for k, v in plan.mca})
    return Command(tuple(argv), tuple(env.items()))


def merge_env(base: Mapping[str, str], cmd: Command) -> dict[str, str]:
    """The launcher's environment: ``base`` plus what ``cmd`` adds."""
    env = dict(base)
    env.update(cmd.env)
    return env
