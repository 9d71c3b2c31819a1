"""What a runtime probe proved about one MPI stack, cached so communicators can choose a path.

`cudampi doctor` runs the probes (in child processes) and saves a :class:`Capabilities` under a
key that names the stack: the MPI library's version string plus the environment settings that
change what it can do with device memory (a preloaded UCX, ``--mca pml ucx``, UCX_TLS, ...).
A :class:`~cudampi.comm.Communicator` computes the same key in-rank and reads the entry; with no
entry it assumes nothing is CUDA-aware (the safe, staged choice) and says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STACK_ENV = (
    "LD_PRELOAD",
    "OMPI_MCA_pml",
    "OMPI_MCA_btl",
    "OMPI_MCA_osc",
    "OMPI_MCA_coll",
    "OMPI_MCA_opal_cuda_support",
    "UCX_TLS",
    "UCX_MODULE_DIR",
    "UCX_MEMTYPE_CACHE",
    "MPIR_CVAR_ENABLE_GPU",
    "MPIR_CVAR_CH4_NETMOD",
    "MPICH_GPU_SUPPORT_ENABLED",
)
"""Environment variables that change whether an MPI library handles device memory."""

OUTCOMES = ("ok", "wrong", "crash", "error", "timeout", "skipped")
"""ok: ran and gave correct data; wrong: ran, data wrong; crash: killed by a signal (a segfault);
error: a clean MPI error or non-zero exit; timeout: hung; skipped: not run (no GPU, no CuPy...)."""


@dataclass(frozen=True)
class ProbeOutcome:
    """The result of one probe run in a child process."""

    status: str
    detail: str = ""
    gbps: float | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def __post_init__(self) -> None:
        if self.status not in OUTCOMES:
            raise ValueError(f"probe status must be one of {OUTCOMES}, got {self.status!r}")


SKIPPED = ProbeOutcome("skipped", "not probed")


@dataclass(frozen=True)
class Capabilities:
    """Proven abilities of one MPI stack (see :func:`stack_key`)."""

    key: str
    mpi_library: str
    device_p2p: ProbeOutcome = SKIPPED
    device_allreduce: ProbeOutcome = SKIPPED
    host_staged: ProbeOutcome = SKIPPED
    host_copy_gbps: float | None = None
    """Measured pinned host<->device copy rate; device p2p at or below it means silent staging."""
    silent_staging: bool | None = None
    gpu: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    probed_at: float = field(default_factory=time.time)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Capabilities:
        kw = dict(data)
        for name in ("device_p2p", "device_allreduce", "host_staged"):
            if isinstance(kw.get(name), Mapping):
                kw[name] = ProbeOutcome(**kw[name])
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in kw.items() if k in known})


def stack_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """The subset of ``env`` that :func:`stack_key` depends on."""
    env = os.environ if env is None else env
    out = {}
    for k in STACK_ENV:
        value = env.get(k)
        if not value:
            continue
        if k == "LD_PRELOAD":
            # Launchers repeat entries; order matters only for the first occurrence.
            parts = [p for p in value.replace(" ", ":").split(":") if p]
            value = ":".join(dict.fromkeys(parts))
        out[k] = value
    return out


def stack_key(mpi_library: str, env: Mapping[str, str] | None = None) -> str:
    """A stable name for an MPI stack: its library version line plus device-relevant settings."""
    first = mpi_library.strip().splitlines()[0].strip() if mpi_library.strip() else "unknown"
    payload = json.dumps({"lib": first, "env": stack_env(env)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_file(cache_dir: str | os.PathLike[str]) -> Path:
    return Path(cache_dir) / "capabilities.json"


def load_all(cache_dir: str | os.PathLike[str]) -> dict[str, Capabilities]:
    """Every cached entry; a missing or unreadable cache is empty (never an exception)."""
    path = cache_file(cache_dir)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    out: dict[str, Capabilities] = {}
    if isinstance(raw, dict):
        for key, value in raw.items():
            try:
                out[key] = Capabilities.from_json(value)
            except (TypeError, ValueError):
                continue
    return out


def load(cache_dir: str | os.PathLike[str], key: str) -> Capabilities | None:
    return load_all(cache_dir).get(key)


def save(cache_dir: str | os.PathLike[str], caps: Capabilities) -> Path:
    """Add or replace ``caps`` in the cache, atomically (write then rename)."""
    path = cache_file(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    entries = {k: v.to_json() for k, v in load_all(cache_dir).items()}
    entries[caps.key] = caps.to_json()
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
    tmp.replace(path)
    return path
