"""Who started this process, where it sits in its job, and which batch job it runs in: read from
the launchers' variables.

The one reader of every launcher's environment (the ground floor: the probe, the observer, the
launcher, the torch backend, ``cudampi.init()`` and the benchmarks all ask it). Pure: it reads a
mapping (``os.environ``), so every launcher's variables are tested without that launcher. Which
variable means what is a table in :mod:`cudampi.names` (:data:`~cudampi.names.RANK_VARS` for the
processes a launcher starts, :data:`~cudampi.names.JOB_VARS` for a batch system's jobs); the
launchers and their order are :data:`cudampi.names.LAUNCHERS`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cudampi.errors import LaunchError
from cudampi.names import (
    JOB_SYSTEMS,
    JOB_VARS,
    LAUNCHER_LABELS,
    LAUNCHERS,
    MPI_LAUNCHERS,
    RANK_VARS,
)


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
        v = RANK_VARS[name]
        if not all(k in env for k in v.needs):
            continue
        if v.needs_int and _int(env, v.needs_int, strict) is None:
            continue
        rank = _int(env, (v.rank,), strict)
        if rank is None:
            continue
        node = _int(env, v.node_rank, strict)
        local_size = _int(env, v.local_size, strict)
        if v.tasks_per_node:
            local_size = _local_size(env, v.tasks_per_node, node, strict)
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


def dies_with_launcher(launcher: str) -> bool:
    """Is a process that ``launcher`` started the child of the launcher's own daemon, so that
    it may ask to die with it (see :attr:`cudampi.names.RankVars.daemon`)?"""
    v = RANK_VARS.get(launcher)
    return v is not None and v.daemon


def forms_mpi_job(launcher: str) -> bool:
    """Do the processes ``launcher`` started always form one MPI job (so rank 0's address can
    be broadcast over MPI)?"""
    v = RANK_VARS.get(launcher)
    return v is not None and v.mpi_job


def rank_nodelist(env: Mapping[str, str], launcher: str) -> str | None:
    """The node list of this process's own job as ``launcher``'s variables give it (Slurm's
    compressed form: the step's nodes), or None."""
    v = RANK_VARS.get(launcher)
    return _first(env, v.nodes) if v is not None else None


def job_key(env: Mapping[str, str]) -> str:
    """The values of every launcher's job-naming variables, in one string: the ranks of one job
    see the same one (a port they agree on without talking is derived from it)."""
    names = [k for n in LAUNCHERS if n in RANK_VARS for k in RANK_VARS[n].job_key]
    return "|".join(env.get(k, "") for k in names)


@dataclass(frozen=True)
class RankEnv:
    """This process's place in its job, every number known (see :func:`rank_env`)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    """torchrun, openmpi, mpich, slurm, lsf, env (RANK/WORLD_SIZE given) or none (plain
    python)."""
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


@dataclass(frozen=True)
class JobEnv:
    """The batch job this process runs in, as its system's variables give it (raw values: the
    system's launcher family in :mod:`cudampi.launch.launchers` reads the files and lists)."""

    system: str
    """One of :data:`cudampi.names.JOB_SYSTEMS`."""
    job_id: str
    nodes: str | None = None
    """The node list (Slurm's compressed form)."""
    nodefile: str | None = None
    """The path of a file naming one host per line, once per slot."""
    host_counts: str | None = None
    """``host count host count ...``."""
    tasks: int | None = None
    tasks_from: str | None = None
    """The variable that gave ``tasks``."""
    node_count: int | None = None
    evidence: tuple[str, ...] = ()
    """The variables that gave the values above."""

    @property
    def label(self) -> str:
        return LAUNCHER_LABELS[self.system]


def job_env(env: Mapping[str, str], among: Sequence[str] = JOB_SYSTEMS) -> JobEnv | None:
    """The job of the first batch system of ``among`` (in :data:`~cudampi.names.JOB_SYSTEMS`
    order) whose job id ``env`` holds; None outside every batch job."""
    for system in (s for s in JOB_SYSTEMS if s in among):
        v = JOB_VARS[system]
        job_id = _first(env, v.job_id)
        if not job_id:
            continue
        fields = (v.job_id, v.nodes, v.nodefile, v.host_counts, v.tasks, v.node_count)
        return JobEnv(
            system,
            job_id,
            _first(env, v.nodes),
            _first(env, v.nodefile),
            _first(env, v.host_counts),
            _int(env, v.tasks, strict=False),
            _set_name(env, v.tasks),
            _int(env, v.node_count, strict=False),
            tuple(n for n in (_set_name(env, names) for names in fields) if n is not None),
        )
    return None


def job_node_count(env: Mapping[str, str]) -> int | None:
    """The node count a batch system's variables give (of the first system that gives one),
    whether or not its job id is set; None where none does."""
    for system in JOB_SYSTEMS:
        count = _int(env, JOB_VARS[system].node_count, strict=False)
        if count is not None:
            return count
    return None


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


def _local_size(
    env: Mapping[str, str], names: Sequence[str], node: int | None, strict: bool
) -> int | None:
    per_node = _first(env, names)
    if not per_node or node is None:
        return None
    try:
        counts = parse_tasks_per_node(per_node)
    except ValueError:
        if strict:
            raise
        return None
    return counts[node] if node < len(counts) else None


def _first(env: Mapping[str, str], names: Sequence[str]) -> str | None:
    """The value of the first of ``names`` that is set and not empty."""
    name = _set_name(env, names)
    return env[name] if name is not None else None


def _set_name(env: Mapping[str, str], names: Sequence[str]) -> str | None:
    return next((n for n in names if env.get(n)), None)


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
