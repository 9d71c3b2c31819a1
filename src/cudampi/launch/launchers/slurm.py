"""Slurm: its job (allocation) and its launcher, srun.

- the job: ``SLURM_JOB_ID``, its node list (``SLURM_JOB_NODELIST``: expanded by Slurm's own
  ``scontrol show hostnames`` inside the job, python-hostlist elsewhere) and its tasks
  (``SLURM_NTASKS``, the default -n), read through :func:`cudampi.rankenv.job_env`;
- srun's argv: ``-n``, ``--nodelist``/``-N``, ``--ntasks-per-node``, its CPU binding, PMIx or PMI-2
  for the ranks' MPI; the rank environment goes into srun's own environment, which it exports to
  every task (values may hold commas that ``--export`` cannot carry);
- srun's failure messages (``tests/fixtures/launch/srun-*.txt``); a second Ctrl-C within a
  second kills a step, so an interrupt is two;
- in a task: rank 0's host is the first node of the step's node list.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping

from cudampi.errors import LaunchError
from cudampi.launch.events import SIGNAL_WORDS, RankFailure, Seen
from cudampi.launch.launchers.base import (
    Allocation,
    Command,
    Launcher,
    LauncherFamily,
    LaunchPlan,
)
from cudampi.rankenv import job_env, rank_nodelist

_VERSION = re.compile(r"\s*slurm(?:-wlm)?\s+(\S+)")
_MPI_PLUGIN = re.compile(r"srun: error: Couldn't load specified plugin name for mpi/(\w+)")
_TASKS = re.compile(r"srun: error: (\S+): tasks? ([\d,\-]+): (.+)$", re.M)

CPU_BIND = {"gpu": "none", "none": "none", "core": "cores", "numa": "ldoms", "socket": "sockets"}
"""cudampi's --bind-to in srun's --cpu-bind words (gpu: each rank binds itself)."""


class Slurm(LauncherFamily):
    name = "slurm"
    commands = ("srun",)
    forwards_environment = True
    binds_every_node = True

    def parse_version(self, text: str) -> tuple[str, str] | None:
        m = _VERSION.match(text)
        return ("Slurm", m.group(1)) if m else None

    def allocation(self, env: Mapping[str, str], launcher: Launcher) -> Allocation | None:
        """Under srun only (an MPI's mpirun inside a Slurm job reads the job itself); srun
        outside a job makes one, of the nodes it is asked for."""
        if launcher.flavour != self.name:
            return None
        job = job_env(env, (self.name,))
        if job is None:
            return Allocation(self.name)
        return Allocation(
            self.name,
            job.job_id,
            nodes=tuple(expand_nodelist(job.nodes or "", env)),
            tasks=job.tasks,
            tasks_from=job.tasks_from or "",
        )

    def command(self, plan: LaunchPlan, hostfile_path: str | None) -> Command:
        del hostfile_path  # srun takes --nodelist; the allocation already knows its hosts
        argv: list[str] = [plan.launcher.path, "-n", str(plan.nprocs)]
        if plan.hosts:
            argv += ["--nodelist", ",".join(h.name for h in plan.hosts), "-N", str(len(plan.hosts))]
        elif plan.nnodes is not None:
            argv += ["-N", str(plan.nnodes)]
        if plan.gpus_per_node is not None:
            argv += [f"--ntasks-per-node={plan.gpus_per_node}"]
        argv += [
            f"--cpu-bind={CPU_BIND[plan.bind]}",
            "--kill-on-bad-exit=1",
            f"--mpi={'pmi2' if plan.mpi_flavour == 'mpich' else 'pmix'}",
        ]
        if plan.oversubscribe:
            argv += ["--overcommit"]
        if plan.tag_output:
            argv += ["--label"]
        argv += [*plan.extra, *plan.command]
        env = dict(plan.launcher_env)
        env.update(plan.env)
        env.update({f"OMPI_MCA_{k}": v for k, v in plan.mca})
        return Command(tuple(argv), tuple(env.items()))

    def read_output(self, text: str, seen: Seen) -> None:
        for m in _MPI_PLUGIN.finditer(text):
            seen.problems.append(
                f"srun cannot start MPI ranks: its mpi/{m.group(1)} plugin failed to load (Slurm "
                f"without PMIx support, e.g. libpmix missing). Fix: run "
                f"`cudampi launch --launcher mpirun` inside the allocation, or install PMIx for "
                f"Slurm"
            )
        for m in _TASKS.finditer(text):
            host, what = m.group(1), m.group(3).strip()
            code_m = re.match(r"Exited with exit code (\d+)", what)
            for r in _ranks(m.group(2)):
                if code_m:
                    seen.add_rank(RankFailure(r, host, exit_code=int(code_m.group(1))))
                else:
                    name = what.replace(" (core dumped)", "")
                    sig = SIGNAL_WORDS.get(name)
                    seen.add_rank(RankFailure(r, host, signal=sig, lines=(what,)))
        if re.search(r"CANCELLED AT|_step_signal: Terminating", text):
            # --kill-on-bad-exit: srun terminated the others because one failed; not their fault.
            first = [k for k, f in seen.ranks.items() if f.signal != 15]
            if first:
                seen.ranks = {k: f for k, f in seen.ranks.items() if f.signal != 15}

    def interrupt(self, send: Callable[[int], None]) -> None:
        send(signal.SIGINT)
        time.sleep(0.2)
        send(signal.SIGINT)  # srun: a second Ctrl-C within 1 s kills the step

    def rendezvous_host(self, env: Mapping[str, str]) -> str | None:
        nodes = rank_nodelist(env, self.name)
        return expand_nodelist(nodes, env)[0] if nodes else None

    def ask_for_nodes(self, nnodes: int) -> str:
        return f"ask salloc/sbatch for {nnodes} (-N {nnodes})"


def _ranks(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            out += list(range(int(lo), int(hi or lo) + 1))
    return out


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
    inside a job, python-hostlist elsewhere (or when scontrol cannot say)."""
    env = os.environ if env is None else env
    if not text:
        return []
    scontrol = shutil.which("scontrol", path=env.get("PATH"))
    if scontrol and job_env(env, ("slurm",)) is not None:
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


FAMILY = Slurm()
