"""IBM Spectrum LSF: its job, and its launcher jsrun (IBM's Job Step Manager, on CSM clusters).

- the job (``LSB_JOBID``): its hosts and slots from ``LSB_DJOB_HOSTFILE`` (one host per line,
  once per slot) or else ``LSB_MCPU_HOSTS`` (``host count host count ...``), read through
  :func:`cudampi.rankenv.job_env`. Under an MPI's mpirun they become the launch's hosts when none
  are given (as under PBS). Under jsrun they are only the job's nodes: jsrun places the tasks
  itself, and on CSM clusters LSF lists the launch node first, with one slot, where jsrun never
  places a task, so it is not counted;
- jsrun's argv: one resource set per rank (``--nrs N --tasks_per_rs 1``), with one GPU each and
  ``--rs_per_host G`` when ``--gpus-per-node G`` is given; its own binding; the rank environment
  with ``-E`` (jsrun also passes on its own environment); ``--stdio_mode prepended`` tags output;
- in a task: JSM_NAMESPACE_RANK/SIZE/LOCAL_RANK/LOCAL_SIZE (:data:`cudampi.names.RANK_VARS`);
  rank 0's address travels over MPI.

jsrun's own failure messages are not parsed (none was captured here): the ranks' reports and
jsrun's exit status make the summary.
"""

from __future__ import annotations

from collections.abc import Mapping

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch.hosts import Host, parse_slot_lines, read_hostfile
from cudampi.launch.launchers.base import (
    Allocation,
    Command,
    Launcher,
    LauncherFamily,
    LaunchPlan,
)
from cudampi.rankenv import JobEnv, job_env

BIND = {"gpu": "none", "none": "none", "core": "packed:1", "numa": "rs", "socket": "rs"}
"""cudampi's --bind-to in jsrun's --bind words (gpu: each rank binds itself)."""


class Lsf(LauncherFamily):
    name = "lsf"
    commands = ("jsrun",)
    mpi_flavours = ("openmpi",)
    forwards_environment = True
    binds_every_node = True

    def launcher_at(self, path: str) -> Launcher:
        return Launcher(self.name, path, "", "IBM jsrun")

    def allocation(self, env: Mapping[str, str], launcher: Launcher) -> Allocation | None:
        job = job_env(env, (self.name,))
        if job is None:
            return None
        hosts, where = job_hosts(job)
        if launcher.flavour == self.name:
            compute = hosts[1:] if len(hosts) > 1 and hosts[0].slots == 1 else hosts
            return Allocation(self.name, job.job_id, nodes=tuple(h.name for h in compute))
        return Allocation(
            self.name,
            job.job_id,
            nodes=tuple(h.name for h in hosts),
            hosts=hosts,
            hosts_from=where,
        )

    def command(self, plan: LaunchPlan, hostfile_path: str | None) -> Command:
        del hostfile_path  # jsrun places the tasks on the job's hosts itself
        argv = [plan.launcher.path, "--nrs", str(plan.nprocs), "--tasks_per_rs", "1"]
        if plan.gpus_per_node is not None:
            argv += ["--gpu_per_rs", "1", "--rs_per_host", str(plan.gpus_per_node)]
        argv += ["--bind", BIND[plan.bind]]
        if plan.tag_output:
            argv += ["--stdio_mode", "prepended"]
        env = [*plan.env, *((f"OMPI_MCA_{k}", v) for k, v in plan.mca)]
        for key, value in env:
            argv += ["-E", f"{key}={value}"]
        argv += [*plan.extra, *plan.command]
        return Command(tuple(argv), plan.launcher_env)

    def ask_for_nodes(self, nnodes: int) -> str:
        return f"ask bsub for {nnodes} (-nnodes {nnodes})"


def parse_host_counts(text: str) -> tuple[Host, ...]:
    """``LSB_MCPU_HOSTS`` (``hostA 4 hostB 4``) -> hosts and their slots."""
    words = text.split()
    if not words or len(words) % 2:
        raise ConfigError(f"cannot read LSF's host list {text!r}: expected 'host count ...'")
    hosts: list[Host] = []
    for name, count in zip(words[::2], words[1::2]):
        if not count.isascii() or not count.isdigit() or int(count) < 1:
            raise ConfigError(f"cannot read LSF's host list {text!r}: {count!r} is not a count")
        hosts.append(Host(name, int(count)))
    return tuple(hosts)


def job_hosts(job: JobEnv) -> tuple[tuple[Host, ...], str]:
    """An LSF job's hosts and slots, and where they were read."""
    if job.nodefile:
        hosts = parse_slot_lines(read_hostfile(job.nodefile, "LSB_DJOB_HOSTFILE"))
        return hosts, f"LSB_DJOB_HOSTFILE {job.nodefile}"
    if job.host_counts:
        return parse_host_counts(job.host_counts), "LSB_MCPU_HOSTS"
    raise LaunchError(
        f"this is LSF job {job.job_id!r} but neither LSB_DJOB_HOSTFILE nor LSB_MCPU_HOSTS is "
        "set: its hosts are unknown. Fix: give them with --hosts/--hostfile"
    )


FAMILY = Lsf()
