"""What a runtime probe proved about one MPI stack, cached so communicators can choose a path.

`cudampi doctor` runs the probes (in child processes) and saves a :class:`Capabilities` under a
key that names the stack: the MPI library's version string plus the environment settings that
change what it can do with device memory (a preloaded UCX, ``--mca pml ucx``, UCX_TLS, ...).
A :class:`~cudampi.comm.Communicator` computes the same key in-rank and reads the entry
(:func:`lookup`); with no entry it assumes nothing is CUDA-aware (the safe, staged choice) and
says so. An entry is believed only if it passes :func:`validate`: the schema, then the same MPI
library, settings and host, and for a claim of device support a GPU of the probed model visible
here. A hand-edited, stale or copied file never hands a device pointer to an MPI.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import socket
import time
from collections.abc import Callable, Mapping
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
    """Proven abilities of one MPI stack (see :func:`stack_key`) on one host."""

    key: str
    mpi_library: str
    device_p2p: ProbeOutcome = SKIPPED
    device_allreduce: ProbeOutcome = SKIPPED
    host_staged: ProbeOutcome = SKIPPED
    device_ipc: ProbeOutcome = SKIPPED
    """cudampi's ipc engine (GPU kernels over CUDA IPC; no MPI on device memory)."""
    ipc_latency_us: float | None = None
    """The ipc engine's 4 KiB allreduce, stream-ordered calls back to back."""
    ipc_shared_gpu: bool | None = None
    """Did the probe's ranks share one GPU? (Then ipc pays off only under MPS.)"""
    device_nccl: ProbeOutcome = SKIPPED
    """cudampi's nccl engine (NCCL bootstrapped over MPI; a GPU per rank), its ``gbps`` at the
    probe's size."""
    nccl_latency_us: float | None = None
    """The nccl engine's 4 KiB allreduce, measured as ``ipc_latency_us`` is."""
    ipc_mps: bool | None = None
    """Was the CUDA MPS daemon serving the probe's ranks? (``ipc_latency_us`` is of that
    setting: ranks sharing a GPU without MPS wait a time slice a call.)"""
    host_copy_gbps: float | None = None
    """Measured pinned host<->device copy rate; device p2p at or below it means silent staging."""
    silent_staging: bool | None = None
    gpu: str | None = None
    """The model of the GPU the device probes ran on (``NVIDIA H200``)."""
    host: str = ""
    """The host the probes ran on: an entry speaks for that host only."""
    env: dict[str, str] = field(default_factory=dict)
    probed_at: float = field(default_factory=time.time)

    @property
    def claims_device(self) -> bool:
        """Does this entry say MPI may be given device memory (for any call)?"""
        return self.device_p2p.ok or self.device_allreduce.ok

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Any) -> Capabilities:
        """An entry as saved by :func:`save`; ``ValueError`` naming the first field of the wrong
        type or value (a hand-edited or corrupted file must not reach the path choice)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"an entry must be an object, got {type(data).__name__}")
        kw: dict[str, Any] = {}
        for name, kinds in _SCHEMA.items():
            if name not in data:
                if name in ("key", "mpi_library"):
                    raise ValueError(f"{name!r} is missing")
                continue
            value: Any = data[name]
            if name in _OUTCOME_FIELDS:
                kw[name] = _outcome(name, value)
                continue
            if name == "env":
                if not isinstance(value, Mapping) or not all(
                    isinstance(k, str) and isinstance(v, str) for k, v in value.items()
                ):
                    raise ValueError(f"'env' must map names to strings, got {value!r}")
                kw[name] = dict(value)
                continue
            if not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds):
                want = " or ".join("null" if k is type(None) else k.__name__ for k in kinds)
                raise ValueError(f"{name!r} must be {want}, got {value!r}")
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{name!r} must be finite, got {value!r}")
            kw[name] = value
        return cls(**kw)


_NUMBER = (int, float, type(None))
_OUTCOME_FIELDS = ("device_p2p", "device_allreduce", "host_staged", "device_ipc", "device_nccl")
_SCHEMA: dict[str, tuple[type, ...]] = {
    "key": (str,),
    "mpi_library": (str,),
    "device_p2p": (),
    "device_allreduce": (),
    "host_staged": (),
    "device_ipc": (),
    "ipc_latency_us": _NUMBER,
    "ipc_shared_gpu": (bool, type(None)),
    "ipc_mps": (bool, type(None)),
    "device_nccl": (),
    "nccl_latency_us": _NUMBER,
    "host_copy_gbps": _NUMBER,
    "silent_staging": (bool, type(None)),
    "gpu": (str, type(None)),
    "host": (str,),
    "env": (dict,),
    "probed_at": (int, float),
}
"""The type(s) of each field of a saved entry (the outcomes are checked by :func:`_outcome`)."""


def _outcome(name: str, value: Any) -> ProbeOutcome:
    if not isinstance(value, Mapping):
        raise ValueError(f"{name!r} must be an object with a status, got {value!r}")
    status, detail, gbps = value.get("status"), value.get("detail", ""), value.get("gbps")
    if status not in OUTCOMES:
        raise ValueError(f"{name}.status must be one of {', '.join(OUTCOMES)}, got {status!r}")
    if not isinstance(detail, str):
        raise ValueError(f"{name}.detail must be a string, got {detail!r}")
    if gbps is not None and (
        isinstance(gbps, bool) or not isinstance(gbps, (int, float)) or not math.isfinite(gbps)
    ):
        raise ValueError(f"{name}.gbps must be a finite number or null, got {gbps!r}")
    return ProbeOutcome(status, detail, gbps)


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
    payload = json.dumps({"lib": _first_line(mpi_library), "env": stack_env(env)}, sort_keys=True)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def cache_file(cache_dir: str | os.PathLike[str]) -> Path:
    return Path(cache_dir) / "capabilities.json"


def entry_name(key: str, host: str) -> str:
    """Where an entry lives in the cache file: its stack key on its host (one cache folder may
    be shared by several hosts, e.g. a home directory on NFS)."""
    return f"{key}@{host}"


def load_all(cache_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Every entry of the cache file as saved (raw JSON objects by :func:`entry_name`); a
    missing or unreadable cache is empty (never an exception)."""
    path = cache_file(cache_dir)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return dict(raw) if isinstance(raw, dict) else {}


