"""Who started this process, and where it sits in its job: read from the launcher's variables.

The one reader of every launcher's environment (the ground floor: the probe, the observer, the
launcher, the torch backend, ``cudampi.init()`` and the benchmarks all ask it). Pure: it reads a
mapping (``os.environ``), so every launcher's variables are tested without that launcher.
The launchers and their order are :data:`cudampi.names.LAUNCHERS`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cudampi.errors import LaunchError
from cudampi.names import LAUNCHER_LABELS, LAUNCHERS, MPI_LAUNCHERS


@dataclass(frozen=True)
class _Vars:
    """One launcher's variables (a tuple: the first one set counts)."""

    rank: str
    size: tuple[str, ...]
    local_rank: tuple[str, ...] = ()
    local_size: tuple[str, ...] = ()
    node_rank: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    """Set (to anything) only where this launcher started the process."""
    needs_int: tuple[str, ...] = ()
    """The first of these that is set must be an integer for this launcher to count."""


_VARS = {
    "torchrun": _Vars(
        "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",), ("GROUP_RANK",),
        needs=("TORCHELASTIC_RUN_ID",),
    ),
    "openmpi": _Vars(
        "OMPI_COMM_WORLD_RANK", ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
        ("OMPI_COMM_WORLD_LOCAL_SIZE",),
    ),
    "mpich": _Vars("PMI_RANK", ("PMI_SIZE",), ("MPI_LOCALRANKID",), ("MPI_LOCALNRANKS",)),
    # a job step's tasks only: a batch script has SLURM_PROCID and SLURM_NTASKS but no step
    "slurm": _Vars(
        "SLURM_PROCID", ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS"),
        ("SLURM_LOCALID",), (), ("SLURM_NODEID",), needs_int=("SLURM_STEP_ID", "SLURM_STEPID"),
    ),
    "pmix": _Vars("PMIX_RANK", ("OMPI_COMM_WORLD_SIZE",)),
    "env": _Vars(
        "RANK", ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",),
        ("GROUP_RANK", "NODE_RANK"), needs_int=("WORLD_SIZE",),
    ),
}  # fmt: skip


@dataclass(frozen=True)
class LauncherInfo:
    """What the launcher's variables say (None where a value is not given)."""

    name: str
    """One of :data:`cudampi.names.LAUNCHERS`."""
    rank: int | None = None
    local_rank: int | None = None
    size: int | None = None
    local_size: int | None = None
    evidence: tuple[str, ...] = ()
    """The variables that gave the launcher away."""
    node_rank: int | None = None

    @property
    def label(self) -> str:
        """The launcher as messages name it (``Open MPI mpirun/prterun``...)."""
        return LAUNCHER_LABELS[self.name]


def launched_by(
    env: Mapping[str, str], among: Sequence[str] = LAUNCHERS, *, strict: bool = False
) -> LauncherInfo:
    """The first launcher of ``among`` (in :data:`~cudampi.names.LAUNCHERS` order) whose
    variables ``env`` holds; ``none`` if there is none.

    ``strict``: a value that is not an integer is a :class:`LaunchError` naming it (for code
    about to trust the numbers); otherwise it reads as not given (the doctor's report).
    """
    for name in (n for n in LAUNCHERS if n in among and n != "none"):
        v = _VARS[name]
        if not all(k in env for k in v.needs):
            continue
        if v.needs_int and _int(env, v.needs_int, strict) is None:
            continue
        rank = _int(env, (v.rank,), strict)
        if rank is None:
            continue
        node = _int(env, v.node_rank, strict)
        local_size = _int(env, v.local_size, strict)
        if name == "slurm":
            local_size = _slurm_local_size(env, node, strict)
        return LauncherInfo(
            name,
            rank,
            _int(env, v.local_rank, strict),
            _int(env, v.size, strict),
            local_size,
            tuple(k for k in (*v.needs, *v.needs_int, v.rank) if k in env),
            node,
        )
    return LauncherInfo("none")


def mpi_launcher(env: Mapping[str, str]) -> tuple[str, int, int] | None:
    """``(launcher label, rank, size)`` if an MPI launcher (:data:`~cudampi.names.MPI_LAUNCHERS`)
    started this process, else None: its ranks then form an MPI job by themselves."""
    info = launched_by(env, MPI_LAUNCHERS)
    if info.rank is None or info.size is None:
        return None
    return info.label, info.rank, info.size


ALLOCATIONS = {"slurm": "SLURM_JOB_ID", "pbs": "PBS_JOBID", "lsf": "LSB_JOBID"}
"""The batch systems whose allocation a process can be inside, and the variable that says so."""


def allocation(env: Mapping[str, str]) -> str | None:
    """The batch system whose allocation this process runs in (a batch script, salloc's
    shell, a job step), or None."""
    for system, var in ALLOCATIONS.items():
        if env.get(var) or (system == "slurm" and env.get("SLURM_JOBID")):
            return system
    return None


@dataclass(frozen=True)
class RankEnv:
    """This process's place in its job, every number known (see :func:`rank_env`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    """torchrun, openmpi, mpich, slurm, env (RANK/WORLD_SIZE given) or none (plain python)."""
    node_rank: int | None = None


RANK_LAUNCHERS = tuple(n for n in LAUNCHERS if n != "pmix")
"""The launchers whose variables number the ranks fully (a bare PMIx launcher gives no size)."""


def rank_env(env: Mapping[str, str]) -> RankEnv:
    """Rank, size, local rank/size and launcher from ``env``, checked: a launcher that gives a
    rank without a size, numbers that contradict each other or that are not integers are a
    :class:`LaunchError`. Without a launcher: rank 0 of 1."""
    info = launched_by(env, RANK_LAUNCHERS, strict=True)
    if info.name == "none":
        return RankEnv(0, 1, 0, 1, "none", 0)
    assert info.rank is not None
    rank, size, local_rank, local_size = info.rank, info.size, info.local_rank, info.local_size
    if size is None:
        raise LaunchError(f"{info.name} gave this process rank {rank} but no world size")
    if local_rank is None:
        # Without a local rank every process is alone on its node: the safe reading.
        local_rank, local_size = 0, local_size or 1
    if local_size is None:
        local_size = local_rank + 1
    if not (0 <= rank < size) or not (0 <= local_rank < local_size):
        raise LaunchError(
            f"{info.name} says rank {rank} of {size}, local rank {local_rank} of {local_size}: "
            f"inconsistent; check the launcher's environment (an outer launcher's variables "
            f"leaking into this one?)"
        )
    return RankEnv(rank, size, local_rank, local_size, info.name, info.node_rank)


def parse_tasks_per_node(text: str) -> list[int]:
    """Slurm's ``SLURM_STEP_TASKS_PER_NODE`` (``2(x3),1``) -> ``[2, 2, 2, 1]``."""
    out: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            raise ValueError(f"cannot read Slurm tasks per node {text!r}")
        out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def _slurm_local_size(env: Mapping[str, str], node: int | None, strict: bool) -> int | None:
    per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    if not per_node or node is None:
        return None
    try:
        counts = parse_tasks_per_node(per_node)
    except ValueError:
        if strict:
            raise
        return None
    return counts[node] if node < len(counts) else None


def _int(env: Mapping[str, str], names: Sequence[str], strict: bool) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            if strict:
                raise LaunchError(
                    f"{name}={raw!r} is not an integer; the launcher or the job script set it wrong"
                ) from None
            return None
    return None
