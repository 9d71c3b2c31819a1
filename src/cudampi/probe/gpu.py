"""GPUs and the software around them: NVML (:mod:`cudampi.probe.nvml`: models, PCI ids, NVLink
and PCIe topology, P2P, CPU affinity), the network cards ``nvidia-smi topo -m`` lists (which
NVML does not), GPUDirect RDMA (nvidia_peermem, /dev/infiniband), NCCL, torch and its
distributed backends, CuPy.

torch and CuPy are imported in a child ``python`` (:class:`PythonGpuProbe`), so a broken CUDA
install or a slow torch import cannot crash or stall the doctor itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudampi.probe.nvml import GpuInfo, NvmlSystem, query_nvml

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_NIC_LEGEND = re.compile(r"^\s*(NIC\d+):\s*(\S+)\s*$")


def parse_topo_nics(text: str) -> tuple[str, ...]:
    """The network cards of ``nvidia-smi topo -m`` (its only use here: NVML does not list them).

    Newer drivers name them ``NIC0`` in the matrix and ``NIC0: mlx5_0`` in a legend; older ones
    put ``mlx5_0`` in the header itself."""
    lines = [_ANSI.sub("", raw).rstrip() for raw in text.splitlines()]
    legend = {m.group(1): m.group(2) for ln in lines if (m := _NIC_LEGEND.match(ln))}
    header = next((ln for ln in lines if "GPU0" in ln.split()), "")
    cells = [c.strip() for c in re.split(r"\t| {2,}", header) if c.strip()]
    nics = [c for c in cells if re.match(r"^(NIC\d+|mlx\w+|\w+_\d+)$", c)]
    return tuple(legend.get(c, c) for c in nics)


def parse_proc_modules(text: str) -> set[str]:
    """Module names from ``/proc/modules`` or ``lsmod`` output."""
    names: set[str] = set()
    for line in text.splitlines():
        first = line.split()[0] if line.split() else ""
        if first and first != "Module":
            names.add(first)
    return names


PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")


def parse_nccl_version_code(code: int) -> str:
    """``ncclGetVersion``'s integer: 22809 -> ``2.28.9`` (>= 2.9), 2708 -> ``2.7.8`` (older)."""
    if code >= 10000:
        return f"{code // 10000}.{code % 10000 // 100}.{code % 100}"
    return f"{code // 1000}.{code % 1000 // 100}.{code % 100}"


@dataclass(frozen=True)
class PythonGpu:
    """What torch and CuPy report in a child interpreter."""

    torch_version: str | None = None
    torch_cuda: str | None = None
    torch_cuda_available: bool | None = None
    torch_devices: tuple[str, ...] = ()
    torch_nccl: str | None = None
    torch_backends: dict[str, bool] = field(default_factory=dict)
    torch_error: str | None = None
    cupy_version: str | None = None
    cupy_runtime: int | None = None
    cupy_devices: int | None = None
    cupy_error: str | None = None
    libnccl: str | None = None
    error: str | None = None

    @property
    def gpu_count(self) -> int:
        return max(len(self.torch_devices), self.cupy_devices or 0)

    @property
    def device_backend(self) -> str | None:
        """The library the device probes use: CuPy if it sees a GPU, else torch.cuda."""
        if self.cupy_version and (self.cupy_devices or 0) > 0:
            return "cupy"
        if self.torch_cuda_available and self.torch_devices:
            return "torch"
        return None

    @property
    def nccl_version(self) -> str | None:
        return self.torch_nccl or self.libnccl


