"""The physical ceiling a benchmark is drawn against.

- ranks sharing one GPU: every byte they exchange crosses that GPU's HBM, so the limit is the
  HBM copy rate, measured here (one rank copying alone, device to device, :data:`COPY_BYTES`:
  out of the GPU's L2);
- one GPU per rank on one node: the GPU's NVLink rate (its active links times their speed, from
  NVML), else its PCIe link rate (generation x width, from NVML);
- the CPU machine: the host memory copy rate, measured the same way (out of the CPU's caches).

:func:`link_limit` is pure (NVML's facts of one GPU in); :func:`physical_limit` is the thin
collective wrapper (rank 0 measures and queries, every rank gets the same answer).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cudampi.bench.results import Limit

if TYPE_CHECKING:
    from cudampi.bench.session import Session
    from cudampi.comm.arrays import Checks
    from cudampi.probe.nvml import GpuInfo

PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}
"""Usable GB/s per lane and direction after line encoding, per PCIe generation."""


def link_limit(gpu: GpuInfo) -> Limit | None:
    """NVLink rate of ``gpu`` when it has active links, else its PCIe rate; None if unknown."""
    if gpu.active_nvlinks and gpu.nvlink_mbps:
        rate = gpu.active_nvlinks * gpu.nvlink_mbps / 1000
        return Limit(
            "nvlink",
            rate,
            f"NVML: GPU{gpu.index} {gpu.active_nvlinks} active NVLinks x "
            f"{gpu.nvlink_mbps / 1000:g} GB/s",
        )
    gen, width = gpu.pcie_max_gen or gpu.pcie_gen, gpu.pcie_max_width or gpu.pcie_width
    if gen in PCIE_LANE_GBPS and width:
        return Limit(
            "pcie", PCIE_LANE_GBPS[gen] * width, f"NVML: GPU{gpu.index} PCIe gen {gen} x{width}"
        )
    return None


def query_link_limit(gpu: int) -> Limit | None:
    """:func:`link_limit` of this machine's GPU ``gpu`` (NVML's numbering: PCI order)."""
    from cudampi.probe.nvml import query_nvml

    gpus = query_nvml().gpus
    return link_limit(gpus[gpu]) if 0 <= gpu < len(gpus) else None


COPY_BYTES = 256 << 20
"""The smallest copy the memory limits are measured with, whatever the sweep's sizes: past a
data-centre GPU's L2 (50-60 MB) many times over, so the line is the memory's rate; a copy that
fits a cache measures the cache, several times faster. On the host it grows with the CPU's
last-level cache (:func:`copy_bytes`)."""


def parse_cache_sizes(texts: list[str]) -> int:
    """The largest of sysfs' cache ``size`` files (``48K``, ``2048K``, ``300M``), in bytes."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    out = 0
    for text in texts:
        t = text.strip()
        if t[:-1].isdigit() and t[-1:] in units:
            out = max(out, int(t[:-1]) * units[t[-1]])
        elif t.isdigit():
            out = max(out, int(t))
    return out


def host_cache_bytes() -> int:
    """The CPU's largest cache (its last level), from sysfs; 0 where it does not say."""
    from pathlib import Path

    texts = []
    for f in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        try:
            texts.append(f.read_text())
        except OSError:
            continue
    return parse_cache_sizes(texts)


def copy_bytes(device: str, cache: int) -> int:
    """The bytes one copy moves to measure ``device``'s memory and not a cache: a copy reads and
    writes twice its size, so twice the last-level cache keeps its footprint four times the
    cache (pure)."""
    return COPY_BYTES if device == "cuda" else max(COPY_BYTES, 2 * cache)


def measure_copy_gbps(lib: Checks, nbytes: int, iters: int = 3) -> float:
    """Bytes per second (GB/s, 1e9) of copying ``nbytes`` from one buffer to another with ``lib``."""
    count = max(nbytes // 4, 1)
    src, dst = lib.empty((count,), "float32"), lib.empty((count,), "float32")
    lib.fill(src, 1.0)  # every page written: an untouched one reads as the shared zero page
    lib.copy_into(dst, src)
    lib.sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        lib.copy_into(dst, src)
    lib.sync()
    dt = (time.perf_counter() - t0) / iters
    return count * 4 / 1e9 / dt if dt > 0 else 0.0


def physical_limit(s: Session, copy_lib: Callable[[], Checks]) -> Limit | None:
    """The limit for this job (collective: rank 0 decides, every rank returns the same).
    ``copy_lib`` gives the array library the memory's copy rate is measured with."""
    limit: Any = None
    if s.rank == 0:
        try:
            limit = decide(s, copy_lib)
        except Exception:  # a limit we cannot find only leaves the line off the plot
            limit = None
    data = s.comm.bcast(limit.to_json() if limit else None, root=0)
    return Limit(**data) if data else None


def decide(s: Session, copy_lib: Callable[[], Checks]) -> Limit | None:
    """The limit of ``s``'s machine, found on the calling rank alone."""
    if s.nodes > 1:
        return None  # the network's rate is not something the topology tells us
    if s.device == "cuda" and not s.shares_gpu and s.gpu_index is not None:
        found = query_link_limit(s.gpu_index)
        if found is not None:
            return found
    size = copy_bytes(s.device, 0 if s.device == "cuda" else host_cache_bytes())
    gbps = measure_copy_gbps(copy_lib(), size)
    copy = f"copy of {size >> 20} MiB (out of cache), one rank alone"
    if s.device == "cuda":
        why = f"{s.local_size} ranks share {s.gpus} GPU(s)" if s.shares_gpu else "no link info"
        return Limit("hbm-copy", gbps, f"{why}: device {copy}")
    return Limit("host-copy", gbps, f"host memory {copy}")
