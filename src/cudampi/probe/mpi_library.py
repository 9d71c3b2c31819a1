"""Which MPI library does mpi4py really load, which other MPIs are installed, and which
``mpiexec`` belongs to the loaded one?

mpi4py is imported in a child ``python`` (``mpi4py.rc.initialize = False``: no MPI_Init), which
reports ``MPI.Get_library_version()`` and the libmpi it mapped (``/proc/self/maps``), so a broken
MPI cannot take the doctor down and the answer is what the interpreter really does, not what a
path suggests.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cudampi.names import CRAY_MPICH, INTEL_MPI, MPICH, MVAPICH, OPEN_MPI
from cudampi.probe.mpich import MpichInfo, query_mpichversion
from cudampi.probe.ompi import OmpiInfo, query_ompi_info


@dataclass(frozen=True)
class MpiLibrary:
    """The MPI library one interpreter's mpi4py loads."""

    python: str
    mpi4py_version: str | None = None
    mpi4py_path: str | None = None
    library_version: str = ""
    """``MPI.Get_library_version()``, verbatim (the first line keys the capabilities cache)."""
    vendor: str | None = None
    version: str | None = None
    path: str | None = None
    """The libmpi file mapped into the process (from /proc/self/maps)."""
    mpi_version: tuple[int, int] | None = None
    mpix_query_cuda_support: bool | None = None
    """Whether libmpi exports ``MPIX_Query_cuda_support`` (its value needs MPI_Init)."""
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.library_version)


@dataclass(frozen=True)
class MpiInstallation:
    """One MPI installation found on this machine."""

    prefix: str
    vendor: str | None = None
    version: str | None = None
    mpiexec: str | None = None
    libmpi: str | None = None
    found_via: tuple[str, ...] = field(default_factory=tuple)
    """Where it was seen: PATH, LD_LIBRARY_PATH, ldconfig, CONDA_PREFIX, VIRTUAL_ENV, sys.prefix."""

    @property
    def label(self) -> str:
        what = " ".join(p for p in (self.vendor, self.version) if p) or "unknown MPI"
        return f"{what} at {self.prefix}"


def parse_library_version(text: str) -> tuple[str | None, str | None]:
    """(vendor, version) from ``MPI_Get_library_version`` text of any common MPI."""
    if m := re.search(r"Open MPI v(\d+(?:\.\d+)*\w*)", text):
        return OPEN_MPI, m.group(1)
    if m := re.search(r"CRAY MPICH version (\d+(?:\.\d+)*)", text, re.IGNORECASE):
        return CRAY_MPICH, m.group(1)
    if m := re.search(r"Intel\(R\) MPI Library (\d+(?:\.\d+)*)", text):
        return INTEL_MPI, m.group(1)
    if m := re.search(r"MVAPICH2? Version:\s*(\S+)", text):
        return MVAPICH, m.group(1)
    if m := re.search(r"MPICH Version:\s*(\S+)", text):
        return MPICH, m.group(1)
    return None, None


def parse_mpiexec_version(text: str) -> tuple[str | None, str | None]:
    """(vendor, version) from ``mpiexec --version`` of Open MPI, MPICH (hydra) or Intel MPI."""
    if m := re.search(r"\((?:Open MPI|OpenRTE)\)\s+(\d+(?:\.\d+)*\w*)", text):
        return OPEN_MPI, m.group(1)
    if m := re.search(r"Intel\(R\) MPI Library.*?Version (\d+(?:\.\d+)*)", text):
        return INTEL_MPI, m.group(1)
    if "HYDRA build details" in text and (m := re.search(r"Version:\s+(\S+)", text)):
        return (MVAPICH if "MVAPICH" in text else MPICH), m.group(1)
    return None, None


_LIBMPI = re.compile(r"/lib(?:mpi|mpich|mpi_abi)\.so(?:\.\d+)*$")


