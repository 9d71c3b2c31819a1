"""NVML's answers -> cudampi's GPU facts (cudampi.probe.nvml), without a GPU: an NVML stand-in
answers as the H200 machine's NVML does, with the values its captured nvidia-smi outputs show
(tests/fixtures/device-h200-1gpu), and as an 8-GPU NVLink machine for the pair mapping. The
real NVML is read on the GPU machine (tests/gpu/test_doctor_gpu.py)."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pynvml
import pytest

from cudampi.doctor.checks import check_gpus
from cudampi.probe.gpu import GpuSystem, PythonGpu, parse_topo_nics
from cudampi.probe.nvml import (
    NvmlSystem,
    cpulist,
    cpus_of_mask,
    query_nvml,
    read_nvml,
    sysfs_bus_id,
)


class FakeNvml:
    """Answers like nvidia-ml-py's pynvml for a list of GPUs (dicts); unsupported -> NVMLError."""

    NVMLError = pynvml.NVMLError
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, gpus, driver, topology=None, p2p=None):
        self.gpus, self.driver = gpus, driver
        self.topology = topology or {}
        self.p2p = p2p or {}

    def _nope(self):
        return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlSystemGetDriverVersion(self):
        return self.driver

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return self.gpus[h]["name"]

    def nvmlDeviceGetUUID(self, h):
        return self.gpus[h]["uuid"]

    def nvmlDeviceGetPciInfo(self, h):
        return SimpleNamespace(busId=self.gpus[h]["bus"].encode())

    def nvmlDeviceGetNumaNodeId(self, h):
        return self.gpus[h]["numa"]

    def nvmlDeviceGetCpuAffinity(self, h, words):
        mask = [0] * words
        for c in self.gpus[h]["cpus"]:
            mask[c // 64] |= 1 << (c % 64)
        return mask

    def _pcie(self, h, key):
        if key not in self.gpus[h]:
            raise self._nope()
        return self.gpus[h][key]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return self._pcie(h, "gen")

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return self._pcie(h, "width")

    def nvmlDeviceGetMaxPcieLinkGeneration(self, h):
        return self._pcie(h, "max_gen")

    def nvmlDeviceGetMaxPcieLinkWidth(self, h):
        return self._pcie(h, "max_width")

    def _link(self, h, link):
        links = self.gpus[h].get("nvlinks", [])
        if link >= len(links):
            raise self._nope()
        return links[link]

    def nvmlDeviceGetNvLinkState(self, h, link):
        return 1 if self._link(h, link) is not None else 0

    def nvmlDeviceGetNvLinkVersion(self, h, link):
        self._link(h, link)
        return 4

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        peer = self._link(h, link)
        if peer is None:
            raise self._nope()
        return SimpleNamespace(busId=self.gpus[peer]["bus"])

    def nvmlDeviceGetFieldValues(self, h, fields):
        return [SimpleNamespace(nvmlReturn=0, value=SimpleNamespace(uiVal=25781))]

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return self.topology[(a, b)]

    def nvmlDeviceGetP2PStatus(self, a, b, index):
        assert index == 0  # the read capability
        return self.p2p.get((a, b), 0)


@pytest.fixture(scope="module")
def h200(fixtures_dir):
    """The H200 machine's one GPU, every value read from its captured nvidia-smi outputs."""
    d = fixtures_dir / "device-h200-1gpu"
    query = (d / "nvidia-smi-query.csv").read_text().splitlines()[1].split(", ")
    uuid = re.search(r"UUID: (GPU-[0-9a-f-]+)", (d / "nvidia-smi-L.txt").read_text()).group(1)
    topo = re.sub(r"\x1b\[[0-9;]*m", "", (d / "nvidia-smi-topo-m.txt").read_text())
    row = next(ln for ln in topo.splitlines() if ln.startswith("GPU0\t")).split("\t")
    lo, hi = map(int, row[2].split("-"))  # "CPU Affinity" 0-15
    gpu = {
        "name": query[1],
        "bus": query[2],
        "uuid": uuid,
        "numa": int(row[3]),
        "cpus": set(range(lo, hi + 1)),
    }
    return FakeNvml([gpu], driver=query[4]), query, uuid


def test_the_h200_machine_as_nvml_describes_it(h200):
    nvml, query, uuid = h200
    system = read_nvml(nvml, cpu_count=16)
    (g,) = system.gpus
    assert (g.index, g.name, g.uuid) == (0, "NVIDIA H200", uuid)
    assert g.bus_id == "0000:00:06.0" == sysfs_bus_id(query[2])  # the form sysfs and CUDA use
    assert g.numa_node == 0 and g.cpus == frozenset(range(16)) and cpulist(g.cpus) == "0-15"
    assert g.nvlinks == () and g.pcie_gen is None  # not in the capture: unsupported -> None
    assert system.driver == "580.159.04" and system.summary == "1 GPU" and system.links == {}
    assert system.gpu_lines() == ["GPU0 0000:00:06.0: PCIe ?, NUMA 0, CPUs 0-15"]
    check = check_gpus(GpuSystem(system), PythonGpu(torch_devices=("NVIDIA H200",)))
    assert check.status == "ok" and check.detail.startswith("1 x NVIDIA H200; topology: 1 GPU")
    assert "driver 580.159.04" in check.detail


def _eight_gpus():
    gpus = []
    for i in range(8):
        # 18 NVLinks to the NVSwitches; here every link reaches one other GPU in turn
        peers = [(i + 1 + k % 7) % 8 for k in range(18)]
        gpus.append(
            {
                "name": "NVIDIA H100 80GB HBM3",
                "bus": f"00000000:{0x18 + i * 0x10:02X}:00.0",
                "uuid": f"GPU-{i}",
                "numa": i // 4,
                "cpus": set(range(56 * (i // 4), 56 * (i // 4 + 1))),
                "gen": 5,
                "width": 16,
                "max_gen": 5,
                "max_width": 16,
                "nvlinks": peers,
            }
        )
    return gpus


def test_nvlink_counts_p2p_and_pcie_words_between_pairs():
    gpus = _eight_gpus()
    system = read_nvml(FakeNvml(gpus, "570.86.15"), cpu_count=112)
    assert system.links[(0, 1)].startswith("NV") and system.summary.startswith("NVLink (")
    assert sum(int(system.links[(0, j)][2:]) for j in range(1, 8)) == 18
    g = system.gpus[5]
    assert g.active_nvlinks == 18 and g.nvlink_mbps == 25781 and g.numa_node == 1
    assert cpulist(g.cpus) == "56-111" and (g.pcie_gen, g.pcie_width) == (5, 16)
    assert (
        "GPU5 0000:68:00.0: PCIe gen 5 x16, NVLink 18/18 active at 25.781 GB/s each"
        in (system.gpu_lines()[5])
    )
    # no NVLink: the PCIe path in nvidia-smi topo -m's words, and P2P as NVML says it
    for gpu in gpus:
        gpu["nvlinks"] = []
    topology = {(a, b): 30 if a // 4 == b // 4 else 50 for a in range(8) for b in range(8)}
    pcie = read_nvml(FakeNvml(gpus, "570", topology, {(0, 4): 1}), cpu_count=112)
    assert pcie.links[(0, 1)] == "PHB" and pcie.links[(0, 4)] == "SYS"
    assert pcie.summary == "PCIe only (PHB, SYS): no NVLink"
    assert pcie.p2p[(0, 4)] == "CNS" and pcie.p2p[(0, 1)] == "OK"
    check = check_gpus(GpuSystem(pcie), PythonGpu(torch_devices=("x",) * 8))
    assert "P2P not supported: GPU0->GPU4: CNS" in check.detail


def test_masks_lists_and_bus_ids():
    assert cpus_of_mask([0b1011, 1]) == {0, 1, 3, 64}
    assert cpulist({0, 1, 2, 3, 8, 10, 11}) == "0-3,8,10-11"
    assert sysfs_bus_id("00000000:3B:00.0") == "0000:3b:00.0"


def test_no_driver_here_is_an_empty_result_with_the_reason():
    system = query_nvml()
    if system.gpus:
        pytest.skip("this machine has a GPU: tests/gpu covers it")
    assert system.error and "NVML" in system.error and system.summary == "0 GPU"
    assert NvmlSystem().gpu_lines() == []


def test_network_cards_from_topo_m(fixtures_dir):
    one = (fixtures_dir / "device-h200-1gpu" / "nvidia-smi-topo-m.txt").read_text()
    assert parse_topo_nics(one) == ()
    newer = (
        "\tGPU0\tGPU1\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\n"
        "GPU0\t X \tNV18\tPIX\tSYS\t0-55\t0\n\nNIC Legend:\n\n  NIC0: mlx5_0\n  NIC1: mlx5_1\n"
    )
    assert parse_topo_nics(newer) == ("mlx5_0", "mlx5_1")
    older = "\tGPU0\tmlx5_0\tCPU Affinity\nGPU0\t X \tPIX\t0-23\n"
    assert parse_topo_nics(older) == ("mlx5_0",)
