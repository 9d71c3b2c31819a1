"""The job doctor's GPU rows on the GPU machine: ``cudampi doctor --hosts localhost`` runs the
node doctor through ``cudampi launch`` (one rank, this node) with the wheels + libucx-cu13
recipe, and reports this node's GPU links: the ipc engine (bandwidth, latency, whether the MPS
daemon served it: run it with MPS off and on) and the copy rate between each pair of GPUs that
can reach each other (n/a on a machine of one GPU), beside its GPU rows in the table.

Run with MPS off then on: ``IPC_FILES=tests/gpu/test_doctor_job_gpu.py bash tools/gpu-session.sh
ipctests`` (CUDAMPI_TEST_WHEEL_PYTHON: the venv with the wheels; this python otherwise).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cudampi.probe.gpu import mps_active
from cudampi.probe.nvml import query_nvml

pytestmark = pytest.mark.gpu
ROOT = Path(__file__).resolve().parents[2]


def test_the_job_doctor_reports_this_nodes_gpu_links(tmp_path: Path):
    python = os.environ.get("CUDAMPI_TEST_WHEEL_PYTHON") or sys.executable
    try:
        import libucx  # noqa: F401
    except ImportError:
        pytest.skip("needs the libucx-cu13 wheel (the CUDA-aware recipe) beside this python")
    saved = tmp_path / "job.json"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
        "CUDAMPI_CACHE_DIR": str(tmp_path / "cache"),
    }
    p = subprocess.run(
        [python, "-m", "cudampi", "doctor", "--hosts", "localhost", "--preload-ucx",
         "--size", "16M", "--save-json", str(saved)],
        capture_output=True, text=True, timeout=560, env=env, cwd=ROOT,
    )  # fmt: skip
    assert saved.exists() and "Traceback" not in p.stderr, p.stdout + p.stderr[-4000:]
    report = json.loads(saved.read_text())
    node = report["facts"]["localhost"]
    gpus = query_nvml().gpus
    links = node["gpu_links"]
    assert links["gpus"] == len(gpus) >= 1, links
    ipc = links["ipc"]
    assert ipc["status"] == "ok", ipc
    assert ipc["gbps"] > 1 and 0 < ipc["latency_us"] < 10_000, ipc
    assert ipc["mps"] is mps_active(), (ipc, os.environ.get("CUDA_MPS_PIPE_DIRECTORY"))
    peer = links["copy_peer"]
    if len(gpus) == 1:
        assert peer == {"status": "n/a", "detail": "one GPU: no GPU-to-GPU link"}, peer
    else:
        assert peer["status"] == "ok", peer
        assert peer["gbps"] and all(g > 1 for g in peer["gbps"].values()), peer
    assert node["rows"]["GPUs"].startswith(f"{len(gpus)} x NVIDIA"), node["rows"]
    assert node["rows"]["CUDA-aware MPI"] in ("yes", "p2p only"), node["rows"]
    assert node["device_p2p"] is True and node["cache"]["keys"], node["cache"]
    assert "[GPU links] inside each node" in p.stdout, p.stdout
    line = next(ln for ln in p.stdout.splitlines() if ln.startswith("  localhost ("))
    assert "ipc engine" in line and "GB/s" in line and ("(MPS)" in line) is mps_active(), line
