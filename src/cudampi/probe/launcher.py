"""The launch environment of this process, as the doctor reports it: which launcher started it
(:mod:`cudampi.rankenv`), the GPUs it may use, its network interfaces
(:mod:`cudampi.probe.interfaces`) and the MPI / UCX / NCCL settings it was given (judged by
:mod:`cudampi.env.settings`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from cudampi.probe.interfaces import Interface, query_interfaces
from cudampi.rankenv import LauncherInfo, launched_by


@dataclass(frozen=True)
class LauncherEnv:
    """Everything :mod:`cudampi.doctor` needs about the launch environment."""

    launcher: LauncherInfo
    cuda_visible_devices: str | None
    interfaces: tuple[Interface, ...] = ()
    settings: dict[str, str] = field(default_factory=dict)
    """Every OMPI_MCA_*, UCX_*, NCCL_*, MPIR_CVAR_*, PRTE_MCA_* variable set."""


SETTING_PREFIXES = ("OMPI_MCA_", "UCX_", "NCCL_", "MPIR_CVAR_", "PRTE_MCA_", "MPICH_", "FI_")


def query_launcher_env(env: Mapping[str, str] | None = None) -> LauncherEnv:
    env = os.environ if env is None else env
    return LauncherEnv(
        launched_by(env),
        env.get("CUDA_VISIBLE_DEVICES"),
        tuple(query_interfaces()),
        {k: v for k, v in sorted(env.items()) if k.startswith(SETTING_PREFIXES)},
    )
