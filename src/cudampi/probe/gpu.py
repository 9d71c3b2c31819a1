"""GPUs and the software around them: nvidia-smi (count, model, NVLink/PCIe topology), NVML,
GPUDirect RDMA (nvidia_peermem, /dev/infiniband), NCCL, torch and its distributed backends, CuPy.

torch, CuPy and NVML are imported in a child ``python`` (:func:`query_python_gpu`), so a broken
CUDA install or a slow torch import cannot crash or stall the doctor itself.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str | None = None


@dataclass(frozen=True)
class Topology:
    """``nvidia-smi topo -m``: the link type between every pair of GPUs."""

    gpus: tuple[str, ...] = ()
    links: dict[str, dict[str, str]] = field(default_factory=dict)
    """``links["GPU0"]["GPU1"] == "NV18"``; NICs (``mlx5_0``...) appear as rows and columns too."""
    cpu_affinity: dict[str, str] = field(default_factory=dict)
    numa_affinity: dict[str, str] = field(default_factory=dict)

    @property
    def nics(self) -> tuple[str, ...]:
        return tuple(k for k in self.links if k not in self.gpus)

    def gpu_link(self, a: str, b: str) -> str | None:
        return self.links.get(a, {}).get(b)

    @property
    def summary(self) -> str:
        """``NVLink (NV18) between all 8 GPUs`` / ``PCIe only (PHB, SYS)`` / ``1 GPU``."""
        kinds = sorted(
            {
                self.links[a][b]
                for a in self.gpus
                for b in self.gpus
                if a != b and b in self.links.get(a, {})
            }
        )
        if len(self.gpus) <= 1:
            return f"{len(self.gpus)} GPU"
        nv = [k for k in kinds if k.startswith("NV")]
        if nv and len(nv) == len(kinds):
            return f"NVLink ({', '.join(nv)}) between all {len(self.gpus)} GPUs"
        if nv:
            return f"mixed: NVLink ({', '.join(nv)}) and PCIe ({', '.join(k for k in kinds if k not in nv)})"
        return f"PCIe only ({', '.join(kinds)}): no NVLink"


_GPU_L = re.compile(r"^GPU (\d+):\s*(.+?)(?:\s+\(UUID:\s*([^)]+)\))?\s*$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_nvidia_smi_L(text: str) -> list[Gpu]:
    """``nvidia-smi -L`` lines ``GPU 0: NVIDIA H200 (UUID: GPU-...)`` (MIG lines are skipped)."""
    out: list[Gpu] = []
    for line in text.splitlines():
        if m := _GPU_L.match(line.strip()):
            out.append(Gpu(int(m.group(1)), m.group(2).strip(), m.group(3)))
    return out


def parse_topo_m(text: str) -> Topology:
    """``nvidia-smi topo -m``: a tab-separated matrix, then a legend (ignored)."""
    lines = [_ANSI.sub("", raw).rstrip() for raw in text.splitlines()]
    header: list[str] | None = None
    links: dict[str, dict[str, str]] = {}
    cpu: dict[str, str] = {}
    numa: dict[str, str] = {}
    for line in lines:
        if not line.strip():
            if header is not None and links:
                break
            continue
        # nvidia-smi separates columns with tabs; fall back to runs of spaces if a copy lost them
        sep = "\t" if "\t" in line else r" {2,}"
        cells = [c.strip() for c in re.split(sep, line)]
        if header is None:
            if "GPU0" in cells:
                header = [c for c in cells if c]
            continue
        row, values = cells[0], cells[1:]
        if not row or row.startswith("Legend"):
            break
        devices = [h for h in header if re.match(r"^(GPU\d+|NIC\d+|mlx\w+|\w+_\d+)$", h)]
        links[row] = {dev: values[i] for i, dev in enumerate(devices) if i < len(values)}
        rest = values[len(devices) :]
        named = [h for h in header if h not in devices]
        for i, name in enumerate(named):
            if i < len(rest) and rest[i]:
                if name == "CPU Affinity":
                    cpu[row] = rest[i]
                elif name == "NUMA Affinity":
                    numa[row] = rest[i]
    gpus = tuple(k for k in links if re.match(r"^GPU\d+$", k))
    return Topology(gpus, links, cpu, numa)


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
    """What torch, CuPy and NVML report in a child interpreter."""

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
    nvml_driver: str | None = None
    nvml_devices: tuple[str, ...] = ()
    libnccl: str | None = None
    error: str | None = None

    @property
    def gpu_count(self) -> int:
        return max(len(self.torch_devices), self.cupy_devices or 0, len(self.nvml_devices))

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
    import pynvml
    pynvml.nvmlInit()
    d = pynvml.nvmlSystemGetDriverVersion()
    out["nvml_driver"] = d.decode() if isinstance(d, bytes) else str(d)
    names = []
    for i in range(pynvml.nvmlDeviceGetCount()):
        n = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))
        names.append(n.decode() if isinstance(n, bytes) else str(n))
    out["nvml_devices"] = names
except Exception:
    pass
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
        nvml_driver=d.get("nvml_driver"),
        nvml_devices=tuple(d.get("nvml_devices", ())),
        libnccl=parse_nccl_version_code(int(code)) if isinstance(code, int) and code > 0 else None,
    )


class PythonGpuProbe:
    """The torch/CuPy/NVML child, started now and collected later, so that its slow torch import
    overlaps the runtime probes (``query_python_gpu`` is start + result)."""

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


def query_python_gpu(
    python: str | None = None, env: Mapping[str, str] | None = None, timeout: float = 180.0
) -> PythonGpu:
    """Run the torch/CuPy/NVML/NCCL child in ``python`` and parse its report (never raises)."""
    return PythonGpuProbe(python, env, timeout).result()


@dataclass(frozen=True)
class GpuSystem:
    """nvidia-smi and kernel facts."""

    nvidia_smi: str | None = None
    gpus: tuple[Gpu, ...] = ()
    topology: Topology | None = None
    peermem_loaded: bool = False
    infiniband: tuple[str, ...] = ()
    """Entries of /dev/infiniband (uverbs0, rdma_cm...)."""
    error: str | None = None


def _run(argv: list[str], timeout: float = 30.0) -> tuple[int, str]:
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return -1, str(exc)
    return proc.returncode, proc.stdout


def query_gpu_system(env: Mapping[str, str] | None = None) -> GpuSystem:
    """nvidia-smi -L, nvidia-smi topo -m, /proc/modules, /dev/infiniband (never raises)."""
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
    smi = shutil.which("nvidia-smi", path=env.get("PATH"))
    if smi is None:
        return GpuSystem(None, (), None, peermem, ib)
    rc, out = _run([smi, "-L"])
    if rc != 0:
        return GpuSystem(
            smi, (), None, peermem, ib, error=f"nvidia-smi -L exited {rc}: {out[-200:]!r}"
        )
    gpus = tuple(parse_nvidia_smi_L(out))
    rc, topo_text = _run([smi, "topo", "-m"])
    topo = parse_topo_m(topo_text) if rc == 0 else None
    return GpuSystem(smi, gpus, topo, peermem, ib)
