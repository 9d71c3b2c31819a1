"""What a runtime probe proved about one MPI stack, cached so communicators can choose a path.

`cudampi doctor` runs the probes (in child processes) and saves a :class:`Capabilities` under a
key that names the stack: the MPI library's version string plus the environment settings that
change what it can do with device memory (a preloaded UCX, ``--mca pml ucx``, UCX_TLS, ...).
A :class:`~cudampi.comm.Communicator` computes the same key in-rank and reads the entry
(:func:`lookup`); with no entry it assumes nothing is CUDA-aware (the safe, staged choice) and
says so. An entry is believed only if it passes :func:`validate`: the schema, then the same MPI
library, settings and host, and for a claim of device support a GPU of the probed model visible
here. A hand-edited, stale or copied file never hands a device pointer to an MPI.

The cache itself is checked before it is read or written (:func:`trust_problem`): a corrupt
file, a folder or file another user could have written, or a folder reached through a symlink
into a system folder is named with the fix and ignored (never an exception in a rank); the
doctor refuses to write there. Saves hold a lock for their read-modify-write, so doctors
saving at once keep each other's entries, and replace the file atomically.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import socket
import stat
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudampi.atomic import why, write_text

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


MAX_CACHE_BYTES = 16 << 20
"""A cache file larger than this is not read (an entry is about 1.5 KiB)."""


class CacheProblem(ValueError):
    """The cache folder or file cannot be believed: corrupt, or writable by someone else. The
    message names the path, what is wrong and the fix."""


class UnsafeCacheError(PermissionError):
    """The cache folder or file is not safe to write: the doctor reports it instead of saving."""


def read_entries(path: Path) -> dict[str, Any]:
    """Every entry of the cache file ``path`` as saved (raw JSON objects by
    :func:`entry_name`); empty when there is none. :class:`CacheProblem` naming the path and
    what is wrong when it cannot be read or is not the JSON object cudampi writes."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CACHE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as exc:
        raise CacheProblem(f"{path} cannot be read: {why(exc)}") from None
    if len(raw) > MAX_CACHE_BYTES:
        raise CacheProblem(f"{path} is over {MAX_CACHE_BYTES >> 20} MiB: not a cache cudampi wrote")
    try:
        data = json.loads(raw)
    except RecursionError:
        raise CacheProblem(
            f"{path} is not a cache cudampi wrote: its JSON nests too deeply"
        ) from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
        raise CacheProblem(f"{path} is not valid JSON (truncated or corrupted?): {exc}") from None
    if not isinstance(data, dict):
        raise CacheProblem(
            f"{path} holds a JSON {type(data).__name__}, not the object of entries cudampi writes"
        )
    return data


SYSTEM_FOLDERS = tuple(
    Path(p) for p in ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32",
                      "/proc", "/sbin", "/sys", "/usr")
)  # fmt: skip
"""Folders of the operating system (and ``/`` itself): a cache folder reached through a
symlink into one of them is refused (a planted link must not make the doctor, run as root,
write into /etc)."""


def _system_folder(real: Path) -> bool:
    return real == Path("/") or any(real == s or s in real.parents for s in SYSTEM_FOLDERS)


_WRITABLE_BY_OTHERS = stat.S_IWGRP | stat.S_IWOTH


def _owner_problem(path: Path, st: os.stat_result, what: str) -> str:
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return (
            f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me}): another user "
            "could have written what it says"
        )
    if st.st_mode & _WRITABLE_BY_OTHERS and not (
        stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX
    ):
        return (
            f"{what} {path} can be written by other users (mode {stat.S_IMODE(st.st_mode):04o}"
            f"{'' if stat.S_ISREG(st.st_mode) else ', no sticky bit'}): anyone could plant an "
            f"entry; `chmod go-w {path}` makes it yours alone"
        )
    return ""


