"""GPU facts from NVML (nvidia-ml-py): PCI ids, UUIDs, the link between every pair of GPUs
(NVLink count or the PCIe path), P2P support, NVLink state, version and speed, PCIe generation
and width, CPU affinity and NUMA node. No CUDA context is made; without a driver the result is
empty with the reason.

:func:`read_nvml` asks only the ``nvml`` object it is given (the ``pynvml`` module of
nvidia-ml-py, or a stand-in in the tests), so the mapping from NVML's answers to these facts is
tested without a GPU. ``nvidia-smi topo -m`` stays only for what NVML does not list: network
cards (see :func:`cudampi.probe.gpu.query_gpu_system`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

TOPOLOGY_WORDS = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
"""NVML's common-ancestor levels in ``nvidia-smi topo -m``'s words (internal, single bridge,
multiple bridges, host bridge, NUMA node, across NUMA nodes)."""

P2P_WORDS = {0: "OK", 1: "CNS", 2: "GNS", 3: "TNS", 4: "DIS", 5: "NS", 6: "U"}
"""nvmlGpuP2PStatus: ok, chipset / GPU / IOH topology not supported, disabled by regkey, not
supported, unknown (``nvidia-smi topo -p2p r``'s words)."""

P2P_READ = 0
"""NVML_P2P_CAPS_INDEX_READ (nvidia-ml-py spells the constant as a 1-tuple)."""

NVLINK_SPEED_FIELD = 90
"""NVML_FI_DEV_NVLINK_SPEED_MBPS_COMMON: the common speed of a GPU's active links, MB/s."""


def sysfs_bus_id(bus_id: str) -> str:
    """NVML's/nvidia-smi's ``00000000:19:00.0`` as sysfs and CUDA name it: ``0000:19:00.0``."""
    b = bus_id.strip().lower()
    dom, _, rest = b.partition(":")
    if rest and len(dom) > 4:
        dom = dom[-4:]
    return f"{dom}:{rest}" if rest else b


def cpus_of_mask(words: Iterable[int], bits: int = 64) -> frozenset[int]:
    """CPU numbers set in NVML's affinity mask (an array of 64-bit words, word 0 = CPUs 0-63)."""
    out = set()
    for w, word in enumerate(words):
        value = int(word)
        for b in range(bits):
            if value >> b & 1:
                out.add(w * bits + b)
    return frozenset(out)


def cpulist(cpus: Iterable[int]) -> str:
    """``{0, 1, 2, 3, 8}`` -> ``0-3,8`` (the sysfs / nvidia-smi form)."""
    nums = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(nums):
        j = i
        while j + 1 < len(nums) and nums[j + 1] == nums[j] + 1:
            j += 1
        parts.append(str(nums[i]) if i == j else f"{nums[i]}-{nums[j]}")
        i = j + 1
    return ",".join(parts)


@dataclass(frozen=True)
class NvLink:
    link: int
    active: bool
    version: int | None = None
    remote_bus_id: str | None = None


@dataclass(frozen=True)
class GpuInfo:
    """One GPU as NVML sees it."""

    index: int
    name: str
    uuid: str | None
    bus_id: str
    """sysfs form: ``0000:19:00.0``."""
    numa_node: int | None = None
    cpus: frozenset[int] = frozenset()
    """The CPUs local to the GPU (its NUMA node's cores)."""
    pcie_gen: int | None = None
    pcie_width: int | None = None
    pcie_max_gen: int | None = None
    pcie_max_width: int | None = None
    nvlinks: tuple[NvLink, ...] = ()
    nvlink_mbps: int | None = None

    @property
    def active_nvlinks(self) -> int:
        return sum(1 for n in self.nvlinks if n.active)


@dataclass(frozen=True)
class NvmlSystem:
    """Every GPU, the link and P2P status of every pair, and the driver."""

    driver: str | None = None
    gpus: tuple[GpuInfo, ...] = ()
    links: dict[tuple[int, int], str] = field(default_factory=dict)
    """``links[(0, 1)] == "NV18"`` (18 NVLinks between them) or ``"PIX"``/``"PHB"``/``"SYS"``."""
    p2p: dict[tuple[int, int], str] = field(default_factory=dict)
    """``p2p[(0, 1)] == "OK"`` when GPU 0 can read GPU 1's memory directly."""
    error: str | None = None
    """Why NVML gave nothing (no driver, no library), or None."""

    @property
    def summary(self) -> str:
        """``NVLink (NV18) between all 8 GPUs`` / ``PCIe only (PHB, SYS): no NVLink`` / ``1 GPU``."""
        n = len(self.gpus)
        if n <= 1:
            return f"{n} GPU"
        kinds = sorted(set(self.links.values()))
        nv = [k for k in kinds if k.startswith("NV")]
        if nv and len(nv) == len(kinds):
            return f"NVLink ({', '.join(nv)}) between all {n} GPUs"
        if nv:
            pcie = ", ".join(k for k in kinds if k not in nv)
            return f"mixed: NVLink ({', '.join(nv)}) and PCIe ({pcie})"
        return f"PCIe only ({', '.join(kinds)}): no NVLink"

    def gpu_lines(self) -> list[str]:
        """One line per GPU: bus id, PCIe link, NVLinks, NUMA node and CPUs."""
        out = []
        for g in self.gpus:
            pcie = (
                f"PCIe gen {g.pcie_gen} x{g.pcie_width}"
                + (
                    f" (max gen {g.pcie_max_gen} x{g.pcie_max_width})"
                    if (g.pcie_max_gen, g.pcie_max_width) != (g.pcie_gen, g.pcie_width)
                    else ""
                )
                if g.pcie_gen
                else "PCIe ?"
            )
            nv = ""
            if g.nvlinks:
                speed = f" at {g.nvlink_mbps / 1000:g} GB/s each" if g.nvlink_mbps else ""
                nv = f", NVLink {g.active_nvlinks}/{len(g.nvlinks)} active{speed}"
            numa = f", NUMA {g.numa_node}" if g.numa_node is not None else ""
            cpus = f", CPUs {cpulist(g.cpus)}" if g.cpus else ""
            out.append(f"GPU{g.index} {g.bus_id}: {pcie}{nv}{numa}{cpus}")
        return out


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _try(nvml: Any, fn: str, *args: Any) -> Any:
    """One NVML call; None where the GPU or driver does not support it."""
    try:
        return getattr(nvml, fn)(*args)
    except (nvml.NVMLError, AttributeError):
        return None


def read_nvml(nvml: Any, cpu_count: int | None = None) -> NvmlSystem:
    """Ask ``nvml`` (nvidia-ml-py's ``pynvml``) everything; the caller has called nvmlInit."""
    ncpu = cpu_count or os.cpu_count() or 64
    words = max(1, (ncpu + 63) // 64)
    driver = _try(nvml, "nvmlSystemGetDriverVersion")
    handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
    gpus: list[GpuInfo] = []
    for i, h in enumerate(handles):
        pci = nvml.nvmlDeviceGetPciInfo(h)
        links: list[NvLink] = []
        for link in range(int(getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            state = _try(nvml, "nvmlDeviceGetNvLinkState", h, link)
            if state is None:
                break  # no NVLink on this GPU, or no more links
            remote = _try(nvml, "nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            links.append(
                NvLink(
                    link,
                    int(state) == 1,
                    _try(nvml, "nvmlDeviceGetNvLinkVersion", h, link),
                    sysfs_bus_id(_text(remote.busId)) if remote is not None else None,
                )
            )
        speed = None
        if links:
            fields = _try(nvml, "nvmlDeviceGetFieldValues", h, [NVLINK_SPEED_FIELD])
            if fields is not None and int(getattr(fields[0], "nvmlReturn", 0)) == 0:
                speed = int(fields[0].value.uiVal) or None
        mask = _try(nvml, "nvmlDeviceGetCpuAffinity", h, words)
        uuid = _try(nvml, "nvmlDeviceGetUUID", h)
        gpus.append(
            GpuInfo(
                index=i,
                name=_text(nvml.nvmlDeviceGetName(h)),
                uuid=_text(uuid) if uuid is not None else None,
                bus_id=sysfs_bus_id(_text(pci.busId)),
                numa_node=_try(nvml, "nvmlDeviceGetNumaNodeId", h),
                cpus=cpus_of_mask(mask) if mask is not None else frozenset(),
                pcie_gen=_try(nvml, "nvmlDeviceGetCurrPcieLinkGeneration", h),
                pcie_width=_try(nvml, "nvmlDeviceGetCurrPcieLinkWidth", h),
                pcie_max_gen=_try(nvml, "nvmlDeviceGetMaxPcieLinkGeneration", h),
                pcie_max_width=_try(nvml, "nvmlDeviceGetMaxPcieLinkWidth", h),
                nvlinks=tuple(links),
                nvlink_mbps=speed,
            )
        )
    pair_links: dict[tuple[int, int], str] = {}
    p2p: dict[tuple[int, int], str] = {}
    for a in gpus:
        for b in gpus:
            if a.index == b.index:
                continue
            nv = sum(1 for n in a.nvlinks if n.active and n.remote_bus_id == b.bus_id)
            if nv:
                pair_links[(a.index, b.index)] = f"NV{nv}"
            else:
                level = _try(
                    nvml,
                    "nvmlDeviceGetTopologyCommonAncestor",
                    handles[a.index],
                    handles[b.index],
                )
                pair_links[(a.index, b.index)] = TOPOLOGY_WORDS.get(
                    int(level) if level is not None else -1, "?"
                )
            status = _try(
                nvml, "nvmlDeviceGetP2PStatus", handles[a.index], handles[b.index], P2P_READ
            )
            p2p[(a.index, b.index)] = P2P_WORDS.get(int(status), "U") if status is not None else "U"
    return NvmlSystem(
        driver=_text(driver) if driver is not None else None,
        gpus=tuple(gpus),
        links=pair_links,
        p2p=p2p,
    )


def query_nvml() -> NvmlSystem:
    """NVML's facts of this machine (never raises: no driver is an empty result with the reason)."""
    try:
        import pynvml
    except ImportError as exc:
        return NvmlSystem(error=f"nvidia-ml-py is not installed ({exc}): pip install nvidia-ml-py")
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return NvmlSystem(error=f"NVML: {exc}")
    try:
        return read_nvml(pynvml)
    except pynvml.NVMLError as exc:
        return NvmlSystem(error=f"NVML: {exc}")
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass
