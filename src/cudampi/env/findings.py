"""The records of the settings judge (:mod:`cudampi.env.settings`): what a rule finds, and what
it may know beyond the environment."""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

from cudampi.probe.interfaces import Interface


@dataclass(frozen=True)
class SettingFinding:
    """A setting in the environment that is wrong for a GPU job, and how to fix it."""

    name: str
    value: str
    status: str
    """'warn' or 'fail'."""
    detail: str
    fix: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.status not in ("warn", "fail"):
            raise ValueError(f"finding status must be 'warn' or 'fail', got {self.status!r}")


@dataclass(frozen=True)
class Facts:
    """What a rule may know beyond the environment (see :func:`check_settings`)."""

    gpus: bool
    multi_node: bool | None
    ompi_major: int | None
    btl_components: Collection[str] | None
    built_with_cuda: bool | None
    interfaces: Sequence[Interface] | None = None

    @property
    def breaks(self) -> str:
        """The status of a setting that takes CUDA away: fail where GPUs are, else warn."""
        return "fail" if self.gpus else "warn"
