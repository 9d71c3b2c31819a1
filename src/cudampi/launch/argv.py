"""A decided :class:`~cudampi.launch.plan.LaunchPlan` -> the exact argv and environment of its
launcher, spelled by the launcher's family (:mod:`cudampi.launch.launchers`: mpirun/prterun and
Hydra's mpiexec through :class:`cudampi.mpiexec.Mpiexec`, srun, jsrun). Pure."""

from __future__ import annotations

from collections.abc import Mapping

from cudampi.launch.launchers import Command, LaunchPlan, family

__all__ = ["Command", "build_command", "merge_env"]


def build_command(plan: LaunchPlan, hostfile_path: str | None = None) -> Command:
    """The argv and environment that run ``plan`` with its launcher.

    ``hostfile_path`` is where the caller will write :attr:`Command.hostfile_text` (only used
    when the plan has hosts and the launcher takes a hostfile).
    """
    return family(plan.launcher.flavour).command(plan, hostfile_path)


def merge_env(base: Mapping[str, str], cmd: Command) -> dict[str, str]:
    """The launcher's environment: ``base`` plus what ``cmd`` adds."""
    env = dict(base)
    env.update(cmd.env)
    return env