_PY_CHILD = r"""
import ctypes, json, sys
out = {}
try:
    import torch
    out["torch_version"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    out["torch_cuda_available"] = bool(torch.cuda.is_available())
    if out["torch_cuda_available"]:
        out["torch_devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            v = torch.cuda.nccl.version()
            out["torch_nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
        except Exception as exc:
            out["torch_nccl_error"] = str(exc)
    import torch.distributed as dist
    out["torch_backends"] = {
        name: bool(getattr(dist, f"is_{name}_available", lambda: False)())
        for name in ("mpi", "nccl", "gloo", "ucc")
    }
except ImportError as exc:
    out["torch_error"] = f"not installed ({exc})"
except Exception as exc:
    out["torch_error"] = f"{type(exc).__name__}: {exc}"
try:
    import cupy
    out["cupy_version"] = cupy.__version__
    try:
        out["cupy_runtime"] = int(cupy.cuda.runtime.runtimeGetVersion())
        out["cupy_devices"] = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:
        out["cupy_devices"] = 0
        out["cupy_error"] = f"{type(exc).__name__}: {exc}"
except ImportError as exc:
    out["cupy_error"] = f"not installed ({exc})"
except Exception as exc:
    out["cupy_error"] = f"{type(exc).__name__}: {exc}"
try:
    lib = ctypes.CDLL("libnccl.so.2")
    v = ctypes.c_int(0)
    if lib.ncclGetVersion(ctypes.byref(v)) == 0:
        out["libnccl_code"] = v.value
except Exception:
    pass
print("CUDAMPI_PYGPU " + json.dumps(out), flush=True)
"""


def parse_python_gpu(text: str) -> PythonGpu:
    """Parse the child's ``CUDAMPI_PYGPU {json}`` line."""
    for line in text.splitlines():
        if line.startswith("CUDAMPI_PYGPU "):
            d: dict[str, Any] = json.loads(line[len("CUDAMPI_PYGPU ") :])
            break
    else:
        return PythonGpu(error=f"no report from the child: {text.strip()[-300:]!r}")
    code = d.get("libnccl_code")
    return PythonGpu(
        torch_version=d.get("torch_version"),
        torch_cuda=d.get("torch_cuda"),
        torch_cuda_available=d.get("torch_cuda_available"),
        torch_devices=tuple(d.get("torch_devices", ())),
        torch_nccl=d.get("torch_nccl"),
        torch_backends=dict(d.get("torch_backends", {})),
        torch_error=d.get("torch_error"),
        cupy_version=d.get("cupy_version"),
        cupy_runtime=d.get("cupy_runtime"),
        cupy_devices=d.get("cupy_devices"),
        cupy_error=d.get("cupy_error"),
        libnccl=parse_nccl_version_code(int(code)) if isinstance(code, int) and code > 0 else None,
    )


