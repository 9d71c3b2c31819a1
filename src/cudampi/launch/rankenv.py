"""Who am I? Rank, world size, local rank and local size from whatever started this process.

Pure: :func:`rank_env` reads a mapping (``os.environ``), so every launcher's variables are tested
without that launcher. Order: torchrun (its workers also inherit the variables of an outer
launcher), Open MPI, MPICH/Intel MPI Hydra (PMI_*), a Slurm job step, plain RANK/WORLD_SIZE,
else a single process.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from cudampi.errors import LaunchError


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    launcher: str
    """torchrun, openmpi, mpich, slurm, env (RANK/WORLD_SIZE given) or none (plain python)."""
    node_rank: int | None = None


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


def _int(env: Mapping[str, str], *names: str) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise LaunchError(
                f"{name}={raw!r} is not an integer; the launcher or the job script set it wrong"
            ) from None
    return None


def rank_env(env: Mapping[str, str]) -> RankEnv:
    """Rank, size, local rank/size and launcher from ``env`` (see the module doc for order)."""
    if env.get("TORCHELASTIC_RUN_ID") is not None and _int(env, "RANK") is not None:
        return _checked(
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK"),
            _int(env, "LOCAL_WORLD_SIZE"),
            "torchrun",
            _int(env, "GROUP_RANK"),
        )
    if _int(env, "OMPI_COMM_WORLD_RANK") is not None:
        return _checked(
            _int(env, "OMPI_COMM_WORLD_RANK"),
            _int(env, "OMPI_COMM_WORLD_SIZE"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
            _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE"),
            "openmpi",
            None,
        )
    if _int(env, "PMI_RANK") is not None:
        return _checked(
            _int(env, "PMI_RANK"),
            _int(env, "PMI_SIZE"),
            _int(env, "MPI_LOCALRANKID"),
            _int(env, "MPI_LOCALNRANKS"),
            "mpich",
            None,
        )
    if (
        _int(env, "SLURM_STEP_ID", "SLURM_STEPID") is not None
        and _int(env, "SLURM_PROCID") is not None
    ):
        size = _int(env, "SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
        node = _int(env, "SLURM_NODEID")
        local_size = None
        per_node = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if per_node and node is not None:
            counts = parse_tasks_per_node(per_node)
            if node < len(counts):
                local_size = counts[node]
        return _checked(
            _int(env, "SLURM_PROCID"), size, _int(env, "SLURM_LOCALID"), local_size, "slurm", node
        )
    if _int(env, "RANK") is not None and _int(env, "WORLD_SIZE") is not None:
        return _checked(
            _int(env, "RANK"),
            _int(env, "WORLD_SIZE"),
            _int(env, "LOCAL_RANK"),
            _int(env, "LOCAL_WORLD_SIZE"),
            "env",
            _int(env, "GROUP_RANK", "NODE_RANK"),
        )
    return RankEnv(0, 1, 0, 1, "none", 0)


def _checked(
    rank: int | None,
    size: int | None,
    local_rank: int | None,
    local_size: int | None,
    launcher: str,
    node_rank: int | None,
) -> RankEnv:
    assert rank is not None
    if size is None:
        raise LaunchError(f"{launcher} gave this process rank {rank} but no world size")
    if local_rank is None:
        # Without a local rank every process is alone on its node: the safe reading.
        local_rank, local_size = 0, local_size or 1
    if local_size is None:
        local_size = local_rank + 1
    if not (0 <= rank < size) or not (0 <= local_rank < local_size):
        raise LaunchError(
            f"{launcher} says rank {rank} of {size}, local rank {local_rank} of {local_size}: "
            f"inconsistent; check the launcher's environment (an outer launcher's variables "
            f"leaking into this one?)"
        )
    return RankEnv(rank, size, local_rank, local_size, launcher, node_rank)
