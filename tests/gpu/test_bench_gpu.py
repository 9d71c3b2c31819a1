"""`cudampi bench` on the GPU machine: ranks sharing one GPU, device buffers on every path that
works there, the others skipped with a reason (never crashed), data checked."""

from __future__ import annotations

import json
import sys

import pytest

from tests.gpu.jobs import time_left
from tests.mpirun import mpi_env, mpiexec_argv, run_launched

pytestmark = [pytest.mark.gpu, pytest.mark.mpi]


def bench(n, *args, timeout=400):
    argv = [
        *mpiexec_argv(n),
        sys.executable,
        "-m",
        "cudampi",
        "bench",
        *args,
        "--device",
        "cuda",
        "--quiet",
        "--json",
    ]
    proc = run_launched(argv, mpi_env(), time_left(timeout), f"cudampi bench {args}")
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n{proc.stdout[-6000:]}\n{proc.stderr[-6000:]}"
    )
    return json.loads(proc.stdout)


@pytest.mark.parametrize("n", [2, 4])
def test_device_collectives_on_every_path_that_works(n):
    data = bench(
        n,
        "allreduce",
        "allgather",
        "broadcast",
        "-b",
        "8",
        "-e",
        "16M",
        "-f",
        "16",
        "-w",
        "2",
        "-n",
        "5",
    )
    assert data["meta"]["device"] == "cuda" and data["meta"]["ranks"] == n
    assert data["verdict"]["wrong"] == 0
    ran = {(r["op"], r["path"]) for r in data["results"]}
    for path in ("staged", "mpi", "copy", "torch-gloo"):
        assert any(p == path for _, p in ran), f"{path} did not run: {data['skipped']}"
    skipped = {(s["op"], s["path"]): s["reason"] for s in data["skipped"]}
    if data["meta"]["shares_gpu"]:
        assert "one GPU per rank" in skipped[("allreduce", "torch-nccl")]
        assert data["limit"]["kind"] == "hbm-copy" and data["limit"]["gbps"] > 100
    assert all(reason for reason in skipped.values())


def test_p2p_device_buffers():
    """cudampi's own paths, raw mpi4py and the torch peers, every size checked. The raw ``mpi``
    peer once delivered wrong bytes here (4 of 10 sweeps, when the bench handed mpi4py buffers
    whose producing kernels had not finished); the bench now synchronises after making its
    buffers, and tools/p2p-sync-check.py shows the mechanism (docs/benchmarks.md, "Raw mpi4py
    device p2p")."""
    data = bench(
        2,
        "p2p",
        "-b",
        "1",
        "-e",
        "16M",
        "-f",
        "64",
        "-n",
        "10",
        "--buffers",
        "host,device",
        "--paths",
        "cudampi,mpi,torch-cudampi,torch-gloo",
    )
    assert data["verdict"]["wrong"] == 0
    for path in ("cudampi", "mpi"):
        assert any(r["buffers"] == "device" and r["path"] == path for r in data["results"]), data[
            "skipped"
        ]


def test_ddp_on_cuda():
    """The default on CUDA: ResNet-50 (where torchvision is importable) and the CUDA
    transformer in one run, each against its own local; MPS on/off reported; two rounds, and
    ddp-nocomm (its hook's future on the device) unchecked."""
    import importlib.util

    paths = "local,ddp-nocomm,torch-gloo,torch-cudampi,torch-nccl"
    data = bench(2, "ddp", "-w", "2", "-n", "3", "--rounds", "2", "--paths", paths)
    assert data["meta"]["rounds"] == 2
    assert isinstance(data["meta"]["mps"], bool)
    models = ["transformer"]
    if importlib.util.find_spec("torchvision"):
        models.insert(0, "resnet50")
    assert list(data["meta"]["models"]) == models
    for model in models:
        rows = {r["path"]: r for r in data["results"] if r["model"] == model}
        assert "local" in rows and data["verdict"]["wrong"] == 0
        assert rows.get("torch-cudampi", {}).get("vs_local") or any(
            s["path"] == "torch-cudampi" and s["model"] == model for s in data["skipped"]
        )
        assert rows["ddp-nocomm"]["vs_local"] > 0 and rows["ddp-nocomm"]["wrong"] is None