def trust_problem(cache_dir: str | os.PathLike[str]) -> str:
    """Why the cache folder ``cache_dir`` (or its file) must not be believed or written, or
    ``""``: reached through a symlink into a system folder (:data:`SYSTEM_FOLDERS`); a folder
    or file owned by another user (root's are fine), or writable by group or others (a folder
    with the sticky bit, like /tmp, is fine: nobody can replace a file of yours in it); a
    cache file that is a symlink. A folder that does not exist yet is no problem."""
    folder = Path(os.path.abspath(os.path.expanduser(cache_dir)))
    real = Path(os.path.realpath(folder))
    if real != folder and _system_folder(real):
        return (
            f"the cache folder {folder} leads to the system folder {real} through a symlink; "
            "cudampi writes no cache there. Remove the link, or set CUDAMPI_CACHE_DIR to a "
            "folder of yours"
        )
    fix = "; or set CUDAMPI_CACHE_DIR (the doctor: --cache-dir) to a folder of yours"
    try:
        st = os.stat(real)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"the cache folder {folder} cannot be inspected: {why(exc)}"
    problem = _owner_problem(folder, st, "the cache folder")
    if problem:
        return problem + fix
    path = cache_file(real)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return ""
    except OSError as exc:
        return f"the cache file {path} cannot be inspected: {why(exc)}"
    if stat.S_ISLNK(st.st_mode):
        return f"the cache file {path} is a symlink, which cudampi never writes: remove it{fix}"
    if not stat.S_ISREG(st.st_mode):
        return f"the cache file {path} is not a regular file: remove it{fix}"
    problem = _owner_problem(path, st, "the cache file")
    return problem + fix if problem else ""


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
    unread = "the capabilities cache was not read: {}. Until it is, cudampi assumes nothing is "
    problem = trust_problem(cache_dir)
    if problem:
        return Lookup(None, unread.format(problem) + "CUDA-aware", ignored=True)
    try:
        entries = read_entries(cache_file(cache_dir))
        raw = entries.get(name)
    except CacheProblem as exc:
        return Lookup(
            None,
            unread.format(exc) + "CUDA-aware; `cudampi doctor` on this host replaces the file "
            "(or remove it)",
            ignored=True,
        )
    if raw is None:
        return Lookup(None, _no_entry(entries, library, env, host))
    try:
        return Lookup(validate(raw, key=key, library=library, env=env, host=host, gpus=gpus))
    except (TypeError, ValueError) as exc:
        return Lookup(
            None,
            f"the cached probe entry {name!r} in {cache_file(cache_dir)} was ignored: {exc}. "
            "Run `cudampi doctor` on this host (with the job's settings) to probe again",
            ignored=True,
        )


def _no_entry(entries: Mapping[str, Any], library: str, env: Mapping[str, str], host: str) -> str:
    """Why no entry describes this stack: none at all, or, where this library was probed on
    this host with other settings, which settings differ (a probe run without the job's
    settings, or a job run without the probe's, is the usual cause)."""
    said = "no probe result for this MPI stack on this host (run `cudampi doctor`)"
    mine, first = stack_env(env), _first_line(library)

    def apart(theirs: Mapping[str, Any]) -> int:
        return len(set(theirs.items()) ^ set(mine.items()))

    candidates = [
        raw["env"]
        for raw in entries.values()
        if isinstance(raw, dict)
        and raw.get("host") == host
        and _first_line(str(raw.get("mpi_library", ""))) == first
        and isinstance(raw.get("env"), dict)
        and all(isinstance(v, str) for v in raw["env"].values())
    ]
    closest = min(candidates, key=apart, default=None)
    if closest is None:
        return said
    keys = sorted(set(closest) | set(mine))
    differ = [
        f"{k}={mine.get(k, '(unset)')} here, {closest.get(k, '(unset)')} when probed"
        for k in keys
        if mine.get(k) != closest.get(k)
    ]
    return (
        f"no probe result for this MPI stack with this process's settings: this library was "
        f"probed on this host with other settings ({'; '.join(differ)}). Run `cudampi doctor` "
        "with the job's settings, or run the job with the probe's"
    )


LOCK_FILE = ".capabilities.lock"
LOCK_WAIT = 30.0
"""Seconds a save waits for another process's save (they take milliseconds)."""


def save(cache_dir: str | os.PathLike[str], caps: Capabilities) -> Path:
    """Add or replace ``caps`` (under its key on its host) in the cache: under a lock, so
    doctors saving at once keep each other's entries, and atomically (a full disk leaves the
    old file). A corrupt cache file is replaced. :class:`UnsafeCacheError` for a folder or
    file :func:`trust_problem` refuses, ``OSError`` if the folder cannot be made or written."""
    folder = Path(os.path.expanduser(cache_dir))
    problem = trust_problem(folder)  # before mkdir: a link into /etc must not be followed
    if not problem:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        problem = trust_problem(folder)
    if problem:
        raise UnsafeCacheError(problem)
    with _locked(folder):
        try:
            entries = read_entries(cache_file(folder))
        except CacheProblem:
            entries = {}  # corrupt: what it held cannot be read by anyone, so start anew
        entries[entry_name(caps.key, caps.host)] = caps.to_json()
        text = json.dumps(entries, indent=2, sort_keys=True)
        return write_text(cache_file(folder), text, follow_symlinks=False, mode=0o644)


@contextlib.contextmanager
def _locked(folder: Path) -> Iterator[None]:
    """An exclusive ``flock`` on the folder's lock file for one read-modify-write of the cache."""
    import fcntl

    path = folder / LOCK_FILE
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        deadline = time.monotonic() + LOCK_WAIT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise OSError(
                        f"{path} has been locked by another process for {LOCK_WAIT:g} s (a "
                        "doctor saving at the same time that is stuck?); end it or remove "
                        "the lock file"
                    ) from None
                time.sleep(0.01)
        yield
    finally:
        os.close(fd)  # releases the lock


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0].strip() if text.strip() else "unknown"


def _norm(name: str) -> str:
    return " ".join(name.split()).lower()
