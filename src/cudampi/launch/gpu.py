"""In-rank GPU choice and CPU binding, done before CUDA initializes (no CUDA call here).

The rank's GPU is ``LOCAL_RANK % GPUs`` among the GPUs it may use (CUDA_VISIBLE_DEVICES, else
every GPU NVML lists, in PCI order: CUDA_DEVICE_ORDER=PCI_BUS_ID is set so CUDA's numbering
matches NVML's and nvidia-smi's). Its CPUs are the cores NVML gives as the GPU's affinity (its
NUMA node's), intersected with what the rank was allowed to use.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from cudampi.errors import ConfigError
from cudampi.launch.detect import query_gpus
from cudampi.launch.plan import GPU_BINDS
from cudampi.probe.nvml import GpuInfo


@dataclass(frozen=True)
class GpuChoice:
    device: int | None
    """CUDA ordinal the rank should use (in the process's own numbering), None: no GPU."""
    physical: str | None
    """The entry of the GPU list it came from (an index or a UUID), for messages."""
    bus_id: str | None
    visible: str | None
    """New CUDA_VISIBLE_DEVICES, or None to leave it alone."""


def visible_list(value: str | None) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES as a list (None when unset; [] when it hides every GPU)."""
    if value is None:
        return None
    items = [v.strip() for v in value.split(",")]
    out = []
    for v in items:
        if not v or v.startswith("-"):
            break  # CUDA stops at the first invalid entry
        out.append(v)
    return out


def choose_gpu(
    local_rank: int,
    mode: str,
    cuda_visible: str | None,
    gpus: Sequence[tuple[int, str]],
) -> GpuChoice:
    """Pure: which GPU ``local_rank`` gets under ``mode`` (local, visible or none)."""
    if mode not in GPU_BINDS:
        raise ConfigError(f"CUDAMPI_BIND_GPU={mode!r}: expected one of {', '.join(GPU_BINDS)}")
    listed = visible_list(cuda_visible)
    pool = [str(i) for i, _ in gpus] if listed is None else listed
    if mode == "none" or not pool:
        return GpuChoice(None, None, None, None)
    pos = local_rank % len(pool)
    entry = pool[pos]
    bus = dict((str(i), b) for i, b in gpus).get(entry)
    if mode == "visible":
        return GpuChoice(0, entry, bus, entry)
    return GpuChoice(pos, entry, bus, None)


def bind_cpus(cpus: set[int]) -> set[int] | None:
    """Bind this process to ``cpus`` ∩ its current set; the new set, or None if unchanged."""
    current = os.sched_getaffinity(0)
    target = cpus & current
    if not target or target == current:
        return None
    os.sched_setaffinity(0, target)
    return target


def select_in_rank(
    local_rank: int, env: MutableMapping[str, str], gpus: Sequence[GpuInfo] | None = None
) -> GpuChoice:
    """Apply CUDAMPI_BIND_GPU / CUDAMPI_BIND_CPU to this process's environment and affinity.

    Sets CUDA_DEVICE_ORDER=PCI_BUS_ID (if unset), CUDA_VISIBLE_DEVICES (visible mode) and
    CUDAMPI_DEVICE (the ordinal cudampi.init() selects). Must run before CUDA initializes.
    """
    mode = env.get("CUDAMPI_BIND_GPU", "local")
    if gpus is None:
        gpus = query_gpus() if mode != "none" else []
    choice = choose_gpu(
        local_rank, mode, env.get("CUDA_VISIBLE_DEVICES"), [(g.index, g.bus_id) for g in gpus]
    )
    if choice.device is None:
        return choice
    env.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    if choice.visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = choice.visible
    env["CUDAMPI_DEVICE"] = str(choice.device)
    if env.get("CUDAMPI_BIND_CPU", "gpu") == "gpu" and choice.bus_id:
        bind_cpus(set(next((g.cpus for g in gpus if g.bus_id == choice.bus_id), ())))
    return choice


def device_hint(env: Mapping[str, str]) -> int | None:
    raw = env.get("CUDAMPI_DEVICE")
    return int(raw) if raw and raw.lstrip("-").isdigit() and int(raw) >= 0 else None