@dataclass(frozen=True)
class Lookup:
    """The cache entry for this stack on this host, or why there is none to believe."""

    entry: Capabilities | None
    note: str = ""
    """Why ``entry`` is None: nothing was probed, or an entry was found and ignored."""
    ignored: bool = False
    """An entry was there but failed validation (say so: someone believes it was probed)."""


def validate(
    data: Any,
    *,
    key: str,
    library: str,
    env: Mapping[str, str],
    host: str,
    gpus: Callable[[], tuple[str, ...] | None],
) -> Capabilities:
    """The entry ``data`` as :class:`Capabilities` if it describes this very stack: the schema
    (:meth:`Capabilities.from_json`), then its key, MPI library, settings and host; and if it
    claims device support, a GPU of its model must be visible here (``gpus()``: the models the
    driver shows, None if it shows none). ``ValueError`` with the reason otherwise."""
    caps = Capabilities.from_json(data)
    first = _first_line(library)
    if caps.key != key:
        raise ValueError(f"it is filed under key {key!r} but names key {caps.key!r}")
    if _first_line(caps.mpi_library) != first:
        raise ValueError(
            f"it was probed with {_first_line(caps.mpi_library)!r}, but mpi4py loads {first!r}"
        )
    if caps.env != stack_env(env):
        raise ValueError(
            f"it was probed with settings {caps.env}, this process has {stack_env(env)}"
        )
    if caps.host != host:
        raise ValueError(f"it was probed on host {caps.host!r}, this is {host!r}")
    if caps.claims_device:
        seen = gpus()
        if not caps.gpu:
            raise ValueError("it claims device support but names no GPU")
        if not seen:
            raise ValueError(
                f"it claims device support on a {caps.gpu}, but the NVIDIA driver shows no GPU "
                "here (/proc/driver/nvidia/gpus)"
            )
        if _norm(caps.gpu) not in {_norm(g) for g in seen}:
            raise ValueError(
                f"it claims device support on a {caps.gpu}, but this host has {', '.join(seen)}"
            )
    return caps


def lookup(
    cache_dir: str | os.PathLike[str],
    library: str,
    env: Mapping[str, str] | None = None,
    *,
    host: str | None = None,
    gpus: Callable[[], tuple[str, ...] | None] | None = None,
) -> Lookup:
    """The validated entry for the stack of ``library`` (``MPI.Get_library_version()``) and
    ``env`` on ``host`` (default: this one). An entry that fails :func:`validate` is ignored:
    cudampi then assumes nothing is CUDA-aware, and ``note`` says why."""
    env = os.environ if env is None else env
    host = socket.gethostname() if host is None else host
    if gpus is None:
        from cudampi.probe.gpu import driver_gpus

        gpus = driver_gpus
    key = stack_key(library, env)
    name = entry_name(key, host)
    raw = load_all(cache_dir).get(name)
    if raw is None:
        return Lookup(
            None, "no probe result for this MPI stack on this host (run `cudampi doctor`)"
        )
    try:
        return Lookup(validate(raw, key=key, library=library, env=env, host=host, gpus=gpus))
    except (TypeError, ValueError) as exc:
        return Lookup(
            None,
            f"the cached probe entry {name!r} in {cache_file(cache_dir)} was ignored: {exc}. "
            "Run `cudampi doctor` on this host (with the job's settings) to probe again",
            ignored=True,
        )


def save(cache_dir: str | os.PathLike[str], caps: Capabilities) -> Path:
    """Add or replace ``caps`` (under its key on its host) in the cache, atomically (write then
    rename), under an exclusive lock of the folder's ``capabilities.lock``: hosts sharing the
    folder (a home on NFS, ``cudampi doctor --hosts``) save at once without losing each other's
    entries. ``OSError`` if the folder cannot be made or written."""
    import fcntl

    path = cache_file(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        entries = load_all(cache_dir)
        entries[entry_name(caps.key, caps.host)] = caps.to_json()
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(entries, indent=2, sort_keys=True))
        tmp.replace(path)
    return path


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else "unknown"


def _norm(name: str) -> str:
    return " ".join(name.split()).lower()
