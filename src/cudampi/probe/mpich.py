"""MPICH's ``mpichversion``: version, devices and whether GPU support was configured in."""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cudampi.errors import ProbeError


@dataclass(frozen=True)
class MpichInfo:
    """The facts of one MPICH build."""

    version: str | None = None
    device: str | None = None
    configure: str | None = None
    features: tuple[str, ...] = ()
    custom: str | None = None

    @property
    def netmods(self) -> tuple[str, ...]:
        """``("ucx", "ofi")`` for ``ch4:ucx ofi``."""
        if not self.device or ":" not in self.device:
            return ()
        return tuple(self.device.split(":", 1)[1].replace(",", " ").split())

    @property
    def gpu_support(self) -> bool | None:
        """True when configured with CUDA (``--with-cuda``), False when configured without (or
        with no GPU runtime at all), None when the configure line is unknown."""
        if self.configure is None:
            return None
        if re.search(r"--with-cuda(?:=(?!no\b)\S+)?(?=\s|$)", self.configure):
            return True
        if re.search(r"--with-(?:ze|hip)(?:=(?!no\b)\S+)?(?=\s|$)", self.configure):
            return False  # a GPU build, but not for NVIDIA
        return False


def parse_mpichversion(text: str) -> MpichInfo:
    """Parse ``mpichversion`` output (``MPICH Version:  5.0.2`` ... lines)."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        head, sep, tail = line.partition(":")
        if sep and head.startswith("MPICH "):
            values.setdefault(head[len("MPICH ") :].strip().lower(), tail.strip())
    features = values.get("features", "")
    return MpichInfo(
        version=values.get("version") or None,
        device=values.get("device") or None,
        configure=values.get("configure"),
        features=tuple(features.split()),
        custom=values.get("custom information") or None,
    )


def query_mpichversion(mpichversion: str | Path, timeout: float = 30.0) -> MpichInfo:
    """Run one installation's ``mpichversion`` and parse it."""
    argv = [str(mpichversion)]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ProbeError(f"could not run {argv!r}: {exc}") from None
    if proc.returncode != 0:
        raise ProbeError(f"{argv!r} exited {proc.returncode}: {proc.stderr.strip()[-500:]!r}")
    return parse_mpichversion(proc.stdout)