def parse_maps_libmpi(maps: str | Iterable[str]) -> list[str]:
    """The libmpi files in a ``/proc/<pid>/maps`` text (or its path column), in first-seen order.

    ``libmpi_cxx``, ``libmpi_mpifh`` and other language bindings are not the MPI library.
    """
    lines = maps.splitlines() if isinstance(maps, str) else list(maps)
    found: list[str] = []
    for line in lines:
        path = line.split()[-1] if line.split() else ""
        if _LIBMPI.search(path) and path not in found:
            found.append(path)
    return found


_CHILD = r"""
import ctypes, json, os, sys
out = {}
try:
    import mpi4py
    out["mpi4py_version"] = mpi4py.__version__
    out["mpi4py_path"] = os.path.dirname(mpi4py.__file__)
    mpi4py.rc.initialize = False
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    out["library_version"] = MPI.Get_library_version()
    out["mpi_version"] = list(MPI.Get_version())
    with open("/proc/self/maps") as f:
        out["maps"] = [l.split()[-1] for l in f if "libmpi" in l or "libmpich" in l]
except BaseException as exc:
    out["error"] = f"{type(exc).__name__}: {exc}"
print("CUDAMPI_LIBRARY " + json.dumps(out), flush=True)
"""


def parse_library_report(python: str, text: str) -> MpiLibrary:
    """Build an :class:`MpiLibrary` from the child's ``CUDAMPI_LIBRARY {json}`` line."""
    for line in text.splitlines():
        if line.startswith("CUDAMPI_LIBRARY "):
            data = json.loads(line[len("CUDAMPI_LIBRARY ") :])
            break
    else:
        return MpiLibrary(python, error=f"no report from the child: {text.strip()[-500:]!r}")
    if "error" in data and "library_version" not in data:
        return MpiLibrary(
            python,
            mpi4py_version=data.get("mpi4py_version"),
            mpi4py_path=data.get("mpi4py_path"),
            error=str(data["error"]),
        )
    lib_version = str(data.get("library_version", ""))
    vendor, version = parse_library_version(lib_version)
    paths = parse_maps_libmpi(data.get("maps", []))
    mpi_version = data.get("mpi_version")
    return MpiLibrary(
        python=python,
        mpi4py_version=data.get("mpi4py_version"),
        mpi4py_path=data.get("mpi4py_path"),
        library_version=lib_version,
        vendor=vendor,
        version=version,
        path=paths[0] if paths else None,
        mpi_version=(int(mpi_version[0]), int(mpi_version[1])) if mpi_version else None,
        error=data.get("error"),
    )


