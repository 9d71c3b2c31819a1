"""The doctor's GPU checks: the GPUs and their links, GPUDirect RDMA, NCCL, torch and CuPy. Pure."""

from __future__ import annotations

import re

from cudampi.doctor.report import GPU, Check
from cudampi.probe.gpu import GpuSystem, PythonGpu


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
    error = py.cupy_error or ""
    if error and not gpus_present:
        # Without a GPU the runtime's error is expected: its code says which case this is
        # (no driver, no device) without the three wrapped lines of CUDA's own sentence.
        code = re.search(r"cudaError\w+", error)
        error = code.group(0) if code else error
    return Check(
        "CuPy",
        "ok",
        f"CuPy {py.cupy_version}{rt_s}, {py.cupy_devices or 0} device(s)"
        + (f" ({error})" if error else ""),
        "",
        GPU,
    )
