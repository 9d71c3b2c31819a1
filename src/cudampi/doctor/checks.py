"""The doctor's checks in report order: :func:`all_checks` runs them on a
:class:`~cudampi.doctor.gather.Facts`, one section after another (MPI, CUDA-awareness, GPU,
launcher), each section's checks in its own module (``checks_mpi``, ``checks_cuda``,
``checks_gpu``, ``checks_launch``).

One function per check: probed data in, :class:`Check` out. Pure: no I/O, no imports of
mpi4py/torch/CuPy, so every check is tested on fixture data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from cudampi.doctor.checks_cuda import (
    RECIPE_WORDS,
    check_cuda_aware,
    check_cuda_build,
    check_device_probe,
    check_ipc,
    check_nccl_engine,
    check_silent_staging,
    check_ucx,
    ucx_with_recipe,
    with_recipe,
)
from cudampi.doctor.checks_gpu import (
    check_cupy,
    check_gpudirect,
    check_gpus,
    check_nccl,
    check_torch,
)
from cudampi.doctor.checks_launch import (
    check_cache,
    check_gpu_mapping,
    check_interfaces,
    check_launcher,
    check_launcher_mpis,
    check_mpi_settings,
    check_nccl_settings,
    check_shm,
)
from cudampi.doctor.checks_mpi import (
    check_home,
    check_host_probe,
    check_installations,
    check_launcher_match,
    check_mpi4py,
    check_mpi_library,
    check_probe_launcher,
    check_python,
)
from cudampi.doctor.report import CUDA, Check
from cudampi.names import OPEN_MPI
from cudampi.pmi import mpich
from cudampi.probe.capabilities import ProbeOutcome
from cudampi.probe.gpu import mps_active

if TYPE_CHECKING:
    from cudampi.doctor.gather import Facts

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
        check_nccl_engine(
            _nccl_choice(f),
            runtime.outcome("device_nccl") if runtime else skipped,
            runtime.runs.get("device_nccl") if runtime else None,
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
        check_launcher_mpis(f.library, *_torchrun_mpi(f.env)),
        check_gpu_mapping(f.launcher.launcher, f.env, physical),
        check_mpi_settings(f.settings_env, gpus_present, f.ompi),
        check_interfaces(f.launcher.interfaces, f.env),
        check_nccl_settings(f.env, f.launcher.interfaces),
        check_shm(f.shm),
        check_cache(f.cache_path, f.cache_keys, runtime is not None, f.runtime_note, f.cache_error),
    ]
    return checks


def _torchrun_mpi(env: Mapping[str, str]) -> tuple[mpich.Choice, str]:
    """The MPI torchrun's ranks would load here, and its family by the ABI's file name."""
    choice = mpich.choose(env)
    name = os.path.basename(choice.path or "")
    return choice, {"libmpi.so.12": "MPICH", "libmpi.so.40": OPEN_MPI}.get(name, "")


def _nccl_choice(f: Facts) -> tuple[bool, str, tuple[int, int]]:
    """What auto makes of this host's nccl probe (:func:`cudampi.comm.paths.nccl_support`)."""
    from cudampi.comm.paths import ipc_support, nccl_support

    caps = f.capabilities
    ipc = (
        caps is not None
        and ipc_support(caps.device_ipc, caps.ipc_shared_gpu, mps_active(f.env), None)[0]
    )
    return nccl_support(caps, ipc, None)