def _exports(library: str, symbol: str) -> bool | None:
    import ctypes

    try:
        lib = ctypes.CDLL(library, mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError:
        return None
    return hasattr(lib, symbol)


def query_mpi_library(
    python: str | None = None, env: Mapping[str, str] | None = None, timeout: float = 60.0
) -> MpiLibrary:
    """Ask a child ``python`` which MPI library its mpi4py loads (never raises)."""
    python = python or sys.executable
    try:
        proc = subprocess.run(
            [python, "-c", _CHILD],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(os.environ if env is None else env),
        )
    except subprocess.TimeoutExpired:
        return MpiLibrary(python, error=f"importing mpi4py hung for {timeout:.0f} s")
    except OSError as exc:
        return MpiLibrary(python, error=f"could not run {python!r}: {exc}")
    lib = parse_library_report(python, proc.stdout)
    if proc.returncode != 0 and lib.ok:
        lib = _replace(lib, error=f"the child exited {proc.returncode}: {proc.stderr[-300:]!r}")
    elif proc.returncode != 0 and lib.error and "no report" in lib.error:
        lib = _replace(
            lib,
            error=f"importing mpi4py in {python} died (exit {proc.returncode}): "
            f"{proc.stderr.strip()[-500:]!r}",
        )
    if lib.path:
        lib = _replace(lib, mpix_query_cuda_support=_exports(lib.path, "MPIX_Query_cuda_support"))
    return lib


def _replace(lib: MpiLibrary, **kw: object) -> MpiLibrary:
    import dataclasses

    return dataclasses.replace(lib, **kw)  # type: ignore[arg-type]


def query_mpiexec_version(
    mpiexec: str | os.PathLike[str], timeout: float = 30.0
) -> tuple[str | None, str | None]:
    """(vendor, version) of an ``mpiexec``/``mpirun`` binary; (None, None) if it cannot say."""
    try:
        proc = subprocess.run(
            [str(mpiexec), "--version"], capture_output=True, text=True, timeout=timeout
        )
    except (OSError, subprocess.TimeoutExpired):
        return None, None
    return parse_mpiexec_version(proc.stdout + proc.stderr)


def prefix_of(path: str | os.PathLike[str]) -> Path:
    """The installation prefix of a libmpi or an mpiexec: the nearest parent with ``bin/mpiexec``
    (``/usr`` for Debian's ``/usr/lib/x86_64-linux-gnu/openmpi/lib/libmpi.so``), else the parent
    of its folder."""
    p = Path(path)
    for candidate in (p, Path(os.path.realpath(p))):
        for parent in candidate.parents:
            if (parent / "bin" / "mpiexec").exists() or (parent / "bin" / "mpirun").exists():
                if parent == Path("/") and Path("/usr/bin/mpiexec").exists():
                    return Path("/usr")
                return parent
    return p.parent.parent


def matching_mpiexec(library: MpiLibrary) -> Path | None:
    """The ``mpiexec`` of the installation whose libmpi ``library`` loaded, if it says it is the
    same vendor and version (the wheel's mpiexec beside ``sys.executable``, /usr/bin/mpiexec for
    a distribution package...)."""
    candidates: list[Path] = []
    if library.path:
        prefix = prefix_of(library.path)
        candidates += [prefix / "bin" / "mpiexec", prefix / "bin" / "mpirun"]
    candidates.append(Path(library.python).parent / "mpiexec")
    for cand in candidates:
        if cand.exists():
            vendor, version = query_mpiexec_version(cand)
            if vendor == library.vendor and (version == library.version or version is None):
                return cand
    return None


def query_build(
    library: MpiLibrary, env: Mapping[str, str] | None = None
) -> tuple[OmpiInfo | None, MpichInfo | None, str | None]:
    """What the loaded library was built with: ``ompi_info`` or ``mpichversion`` of its own
    installation, and why neither answered (never raises: a broken tool is a finding)."""
    if not library.path:
        return None, None, None
    prefix = prefix_of(library.path)
    try:
        if library.vendor == OPEN_MPI:
            tool = prefix / "bin" / "ompi_info"
            if tool.exists():
                return query_ompi_info(tool, env=env), None, None
            return None, None, f"no ompi_info beside {library.path} (looked in {prefix / 'bin'})"
        if library.vendor == MPICH:
            tool = prefix / "bin" / "mpichversion"
            if tool.exists():
                return None, query_mpichversion(tool), None
            return None, None, f"no mpichversion in {prefix / 'bin'}"
    except Exception as exc:
        return None, None, str(exc)
    return None, None, None


def _ldconfig_libmpi(timeout: float = 20.0) -> list[str]:
    exe = shutil.which("ldconfig") or (
        "/sbin/ldconfig" if Path("/sbin/ldconfig").exists() else None
    )
    if exe is None:
        return []
    try:
        proc = subprocess.run([exe, "-p"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return parse_ldconfig_libmpi(proc.stdout)


def parse_ldconfig_libmpi(text: str) -> list[str]:
    """The libmpi paths in ``ldconfig -p`` output (``libmpi.so.40 (libc6,x86-64) => /path``)."""
    out: list[str] = []
    for line in text.splitlines():
        _, sep, path = line.partition("=>")
        path = path.strip()
        if sep and _LIBMPI.search(path) and path not in out:
            out.append(path)
    return out


def _vendor_of_soname(libmpi: str) -> str | None:
    name = Path(libmpi).name
    if name.startswith("libmpi.so.40"):
        return OPEN_MPI
    if name.startswith("libmpi.so.12") or name.startswith("libmpich"):
        return MPICH
    return None


@dataclass
class _Sighting:
    """What the places that name one prefix say about it (the first mpiexec and libmpi win)."""

    via: list[str]
    mpiexec: str | None = None
    libmpi: str | None = None


def _libs_in(folder: Path) -> list[str]:
    try:
        return sorted(str(p) for p in folder.iterdir() if _LIBMPI.search(str(p)))
    except OSError:
        return []


def _sightings(
    env: Mapping[str, str], sys_prefix: str, loaded: str | None
) -> Iterator[tuple[Path, str, Path | None, str | None]]:
    """``(prefix, via, mpiexec, libmpi)`` for each place an MPI shows itself, in the order
    :func:`find_installations` documents."""
    for d in env.get("PATH", "").split(os.pathsep):
        if not d:
            continue
        for name in ("mpiexec", "mpirun"):
            exe = Path(d) / name
            if exe.is_file() and os.access(exe, os.X_OK):
                yield prefix_of(exe), "PATH", exe, None
                break
    if loaded:
        yield prefix_of(loaded), "mpi4py", None, loaded
    for d in env.get("LD_LIBRARY_PATH", "").split(os.pathsep):
        if d:
            for lib in _libs_in(Path(d))[:1]:
                yield prefix_of(lib), "LD_LIBRARY_PATH", None, lib
    for lib in _ldconfig_libmpi():
        yield prefix_of(lib), "ldconfig", None, lib
    roots = (
        ("CONDA_PREFIX", env.get("CONDA_PREFIX")),
        ("VIRTUAL_ENV", env.get("VIRTUAL_ENV")),
        ("sys.prefix", sys_prefix),
    )
    for via, root in roots:
        if not root:
            continue
        r = Path(root)
        found = [r / "bin" / n for n in ("mpiexec", "mpirun") if (r / "bin" / n).exists()]
        libs = _libs_in(r / "lib")
        if found or libs:
            yield r, via, found[0] if found else None, libs[0] if libs else None


def _installation(prefix: str, seen: _Sighting) -> MpiInstallation:
    """One prefix's entry: its mpiexec (else the one in its bin/) asked for vendor and version,
    else the vendor its libmpi's soname implies."""
    mpiexec = seen.mpiexec
    if mpiexec is None:
        for name in ("mpiexec", "mpirun"):
            if (Path(prefix) / "bin" / name).exists():
                mpiexec = str(Path(prefix) / "bin" / name)
                break
    vendor, version = query_mpiexec_version(mpiexec) if mpiexec is not None else (None, None)
    if vendor is None and seen.libmpi is not None:
        vendor = _vendor_of_soname(seen.libmpi)
    return MpiInstallation(
        prefix=prefix,
        vendor=vendor,
        version=version,
        mpiexec=mpiexec,
        libmpi=seen.libmpi,
        found_via=tuple(seen.via),
    )


def find_installations(
    env: Mapping[str, str] | None = None,
    sys_prefix: str | None = None,
    loaded: str | None = None,
) -> list[MpiInstallation]:
    """Every MPI installation reachable from PATH, LD_LIBRARY_PATH, ``ldconfig -p``,
    CONDA_PREFIX, VIRTUAL_ENV and ``sys.prefix``, plus the one of the ``loaded`` libmpi
    (found via mpi4py), one entry per prefix."""
    env = os.environ if env is None else env
    seen: dict[str, _Sighting] = {}
    for prefix, via, mpiexec, libmpi in _sightings(env, sys_prefix or sys.prefix, loaded):
        entry = seen.setdefault(str(prefix), _Sighting([]))
        if via not in entry.via:
            entry.via.append(via)
        if mpiexec is not None and entry.mpiexec is None:
            entry.mpiexec = str(mpiexec)
        if libmpi is not None and entry.libmpi is None:
            entry.libmpi = libmpi
    return [_installation(prefix, entry) for prefix, entry in seen.items()]


def launcher_on_path(
    env: Mapping[str, str] | None = None,
) -> tuple[str | None, str | None, str | None]:
    """(path, vendor, version) of the ``mpirun`` (else ``mpiexec``) first on PATH."""
    env = os.environ if env is None else env
    for name in ("mpirun", "mpiexec"):
        exe = shutil.which(name, path=env.get("PATH", ""))
        if exe:
            vendor, version = query_mpiexec_version(exe)
            return exe, vendor, version
    return None, None, None
