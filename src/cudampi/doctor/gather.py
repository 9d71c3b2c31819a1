"""Run every probe once and keep what they said: the doctor's only I/O besides printing.

Each external tool and each runtime test runs in a child process with a timeout, so nothing a
broken MPI, CUDA or torch does can take the doctor down; a probe that fails becomes data.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from cudampi.config import PROBE_TIMEOUT
from cudampi.errors import ConfigError
from cudampi.probe import capabilities as caps_mod
from cudampi.probe.capabilities import Capabilities
from cudampi.probe.gpu import GpuSystem, PythonGpu, PythonGpuProbe, query_gpu_system
from cudampi.probe.launcher import SETTING_PREFIXES, LauncherEnv, query_launcher_env
from cudampi.probe.mpi_library import (
    MpiInstallation,
    MpiLibrary,
    find_installations,
    launcher_on_path,
    matching_mpiexec,
    prefix_of,
    query_build,
    query_mpi_library,
    query_mpiexec_version,
)
from cudampi.probe.mpich import MpichInfo
from cudampi.probe.ompi import OmpiInfo
from cudampi.probe.runtime import (
    DEVICE_TESTS,
    HOST_TESTS,
    PROBE_BYTES,
    PROBE_RANKS,
    ProbeSpec,
    RuntimeResult,
    ranks_env,
    run_probes,
    staging_verdict,
)
from cudampi.probe.ucx import UcxInstall, find_ucx, libucx_package_dir, preload_env
from cudampi.shm import ShmState, shm_state


@dataclass(frozen=True)
class DoctorOptions:
    """What to probe: the stack as given on the command line."""

    mpiexec: str | None = None
    preload_ucx: str | None = None
    """None: no; ``auto``: the importable libucx package; else a libucx package folder."""
    mca: tuple[tuple[str, str], ...] = ()
    exports: tuple[tuple[str, str], ...] = ()
    runtime: bool = True
    nbytes: int = PROBE_BYTES
    ranks: int = PROBE_RANKS
    timeout: float = PROBE_TIMEOUT
    cache_dir: str | None = None


@dataclass(frozen=True)
class Facts:
    """Everything the probes found; :mod:`cudampi.doctor.checks` reads only this."""

    python_version: str
    python: str
    platform: str
    library: MpiLibrary
    installations: tuple[MpiInstallation, ...]
    path_launcher: tuple[str | None, str | None, str | None]
    matching_mpiexec: str | None
    probe_mpiexec: str | None
    probe_mpiexec_version: tuple[str | None, str | None]
    ompi: OmpiInfo | None
    mpich: MpichInfo | None
    build_error: str | None
    ucx: tuple[UcxInstall, ...]
    ucx_package: str | None
    options: DoctorOptions
    ranks_env: dict[str, str]
    """The settings (OMPI_MCA_*, UCX_*, ... and the capabilities-key variables) the probe ranks
    get: the caller's, minus an enclosing job's launcher variables, plus ``--mca``/``-x``."""
    settings_env: dict[str, str]
    """The whole environment the ranks get (checked, never printed: it may hold secrets)."""
    gpu_system: GpuSystem
    python_gpu: PythonGpu
    launcher: LauncherEnv
    env: dict[str, str]
    runtime: RuntimeResult | None
    runtime_note: str = ""
    capabilities: Capabilities | None = None
    cache_path: str | None = None
    cache_keys: tuple[str, ...] = field(default_factory=tuple)
    recipe: RuntimeResult | None = None
    """The same probes again with the libucx recipe `cudampi launch` applies, run by itself when
    the libucx wheel is importable, ``--preload-ucx`` was not given and plain device p2p failed."""
    recipe_package: str | None = None
    cache_error: str = ""
    """Why the probed capabilities could not be saved (an unwritable cache folder)."""
    shm: ShmState | None = None
    """/dev/shm: its size, free space and the stale MPI segments in it."""


def resolve_ucx_package(choice: str | None) -> str | None:
    """The libucx package folder for ``--preload-ucx`` (``auto`` = the importable one)."""
    if choice is None:
        return None
    if choice == "auto":
        found = libucx_package_dir()
        if found is None:
            raise ConfigError(
                "--preload-ucx: no importable libucx package (libucx-cu12/libucx-cu13) in "
                f"{sys.executable}. Fix: {sys.executable} -m pip install libucx-cu13 "
                "(libucx-cu12 for CUDA 12), or give its folder: --preload-ucx /path/to/libucx"
            )
        return str(found)
    path = Path(choice)
    if not (path / "lib" / "libucp.so.0").exists():
        raise ConfigError(
            f"--preload-ucx {choice!r}: no lib/libucp.so.0 there; give the folder of the libucx "
            "package (python -c 'import libucx,os;print(os.path.dirname(libucx.__file__))')"
        )
    return str(path)


def build_spec(
    options: DoctorOptions, mpiexec: str, vendor: str | None, ucx_package: str | None
) -> ProbeSpec:
    """The probe launch for ``options``: ``--preload-ucx`` adds the recipe's LD_PRELOAD,
    UCX_MODULE_DIR and ``--mca pml ucx`` (unless a pml was given)."""
    mca = list(options.mca)
    exports = list(options.exports)
    if ucx_package is not None:
        exports += [kv for kv in preload_env(ucx_package).items() if kv[0] not in dict(exports)]
        if "pml" not in dict(mca):
            mca.append(("pml", "ucx"))
    return ProbeSpec(
        mpiexec=mpiexec,
        python=sys.executable,
        vendor=vendor,
        mca=tuple(mca),
        exports=tuple(exports),
        nbytes=options.nbytes,
        ranks=options.ranks,
        timeout=options.timeout,
    )


PROBE_WORDS = {
    "host_p2p": "host point-to-point",
    "host_allreduce": "host allreduce",
    "device_p2p": "device point-to-point",
    "device_allreduce": "device allreduce",
    "host_staged": "host-staged allreduce",
    "copy": "host<->device copy rate",
}


def gather(
    options: DoctorOptions,
    env: Mapping[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
) -> Facts:
    """Probe everything (see the module docstring); never raises for a broken stack.

    ``progress(line)`` hears one line as each probe starts (the CLI prints them on a terminal).
    """
    env = dict(os.environ if env is None else env)

    def say(text: str) -> None:
        if progress is not None:
            progress(text)

    def job(where: str) -> Callable[[str], None]:
        return lambda test: say(f"{PROBE_WORDS.get(test, test)}, {options.ranks} ranks{where}")

    ucx_package = resolve_ucx_package(options.preload_ucx)
    say("the MPI library mpi4py loads, and the GPUs torch/CuPy see")
    python_gpu_probe = PythonGpuProbe(sys.executable, env)  # slow torch import: overlap it
    library = query_mpi_library(sys.executable, env)
    installations = tuple(find_installations(env, sys.prefix, library.path))
    path_launcher = launcher_on_path(env)
    matching = matching_mpiexec(library) if library.ok else None
    probe_mpiexec = options.mpiexec or (str(matching) if matching else None)
    probe_version = query_mpiexec_version(probe_mpiexec) if probe_mpiexec else (None, None)
    say("the MPI build (ompi_info / mpichversion)")
    ompi, mpich, build_error = query_build(library, env)
    mpi_prefix = str(prefix_of(library.path)) if library.path else None
    say("UCX transports")
    ucx = tuple(find_ucx(mpi_prefix, ucx_package, env))
    say("GPUs and topology")
    gpu_system = query_gpu_system(env)
    launcher = query_launcher_env(env)

    vendor = probe_version[0] or library.vendor
    spec = build_spec(options, probe_mpiexec or "mpiexec", vendor, ucx_package)
    predicted_env = ranks_env(spec, env)
    host_runs: RuntimeResult | None = None
    note = _runtime_note(options, library, probe_mpiexec)
    if not note:
        host_runs = run_probes(spec, None, "", env, tests=HOST_TESTS, on_test=job(""))
    python_gpu = python_gpu_probe.result()  # after the host probes: its torch import overlaps
    probed = _Probed()
    if host_runs is not None:
        probed = _device_probes(
            _DeviceJob(spec, options, vendor, ucx_package, env, job),
            python_gpu,
            gpu_system,
            host_runs,
        )
    return Facts(
        python_version=platform.python_version(),
        python=sys.executable,
        platform=f"{platform.system()} {platform.release()} {platform.machine()}",
        library=library,
        installations=installations,
        path_launcher=path_launcher,
        matching_mpiexec=str(matching) if matching else None,
        probe_mpiexec=probe_mpiexec,
        probe_mpiexec_version=probe_version,
        ompi=ompi,
        mpich=mpich,
        build_error=build_error,
        ucx=ucx,
        ucx_package=ucx_package,
        options=options,
        ranks_env={
            k: v
            for k, v in predicted_env.items()
            if k in caps_mod.STACK_ENV or k.startswith(SETTING_PREFIXES)
        },
        settings_env=dict(predicted_env),
        gpu_system=gpu_system,
        python_gpu=python_gpu,
        launcher=launcher,
        env=env,
        runtime=probed.runtime,
        runtime_note=note,
        capabilities=probed.capabilities,
        cache_path=probed.cache_path,
        cache_keys=probed.keys,
        recipe=probed.recipe,
        recipe_package=probed.recipe_package,
        cache_error=probed.cache_error,
        shm=shm_state(),
    )


@dataclass
class _Probed:
    """What the runtime probes found and where it was cached."""

    runtime: RuntimeResult | None = None
    capabilities: Capabilities | None = None
    cache_path: str | None = None
    keys: tuple[str, ...] = ()
    cache_error: str = ""
    recipe: RuntimeResult | None = None
    recipe_package: str | None = None


@dataclass(frozen=True)
class _DeviceJob:
    """How the device probes are run (the same for the stack and for the libucx recipe)."""

    spec: ProbeSpec
    options: DoctorOptions
    vendor: str | None
    ucx_package: str | None
    env: Mapping[str, str]
    job: Callable[[str], Callable[[str], None]]


def _runtime_note(options: DoctorOptions, library: MpiLibrary, probe_mpiexec: str | None) -> str:
    """Why the runtime probes do not run here; empty where they do."""
    if not options.runtime:
        return "skipped (--no-runtime)"
    if not library.ok:
        return "skipped: mpi4py cannot load an MPI library"
    if probe_mpiexec is None:
        return (
            f"skipped: no mpiexec of {library.vendor} {library.version} found beside "
            f"{library.path} or {sys.executable}; give one with --mpiexec PATH"
        )
    return ""


def _no_device_reason(python_gpu: PythonGpu, gpu_system: GpuSystem) -> str:
    if python_gpu.gpu_count == 0 and not gpu_system.gpus:
        return "no GPU visible (nvidia-smi, torch.cuda and CuPy see none)"
    return (
        "a GPU is present but neither CuPy nor torch.cuda can use it: "
        f"torch: {python_gpu.torch_error or python_gpu.torch_cuda_available}, "
        f"cupy: {python_gpu.cupy_error or python_gpu.cupy_devices}"
    )


def _cannot_run(gpus: int) -> dict[str, str]:
    """The probe tests this machine cannot run, with why: the ipc engine needs CuPy; the nccl
    engine CuPy's NCCL and a GPU for each of the probe's 2 ranks (NCCL refuses two ranks on one
    GPU), so a host of ``gpus`` < 2 GPUs cannot probe it."""
    from cudampi.comm.paths import kinds

    out = {}
    why = kinds()["ipc"].available()
    if why is not None:
        out["device_ipc"] = why
    if gpus < 2:  # (asked first: CuPy warns aloud on importing its NCCL module without one)
        why = (
            f"the nccl engine needs a GPU per rank and this host shows {gpus} (NCCL refuses "
            "two ranks on one GPU; ranks sharing a GPU keep ipc)"
        )
    else:
        why = kinds()["nccl"].available()
    if why is not None:
        out["device_nccl"] = why
    return out


def _device_probes(
    d: _DeviceJob, python_gpu: PythonGpu, gpu_system: GpuSystem, host_runs: RuntimeResult
) -> _Probed:
    """The device probes after the host ones, cached; and where the libucx wheel is here but
    device p2p failed without it, the same with the recipe `cudampi launch` applies, so the
    report can say whether the stack works the way it will be run."""
    backend = python_gpu.device_backend
    reason = None if backend is not None else _no_device_reason(python_gpu, gpu_system)
    cannot = _cannot_run(python_gpu.gpu_count)
    device = run_probes(d.spec, backend, reason, d.env, (*DEVICE_TESTS, "copy"), d.job(""), cannot)
    runtime = RuntimeResult(
        {**host_runs.runs, **device.runs}, {**host_runs.skipped, **device.skipped}
    )
    p = _Probed(runtime)
    p.capabilities, p.cache_path, p.keys, p.cache_error = _save_capabilities(runtime, d.options)
    found = libucx_package_dir()
    retry = d.ucx_package is None and backend is not None and found is not None
    if retry and not runtime.outcome("device_p2p").ok:
        p.recipe_package = str(found)
        rspec = build_spec(d.options, d.spec.mpiexec, d.vendor, p.recipe_package)
        p.recipe = run_probes(
            rspec, backend, reason, d.env, None, d.job(" with the libucx recipe"), cannot
        )
        rcaps, rpath, rkeys, rerror = _save_capabilities(p.recipe, d.options)
        p.cache_error = p.cache_error or rerror
        if rcaps is not None:
            p.cache_path, p.keys = rpath, (*p.keys, *rkeys)
    return p


def _save_capabilities(
    runtime: RuntimeResult, options: DoctorOptions
) -> tuple[Capabilities | None, str | None, tuple[str, ...], str]:
    """Cache what the probe proved under the key the ranks computed for themselves: what a
    :class:`~cudampi.comm.Communicator` computes in a job launched the same way (same MPI,
    same ``--mca``/``-x`` settings, same launcher). Nothing is saved when the host probes failed:
    with no entry, cudampi assumes nothing is CUDA-aware."""
    facts = runtime.rank_facts
    if facts is None or not all(runtime.outcome(t).ok for t in HOST_TESTS):
        return None, None, (), ""
    p2p = runtime.outcome("device_p2p")
    copy = runtime.runs.get("copy")
    copy_gbps = copy.outcome.gbps if copy is not None and copy.outcome.ok else None
    gpu = next(
        (r.report["device"] for r in runtime.runs.values() if r.report and r.report.get("device")),
        None,
    )
    cache_dir = options.cache_dir
    if cache_dir is None:
        from cudampi.config import Config

        cache_dir = Config.load().cache_dir
    host = str(facts.get("hostname") or socket.gethostname())
    ipc = runtime.runs.get("device_ipc")
    ipc_report = ipc.report if ipc is not None and ipc.report else {}
    latency = ipc_report.get("latency_us")
    shared = ipc_report.get("shared_gpu")
    probed_mps = ipc_report.get("mps")
    nccl = runtime.runs.get("device_nccl")
    nccl_latency = (nccl.report or {}).get("latency_us") if nccl is not None else None
    caps = Capabilities(
        key=str(facts["key"]),
        mpi_library=str(facts["library_version"]),
        device_p2p=p2p,
        device_allreduce=runtime.outcome("device_allreduce"),
        host_staged=runtime.outcome("host_staged"),
        device_ipc=runtime.outcome("device_ipc"),
        ipc_latency_us=float(latency) if isinstance(latency, (int, float)) else None,
        ipc_shared_gpu=shared if isinstance(shared, bool) else None,
        ipc_mps=probed_mps if isinstance(probed_mps, bool) else None,
        device_nccl=runtime.outcome("device_nccl"),
        nccl_latency_us=float(nccl_latency) if isinstance(nccl_latency, (int, float)) else None,
        host_copy_gbps=copy_gbps,
        silent_staging=staging_verdict(p2p.gbps if p2p.ok else None, copy_gbps),
        gpu=str(gpu) if gpu else None,
        host=host,
        env=dict(facts.get("env") or {}),
    )
    try:
        path = caps_mod.save(cache_dir, caps)
    except OSError as exc:
        return caps, None, (), f"cannot write {caps_mod.cache_file(cache_dir)}: {exc}"
    return caps, str(path), (caps.key,), ""
