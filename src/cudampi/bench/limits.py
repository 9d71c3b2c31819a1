"""The physical ceiling a benchmark is drawn against.

- ranks sharing one GPU: every byte they exchange crosses that GPU's HBM, so the limit is the
  HBM copy rate, measured here (one rank copying alone, device to device);
- one GPU per rank on one node: the GPU's NVLink rate (sum of its active links, from
  ``nvidia-smi nvlink --status``), else its PCIe link rate (generation x width);
- the CPU machine: the host memory copy rate, measured the same way.

``parse_*`` are pure; :func:`physical_limit` is the thin collective wrapper (rank 0 measures and
queries, every rank gets the same answer).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import TYPE_CHECKING, Any

from cudampi.bench.results import Limit

if TYPE_CHECKING:
    from cudampi.bench.arrays import ArrayLib
    from cudampi.bench.runner import Runner

PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
"""Usable GB/s per lane and direction after line encoding, per PCIe generation."""

_LINK = re.compile(r"^\s*Link\s+(\d+)\s*:\s*([0-9.]+)\s*GB/s", re.MULTILINE)
_GPU = re.compile(r"^GPU\s+(\d+)\s*:", re.MULTILINE)


def parse_nvlink_status(text: str, gpu: int = 0) -> float | None:
    """Sum of the active link rates of ``gpu`` in ``nvidia-smi nvlink --status`` output.

    None when the GPU has no active link (lines such as ``Link 0: <inactive>`` or no links).
    """
    blocks = list(_GPU.finditer(text))
    body = text
    for i, m in enumerate(blocks):
        if int(m.group(1)) == gpu:
            end = blocks[i + 1].start() if i + 1 < len(blocks) else len(text)
            body = text[m.end() : end]
            break
    else:
        if blocks:
            return None
    rates = [float(m.group(2)) for m in _LINK.finditer(body)]
    total = sum(rates)
    return total if total > 0 else None


def parse_pcie_query(text: str) -> float | None:
    """GB/s of ``nvidia-smi --query-gpu=pcie.link.gen.max,pcie.link.width.max
    --format=csv,noheader,nounits`` (first line: ``5, 16``)."""
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 2 and parts[0].isdigit() and parts[1].isdigit():
            gen, width = int(parts[0]), int(parts[1])
            if gen in PCIE_LANE_GBPS and width > 0:
                return PCIE_LANE_GBPS[gen] * width
    return None


def _nvidia_smi(args: list[str]) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        out = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout if out.returncode == 0 else None


def query_link_limit(gpu: int) -> Limit | None:
    """NVLink rate of ``gpu`` when it has active links, else its PCIe rate; None if unknown."""
    text = _nvidia_smi(["nvlink", "--status", "-i", str(gpu)])
    if text:
        rate = parse_nvlink_status(text, gpu)
        if rate:
            return Limit(
                "nvlink", rate, f"nvidia-smi nvlink --status -i {gpu}: active links summed"
            )
    text = _nvidia_smi(
        [
            "--query-gpu=pcie.link.gen.max,pcie.link.width.max",
            "--format=csv,noheader,nounits",
            "-i",
            str(gpu),
        ]
    )
    if text:
        rate = parse_pcie_query(text)
        if rate:
            return Limit("pcie", rate, f"nvidia-smi PCIe gen x width of GPU {gpu}: {text.strip()}")
    return None


def measure_copy_gbps(lib: ArrayLib, nbytes: int, iters: int = 10) -> float:
    """Bytes per second (GB/s, 1e9) of copying ``nbytes`` from one buffer to another with ``lib``."""
    count = max(nbytes // 4, 1)
    src = lib.pattern(count, 0, "sum", "float32")
    dst = lib.empty((count,), "float32")
    lib.copy_into(dst, src)
    lib.sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        lib.copy_into(dst, src)
    lib.sync()
    dt = (time.perf_counter() - t0) / iters
    return count * 4 / 1e9 / dt if dt > 0 else 0.0


def physical_limit(runner: Runner) -> Limit | None:
    """The limit for this job (collective: rank 0 decides, every rank returns the same)."""
    from cudampi.bench.runner import lib_kind

    s = runner.s
    limit: Any = None
    if s.rank == 0:
        try:
            limit = _decide(runner, lib_kind)
        except Exception:  # a limit we cannot find only leaves the line off the plot
            limit = None
    data = s.comm.bcast(limit.to_json() if limit else None, root=0)
    return Limit(**data) if data else None


def _decide(runner: Runner, lib_kind: Any) -> Limit | None:
    s = runner.s
    if s.nodes > 1:
        return None  # the network's rate is not something the topology tells us
    if s.device == "cuda" and not s.shares_gpu and s.gpu_index is not None:
        found = query_link_limit(s.gpu_index)
        if found is not None:
            return found
    size = min(max(runner.spec.sizes), 256 << 20)
    size = max(size, 1 << 20)
    lib = runner.lib(lib_kind("copy", runner.spec.array, s.device, "float32"))
    gbps = measure_copy_gbps(lib, size)
    if s.device == "cuda":
        why = f"{s.local_size} ranks share {s.gpus} GPU(s)" if s.shares_gpu else "no link info"
        return Limit("hbm-copy", gbps, f"{why}: device copy of {size} B, one rank alone")
    return Limit("host-copy", gbps, f"host memory copy of {size} B, one rank alone")
