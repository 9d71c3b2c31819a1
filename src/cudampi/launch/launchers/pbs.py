"""PBS (OpenPBS, PBS Pro, Torque): its job, whose ranks an MPI's own mpiexec starts.

Inside a PBS job (``PBS_JOBID``), ``PBS_NODEFILE`` names one host per line, once per MPI process
the job asked for (``select=2:ncpus=8:mpiprocs=4`` lists each of its two hosts four times). Those
hosts and slots become the launch's hosts when none are given, so mpirun/mpiexec (built with or
without PBS's TM support) places the ranks where PBS put the job, and ``-n`` defaults to the
slots. PBS has no launcher of its own here (its ``pbsdsh`` starts no MPI job).
"""

from __future__ import annotations

from collections.abc import Mapping

from cudampi.errors import LaunchError
from cudampi.launch.hosts import parse_slot_lines, read_hostfile
from cudampi.launch.launchers.base import Allocation, Launcher, LauncherFamily
from cudampi.rankenv import job_env


class Pbs(LauncherFamily):
    name = "pbs"

    def allocation(self, env: Mapping[str, str], launcher: Launcher) -> Allocation | None:
        job = job_env(env, (self.name,))
        if job is None:
            return None
        if not job.nodefile:
            raise LaunchError(
                f"this is PBS job {job.job_id!r} but PBS_NODEFILE is not set: its hosts are "
                "unknown. Fix: give them with --hosts/--hostfile"
            )
        hosts = parse_slot_lines(read_hostfile(job.nodefile, "PBS_NODEFILE"))
        return Allocation(
            self.name,
            job.job_id,
            nodes=tuple(h.name for h in hosts),
            hosts=hosts,
            hosts_from=f"PBS_NODEFILE {job.nodefile}",
        )

    def ask_for_nodes(self, nnodes: int) -> str:
        return f"ask qsub for {nnodes} (-l select={nnodes}:ncpus=...:mpiprocs=...)"


FAMILY = Pbs()
