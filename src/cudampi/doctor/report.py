"""The doctor's result: a list of checks, each ``name · status · detail · fix``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

STATUSES = ("ok", "warn", "fail", "n/a")
"""ok: works; warn: works but weaker than it could be (or not proven); fail: broken, the exit
code is 1; n/a: does not apply here (no GPU, not under a launcher...)."""

MPI, CUDA, GPU, LAUNCH = "MPI", "CUDA-awareness", "GPU", "launcher"
"""The report's sections, one module of checks each (``doctor/checks_<section>.py``)."""


@dataclass(frozen=True)
class Check:
    """One row of the report. ``fix`` is a concrete command or change ("" when ok)."""

    name: str
    status: str
    detail: str
    fix: str = ""
    section: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"check status must be one of {STATUSES}, got {self.status!r}")

    def to_json(self) -> dict[str, str]:
        return {
            "name": self.name,
            "section": self.section,
            "status": self.status,
            "detail": self.detail,
            "fix": self.fix,
        }


@dataclass(frozen=True)
class Report:
    """Every check of one doctor run, plus the probed data they came from (for ``--json``)."""

    checks: tuple[Check, ...]
    data: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def of(cls, checks: Iterable[Check], data: dict[str, Any] | None = None) -> Report:
        return cls(tuple(checks), dict(data or {}))

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(1 for c in self.checks if c.status == s) for s in STATUSES}

    @property
    def failed(self) -> bool:
        return any(c.status == "fail" for c in self.checks)

    @property
    def exit_code(self) -> int:
        """1 if any check failed, else 0 (a warning does not fail)."""
        return 1 if self.failed else 0

    def get(self, name: str) -> Check:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(f"no check named {name!r}; the checks are {[c.name for c in self.checks]}")