class PythonGpuProbe:
    """The torch/CuPy/NVML child, started now and collected later, so that its slow torch import
    overlaps the runtime probes (start it, then ask for :meth:`result`)."""

    def __init__(
        self,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float = 180.0,
    ) -> None:
        self.python = python or sys.executable
        self.timeout = timeout
        self.error: str | None = None
        self.proc: subprocess.Popen[str] | None = None
        try:
            self.proc = subprocess.Popen(
                [self.python, "-c", _PY_CHILD],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=dict(os.environ if env is None else env),
            )
        except OSError as exc:
            self.error = f"could not run {self.python!r}: {exc}"

    def result(self) -> PythonGpu:
        """Wait for the child (never raises); a hang is killed after the timeout."""
        if self.proc is None:
            return PythonGpu(error=self.error)
        try:
            stdout, stderr = self.proc.communicate(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
            return PythonGpu(error=f"importing torch/cupy hung for {self.timeout:.0f} s")
        result = parse_python_gpu(stdout)
        if result.error and self.proc.returncode != 0:
            return PythonGpu(
                error=f"the torch/cupy child died (exit {self.proc.returncode}): "
                f"{stderr.strip()[-300:]!r}"
            )
        return result


@dataclass(frozen=True)
class GpuSystem:
    """NVML's GPU facts, the network cards and the kernel's GPUDirect pieces."""

    nvml: NvmlSystem = field(default_factory=NvmlSystem)
    nics: tuple[str, ...] = ()
    """Network cards ``nvidia-smi topo -m`` lists (mlx5_0, ...)."""
    peermem_loaded: bool = False
    infiniband: tuple[str, ...] = ()
    """Entries of /dev/infiniband (uverbs0, rdma_cm...)."""

    @property
    def gpus(self) -> tuple[GpuInfo, ...]:
        return self.nvml.gpus

    @property
    def error(self) -> str | None:
        return self.nvml.error


def _run(argv: list[str], timeout: float = 30.0) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return proc.returncode, proc.stdout


def parse_driver_information(text: str) -> str | None:
    """The model of one GPU from the NVIDIA driver's ``/proc/driver/nvidia/gpus/*/information``
    (``Model: \t\t NVIDIA H200``), or None."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "Model" and value.strip():
            return " ".join(value.split())
    return None


def driver_gpus(root: str = "/proc/driver/nvidia/gpus") -> tuple[str, ...] | None:
    """The models of the GPUs the NVIDIA driver shows this process (a container sees only its
    own), read from /proc without starting CUDA; None when the driver shows nothing here."""
    try:
        folders = sorted(Path(root).iterdir())
    except OSError:
        return None
    models = []
    for folder in folders:
        try:
            model = parse_driver_information((folder / "information").read_text())
        except OSError:
            continue
        if model:
            models.append(model)
    return tuple(models) or None


def query_gpu_system(env: Mapping[str, str] | None = None) -> GpuSystem:
    """NVML, nvidia-smi topo -m (network cards), /proc/modules, /dev/infiniband (never raises)."""
    env = os.environ if env is None else env
    modules: set[str] = set()
    try:
        modules = parse_proc_modules(Path("/proc/modules").read_text())
    except OSError:
        if shutil.which("lsmod"):
            modules = parse_proc_modules(_run(["lsmod"])[1])
    peermem = any(m in modules for m in PEERMEM_MODULES)
    try:
        ib = tuple(sorted(p.name for p in Path("/dev/infiniband").iterdir()))
    except OSError:
        ib = ()
    nvml = query_nvml()
    nics: tuple[str, ...] = ()
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if nvml.gpus and smi is not None:
        rc, topo_text = _run([smi, "topo", "-m"])
        nics = parse_topo_nics(topo_text) if rc == 0 else ()
    return GpuSystem(nvml, nics, peermem, ib)


MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"


def mps_active(
    env: Mapping[str, str] | None = None, exists: Callable[[str], bool] = os.path.exists
) -> bool:
    """Whether the CUDA MPS daemon serves this environment: its control pipe
    ``$CUDA_MPS_PIPE_DIRECTORY/control`` (default ``/tmp/nvidia-mps/control``) exists. With MPS
    the ranks sharing a GPU run their kernels side by side instead of time-slicing it, which
    changes every timing of ranks on one GPU (a fact to report with them)."""
    env = os.environ if env is None else env
    pipe_dir = env.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT
    return bool(exists(os.path.join(pipe_dir, "control")))


def visible_devices(env: Mapping[str, str], physical: int) -> list[str]:
    """The GPU identifiers this process may use: CUDA_VISIBLE_DEVICES (indices, UUIDs, MIG ids)
    up to the first invalid entry, as CUDA does; all ``physical`` GPUs when it is unset."""
    raw = env.get("CUDA_VISIBLE_DEVICES")
    if raw is None:
        return [str(i) for i in range(physical)]
    out: list[str] = []
    for item in (s.strip() for s in raw.split(",")):
        if not item:
            break
        if item.lstrip("-").isdigit() and (int(item) < 0 or (physical and int(item) >= physical)):
            break  # CUDA stops at the first invalid ordinal
        out.append(item)
    return out


def gpu_for_local_rank(local_rank: int, visible: Sequence[str]) -> str | None:
    """The device a rank binds to under cudampi's rule: ``local_rank % n_visible``."""
    if not visible:
        return None
    return visible[local_rank % len(visible)]
