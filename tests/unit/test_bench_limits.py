"""The physical-limit line from NVML's facts of one GPU: NVLink (active links x speed), else
PCIe (generation x width)."""

from __future__ import annotations

import pytest

from cudampi.bench.limits import (
    COPY_BYTES,
    PCIE_LANE_GBPS,
    copy_bytes,
    decide,
    host_cache_bytes,
    link_limit,
    parse_cache_sizes,
)
from cudampi.bench.session import Session
from cudampi.comm.arrays import checks_for
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


def test_sysfs_cache_sizes():
    assert parse_cache_sizes(["48K\n", "32K\n", "2048K\n", "307200K\n"]) == 300 << 20
    assert parse_cache_sizes(["1M", "junk", ""]) == 1 << 20
    assert parse_cache_sizes([]) == 0


def test_the_memory_limit_is_measured_out_of_cache():
    # a 1 MiB copy fits a CPU's caches (the line then showed the cache's rate); the limit must
    # be memory's: a copy whose footprint is several times this machine's largest cache
    s = Session(None, None, 0, 2, 0, 2, 1, "cpu")
    limit = decide(s, lambda: checks_for("numpy", "cpu"))
    assert limit is not None and limit.kind == "host-copy" and limit.gbps > 0
    size = copy_bytes("cpu", host_cache_bytes())
    assert size >= COPY_BYTES and size >= 2 * host_cache_bytes()
    assert f"host memory copy of {size >> 20} MiB (out of cache)" in limit.source
    assert copy_bytes("cuda", 300 << 20) == COPY_BYTES >= 4 * (60 << 20)  # a GPU's L2
