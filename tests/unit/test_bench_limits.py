"""The physical-limit line from NVML's facts of one GPU: NVLink (active links x speed), else
PCIe (generation x width)."""

from __future__ import annotations

import pytest

from cudampi.bench.limits import PCIE_LANE_GBPS, link_limit
from cudampi.probe.nvml import GpuInfo, NvLink


def gpu(**kw):
    return GpuInfo(0, "NVIDIA H100 80GB HBM3", None, "0000:18:00.0", **kw)


def test_nvlink_is_the_active_links_times_their_speed():
    links = tuple(NvLink(i, i < 16, 4, "0000:28:00.0") for i in range(18))
    limit = link_limit(gpu(nvlinks=links, nvlink_mbps=25781, pcie_gen=5, pcie_width=16))
    assert limit is not None and limit.kind == "nvlink"
    assert limit.gbps == pytest.approx(16 * 25.781)
    assert "16 active NVLinks x 25.781 GB/s" in limit.source


def test_without_active_links_the_pcie_rate_is_lane_rate_times_width():
    inactive = tuple(NvLink(i, False) for i in range(18))
    limit = link_limit(gpu(nvlinks=inactive, pcie_gen=4, pcie_width=16, pcie_max_gen=5))
    assert limit is not None and limit.kind == "pcie"
    assert limit.gbps == pytest.approx(PCIE_LANE_GBPS[5] * 16)  # the link's maximum
    assert link_limit(gpu()) is None  # NVML said nothing usable
