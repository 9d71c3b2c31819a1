"""Parsers of the topology the physical-limit line comes from.

The samples follow the layout nvidia-smi prints (`nvidia-smi nvlink --status`: a `GPU i: name
(UUID: ...)` line, then one `Link k: <rate> GB/s` or `Link k: <inactive>` line per link; the csv
query: `gen, width`)."""

from __future__ import annotations

import pytest

from cudampi.bench.limits import PCIE_LANE_GBPS, parse_nvlink_status, parse_pcie_query

NVLINK_2GPU = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-aaaa)
\t Link 0: 26.562 GB/s
\t Link 1: 26.562 GB/s
\t Link 2: 26.562 GB/s
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-bbbb)
\t Link 0: 26.562 GB/s
"""

INACTIVE = """GPU 0: NVIDIA H200 (UUID: GPU-cccc)
\t Link 0: <inactive>
\t Link 1: <inactive>
"""


def test_nvlink_sums_the_links_of_the_asked_gpu():
    assert parse_nvlink_status(NVLINK_2GPU, 0) == pytest.approx(3 * 26.562)
    assert parse_nvlink_status(NVLINK_2GPU, 1) == pytest.approx(26.562)
    assert parse_nvlink_status(NVLINK_2GPU, 5) is None


def test_inactive_or_absent_links_give_none():
    assert parse_nvlink_status(INACTIVE, 0) is None
    assert parse_nvlink_status("", 0) is None


def test_pcie_rate_is_lane_rate_times_width():
    assert parse_pcie_query("5, 16\n") == pytest.approx(PCIE_LANE_GBPS[5] * 16)
    assert parse_pcie_query("4, 8") == pytest.approx(PCIE_LANE_GBPS[4] * 8)
    assert parse_pcie_query("[N/A], [N/A]") is None
    assert parse_pcie_query("") is None
